"""Incremental detokenizer: exact streamed text, stop strings across tokens, UTF-8 held until whole."""

from __future__ import annotations

import pytest
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.common.config import ModelConfig
from pagedkv.scheduler.detokenizer import IncrementalDetokenizer
from pagedkv.scheduler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(stories260k) -> Tokenizer:
    return Tokenizer.load(ModelConfig.load(str(stories260k)))


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.load(ModelConfig.load(None))


def stream(tok, prompt_ids, output_ids, stop=(), skip_special_tokens=True, flush=True, **kw):
    """Feed ``output_ids`` one by one until a stop string matches, as the engine does.

    Returns (deltas, detokenizer); the flush delta comes last when the output did not stop.
    """
    d = IncrementalDetokenizer(tok, prompt_ids, list(stop), skip_special_tokens, **kw)
    deltas = []
    for t in output_ids:
        deltas.append(d.append(t))
        if d.stopped:
            break
    if flush and not d.stopped:
        deltas.append(d.flush())
    return deltas, d


def test_golden_60_tokens_stream_to_the_golden_text(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS)
    assert deltas[:12] == [",", " there", " was", " a", " little", " g", "ir", "l", " named", " Lily", ".", " She"]
    assert deltas[-5:] == [".", "\n", "L", "ily", ""]  # nothing was held back, so the flush is empty
    assert "".join(deltas) == GOLDEN_COMPLETION
    assert d.output_text == GOLDEN_COMPLETION == tok.decode(GOLDEN_OUTPUT_IDS)
    assert d.stopped is False


def test_first_output_token_is_spaced_in_the_context_of_the_prompt(tok):
    # "Once upon a time," + "▁there": alone, SentencePiece decoding would drop the space.
    prompt = GOLDEN_PROMPT_IDS + [432]
    deltas, d = stream(tok, prompt, [383, 286])
    assert deltas == [" there", " was", ""]
    assert tok.decode([383, 286]) == "there was"


def test_stop_string_split_across_tokens_is_never_streamed(tok):
    # " g" + "ir" + "l" spell "girl"; the held "g", "gir" are never released.
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["girl"])
    assert deltas == [",", " there", " was", " a", " little", " ", "", ""]
    assert d.stopped is True
    assert d.stop_reason == "girl"
    assert d.output_text == ", there was a little "
    assert d.append(395) == ""  # tokens after the stop are ignored
    assert d.flush() == ""


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["girl"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.output_text == ", there was a little girl"
    assert d.stop_reason == "girl"


def test_no_stop_string_is_looked_for_before_min_tokens(tok):
    # "Lily" ends token 10; with min_tokens 11 the first "Lily" is output and the next one stops it
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["Lily"], min_tokens=11)
    assert d.stopped and d.output_text == "".join(deltas)
    assert d.output_text == GOLDEN_COMPLETION[:GOLDEN_COMPLETION.index("Lily", 40)]
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["Lily"], min_tokens=10)
    assert d.output_text == ", there was a little girl named "  # token 10 completes the match


def test_held_prefix_is_released_when_the_stop_string_does_not_follow(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[:10], stop=["girls"])
    assert deltas == [",", " there", " was", " a", " little", " ", "", "", "girl named", " Lily", ""]
    assert d.stopped is False
    assert d.output_text == ", there was a little girl named Lily"


def test_held_prefix_is_released_by_flush_at_the_end(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[:7], stop=["girls"])
    assert deltas == [",", " there", " was", " a", " little", " ", "", "gir"]
    assert d.output_text == ", there was a little gir"


def test_stop_string_at_the_very_start_gives_empty_output(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS[:3], stop=[", there"])
    assert deltas == ["", ""]
    assert d.stopped and d.output_text == ""


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["Lily", "was a"])
    assert "".join(deltas) == ", there "
    assert d.stop_reason == "was a"


def test_stop_string_ending_inside_a_token_cuts_that_token(tok):
    # " named" contains "nam": the output ends before it, mid-token.
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, GOLDEN_OUTPUT_IDS, stop=["nam"])
    assert "".join(deltas) == ", there was a little girl "
    assert d.output_text == ", there was a little girl "


def test_emoji_from_byte_fallback_is_held_until_complete(tok):
    # "She said hi 😀!" -> ... "▁" <0xF0> <0x9F> <0x98> <0x80> "!"
    prompt = [1, 338, 336, 270, 417]
    deltas, d = stream(tok, prompt, [410, 243, 162, 155, 131, 443])
    assert deltas == [" ", "", "", "", "😀", "!", ""]
    assert d.output_text == " 😀!"
    assert tok.decode(prompt) + d.output_text == "She said hi 😀!"


def test_unfinished_character_is_released_as_replacement_by_flush(tok):
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, [432, 243, 162])
    assert deltas == [",", "", "", "\ufffd\ufffd"]
    assert d.output_text == "," + "\ufffd\ufffd" == tok.decode([432, 243, 162])


def test_stop_string_made_of_one_multibyte_character(byte_tok):
    text = "ab😀cd"
    ids = byte_tok.encode(text)
    deltas, d = stream(byte_tok, ids[:1], ids[1:], stop=["😀c"])
    assert deltas == ["a", "b", "", "", "", "", ""]
    assert d.stopped and d.output_text == "ab"


def test_byte_tokenizer_streams_utf8_characters_whole(byte_tok):
    ids = byte_tok.encode("héllo €")
    deltas, d = stream(byte_tok, ids[:1], ids[1:] + [257])
    assert deltas == ["h", "", "é", "l", "l", "o", " ", "", "", "€", "", ""]
    assert d.output_text == "héllo €"


def test_prompt_whose_last_five_tokens_start_inside_a_character(tok):
    # "中中" is six byte tokens: five of them start inside the first "中", and a byte fallback decoder
    # turns that whole run, the output's "😀" bytes with it, into U+FFFD. The context reaches back to "中".
    prompt = tok.encode("Once upon a time 中中")
    deltas, d = stream(tok, prompt, [243, 162, 155, 131, 383, 286])
    assert deltas == ["", "", "", "😀", " there", " was", ""]
    assert tok.decode(prompt) + d.output_text == "Once upon a time 中中😀 there was"


def test_prompt_of_token_ids_ending_inside_a_character(tok):
    # The prompt ends with <0xE2> <0x82>, the first bytes of "€": the output's <0xAC> no longer completes
    # it and swallows " there" (the window's text shrank); the output reads as after the whole characters.
    out = [3 + 0xAC, 383, 286]
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS + [3 + 0xE2, 3 + 0x82], out)
    assert deltas == ["", "\ufffd there", " was", ""]
    assert d.output_text == tok.decode(GOLDEN_PROMPT_IDS + out)[len(tok.decode(GOLDEN_PROMPT_IDS)):]


@pytest.mark.parametrize("complete, partial", [
    ([1, 13], [3 + 0xF0]),  # "\n" then the first byte of "😀": one byte run, decoded "��" as a whole
    ([1, 3 + 0xC3, 3 + 0xA9], [3 + 0xE2, 3 + 0x82]),  # "é" then the first bytes of "€"
])
def test_a_partial_character_does_not_hide_the_complete_bytes_before_it(tok, complete, partial):
    # The context was trimmed from the front while its decode started with U+FFFD, but a byte fallback
    # decoder marks the whole run invalid for the trailing partial: "\n" was dropped with it and the
    # output's " t" streamed as "t".
    deltas, d = stream(tok, complete + partial, [259, 383])
    expected = tok.decode(complete + [259, 383])[len(tok.decode(complete)):]
    assert expected == " t there"
    assert "".join(deltas) == d.output_text == expected


def test_special_tokens_are_skipped_without_losing_spaces(tok):
    # The model ends a story with BOS (1); the next story's "▁Once" keeps its space as a full decode does.
    out = [426, 1, 403, 407]
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, out)
    assert deltas == [".", "", " Once", " upon", ""]
    assert d.output_text == tok.decode(out) == ". Once upon"


def test_special_tokens_are_kept_when_asked(tok):
    out = [426, 1, 403]
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, out, skip_special_tokens=False)
    assert "".join(deltas) == d.output_text == ".<s> Once"


def test_context_is_the_prompts_last_five_tokens_after_dropping_special_ones(tok):
    assert tok.special_token_ids == {0, 1, 2}
    prompt = list(range(300, 400)) + [403, 407, 1, 2, 261, 378, 1]
    assert IncrementalDetokenizer(tok, prompt, [], True)._ids == [399, 403, 407, 261, 378]
    assert IncrementalDetokenizer(tok, prompt, [], False)._ids == [1, 2, 261, 378, 1]
    assert IncrementalDetokenizer(tok, [1, 2], [], True)._ids == []


def test_long_generation_keeps_a_short_window(tok):
    d = IncrementalDetokenizer(tok, GOLDEN_PROMPT_IDS, [], True)
    for _ in range(20):
        for t in GOLDEN_OUTPUT_IDS:
            d.append(t)
    d.flush()
    assert d.output_text == GOLDEN_COMPLETION * 20
    assert len(d._ids) <= 70


# Output "units": ordinary tokens, special tokens, and whole characters spelled in byte tokens.
_BYTE = {b: 3 + b for b in range(256)}  # stories260K: <0x00> is id 3
_UNITS = ([[i] for i in range(259, 512)] + [[0], [1], [2], [13]]
          + [[_BYTE[b] for b in ch.encode()] for ch in "😀€é中"])


@settings(max_examples=300, deadline=None)
@given(units=st.lists(st.sampled_from(_UNITS), min_size=1, max_size=40), data=st.data())
def test_streamed_text_equals_a_full_decode(stories260k, units, data):
    tok = _stories_tokenizer(stories260k)
    out = [t for u in units for t in u]
    full = tok.decode(GOLDEN_PROMPT_IDS + out)
    prompt_text = tok.decode(GOLDEN_PROMPT_IDS)
    assert full.startswith(prompt_text)
    expected = full[len(prompt_text):]
    stop = []
    if expected and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(expected) - 1))
        stop = [expected[i:i + data.draw(st.integers(1, 6))]]
        expected = expected[:expected.find(stop[0])]
    deltas, d = stream(tok, GOLDEN_PROMPT_IDS, out, stop=stop)
    assert "".join(deltas) == expected == d.output_text
    assert all("\ufffd" not in x for x in deltas)
    assert d.stopped == bool(stop)


_TOK_CACHE: dict = {}


def _stories_tokenizer(path):
    if path not in _TOK_CACHE:
        _TOK_CACHE[path] = Tokenizer.load(ModelConfig.load(str(path)))
    return _TOK_CACHE[path]


_PARTIAL = [[_BYTE[b] for b in ch.encode()[:k]] for ch in "😀€é中" for k in range(1, len(ch.encode()))]


@settings(max_examples=300, deadline=None)
@given(prompt_units=st.lists(st.sampled_from(_UNITS), min_size=0, max_size=8),
       partial=st.one_of(st.just([]), st.sampled_from(_PARTIAL)),
       units=st.lists(st.sampled_from(_UNITS), min_size=1, max_size=20), data=st.data())
def test_streamed_text_equals_a_full_decode_after_any_prompt(stories260k, prompt_units, partial, units, data):
    # A prompt whose last five tokens start inside a character (byte fallback) once turned the output's
    # own bytes into U+FFFD; one given as token ids that ends inside a character (``partial``) swallowed
    # output text. The output reads as it would after the prompt's complete characters.
    tok = _stories_tokenizer(stories260k)
    complete = [1] + [t for u in prompt_units for t in u]
    out = [t for u in units for t in u]
    prompt_text = tok.decode(complete)
    expected = tok.decode(complete + out)[len(prompt_text):]
    assert tok.decode(complete + out).startswith(prompt_text)
    stop = []
    if expected and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(expected) - 1))
        stop = [expected[i:i + data.draw(st.integers(1, 6))]]
        expected = expected[:expected.find(stop[0])]
    deltas, d = stream(tok, complete + partial, out, stop=stop)
    assert "".join(deltas) == expected == d.output_text
    assert all("\ufffd" not in x for x in deltas)


@settings(max_examples=200, deadline=None)
@given(prompt=st.text(min_size=1, max_size=12), output=st.text(min_size=1, max_size=12),
       cut=st.integers(0, 3))
def test_byte_tokenizer_output_after_a_multibyte_prompt(byte_tok, prompt, output, cut):
    # The embedded default's tokens are all bytes: a prompt "日本" left a context starting inside "日",
    # and every output byte decoded to U+FFFD with it.
    ids = byte_tok.encode(prompt)
    if cut and len(prompt[-1].encode()) > cut:  # a prompt of token ids ending inside its last character
        ids = ids[:-cut]
    deltas, d = stream(byte_tok, ids, list(output.encode()))
    assert "".join(deltas) == d.output_text == output == byte_tok.decode(list(output.encode()))
