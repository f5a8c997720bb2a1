"""Text <-> token ids for the control plane (Hugging Face `tokenizers`, no torch, no transformers).

A checkpoint directory supplies ``tokenizer.json`` (the fast-tokenizer format), and optionally
``tokenizer_config.json`` (``add_bos_token``, ``bos_token``/``eos_token``, ``chat_template``),
``chat_template.jinja`` (where current transformers saves the template; it wins over the config's,
as in transformers) and
``generation_config.json`` (extra ``eos_token_id``, merged by `ModelConfig.load`). The embedded default model gets a byte-level
tokenizer built here: ids 0..255 are the bytes, 256 is ``<s>`` and 257 is ``</s>``, matching
`common.config.EMBEDDED_HF_CONFIG`.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from datetime import datetime
from functools import lru_cache

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedkv.common.config import ModelConfig, read_json

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_content(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """The embedded default's tokenizer: 256 byte tokens (id = byte value), ``<s>`` = 256, ``</s>`` = 257.

    A BPE model with no merges and byte fallback maps every character to its UTF-8 bytes; the
    post-processor prepends ``<s>`` as Llama's does.
    """
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab["<s>"] = 256
    vocab["</s>"] = 257
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.add_special_tokens([tokenizers.AddedToken("<s>", special=True, normalized=False),
                            tokenizers.AddedToken("</s>", special=True, normalized=False)])
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()])
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)])
    return tok


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's chat-template tojson: non-ASCII kept as is (jinja's default filter escapes it).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    # Same environment options as transformers' chat templating, sandboxed so a checkpoint's
    # template cannot reach Python internals.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encodes prompts, decodes outputs and renders chat templates for one model.

    Attributes: ``bos_token_id`` (int | None), ``eos_token_ids`` (list[int]: every id that ends
    generation), ``bos_token`` / ``eos_token`` (their text, or None), ``vocab_size`` (including
    added tokens), ``chat_template`` (str | None),
    ``special_token_ids`` (frozenset of ids of special added tokens, dropped by
    ``skip_special_tokens``).
    """

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None, bos_token: str | None, eos_token: str | None,
                 special_template_vars: dict | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # No token covers more characters than its longest piece spells (SentencePiece and byte-level
        # BPE pieces are at least as long as the text they cover), so a text of more than
        # max_token_chars x N characters has more than N tokens: refused without tokenizing it.
        self.max_token_chars = max((len(p) for p in tok.get_vocab(with_added_tokens=True)), default=1)
        self.chat_template = chat_template
        self.special_token_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._add_bos = add_bos
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template_vars = special_template_vars or {}
        self._token_str_cache: dict[int, str] = {}

    @classmethod
    def load(cls, model_config: ModelConfig, chat_template: str | None = None) -> "Tokenizer":
        """The tokenizer for ``model_config``: ``PATH/tokenizer.json``, or the byte tokenizer when path is None.

        BOS is added when tokenizer_config.json's ``add_bos_token`` is true or the tokenizer's own
        post-processor adds it (never twice). chat_template: a template text replacing the
        checkpoint's (``--chat-template``); else ``chat_template.jinja``; else tokenizer_config.json's
        ``chat_template``. Raises FileNotFoundError naming the path when tokenizer.json is missing,
        ValueError naming the file when it, tokenizer_config.json or chat_template.jinja cannot be read.
        """
        if model_config.path is None:
            return cls(build_byte_tokenizer(), bos_token_id=256, eos_token_ids=list(model_config.eos_token_ids) or [257],
                       add_bos=True, chat_template=chat_template, bos_token="<s>", eos_token="</s>")
        path = os.path.join(model_config.path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json at {path!r}: pagedkv needs the Hugging Face fast-tokenizer file")
        try:
            tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust library raises its own Exception type
            raise ValueError(f"{path}: not a tokenizers file: {' '.join(str(e).split())}") from None
        cfg = _read_json(os.path.join(model_config.path, "tokenizer_config.json"))

        bos_token = _token_content(cfg.get("bos_token"))
        eos_token = _token_content(cfg.get("eos_token"))
        bos_id = tok.token_to_id(bos_token) if bos_token else None
        if bos_id is None:
            bos_id = model_config.bos_token_id
        if bos_token is None and bos_id is not None:
            bos_token = tok.id_to_token(bos_id)

        eos_ids = list(model_config.eos_token_ids)  # config.json's and generation_config.json's
        if eos_token is None and eos_ids:
            eos_token = tok.id_to_token(eos_ids[0])

        template = (chat_template or _read_text(os.path.join(model_config.path, "chat_template.jinja"))
                    or cfg.get("chat_template"))
        if isinstance(template, list):  # HF allows a list of named templates; "default" is the one used
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        extra = {k: _token_content(cfg.get(k)) for k in ("unk_token", "pad_token")}
        return cls(tok, bos_token_id=bos_id, eos_token_ids=eos_ids, add_bos=bool(cfg.get("add_bos_token", False)),
                   chat_template=template, bos_token=bos_token, eos_token=eos_token, special_template_vars=extra)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens`` BOS comes first when the model adds one, exactly once: a text
        that already starts with the BOS string (a rendered chat template) gets no second BOS.
        Without it the ids are the text's alone (as transformers does for chat templates).
        """
        # encode_batch releases the GIL (encode does not): a long prompt tokenized in a thread then
        # leaves the event loop running
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self._add_bos and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
            del ids[0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; an incomplete UTF-8 sequence decodes to U+FFFD."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        """One token's text as it reads inside a sequence (for logprobs), e.g. ``" there"`` for ``▁there``.

        Decoded after BOS so that decoders which strip the sequence's leading space (SentencePiece)
        keep it. A token that is only part of a UTF-8 character gives OpenAI's ``"bytes:\\xNN"`` form.
        """
        cached = self._token_str_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        m = _BYTE_PIECE.match(piece)
        if m is not None and int(m.group(1), 16) >= 0x80:
            text = f"bytes:\\x{m.group(1).lower()}"
        elif self.bos_token_id is not None and token_id != self.bos_token_id:
            anchor = self._tok.decode([self.bos_token_id], skip_special_tokens=False)
            text = self._tok.decode([self.bos_token_id, token_id], skip_special_tokens=False)[len(anchor):]
        else:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        self._token_str_cache[token_id] = text
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's jinja2 chat template.

        Template variables as in Hugging Face transformers: ``messages``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token`` (plus ``unk_token``/``pad_token`` when configured) and the
        ``raise_exception`` helper. Raises ValueError("messages: ...") when the model has no chat
        template or the template rejects the messages.
        """
        if self.chat_template is None:
            raise ValueError("messages: model has no chat template")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                **{k: v for k, v in self._template_vars.items() if v is not None})
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: chat template failed: {e}") from None


def _read_text(path: str) -> str | None:
    """A UTF-8 file's text, or None when there is no such file. Raises ValueError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as UTF-8 text: {e}") from None


def _read_json(path: str) -> dict:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template text of ``--chat-template PATH_OR_STRING``, with vLLM's rules.

    A readable file gives its contents. Otherwise a value holding a jinja2 character (``{``, ``}``
    or a newline) is the template itself, with backslash escapes such as ``\\n`` decoded; anything
    else is taken for a mistyped path. The template is compiled here, so a syntax error is found at
    start-up. Raises ValueError naming the problem.
    """
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"{value!r} is neither a readable file ({e.strerror}) nor a jinja2 template") from None
        text = codecs.decode(value, "unicode_escape")
    try:
        _compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"invalid jinja2 template: {e.message} (line {e.lineno})") from None
    return text
