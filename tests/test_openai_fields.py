"""Every field of OpenAI's completions and chat request schemas is honoured or refused, driven by the
official `openai` client against the real engine (stories260K, a chat template from tests/data).

The schemas are read from the installed `openai` package: a field it adds later is refused with a 400
naming it (pagedkv refuses unknown fields) until someone implements it and lists it in HONOURED.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import aiohttp
import openai
import pytest
import structlog
import structlog.testing
import pytest_asyncio
from aiohttp.test_utils import TestServer
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS, metric

from pagedkv.common.config import EngineConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.tokenizer import load_chat_template

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_GPU_BLOCKS = 64
CHAT_TEMPLATE = Path(__file__).parent / "data" / "chat_template.jinja"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]

# field -> the test below that asserts what it does. Every other schema field must be refused.
HONOURED_COMPLETIONS = {
    "model": "test_model_must_be_a_served_name", "prompt": "test_golden_completion_and_sampling_fields",
    "temperature": "test_golden_completion_and_sampling_fields", "max_tokens": "test_golden_completion_and_sampling_fields",
    "top_p": "test_golden_completion_and_sampling_fields", "seed": "test_seed_and_n", "n": "test_seed_and_n",
    "best_of": "test_seed_and_n", "frequency_penalty": "test_penalties_change_the_greedy_text",
    "presence_penalty": "test_penalties_change_the_greedy_text", "logit_bias": "test_logit_bias_steers_tokens",
    "stop": "test_stop_reason_names_the_stop_string_or_token", "echo": "test_echo_with_max_tokens_0_scores_the_prompt",
    "logprobs": "test_echo_with_max_tokens_0_scores_the_prompt", "stream_options": "test_streamed_usage",
    "user": "test_user_is_logged_with_the_request", "suffix": "test_neutral_values_of_unsupported_fields_are_accepted",
}
HONOURED_CHAT = {
    "messages": "test_chat_fields", "model": "test_model_must_be_a_served_name", "temperature": "test_chat_fields",
    "max_tokens": "test_chat_fields", "max_completion_tokens": "test_chat_fields", "logprobs": "test_chat_fields",
    "top_logprobs": "test_chat_fields", "stop": "test_chat_fields", "top_p": "test_chat_fields",
    "seed": "test_chat_fields", "n": "test_chat_fields", "frequency_penalty": "test_chat_fields",
    "presence_penalty": "test_chat_fields", "logit_bias": "test_chat_fields", "stream_options": "test_streamed_usage",
    "user": "test_user_is_logged_with_the_request", "safety_identifier": "test_user_is_logged_with_the_request",
    "response_format": "test_neutral_values_of_unsupported_fields_are_accepted",
    "tools": "test_neutral_values_of_unsupported_fields_are_accepted",
    "tool_choice": "test_neutral_values_of_unsupported_fields_are_accepted",
    "store": "test_neutral_values_of_unsupported_fields_are_accepted",
    "service_tier": "test_neutral_values_of_unsupported_fields_are_accepted",
    "modalities": "test_neutral_values_of_unsupported_fields_are_accepted",
}
# a value each refused field must be refused with (others get a plain string)
REFUSED_VALUES = {
    "suffix": "The end.", "best_of": 3, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "parallel_tool_calls": True, "functions": [{"name": "f"}], "function_call": "auto",
    "response_format": {"type": "json_object"}, "store": True, "metadata": {"k": "v"}, "modalities": ["audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "service_tier": "flex", "web_search_options": {}, "verbosity": "low",
}


def _schema_fields(module) -> list[str]:
    return sorted(module.CompletionCreateParamsBase.__annotations__)


COMPLETION_FIELDS = _schema_fields(openai.types.completion_create_params)
CHAT_FIELDS = _schema_fields(openai.types.chat.completion_create_params)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(stories260k):
    e = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=NUM_GPU_BLOCKS,
                                        swap_space=0.001, worker_timeout=60, served_model_name=["tiny", "stories"],
                                        chat_template=load_chat_template(str(CHAT_TEMPLATE))))
    yield e
    await e.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(engine):
    server = TestServer(build_app(engine), host="127.0.0.1", port=0, handler_cancellation=True)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(base_url):
    c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    yield c
    await c.close()


async def _complete(client, **kw):
    return await client.completions.create(model="tiny", prompt=kw.pop("prompt", GOLDEN_PROMPT), **kw)


# ---- the enumeration -------------------------------------------------------------------------

async def test_every_schema_field_is_honoured_or_refused():
    for honoured, fields in ((HONOURED_COMPLETIONS, COMPLETION_FIELDS), (HONOURED_CHAT, CHAT_FIELDS)):
        assert set(honoured) <= set(fields) | {"stream"}, set(honoured) - set(fields)
        for field, test in honoured.items():
            assert callable(globals().get(test)), f"{field}: {test} does not exist"
    assert {"prompt", "echo", "logprobs", "suffix"} <= set(COMPLETION_FIELDS)  # the schema was really read
    assert {"messages", "tools", "response_format"} <= set(CHAT_FIELDS)


@pytest.mark.parametrize("field", [f for f in COMPLETION_FIELDS if f not in HONOURED_COMPLETIONS] +
                         ["suffix", "best_of"])
async def test_unimplemented_completion_field_is_refused_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        await _complete(client, max_tokens=1, extra_body={field: REFUSED_VALUES.get(field, "x")})
    assert e.value.body["param"] == field, e.value.body


@pytest.mark.parametrize("field", [f for f in CHAT_FIELDS if f not in HONOURED_CHAT] +
                         ["response_format", "tools", "tool_choice", "store", "service_tier", "modalities"])
async def test_unimplemented_chat_field_is_refused_naming_it(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                             extra_body={field: REFUSED_VALUES.get(field, "x")})
    assert e.value.body["param"] == field, e.value.body


async def test_unknown_vllm_style_fields_are_refused_too(client):
    for body in ({"guided_json": {}}, {"stream_options": {"include_obfuscation": True}}, {"echo": True}):
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, stream=True,
                                                 extra_body=body)
        assert e.value.body["param"] in ("guided_json", "stream_options.include_obfuscation", "echo")


async def test_neutral_values_of_unsupported_fields_are_accepted(client):
    out = await _complete(client, max_tokens=2, temperature=0, suffix=None, extra_body={"best_of": 1})
    assert out.choices[0].text == ", there"
    chat = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, temperature=0, response_format={"type": "text"}, tools=[],
        tool_choice="none", store=False, service_tier="auto", modalities=["text"])
    assert chat.choices[0].finish_reason == "length"


# ---- honoured fields -------------------------------------------------------------------------

async def test_model_must_be_a_served_name(client):
    out = await client.completions.create(model="stories", prompt=GOLDEN_PROMPT, max_tokens=1)
    assert out.model == "tiny"  # the first --served-model-name is reported
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="stories260K", prompt=GOLDEN_PROMPT, max_tokens=1)


async def test_golden_completion_and_sampling_fields(client):
    out = await _complete(client, max_tokens=60, temperature=0)
    assert out.choices[0].text == GOLDEN_COMPLETION and out.usage.completion_tokens == 60
    nucleus = await _complete(client, max_tokens=60, temperature=1.0, top_p=1e-9)  # only the top token survives
    assert nucleus.choices[0].text == GOLDEN_COMPLETION
    ids = await client.completions.create(model="tiny", prompt=GOLDEN_PROMPT_IDS, max_tokens=3, temperature=0)
    assert ids.choices[0].text == ", there was"


async def test_seed_and_n(client):
    a = await _complete(client, max_tokens=8, temperature=1.0, seed=7, n=2, best_of=2)
    b = await _complete(client, max_tokens=8, temperature=1.0, seed=7, n=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1] and a.choices[0].text != a.choices[1].text
    c, d = [await _complete(client, max_tokens=8, temperature=1.0, seed=-1, n=2) for _ in range(2)]  # any int64
    assert [x.text for x in c.choices] == [x.text for x in d.choices] != [x.text for x in a.choices]


async def test_penalties_change_the_greedy_text(client):
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        out = await _complete(client, max_tokens=60, temperature=0, **kw)
        assert out.choices[0].text != GOLDEN_COMPLETION, kw


async def test_logit_bias_steers_tokens(client):
    banned = await _complete(client, max_tokens=1, temperature=0, logit_bias={"432": -100})  # "," is the greedy one
    assert banned.choices[0].text != ","
    forced = await _complete(client, max_tokens=3, temperature=0, logit_bias={"383": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [" there"] * 3
    # logprobs are the model's own (before the bias): " there" after "time" is not likely
    assert forced.choices[0].logprobs.token_logprobs[0] < -1
    with pytest.raises(openai.BadRequestError) as e:
        await _complete(client, max_tokens=1, logit_bias={"512": 1})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        await _complete(client, max_tokens=1, logit_bias={"5": 101})
    assert e.value.body["param"] == "logit_bias.5"


async def test_stop_reason_names_the_stop_string_or_token(client):
    out = await _complete(client, max_tokens=60, temperature=0, stop=["Lily"])
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (", there was a little girl named ", "stop", "Lily")
    out = await _complete(client, max_tokens=60, temperature=0, stop=["Lily"],
                          extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == ", there was a little girl named Lily"
    out = await _complete(client, max_tokens=60, temperature=0, extra_body={"stop_token_ids": [286]})  # " was"
    c = out.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == (", there", "stop", 286)
    out = await _complete(client, max_tokens=60, temperature=0,
                          extra_body={"stop_token_ids": [286], "include_stop_str_in_output": True})
    assert out.choices[0].text == ", there was"
    length = await _complete(client, max_tokens=2, temperature=0)
    assert length.choices[0].model_extra["stop_reason"] is None
    stream = await _complete(client, max_tokens=60, temperature=0, stop=["Lily"], stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == "Lily"
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])


async def test_min_tokens_defers_every_stop_condition(client):
    # "Lily" ends output token 10: with min_tokens 11 the text runs on to the next "Lily" (the 60th token)
    out = await _complete(client, max_tokens=60, temperature=0, stop=["Lily"], extra_body={"min_tokens": 11})
    c = out.choices[0]
    assert (c.text, c.finish_reason) == (GOLDEN_COMPLETION.removesuffix("Lily"), "stop")
    # a stop token (" was", the 3rd greedy token) cannot even be sampled before min_tokens (vLLM masks it)
    out = await _complete(client, max_tokens=20, temperature=0, logprobs=0,
                          extra_body={"stop_token_ids": [286], "min_tokens": 11})
    tokens = out.choices[0].logprobs.tokens
    assert tokens[:2] == [",", " there"] and " was" not in tokens[:11]
    assert out.choices[0].finish_reason == "length" or tokens.index(" was") >= 11
    with pytest.raises(openai.BadRequestError) as e:
        await _complete(client, max_tokens=2, extra_body={"min_tokens": 3})
    assert e.value.body["param"] == "min_tokens"


async def test_echo_with_max_tokens_0_scores_the_prompt(client, engine):
    prompt = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:10]
    gen = await client.completions.create(model="tiny", prompt=GOLDEN_PROMPT_IDS, max_tokens=10, temperature=0,
                                          logprobs=0)
    generated = metric(engine, "pagedkv:generation_tokens_total", model_name="tiny")
    assert generated >= 10  # the labels are right: the request above counted
    out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    assert metric(engine, "pagedkv:generation_tokens_total", model_name="tiny") == generated  # none is output
    c = out.choices[0]
    tok = engine.tokenizer
    assert c.text == tok.decode(prompt) and c.finish_reason == "length"
    lp = c.logprobs
    assert lp.tokens == [tok.token_to_str(t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the prompt's logprobs from the prefill equal the same tokens' logprobs when they were decoded
    for got, want in zip(lp.token_logprobs[5:], gen.choices[0].logprobs.token_logprobs):
        assert math.isclose(got, want, abs_tol=1e-4)
    assert all(len(top) == 2 and max(top.values()) == top[t] for t, top in zip(lp.tokens[5:], lp.top_logprobs[5:]))
    assert out.usage.prompt_tokens == 15 and out.usage.completion_tokens == 0
    # echo with generation: the prompt, then the output, in one list
    more = await client.completions.create(model="tiny", prompt=GOLDEN_PROMPT, max_tokens=3, echo=True, logprobs=1,
                                           temperature=0)
    assert more.choices[0].text == GOLDEN_PROMPT + ", there was"
    assert len(more.choices[0].logprobs.tokens) == 5 + 3
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="tiny", prompt=GOLDEN_PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


async def test_echo_streamed_sends_the_prompt_first(client):
    stream = await client.completions.create(model="tiny", prompt=GOLDEN_PROMPT, max_tokens=2, echo=True,
                                             logprobs=1, temperature=0, stream=True)
    chunks = [c async for c in stream]
    assert [c.choices[0].text for c in chunks] == [GOLDEN_PROMPT + ",", " there"]
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert len(chunks[0].choices[0].logprobs.tokens) == 6


async def test_prompt_logprobs_as_vllm_and_prefix_cache_is_not_used_for_them(client, base_url):
    prompt = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:30]  # 35 tokens: two full blocks of 16
    async with aiohttp.ClientSession(base_url) as http:
        plain = await (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
        assert "prompt_logprobs" not in plain["choices"][0]
        bodies = [await (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                                  "prompt_logprobs": 1})).json() for _ in range(2)]
        again = await (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
    for body in bodies:  # cached blocks hold no logits: such a request computes its whole prompt
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the blocks were cached for others
    plp = bodies[0]["choices"][0]["prompt_logprobs"]
    assert plp == bodies[1]["choices"][0]["prompt_logprobs"] and len(plp) == 35 and plp[0] is None
    for token, entry in zip(prompt[6:], plp[6:]):  # the golden continuation is greedy: every token ranks first
        assert entry[str(token)]["rank"] == 1 and len(entry) == 1


async def test_streamed_usage(client):
    stream = await _complete(client, max_tokens=3, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c async for c in stream]
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 3] and chunks[-1].choices == []
    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 2


async def test_user_is_logged_with_the_request(client):
    # captured at structlog itself: which stream an earlier test left the renderer on does not matter
    with structlog.testing.capture_logs() as logs:
        await _complete(client, max_tokens=1, user="alice")
        await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, safety_identifier="bob")
    users = [e["user"] for e in logs if e["event"] == "request from user"]
    assert users == ["alice", "bob"]


async def test_chat_fields(client, engine):
    kw = dict(model="tiny", messages=MESSAGES, temperature=0, top_p=1.0, seed=3)
    a = await client.chat.completions.create(**kw, max_tokens=12, logprobs=True, top_logprobs=2)
    b = await client.chat.completions.create(**kw, max_completion_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage.completion_tokens == 12
    content = a.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
                                      for t in content)
    first = content[0].token
    stopped = await client.chat.completions.create(**kw, max_tokens=12, stop=[content[2].token])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == content[2].token
    tok = engine.tokenizer
    banned = {str(i): -100 for i in range(tok.vocab_size) if tok.token_to_str(i) == first}
    biased = await client.chat.completions.create(**kw, max_tokens=1, logit_bias=banned)
    assert biased.choices[0].message.content != first
    plain = await client.chat.completions.create(**kw, max_tokens=40)
    penalized = await client.chat.completions.create(**kw, max_tokens=40, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].message.content != plain.choices[0].message.content
    n = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, seed=5)
    assert [c.index for c in n.choices] == [0, 1]
    streamed = await client.chat.completions.create(**kw, max_tokens=12, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in streamed]) == b.choices[0].message.content


async def test_every_block_is_back(base_url):
    async with aiohttp.ClientSession(base_url) as http:
        snap = await (await http.get("/kv_cache")).json()
    assert snap["num_free_blocks"] == NUM_GPU_BLOCKS and snap["requests"] == []
    assert json.dumps(snap)  # the snapshot stays JSON
