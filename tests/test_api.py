"""The OpenAI-compatible API against the real engine and the real stories260K model.

One engine (its own worker process) serves the whole module on a free port; a second one runs the
embedded default for the random-weights checks. A few error paths that a healthy real engine
cannot produce (a worker failing mid-generation) use a small stand-in engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import socket

import aiohttp
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from conftest import GOLDEN_COMPLETION, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS, with_chat_template

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.output_processor import RequestOutput
from pagedkv.scheduler.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_GPU_BLOCKS = 64
GREEDY_60 = {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0}


async def _serve(engine) -> TestServer:
    server = TestServer(build_app(engine), host="127.0.0.1", port=0, handler_cancellation=True)
    await server.start_server()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(stories260k):
    e = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=NUM_GPU_BLOCKS,
                                        swap_space=0.001, worker_timeout=60))
    yield e
    await e.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(engine):
    server = await _serve(engine)
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(base_url):
    async with aiohttp.ClientSession(base_url) as session:
        yield session


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing (every event ends with a blank line)."""
    body = (await resp.read()).decode()
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


async def wait_all_blocks_free(http, timeout: float = 10.0) -> dict:
    """Poll /kv_cache until no request is left and every block is free; fail the test if that takes over ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        snap = await (await http.get("/kv_cache")).json()
        if snap["num_free_blocks"] == NUM_GPU_BLOCKS and not snap["requests"] and snap["block_ref_counts"] == {}:
            return snap
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"blocks still held after {timeout} s: {snap['num_free_blocks']} of {NUM_GPU_BLOCKS} free, "
                        f"requests {[r['id'] for r in snap['requests']]}")
        await asyncio.sleep(0.05)


# ---- completions --------------------------------------------------------------------------------

async def test_non_streamed_golden_completion(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "model": "stories260K"})
    assert resp.status == 200
    body = await resp.json()
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion"
    assert body["model"] == "stories260K"
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": GOLDEN_COMPLETION, "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 60, "total_tokens": 65,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_streamed_golden_completion_ends_with_done(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *deltas, usage = chunks
    assert "".join(c["choices"][0]["text"] for c in deltas) == GOLDEN_COMPLETION
    assert len(deltas) == 60  # one chunk per token: nothing of the golden is held back
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * 59 + ["length"]
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in deltas)
    assert len({c["id"] for c in chunks}) == 1
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 60, "total_tokens": 65,
                              "prompt_tokens_details": {"cached_tokens": 0}}


async def test_streamed_completion_without_usage_has_no_usage_field(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "max_tokens": 3, "stream": True})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [",", " there", " was"]
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("prompt", [GOLDEN_PROMPT_IDS, [GOLDEN_PROMPT], [GOLDEN_PROMPT_IDS]],
                         ids=["token-ids", "list-of-one-string", "list-of-one-token-list"])
async def test_prompt_forms_give_the_golden(http, prompt):
    body = await (await http.post("/v1/completions", json={**GREEDY_60, "prompt": prompt})).json()
    assert body["choices"][0]["text"] == GOLDEN_COMPLETION


async def test_batch_of_prompts_gives_one_choice_each(http):
    body = await (await http.post("/v1/completions", json={**GREEDY_60, "prompt": [GOLDEN_PROMPT, "Once upon a"],
                                                            "max_tokens": 4})).json()
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, ", there was a"), (1, " time, there was")]
    assert body["usage"]["prompt_tokens"] == 5 + 4
    assert body["usage"]["completion_tokens"] == 8


async def test_n3_seeded_gives_three_reproducible_choices_and_usage_sums_them(http):
    body = {"prompt": GOLDEN_PROMPT, "max_tokens": 12, "n": 3, "seed": 7, "temperature": 1.0}
    first = await (await http.post("/v1/completions", json=body)).json()
    again = await (await http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert len({c["text"] for c in first["choices"]}) == 3  # (seed 7 happens to give three different stories)
    assert first["usage"]["completion_tokens"] == 36 and first["usage"]["prompt_tokens"] == 5
    await wait_all_blocks_free(http)


async def test_beam_search_returns_n_beams_best_first(http):
    body = {"prompt": GOLDEN_PROMPT, "max_tokens": 10, "n": 2, "use_beam_search": True, "temperature": 0}
    resp = await http.post("/v1/completions", json=body)
    assert resp.status == 200
    result = await resp.json()
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] != choices[1]["text"]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert result["usage"]["completion_tokens"] == 20
    await wait_all_blocks_free(http)


async def test_stop_string_ends_the_completion_before_it(http):
    body = await (await http.post("/v1/completions", json={**GREEDY_60, "stop": "girl"})).json()
    assert body["choices"][0]["text"] == ", there was a little "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8  # " g" "ir" "l" were generated, never shown


async def test_stop_string_in_a_stream_is_never_sent(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "stop": ["girl"], "stream": True})
    events = await sse_events(resp)
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ", there was a little "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_echo_prepends_the_prompt(http):
    body = await (await http.post("/v1/completions", json={**GREEDY_60, "echo": True})).json()
    assert body["choices"][0]["text"] == GOLDEN_PROMPT + GOLDEN_COMPLETION


async def test_completion_logprobs_in_the_openai_format(http, engine):
    body = await (await http.post("/v1/completions", json={**GREEDY_60, "max_tokens": 5, "logprobs": 2})).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [",", " there", " was", " a", " little"]
    assert lp["text_offset"] == [0, 1, 7, 11, 13]
    assert len(lp["token_logprobs"]) == 5 and all(x <= 0 for x in lp["token_logprobs"])
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 2
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the most likely


async def test_openai_client_non_streamed(base_url):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    resp = await client.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, max_tokens=60, temperature=0)
    assert resp.choices[0].text == GOLDEN_COMPLETION
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 60
    await client.close()


async def test_openai_client_streamed(base_url):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")
    stream = await client.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, max_tokens=60,
                                             temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    async for chunk in stream:
        text.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(text) == GOLDEN_COMPLETION
    assert (usage.prompt_tokens, usage.completion_tokens) == (5, 60)
    await client.close()


async def test_openai_client_sees_400_with_param(base_url):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, temperature=-1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "temperature"
    await client.close()


# ---- validation ---------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("negative-temperature", {"temperature": -0.5}, "temperature"),
    ("top-p-zero", {"top_p": 0}, "top_p"),
    ("top-p-above-one", {"top_p": 1.5}, "top_p"),
    ("max-tokens-zero", {"max_tokens": 0}, "max_tokens"),
    ("max-tokens-null", {"max_tokens": None}, "max_tokens"),
    ("empty-prompt", {"prompt": ""}, "prompt"),
    ("empty-prompt-list", {"prompt": []}, "prompt"),
    ("missing-prompt", {"prompt": None}, "prompt"),
    ("mixed-prompt-list", {"prompt": [1, "a"]}, "prompt"),
    ("n-above-max-n", {"n": 17}, "n"),
    ("temperature-string", {"temperature": "hot"}, "temperature"),
    ("max-tokens-string", {"max_tokens": "10"}, "max_tokens"),
    ("stop-number", {"stop": 5}, "stop"),
    ("stop-empty-string", {"stop": [""]}, "stop"),
    ("prompt-token-not-int", {"prompt": [[1, "x"]]}, "prompt[0][1]"),
    ("logprobs-too-many", {"logprobs": 50}, "logprobs"),
    ("logprobs-bool", {"logprobs": True}, "logprobs"),
    ("token-outside-vocab", {"prompt": [1, 512]}, "prompt"),
    ("over-long-prompt", {"prompt": [1] + [403] * 600}, "prompt"),
    ("prompt-plus-max-tokens-too-long", {"prompt": [1] + [403] * 500, "max_tokens": 20}, "max_tokens"),
    ("stream-options-without-stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("stop-token-outside-vocab", {"stop_token_ids": [9999]}, "stop_token_ids"),
    ("cache-salt-empty", {"cache_salt": ""}, "cache_salt"),
    ("group-larger-than-the-pool", {"n": 16, "max_tokens": 400, "ignore_eos": True}, "max_tokens"),
]


@pytest.mark.parametrize("override,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
async def test_invalid_field_gets_400_naming_it(http, override, param):
    resp = await http.post("/v1/completions", json={**GREEDY_60, **override})
    assert resp.status == 400
    body = await resp.json()
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] is None
    assert body["error"]["message"].startswith(f"{param}: ")


async def test_nan_temperature_gets_400(http):
    resp = await http.post("/v1/completions", data=b'{"prompt": "Once", "temperature": NaN}',
                           headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"] == {"message": "temperature: must be a finite number, got nan",
                                            "type": "invalid_request_error", "param": "temperature", "code": None}


async def test_n_above_max_n_names_max_n_even_past_max_choices(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "n": 300})  # 300 > --max-choices 128 too
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "n: must be between 1 and 16 (--max-n), got 300"
    resp = await http.post("/v1/completions", json={**GREEDY_60, "n": 0})  # below the bound: the same message
    assert (await resp.json())["error"]["message"] == "n: must be between 1 and 16 (--max-n), got 0"


async def test_wrong_type_message_names_the_expected_type(http):
    resp = await http.post("/v1/completions", json={"prompt": "Once", "temperature": "hot"})
    assert (await resp.json())["error"]["message"] == "temperature: expected `float | null`, got `str`"


@pytest.mark.parametrize("data", [b'{"prompt": "Once",', b"not json", b"\xff\xfe"], ids=["truncated", "text", "binary"])
async def test_malformed_json_gets_400(http, data):
    resp = await http.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    body = await resp.json()
    assert body["error"]["param"] is None
    assert body["error"]["message"].startswith("request body is not valid JSON: ")


async def test_body_that_is_not_an_object_gets_400(http):
    resp = await http.post("/v1/completions", json=[1, 2])
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "request body: Expected `object`, got `array`"


async def test_unknown_model_gets_404(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "model": "gpt-4"})
    assert resp.status == 404
    assert (await resp.json())["error"] == {"message": "The model `gpt-4` does not exist.",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}


async def test_server_keeps_serving_after_every_error(http):
    for _, override, _ in BAD_REQUESTS:
        assert (await http.post("/v1/completions", json={**GREEDY_60, **override})).status == 400
    body = await (await http.post("/v1/completions", json=GREEDY_60)).json()
    assert body["choices"][0]["text"] == GOLDEN_COMPLETION
    snap = await wait_all_blocks_free(http)
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS


async def test_unknown_route_gets_json_404(http):
    resp = await http.get("/v1/nothing")
    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == "Not Found"


# ---- chat ---------------------------------------------------------------------------------------

async def test_chat_without_template_gets_400(http):
    resp = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "messages: model 'stories260K' has no chat template; start the server with --chat-template, "
                   "or use /v1/completions",
        "type": "invalid_request_error", "param": "messages", "code": None}


async def test_chat_with_empty_messages_gets_400(http):
    resp = await http.post("/v1/chat/completions", json={"messages": []})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "messages"


async def test_chat_with_a_bad_message_type_names_the_path(http):
    resp = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "messages[0].content"


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
                 "{% if not add_generation_prompt %}{{ raise_exception('needs a generation prompt') }}{% endif %}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_base_url(stories260k, tmp_path_factory):
    """stories260K plus a chat template that turns the messages into the plain golden prompt."""
    ckpt = with_chat_template(stories260k, tmp_path_factory.mktemp("stories260K-chat"), CHAT_TEMPLATE)
    e = await Engine.start(EngineConfig(model=str(ckpt), device="cpu", num_gpu_blocks=64, swap_space=0.001))
    server = await _serve(e)
    yield str(server.make_url("")).rstrip("/")
    await server.close()
    await e.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat_http(chat_base_url):
    async with aiohttp.ClientSession(chat_base_url) as session:
        yield session


CHAT_GOLDEN = {"messages": [{"role": "user", "content": GOLDEN_PROMPT}], "max_tokens": 60, "temperature": 0}


async def test_chat_completion_renders_the_template(chat_http):
    resp = await chat_http.post("/v1/chat/completions", json=CHAT_GOLDEN)
    assert resp.status == 200
    body = await resp.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": GOLDEN_COMPLETION},
                                "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    assert body["usage"]["prompt_tokens"] == 5  # the template's BOS, not a second one


async def test_chat_completion_streamed(chat_http):
    resp = await chat_http.post("/v1/chat/completions", json={**CHAT_GOLDEN, "stream": True})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == GOLDEN_COMPLETION
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_chat_logprobs_in_the_openai_format(chat_http):
    body = await (await chat_http.post("/v1/chat/completions", json={
        **CHAT_GOLDEN, "max_tokens": 2, "logprobs": True, "top_logprobs": 3})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [",", " there"]
    assert [c["bytes"] for c in content] == [[44], [32, 116, 104, 101, 114, 101]]
    for c in content:
        assert len(c["top_logprobs"]) == 3
        assert c["top_logprobs"][0]["token"] == c["token"]
        assert c["top_logprobs"][0]["logprob"] == c["logprob"]


async def test_chat_without_max_tokens_runs_to_the_pool_limit(chat_http):
    # 64 blocks x 16 tokens = 1024 > max_model_len 512: the context limit decides.
    body = await (await chat_http.post("/v1/chat/completions", json={
        "messages": CHAT_GOLDEN["messages"], "temperature": 0, "ignore_eos": True})).json()
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 507, "total_tokens": 512,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_without_max_tokens_shares_the_pool_among_n_choices(chat_http):
    # n = 3 sequences of 512 tokens need 96 blocks: each choice gets 64 // 3 = 21 blocks, 336 tokens
    # (the last sampled one is never written: 5 prompt + 332 output). It was sized for one choice and refused.
    body = await (await chat_http.post("/v1/chat/completions", json={
        "messages": CHAT_GOLDEN["messages"], "temperature": 0, "ignore_eos": True, "n": 3})).json()
    assert body["usage"]["completion_tokens"] == 3 * 332, body
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    await wait_all_blocks_free(chat_http)


async def test_chat_top_logprobs_without_logprobs_gets_400(chat_http):
    resp = await chat_http.post("/v1/chat/completions", json={**CHAT_GOLDEN, "top_logprobs": 2})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "top_logprobs"


async def test_chat_tool_call_history_is_refused_not_dropped(chat_http):
    """An assistant turn's tool_calls and a tool turn's tool_call_id were dropped unseen, so the model
    got a different conversation than sent; now refused as ``tools`` is. Their null values (the openai
    SDK's message.model_dump()) still pass."""
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": call},
               {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    for path, body in (("/v1/chat/completions", {"messages": history, "max_tokens": 1}),
                       ("/tokenize", {"messages": history})):
        resp = await chat_http.post(path, json=body)
        assert resp.status == 400
        assert (await resp.json())["error"] == {
            "message": "messages[1].tool_calls: tool calling is not supported",
            "type": "invalid_request_error", "param": "messages[1].tool_calls", "code": None}
    resp = await chat_http.post("/tokenize", json={"messages": history[2:]})
    assert (await resp.json())["error"]["param"] == "messages[0].tool_call_id"
    dumped = {"role": "assistant", "content": "Once", "tool_calls": None, "function_call": None, "refusal": None}
    resp = await chat_http.post("/tokenize", json={"messages": [dumped]})
    assert resp.status == 200


async def test_chat_template_error_gets_400(chat_http):
    resp = await chat_http.post("/v1/chat/completions", json={**CHAT_GOLDEN, "add_generation_prompt": False})
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": "messages: chat template failed: needs a generation prompt",
        "type": "invalid_request_error", "param": "messages", "code": None}


async def test_openai_client_chat(chat_base_url):
    client = openai.AsyncOpenAI(base_url=f"{chat_base_url}/v1", api_key="unused")
    [model] = (await client.models.list()).data
    resp = await client.chat.completions.create(model=model.id, messages=CHAT_GOLDEN["messages"],
                                                max_tokens=60, temperature=0)
    assert resp.choices[0].message.content == GOLDEN_COMPLETION
    stream = await client.chat.completions.create(model=model.id, messages=CHAT_GOLDEN["messages"],
                                                  max_tokens=60, temperature=0, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == GOLDEN_COMPLETION
    await client.close()


# ---- models, health, metrics, kv_cache ----------------------------------------------------------

async def test_models_lists_the_real_model(http):
    body = await (await http.get("/v1/models")).json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == "stories260K"
    assert card["object"] == "model"
    assert card["owned_by"] == "pagedkv"
    assert card["random_weights"] is False
    assert card["max_model_len"] == 512
    assert card["supports_chat"] is False  # stories260K ships no chat template (--chat-template adds one)
    assert "description" not in card
    assert (await (await http.get("/v1/models/stories260K")).json()) == card
    assert (await http.get("/v1/models/other")).status == 404


# ---- tokenizer endpoints (vLLM's), version ------------------------------------------------------

async def test_tokenize_and_detokenize_round_trip_as_vllm(http):
    body = await (await http.post("/tokenize", json={"prompt": GOLDEN_PROMPT})).json()
    assert body == {"count": 5, "max_model_len": 512, "tokens": GOLDEN_PROMPT_IDS, "token_strs": None}
    body = await (await http.post("/tokenize", json={"prompt": GOLDEN_PROMPT, "add_special_tokens": False,
                                                      "return_token_strs": True})).json()
    assert body["tokens"] == GOLDEN_PROMPT_IDS[1:] and body["token_strs"] == [" Once", " upon", " a", " time"]
    assert await (await http.post("/detokenize", json={"tokens": GOLDEN_PROMPT_IDS})).json() == \
        {"prompt": GOLDEN_PROMPT}


async def test_tokenize_refuses_bad_bodies_naming_the_field(http):
    cases = [({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
             ({"messages": [{"role": "user", "content": "x"}]}, "messages"),  # no chat template
             ({"prompt": "x", "model": "other"}, "model"), ({"prompt": "x", "extra": 1}, "extra")]
    for body, param in cases:
        resp = await http.post("/tokenize", json=body)
        assert resp.status in (400, 404) and (await resp.json())["error"]["param"] == param, body
    resp = await http.post("/detokenize", json={"tokens": [512]})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"


async def test_version_and_tokenizer_info(http):
    import importlib.metadata

    assert await (await http.get("/version")).json() == {"version": importlib.metadata.version("pagedkv")}
    info = await (await http.get("/tokenizer_info")).json()
    assert (info["bos_token"], info["eos_token"], info["bos_token_id"], info["eos_token_id"]) == ("<s>", "</s>", 1, 2)
    assert info["model_max_length"] == 512 and info["chat_template"] is None


async def test_health(http):
    resp = await http.get("/health")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok"}


async def test_metrics_are_prometheus_text_with_pagedkv_names(http):
    await http.post("/v1/completions", json={**GREEDY_60, "max_tokens": 2})
    resp = await http.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    text = await resp.text()
    for name in ("pagedkv:kv_cache_usage_perc", "pagedkv:num_requests_running", "pagedkv:num_requests_waiting",
                 "pagedkv:num_preemptions_total", "pagedkv:prompt_tokens_total", "pagedkv:generation_tokens_total",
                 "pagedkv:time_to_first_token_seconds_bucket", "pagedkv:inter_token_latency_seconds_bucket",
                 "pagedkv:e2e_request_latency_seconds_bucket"):
        assert re.search(rf"^(# TYPE )?{re.escape(name)}", text, re.M), name


async def test_kv_cache_snapshot_shape(http):
    snap = await wait_all_blocks_free(http)
    assert snap["block_size"] == 16
    assert snap["num_gpu_blocks"] == NUM_GPU_BLOCKS
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS
    assert snap["usage"] == 0.0
    assert snap["requests"] == []


async def test_kv_cache_shows_a_live_request_block_table(http):
    resp = await http.post("/v1/completions", json={**GREEDY_60, "max_tokens": 400, "ignore_eos": True, "stream": True})
    await resp.content.readuntil(b"\n\n")  # the first token: the request is running
    snap = await (await http.get("/kv_cache")).json()
    [req] = snap["requests"]
    assert req["id"].startswith("sha256:")  # ids are hashed unless asked for
    raw = await (await http.get("/kv_cache?request_ids=raw")).json()
    assert raw["requests"][0]["id"].startswith("cmpl-")
    assert req["num_tokens"] >= 6
    assert len(req["block_table"]) == math.ceil(req["num_tokens"] / 16) or \
        len(req["block_table"]) == math.ceil((req["num_tokens"] + 1) / 16)
    resp.close()
    await wait_all_blocks_free(http)


@pytest.mark.parametrize("prompt", [GOLDEN_PROMPT, [GOLDEN_PROMPT, "Once upon a"]], ids=["one-prompt", "two-prompts"])
async def test_client_disconnect_mid_stream_aborts_and_frees_every_block(http, prompt):
    metrics_before = await (await http.get("/metrics")).text()
    resp = await http.post("/v1/completions", json={**GREEDY_60, "prompt": prompt, "max_tokens": 500,
                                                     "ignore_eos": True, "stream": True})
    for _ in range(3):
        await resp.content.readuntil(b"\n\n")
    resp.close()  # drop the connection mid-stream
    snap = await wait_all_blocks_free(http)
    assert snap["requests"] == []
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS
    assert snap["usage"] == 0.0
    text = await (await http.get("/metrics")).text()
    assert _aborted(text) == _aborted(metrics_before) + (1 if isinstance(prompt, str) else 2)


async def test_a_client_gone_before_the_stream_starts_is_aborted_without_a_server_error(http, base_url, caplog):
    # a benchmark client cut off at its deadline: the request arrives, the connection is already closed
    metrics_before = await (await http.get("/metrics")).text()
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({**GREEDY_60, "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        snap = await wait_all_blocks_free(http)
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS
    assert _aborted(await (await http.get("/metrics")).text()) == _aborted(metrics_before) + 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_a_client_that_stops_reading_holds_only_its_output_not_its_blocks_or_the_engine(http, base_url):
    # no backpressure reaches the engine (as in vLLM): the request runs to the end at full speed and
    # frees its blocks; its unread deltas wait, merged (one per choice), until the client reads or leaves
    loop = asyncio.get_running_loop()
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small TCP window, soon full
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    body = json.dumps({**GREEDY_60, "n": 4, "max_tokens": 200, "logprobs": 5, "ignore_eos": True,
                       "stream": True}).encode()
    await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    snap = await wait_all_blocks_free(http)  # while nothing was read
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS
    resp = await http.post("/v1/completions", json=GREEDY_60)  # others are served meanwhile
    assert (await resp.json())["choices"][0]["text"] == GOLDEN_COMPLETION
    # then the whole stream, nothing dropped (the chunked body ends with a zero-size chunk)
    raw = b""
    while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), 30)
        assert chunk, raw[-200:]
        raw += chunk
    sock.close()
    assert len(raw) > 300_000  # 0.35 MB: on loopback the server's kernel send buffer (~4 MB) holds it all
    events = [json.loads(e) for e in re.findall(rb"data: (\{.*?\})\r?\n\r?\n", raw)]
    tokens = [0] * 4
    for e in events:
        for c in e["choices"]:
            tokens[c["index"]] += len(c["logprobs"]["tokens"])
    assert tokens == [200] * 4
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"] * 4


def _aborted(metrics_text: str) -> float:
    m = re.search(r'^pagedkv:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', metrics_text, re.M)
    return float(m.group(1)) if m else 0.0


# ---- the embedded default -----------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded_http():
    e = await Engine.start(EngineConfig(model=None, device="cpu", num_gpu_blocks=64, swap_space=0.001))
    server = await _serve(e)
    async with aiohttp.ClientSession(str(server.make_url("")).rstrip("/")) as session:
        yield session
    await server.close()
    await e.shutdown()


async def test_embedded_default_says_its_weights_are_random(embedded_http):
    [card] = (await (await embedded_http.get("/v1/models")).json())["data"]
    assert card["id"] == "pagedkv-embedded-random"
    assert card["random_weights"] is True
    assert card["owned_by"] == "pagedkv (random weights)"
    assert card["description"].startswith("This model runs on seeded random weights: its outputs are noise.")


async def test_a_checkpoint_served_with_dummy_weights_is_told_to_drop_the_flag_not_to_pass_a_path():
    from types import SimpleNamespace

    from pagedkv.scheduler.api import _API

    def card(path):
        engine = SimpleNamespace(served_model_names=["m"], model_config=SimpleNamespace(path=path), max_model_len=512,
                                 tokenizer=SimpleNamespace(chat_template=None), random_weights=True)
        return _API(engine)._model_card()["description"]

    assert card(None).endswith("Serve a real checkpoint with --model PATH for meaningful text.")
    assert card("/models/x").endswith("Serve without --load-format dummy for the checkpoint's own weights.")


async def test_embedded_default_streams_sse_ending_in_done(embedded_http):
    resp = await embedded_http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "stream": True,
                                                             "ignore_eos": True, "temperature": 0})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- engine failures (a stand-in engine: a healthy real one does not fail on demand) -------------

class FailingEngine:
    """Implements the Engine interface the API uses; every request fails after one token."""

    def __init__(self, stories260k):
        self.config = EngineConfig(model=str(stories260k))
        self.model_config = ModelConfig.load(str(stories260k))
        self.tokenizer = Tokenizer.load(self.model_config)
        self.max_model_len = 512
        self.served_model_names = ["stories260K"]
        self.random_weights = False
        self.healthy = False
        self.aborted: list[str] = []

    def health(self):
        return False, "failed: worker died"

    def add_request(self, prompt_token_ids, params, request_id=None, **extra):
        async def outputs():
            n = len(prompt_token_ids)
            yield RequestOutput(request_id, 0, [432], ",", None, None, None, n, 1, 0)
            yield RequestOutput(request_id, 0, [], "", None, "error", "worker died", n, 1, 0)
        return outputs()

    def abort(self, request_id):
        self.aborted.append(request_id)


async def test_generation_error_is_500_without_stream(stories260k):
    server = await _serve(FailingEngine(stories260k))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(server.make_url("/v1/completions"), json=GREEDY_60)
        assert resp.status == 500
        assert (await resp.json())["error"] == {"message": "worker died", "type": "server_error",
                                                "param": None, "code": None}
    await server.close()


async def test_generation_error_in_a_stream_is_an_error_event_then_done(stories260k):
    server = await _serve(FailingEngine(stories260k))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(server.make_url("/v1/completions"), json={**GREEDY_60, "stream": True})
        events = await sse_events(resp)
    assert json.loads(events[0])["choices"][0]["text"] == ","
    assert json.loads(events[1]) == {"error": {"message": "worker died", "type": "server_error",
                                               "param": None, "code": None}}
    assert events[2:] == ["[DONE]"]
    await server.close()


async def test_unhealthy_engine_fails_health_check(stories260k):
    server = await _serve(FailingEngine(stories260k))
    async with aiohttp.ClientSession() as s:
        resp = await s.get(server.make_url("/health"))
        assert resp.status == 503
    await server.close()
