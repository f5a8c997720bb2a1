"""Tokenizer: the real stories260K SentencePiece tokenizer, the embedded byte tokenizer, chat templates."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS

from pagedkv.common.config import ModelConfig
from pagedkv.scheduler.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def stories_tok(stories260k) -> Tokenizer:
    return Tokenizer.load(ModelConfig.load(str(stories260k)))


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.load(ModelConfig.load(None))


def test_stories260k_encodes_the_golden_prompt_with_one_bos(stories_tok):
    assert stories_tok.encode(GOLDEN_PROMPT) == GOLDEN_PROMPT_IDS


def test_stories260k_attributes(stories_tok):
    assert stories_tok.bos_token_id == 1
    assert stories_tok.eos_token_ids == [2]
    assert stories_tok.vocab_size == 512
    assert stories_tok.chat_template is None
    assert stories_tok.special_token_ids == frozenset({0, 1, 2})


def test_stories260k_decodes_the_golden_output(stories_tok):
    assert stories_tok.decode(GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS) == GOLDEN_PROMPT + GOLDEN_COMPLETION
    assert stories_tok.decode(GOLDEN_OUTPUT_IDS) == GOLDEN_COMPLETION
    assert stories_tok.decode([1, 403], skip_special_tokens=False) == "<s> Once"


def test_text_that_already_starts_with_bos_gets_no_second_bos(stories_tok):
    assert stories_tok.encode("<s>Once upon a time") == [1, 403, 407, 261, 378]
    assert stories_tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]


def test_token_to_str_keeps_the_sentencepiece_leading_space(stories_tok):
    assert [stories_tok.token_to_str(i) for i in GOLDEN_OUTPUT_IDS[:5]] == [",", " there", " was", " a", " little"]
    assert stories_tok.token_to_str(13) == "\n"  # <0x0A>: a whole character
    assert stories_tok.token_to_str(243) == "bytes:\\xf0"  # <0xF0>: part of one
    assert stories_tok.token_to_str(1) == "<s>"
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        stories_tok.token_to_str(512)


def test_model_without_chat_template_raises(stories_tok):
    with pytest.raises(ValueError, match="^messages: model has no chat template$"):
        stories_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_embedded_byte_tokenizer(byte_tok):
    assert byte_tok.bos_token_id == 256
    assert byte_tok.eos_token_ids == [257]
    assert byte_tok.vocab_size == 258
    assert byte_tok.chat_template is None
    assert byte_tok.encode("hi") == [256, 104, 105]
    assert byte_tok.encode("é😀") == [256, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80]
    assert byte_tok.decode([256, 0xC3, 0xA9, 0xF0, 0x9F, 0x98, 0x80, 257]) == "é😀"
    assert byte_tok.decode([256, 104, 257], skip_special_tokens=False) == "<s>h</s>"
    assert byte_tok.decode([0xF0, 0x9F]) == "\ufffd\ufffd"
    assert byte_tok.token_to_str(ord(" ")) == " "
    assert byte_tok.token_to_str(0xC3) == "bytes:\\xc3"


def test_missing_tokenizer_json_names_the_path(tmp_path, stories260k):
    shutil.copy(stories260k / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json at '{tmp_path}/tokenizer.json'"):
        Tokenizer.load(ModelConfig.load(str(tmp_path)))


def _checkpoint_with(tmp_path, stories260k, tokenizer_config: dict | None = None, generation_config: dict | None = None):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(stories260k / name, tmp_path / name)
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return Tokenizer.load(ModelConfig.load(str(tmp_path)))


def test_generation_config_adds_eos_ids(tmp_path, stories260k):
    tok = _checkpoint_with(tmp_path, stories260k, generation_config={"eos_token_id": [2, 1]})
    assert tok.eos_token_ids == [2, 1]


def test_post_processor_alone_adds_bos_once(tmp_path, stories260k):
    tok = _checkpoint_with(tmp_path, stories260k, tokenizer_config={"add_bos_token": False})
    assert tok.encode(GOLDEN_PROMPT) == GOLDEN_PROMPT_IDS


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_chat_template_renders_like_transformers(tmp_path, stories260k):
    tok = _checkpoint_with(tmp_path, stories260k, tokenizer_config={
        "add_bos_token": True, "bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE})
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[user] Hi</s>\n[assistant] Once</s>\n[assistant]"
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False) == "<s>[user] Hi</s>\n"
    assert tok.encode(text)[:2] == [1, tok.encode("[", add_special_tokens=False)[0]]  # one BOS, from the template


def test_chat_template_jinja_file_wins_over_the_config_and_the_flag_over_both(tmp_path, stories260k):
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = _checkpoint_with(tmp_path, stories260k, tokenizer_config={"chat_template": "{{ 'from the config' }}"})
    assert tok.chat_template == CHAT_TEMPLATE
    assert Tokenizer.load(ModelConfig.load(str(tmp_path)), "{{ 'flag' }}").chat_template == "{{ 'flag' }}"
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: cannot be read as UTF-8"):
        Tokenizer.load(ModelConfig.load(str(tmp_path)))


def test_a_template_saved_by_transformers_renders_as_transformers_renders_it(tmp_path, stories260k):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(stories260k / "tokenizer.json"), bos_token="<s>",
                                 eos_token="</s>", chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(tmp_path)  # the template goes to chat_template.jinja, not tokenizer_config.json
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    shutil.copy(stories260k / "config.json", tmp_path / "config.json")
    tok = Tokenizer.load(ModelConfig.load(str(tmp_path)))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]
    assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)


def test_chat_template_raise_exception_becomes_value_error(tmp_path, stories260k):
    tok = _checkpoint_with(tmp_path, stories260k, tokenizer_config={"chat_template": CHAT_TEMPLATE})
    with pytest.raises(ValueError, match="^messages: chat template failed: bad role system$"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path, stories260k):
    tok = _checkpoint_with(tmp_path, stories260k,
                           tokenizer_config={"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ValueError, match="^messages: chat template failed: "):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_tokenizer_and_detokenizer_do_not_import_torch():
    code = ("import sys, scheduler.tokenizer, scheduler.detokenizer, common.log; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
