"""Incremental detokenization with stop strings, for streaming one request's output.

Each new token is decoded inside a short window of the tokens before it (the prefix/read offsets
of TGI and vLLM), so the cost per token is constant and tokenizers whose pieces depend on their
neighbours (SentencePiece's leading ``▁``, byte fallback) still produce exactly the text a full
decode would. Text is released to the client only when it is final:

- a character still being assembled from byte tokens (the decode ends in U+FFFD) is held back;
- a suffix that could be the start of a stop string is held back until it cannot be;
- a stop string is matched across token boundaries; on a match the output ends just before it
  (or just after it, with ``include_stop_str_in_output``);
- before ``min_tokens`` tokens no stop string is looked for (vLLM): that text is released as is,
  and a later match must start after it.
"""

from __future__ import annotations

from pagedkv.scheduler.tokenizer import Tokenizer

# Tokens of the prompt decoded with the first output token, so its spacing is read in context; up to
# 3 more when those start inside a character (a UTF-8 character is at most 4 byte tokens).
_INITIAL_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 8
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into stream-safe text deltas.

    ``append(token_id)`` returns the new text that is safe to send; ``flush()`` releases what is
    held back once the request ends without a stop string. ``output_text`` is the output so far
    (every complete character, including text still held back for a possible stop string; after a
    stop-string match, the text before the match, or through it with ``include_stop_str_in_output``).
    ``stopped`` is True once a stop string matched; ``stop_reason`` is then that string.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, *, min_tokens: int = 0, include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # Special tokens are dropped before decoding (as a full decode with skip_special_tokens
        # does), so the window never starts on an invisible token and loses a leading space.
        context: list[int] = []  # read back from the end: five ordinary tokens, more if they start mid-character
        for t in reversed(prompt_token_ids):
            if t in self._special:
                continue
            context.append(t)
            if len(context) == _MAX_CONTEXT_TOKENS or len(context) >= _INITIAL_CONTEXT_TOKENS and \
                    not tokenizer.decode(context[::-1], skip_special_tokens).startswith(_REPLACEMENT_CHAR):
                break
        context.reverse()
        # A context that decodes with U+FFFD at either end (it starts inside a character, or the prompt,
        # given as token ids, ends inside one) reads differently once output bytes follow it: a byte
        # fallback decoder turns a whole run of byte tokens into U+FFFD when any of it is invalid, so
        # one stray byte can hide a complete "\n" or "é" next to it. The output is read after the
        # longest clean slice that ends as late as possible (a trailing partial character is cut;
        # complete characters before it stay).
        self._ids: list[int] = _clean_slice(tokenizer, context, skip_special_tokens)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in stop if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str_in_output
        self._num_tokens = 0
        self._match_from = 0  # a stop string may only start here or later (after the min_tokens text)
        self.output_text = ""
        self._sent = 0  # characters of output_text already returned
        self.stopped = False
        self.stop_reason: str | None = None

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that became safe to stream (often "").

        After a stop string matched, further tokens are ignored and return "".
        """
        if self.stopped:
            return ""
        self._num_tokens += 1
        if token_id not in self._special:
            self._ids.append(token_id)
            self.output_text += self._decode_new(final=False)
        if self._num_tokens < self._min_tokens:  # no stop string yet: release everything
            self._match_from = len(self.output_text)
            return self._take(len(self.output_text))
        return self._release()

    def flush(self) -> str:
        """Release everything held back: the request ended (length, EOS, abort) without a stop string.

        An unfinished byte sequence is released as U+FFFD, as a full decode gives it.
        """
        if self.stopped:
            return ""
        self.output_text += self._decode_new(final=True)
        released = self._release()  # the completed tail may still finish a stop string
        return released if self.stopped else released + self._take(len(self.output_text))

    def _decode_new(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        new_text = self._tokenizer.decode(self._ids[self._prefix_offset:], self._skip_special)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ""  # a character is still being assembled from byte tokens
        delta = new_text[len(prefix_text):]
        # The window only ever needs the last complete token as context.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset > 64:  # keep the id list short on long generations
            drop = self._prefix_offset
            del self._ids[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return delta

    def _release(self) -> str:
        """Match stop strings in the unsent text; return what can be sent now."""
        text = self.output_text
        if not self._stop:
            return self._take(len(text))
        # A match can only involve characters not yet sent, or the last max_stop_len - 1 before them.
        start = max(self._match_from, self._sent - self._max_stop_len + 1)
        best = -1
        for s in self._stop:
            i = text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stop_reason = i, s
        if best != -1:
            self.stopped = True
            end = best + len(self.stop_reason) if self._include_stop else best
            self.output_text = text[:end]
            return self._take(end)
        return self._take(len(text) - self._held_stop_prefix(text))

    def _held_stop_prefix(self, text: str) -> int:
        """Length of the longest unsent suffix of ``text`` that begins some stop string."""
        unsent = len(text) - self._sent
        for k in range(min(self._max_stop_len - 1, unsent), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _take(self, end: int) -> str:
        end = max(end, self._sent)
        out = self.output_text[self._sent:end]
        self._sent = end
        return out


class NoDetokenizer:
    """`IncrementalDetokenizer`'s stand-in for a ``detokenize=False`` request (vLLM): no text, and no
    stop string (`SamplingParams.validate` refuses them without detokenize)."""

    stopped = False
    stop_reason = None

    def append(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


def _clean_slice(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[int]:
    """The slice ``ids[i:j]`` with the largest ``j``, then the smallest ``i``, whose decode has no U+FFFD
    at either end (an empty decode counts as clean); [] if none. ``ids`` holds at most
    ``_MAX_CONTEXT_TOKENS`` (8) tokens: at most 36 decodes, once per request, one when it is clean."""
    for j in range(len(ids), 0, -1):
        for i in range(j):
            text = tokenizer.decode(ids[i:j], skip_special_tokens)
            if not text or _REPLACEMENT_CHAR not in (text[0], text[-1]):  # "▁" alone decodes to ""
                return ids[i:j]
    return []
