"""Hostile input at the HTTP edge (issue 12): every poison request gets a 4xx naming its field, never
a 500, and the server then still serves the golden completion on stories260K.

Each input here once crashed the engine loop (OverflowError / UnicodeEncodeError while encoding a
step plan or hashing a block), failed a whole worker step, raised a 500, or stalled the event loop.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from conftest import GOLDEN_COMPLETION, GOLDEN_PROMPT, with_chat_template

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import MIN_TEMPERATURE
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY_60 = {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0}
MAX_REQUEST_BYTES = 1 << 20
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(stories260k, tmp_path_factory):
    """stories260K with a chat template (so chat paths run), 64 blocks, max_stop / max_choices defaults."""
    ckpt = with_chat_template(stories260k, tmp_path_factory.mktemp("stories260K-chat"), CHAT_TEMPLATE)
    e = await Engine.start(EngineConfig(model=str(ckpt), device="cpu", num_gpu_blocks=64, swap_space=0.001))
    yield e
    await e.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(engine):
    server = TestServer(build_app(engine, max_request_bytes=MAX_REQUEST_BYTES), host="127.0.0.1", port=0)
    await server.start_server()
    async with aiohttp.ClientSession(str(server.make_url("")).rstrip("/")) as session:
        yield session
    await server.close()


async def post_raw(http, path: str, body: str) -> aiohttp.ClientResponse:
    """POST a JSON body written by hand (lone surrogates and huge integers as JSON spells them)."""
    return await http.post(path, data=body.encode(), headers={"Content-Type": "application/json"})


def with_field(field: str, raw_value: str, base: dict = GREEDY_60) -> str:
    body = json.dumps({k: v for k, v in base.items() if k != field})
    return body[:-1] + f', "{field}": {raw_value}}}'


POISON = [  # (id, path, raw body, param named by the 400)
    ("top-k-above-uint64", "/v1/completions", with_field("top_k", "1" + "0" * 30), "top_k"),
    ("top-k-int64-overflow", "/v1/completions", with_field("top_k", str(2**63)), "top_k"),
    ("top-k-above-vocab", "/v1/completions", with_field("top_k", "513"), "top_k"),
    ("stop-lone-surrogate", "/v1/completions", with_field("stop", '"\\udfff"'), "stop"),
    ("stop-list-lone-surrogate", "/v1/completions", with_field("stop", '["ok", "\\ud800"]'), "stop[1]"),
    ("cache-salt-lone-surrogate", "/v1/completions", with_field("cache_salt", '"\\udfff"'), "cache_salt"),
    ("prompt-lone-surrogate", "/v1/completions", with_field("prompt", '"Once \\udfff"'), "prompt"),
    ("model-lone-surrogate", "/v1/completions", with_field("model", '"\\udfff"'), "model"),
    ("user-lone-surrogate", "/v1/completions", with_field("user", '"\\ud83d"'), "user"),
    ("priority-huge", "/v1/completions", with_field("priority", "1" + "0" * 30), "priority"),
    ("seed-400-digits", "/v1/completions", with_field("seed", "9" * 400), "seed"),  # past float's range
    ("seed-5000-digits", "/v1/completions", with_field("seed", "9" * 5000), None),  # past Python's int parsing
    ("priority-int64-overflow", "/v1/completions", with_field("priority", str(-(2**63) - 1)), "priority"),
    ("seed-above-uint64", "/v1/completions", with_field("seed", str(2**64)), "seed"),
    ("stop-token-id-huge", "/v1/completions", with_field("stop_token_ids", f"[{2**64}]"), "stop_token_ids[0]"),
    ("prompt-token-id-huge", "/v1/completions", with_field("prompt", f"[1, {2**70}]"), "prompt[1]"),
    ("stop-list-too-long", "/v1/completions", with_field("stop", json.dumps(["a", "b", "c", "d", "e"])), "stop"),
    ("stop-list-10000", "/v1/completions", with_field("stop", json.dumps([f"s{i}" for i in range(10000)])), "stop"),
    ("n-times-prompts-too-many", "/v1/completions",
     json.dumps({"prompt": [GOLDEN_PROMPT] * 1000, "n": 16, "max_tokens": 1}), "n"),
    ("deeply-nested-json", "/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
    ("nested-beyond-depth-limit", "/v1/completions", '{"prompt": ' + "[" * 70 + "]" * 70 + "}", None),
    ("chat-content-lone-surrogate", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 4}', "messages[0].content"),
    ("chat-content-null-user", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": null}], "max_tokens": 4}', "messages[0].content"),
    ("chat-n-zero", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
    ("chat-role-lone-surrogate", "/v1/chat/completions",
     '{"messages": [{"role": "\\udfff", "content": "x"}], "max_tokens": 4}', "messages[0].role"),
    ("logit-bias-key-5000-digits", "/v1/completions", with_field("logit_bias", '{"' + "1" * 5000 + '": 1}'),
     "logit_bias"),  # past Python's int-parsing limit
    ("logit-bias-key-arabic-digit", "/v1/completions", with_field("logit_bias", '{"\\u0665": 1}'), "logit_bias"),
    ("chat-top-logprobs-above-max", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
    ("beam-search-logprobs", "/v1/completions",
     json.dumps({"prompt": GOLDEN_PROMPT, "use_beam_search": True, "n": 2, "logprobs": 1, "max_tokens": 4}),
     "logprobs"),  # the hypotheses would come back with empty logprobs lists
    ("chat-top-logprobs-negative", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}', "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", [p[1:] for p in POISON], ids=[p[0] for p in POISON])
async def test_poison_request_gets_400_naming_the_field(http, path, body, param):
    resp = await post_raw(http, path, body)
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("raw, shown", [(str(2**63), f"integer {2**63} is"), ("9" * 400, "integer of 400 digits is")])
async def test_out_of_range_integer_is_written_out_in_the_error(http, raw, shown):
    error = (await (await post_raw(http, "/v1/completions", with_field("seed", raw))).json())["error"]
    assert error["message"] == f"seed: {shown} outside the 64-bit signed range"


async def test_server_still_serves_the_golden_after_every_poison(http):
    for _, path, body, _ in POISON:
        assert (await post_raw(http, path, body)).status == 400
    health = await http.get("/health")
    assert health.status == 200
    resp = await http.post("/v1/completions", json=GREEDY_60)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == GOLDEN_COMPLETION


async def test_top_k_equal_to_vocab_and_minus_one_are_accepted(http):
    for top_k in (512, -1, 0):
        resp = await http.post("/v1/completions", json={**GREEDY_60, "max_tokens": 4, "top_k": top_k})
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("temperature", [1e-45, MIN_TEMPERATURE / 2])
async def test_temperature_below_the_minimum_is_greedy(http, temperature):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "temperature": temperature})
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["text"] == GOLDEN_COMPLETION


@pytest.mark.parametrize("over", [1, 50, MAX_REQUEST_BYTES])
async def test_body_above_max_request_bytes_gets_413_naming_the_flag(http, over):
    body = json.dumps({**GREEDY_60, "prompt": ""}).encode()
    body = body.replace(b'"prompt": ""', b'"prompt": "' + b"a" * (MAX_REQUEST_BYTES + over - len(body)) + b'"')
    assert len(body) == MAX_REQUEST_BYTES + over
    resp = await http.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 413, await resp.text()
    assert "--max-request-bytes" in (await resp.json())["error"]["message"]


async def test_huge_prompt_is_refused_without_stalling_the_loop(http):
    """A prompt that cannot fit max_model_len is 400 before it is tokenized; /health answers meanwhile."""
    big = asyncio.create_task(http.post("/v1/completions", json={**GREEDY_60, "prompt": "Once upon " * 90_000}))
    health = await http.get("/health")
    assert health.status == 200
    resp = await big
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "prompt"


async def test_long_prompt_that_might_fit_is_tokenized_then_refused_by_length(http):
    text = "Once upon a time " * 200  # 3,400 characters: could fit, tokenizes to ~800 tokens > 512
    resp = await http.post("/v1/completions", json={**GREEDY_60, "prompt": text})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "prompt" and "longer than max_model_len" in error["message"]


async def test_long_prompt_is_tokenized_in_a_thread(engine):
    """Past _TOKENIZE_INLINE_CHARS the tokenizer runs off the event loop's thread, same ids."""
    import threading
    import types

    from pagedkv.scheduler import api

    threads = []

    class Spy:
        max_token_chars = engine.tokenizer.max_token_chars

        def encode(self, text, add_special_tokens=True):
            threads.append(threading.get_ident())
            return engine.tokenizer.encode(text, add_special_tokens)

    text = "Once upon a time " * 1000
    stub = types.SimpleNamespace(tokenizer=Spy(), max_model_len=100_000)
    assert await api._tokenize(stub, text, "prompt") == engine.tokenizer.encode(text)
    assert threads and threads[0] != threading.get_ident()
    assert await api._tokenize(stub, GOLDEN_PROMPT, "prompt") == engine.tokenizer.encode(GOLDEN_PROMPT)
    assert threads[1] == threading.get_ident()  # short prompts stay inline


async def test_chat_assistant_message_with_null_content_renders_as_empty(http):
    resp = await http.post("/v1/chat/completions", json={
        "messages": [{"role": "assistant", "content": None}, {"role": "user", "content": GOLDEN_PROMPT}],
        "max_tokens": 60, "temperature": 0})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == GOLDEN_COMPLETION


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_chat_length_errors_name_the_field_that_was_sent(http, field):
    chat = {"messages": [{"role": "user", "content": GOLDEN_PROMPT}]}
    resp = await http.post("/v1/chat/completions", json={**chat, field: 0})
    assert resp.status == 400
    assert (await resp.json())["error"] == {"message": f"{field}: must be >= 1, got 0", "type": "invalid_request_error",
                                           "param": field, "code": None}
    resp = await http.post("/v1/chat/completions", json={**chat, field: 600})  # past max_model_len (512)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: prompt (5 tokens) + {field} (600) ")
    assert "max_tokens" not in error["message"] or field == "max_tokens"
