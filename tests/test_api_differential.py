"""A seeded randomized differential test of the HTTP API on stories260K.

Random requests (completions and chat; text, token-id and batched prompts; n > 1, seeded sampling,
greedy, beam search; echo, logprobs, stop strings with and without include_stop_str_in_output,
stop_token_ids, min_tokens, ignore_eos, skip_special_tokens, logit_bias pushing byte-fallback and
special tokens into the output; stream_options) are each sent streamed and not streamed, to two
engines, one with ``--stream-interval 3``. What must hold:

- the streamed response, put together, equals the non-streamed one: text, finish and stop reasons,
  logprobs, usage;
- each choice's text is the engine's output token ids read back through the tokenizer (the prompt's
  decode, then the prompt with the output's, the difference), cut by the stop-string rule (the first
  token whose text holds a stop string ends the output, before the earliest match, or after it with
  include_stop_str_in_output; none starts in the text of the first min_tokens - 1 tokens);
- finish_reason and stop_reason follow from those ids (EOS, a stop token, a stop string, max_tokens);
  usage counts them exactly;
- a malformed field on top of a random request gets a 400 naming it (404 for the model), streamed
  or not; a client gone mid-stream or mid-request aborts it; afterwards every block is free.

The engine is deterministic for greedy and seeded requests (batched or alone), so every variant of a
request samples the same tokens; they are recorded at the engine's `add_request`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from conftest import GOLDEN_OUTPUT_IDS, assert_all_blocks_free

from pagedkv.common.config import EngineConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

SEED = 20240611
NUM_CASES = 100
NUM_GPU_BLOCKS = 128
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                "{% if add_generation_prompt %}assistant:{% endif %}"
TEXTS = ["Once upon a time", "Lily saw a big red ball.", "The dog ran to the park", "She said hi 😀!",
         "Tom likes 中中 and café", "One day, a little girl", "Ben and Mia played.\n", "é€😀", "She saw 中中"]
STOPS = [" the", "Lily", ".", ",", "e", "ll", " a ", "\n", "She", "ed", "ing", "p", "ball", "one day", "😀", "é"]
# stories260K: ids 3..258 are the bytes <0x00>..<0xFF>, 1 is <s> (special; the model ends stories
# with it), 2 is </s> (EOS)
BYTE = {b: 3 + b for b in range(256)}


class Recorder:
    """Wraps ``engine.add_request``: every request's prompt, sampling params and output token ids."""

    def __init__(self, engine):
        self.requests: dict[str, dict] = {}
        add_request = engine.add_request

        def recording(prompt_token_ids, params, request_id=None, **kw):
            rec = self.requests[request_id] = {"prompt": list(prompt_token_ids), "params": params, "outs": {}}
            it = add_request(prompt_token_ids, params, request_id, **kw)

            async def tee():
                try:
                    async for out in it:
                        rec["outs"].setdefault(out.index, []).append(out)
                        yield out
                finally:
                    await it.aclose()
            return tee()

        engine.add_request = recording


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(stories260k):
    """(engine, session, recorder) for --stream-interval 1 and 3."""
    out = []
    for interval in (1, 3):
        e = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=NUM_GPU_BLOCKS,
                                            swap_space=0.001, stream_interval=interval,
                                            chat_template=CHAT_TEMPLATE))
        server = TestServer(build_app(e), host="127.0.0.1", port=0, handler_cancellation=True)
        await server.start_server()
        session = aiohttp.ClientSession(str(server.make_url("")).rstrip("/"))
        out.append((e, session, Recorder(e), server))
    yield [(e, s, r) for e, s, r, _ in out]
    for e, session, _, server in out:
        await session.close()
        await server.close()
        await e.shutdown()


# ---- random requests ----------------------------------------------------------------------------

def random_prompt(rng: random.Random):
    kind = rng.choice(["text", "text", "ids", "batch", "one"])
    if kind == "one":  # n > 1 siblings then start together instead of forking at the prompt's last token
        return [rng.choice([1, 403, 410])]
    if kind == "text":
        return " ".join(rng.sample(TEXTS, rng.randint(1, 2)))
    if kind == "ids":  # BOS, ordinary tokens and whole characters in byte tokens
        ids = [1]
        for _ in range(rng.randint(1, 10)):
            ids += [rng.randrange(259, 512)] if rng.random() < 0.7 else \
                [BYTE[b] for b in rng.choice("😀€é中").encode()]
        return ids
    return [rng.choice(TEXTS), rng.choice(TEXTS)]


def random_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.3
    body: dict = {"messages": [{"role": "user", "content": rng.choice(TEXTS)}]} if chat else \
        {"prompt": random_prompt(rng)}
    beam = not chat and rng.random() < 0.08
    body["max_completion_tokens" if chat and rng.random() < 0.3 else "max_tokens"] = rng.randint(1, 40)
    if rng.random() < 0.5 or beam:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice([0.7, 1.0, 1.3])
        body["seed"] = rng.randrange(-2**63, 2**63)
        if rng.random() < 0.3:
            body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([5, 40])
    body["n"] = rng.choice([1, 1, 2, 3])
    if beam:
        body.update(use_beam_search=True, n=rng.choice([1, 2]), max_tokens=rng.randint(1, 12))
    else:
        if rng.random() < 0.6:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3)) if rng.random() < 0.8 else rng.choice(STOPS)
            body["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3:
            body["stop_token_ids"] = rng.sample(sorted(set(GOLDEN_OUTPUT_IDS)), rng.randint(1, 2))
            body["include_stop_str_in_output"] = rng.random() < 0.5
        if rng.random() < 0.3:
            body["min_tokens"] = rng.randint(0, body.get("max_tokens", body.get("max_completion_tokens")))
        if rng.random() < 0.4:  # push byte-fallback, special and EOS tokens into the output
            pushed = [BYTE[b] for b in rng.choice("😀€é中").encode()] + rng.sample([1, 2], rng.randint(0, 2))
            body["logit_bias"] = {str(t): rng.choice([15.0, 30.0, 100.0]) for t in pushed}
    body["ignore_eos"] = rng.random() < 0.3
    body["skip_special_tokens"] = rng.random() < 0.7
    if chat:
        if rng.random() < 0.4 and not beam:  # beam search takes no logprobs (400)
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
    else:
        if rng.random() < 0.4 and not beam:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.2 and not beam:
            body["prompt_logprobs"] = rng.randint(0, 2)
        if rng.random() < 0.25 and not beam:
            body["echo"] = True
            if rng.random() < 0.3:
                body["max_tokens"] = 0
                body.pop("min_tokens", None)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def stream_options(rng: random.Random) -> dict | None:
    return rng.choice([None, {"include_usage": True}, {"continuous_usage_stats": True},
                       {"include_usage": True, "continuous_usage_stats": True}])


# ---- sending and putting a stream together ------------------------------------------------------

async def sse_chunks(resp: aiohttp.ClientResponse) -> list[dict]:
    body = (await resp.read()).decode()
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")[:-2]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[len("data: "):]) for e in events]


def assemble(path: str, chunks: list[dict], options: dict | None) -> dict:
    """The non-streamed response body that a stream's chunks spell."""
    include = bool(options and options.get("include_usage"))
    continuous = include and bool(options.get("continuous_usage_stats"))  # alone it adds nothing (vLLM)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    choices: dict[int, dict] = {}
    usage = None
    for c in chunks:
        if continuous or (include and c["choices"]):
            assert "usage" in c
        if include and c["choices"]:
            assert continuous or c["usage"] is None
        if not (include or continuous):
            assert "usage" not in c
        if not c["choices"]:  # the usage chunk: last, and only with include_usage
            assert include and c is chunks[-1]
            usage = c["usage"]
            continue
        [ch] = c["choices"]
        acc = choices.setdefault(ch["index"], {"index": ch["index"], "text": "", "logprobs": None,
                                               "finish_reason": None, "stop_reason": None})
        assert acc["finish_reason"] is None, "a chunk after the choice's finish"
        if "prompt_logprobs" in ch:  # the choice's first chunk only
            assert "prompt_logprobs" not in acc
            acc["prompt_logprobs"] = ch["prompt_logprobs"]
        if path == "/v1/completions":
            acc["text"] += ch["text"]
            if ch["logprobs"] is not None:
                lp = acc["logprobs"] = acc["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                          "text_offset": []}
                for k in lp:
                    lp[k] += ch["logprobs"][k]
        else:
            delta = ch["delta"]
            if "role" in delta:
                assert delta == {"role": "assistant", "content": ""} and acc["text"] == ""
            acc["text"] += delta.get("content", "")
            if ch["logprobs"] is not None:
                acc["logprobs"] = acc["logprobs"] or {"content": []}
                acc["logprobs"]["content"] += ch["logprobs"]["content"]
        acc["finish_reason"], acc["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
        if continuous:
            usage = c["usage"]
    return {"id": chunks[0]["id"], "choices": [choices[i] for i in sorted(choices)], "usage": usage}


def normalized(path: str, body: dict) -> dict:
    """A response with the same shape for both: chat's message content as text."""
    choices = []
    for c in body["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        choices.append({"index": c["index"], "text": text, "logprobs": c["logprobs"],
                        "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                        **({"prompt_logprobs": c["prompt_logprobs"]} if "prompt_logprobs" in c else {})})
    return {"id": body["id"], "choices": choices, "usage": body["usage"]}


def assert_same_logprobs(a, b):
    if a is None or b is None:
        assert a == b
        return
    if "content" in a:  # chat
        assert len(a["content"]) == len(b["content"])
        for x, y in zip(a["content"], b["content"]):
            assert (x["token"], x["bytes"]) == (y["token"], y["bytes"])
            assert math.isclose(x["logprob"], y["logprob"], abs_tol=1e-4)
            assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        return
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"]):
        assert (x is None) == (y is None) and (x is None or math.isclose(x, y, abs_tol=1e-4))
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys() and all(math.isclose(x[k], y[k], abs_tol=1e-4) for k in x)


def assert_same_prompt_logprobs(a, b):
    assert (a is None) == (b is None) and len(a or []) == len(b or [])
    for x, y in zip(a or [], b or []):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys()
            for k in x:
                assert (x[k]["rank"], x[k]["decoded_token"]) == (y[k]["rank"], y[k]["decoded_token"])
                assert math.isclose(x[k]["logprob"], y[k]["logprob"], abs_tol=1e-4)


# ---- the reference: text and finish from the token ids ------------------------------------------

def byte_runs_valid(tok, ids: list[int], skip: bool) -> bool:
    """Whether every run of byte tokens decodes as UTF-8 (a byte fallback decoder turns a whole
    invalid run into U+FFFD, bytes already streamed included: no incremental decoder can match that)."""
    run: list[int] = []
    for t in ids + [-1]:
        if skip and t in tok.special_token_ids:
            continue
        piece = tok._tok.id_to_token(t) if t >= 0 else None
        if piece is not None and len(piece) == 6 and piece.startswith("<0x"):
            run.append(int(piece[3:5], 16))
            continue
        try:
            bytes(run).decode()
        except UnicodeDecodeError:
            return False
        run = []
    return True


def expected_choice(tok, prompt: list[int], out: list[int], params, max_model_len: int) -> dict | None:
    """text, finish_reason, stop_reason of one choice whose engine output is ``out``; None when its
    byte runs are invalid (then only the streamed and non-streamed responses are compared)."""
    skip = params.skip_special_tokens
    if not byte_runs_valid(tok, prompt + out, skip):
        return None
    base = tok.decode(prompt, skip)

    def text_of(ids: list[int], final: bool) -> str:
        """The text of ``ids``; not ``final``: as far as the last token ending a character (the decoder
        turns a run of byte tokens that ends inside a character into U+FFFD, all of it)."""
        for j in range(len(ids), -1, -1):
            full = tok.decode(prompt + ids[:j], skip)
            assert full.startswith(base)
            if final or not full.endswith("\ufffd"):
                return full[len(base):]
        return ""

    last = out[-1]
    by_stop_token = last in params.stop_token_ids
    by_eos = not by_stop_token and not params.ignore_eos and last in tok.eos_token_ids
    appended = out[:-1] if by_eos or (by_stop_token and not params.include_stop_str_in_output) else out
    # no stop condition fired before the last token
    for i, t in enumerate(out[:-1]):
        assert t not in params.stop_token_ids and (params.ignore_eos or t not in tok.eos_token_ids), (i, t)
    assert not (by_stop_token or by_eos) or len(out) >= params.min_tokens  # masked before min_tokens
    match_from = len(text_of(appended[:params.min_tokens - 1], False)) if params.min_tokens > 1 else 0
    for k in range(max(params.min_tokens, 1), len(appended) + 1):
        text = text_of(appended[:k], False)
        found = [(text.find(s, match_from), j, s) for j, s in enumerate(params.stop) if text.find(s, match_from) != -1]
        if found:
            i, _, s = min(found)
            assert k == len(out), f"stop string {s!r} in the first {k} tokens, yet {len(out)} were generated"
            return {"text": text[:i + len(s)] if params.include_stop_str_in_output else text[:i],
                    "finish_reason": "stop", "stop_reason": s}
    text = text_of(appended, True)
    if by_stop_token:
        return {"text": text, "finish_reason": "stop", "stop_reason": last}
    if by_eos:
        return {"text": text, "finish_reason": "stop", "stop_reason": None}
    assert len(out) == params.max_tokens or len(prompt) + len(out) == max_model_len
    return {"text": text, "finish_reason": "length", "stop_reason": None}


def check_against_engine(engine, recorder, path: str, body: dict, resp: dict) -> None:
    """The response's choices and usage against the token ids the engine generated for it."""
    tok = engine.tokenizer
    num_prompts = len(body["prompt"]) if path == "/v1/completions" and isinstance(body["prompt"], list) and \
        not isinstance(body["prompt"][0], int) else 1
    rids = [resp["id"]] if num_prompts == 1 else [f"{resp['id']}-{p}" for p in range(num_prompts)]
    recs = [recorder.requests[rid] for rid in rids]
    n = body.get("n", 1)
    echo_only = body.get("echo") and body["max_tokens"] == 0
    assert len(resp["choices"]) == num_prompts * n
    completion_tokens = 0
    for choice in resp["choices"]:
        rec = recs[choice["index"] // n]
        deltas = rec["outs"][choice["index"] % n]
        out = [t for d in deltas for t in d.token_ids]
        assert deltas[-1].num_output_tokens == len(out)
        completion_tokens += len(out)
        text = choice["text"]
        if body.get("echo"):
            prompt = body["prompt"] if num_prompts == 1 else body["prompt"][choice["index"] // n]
            prompt_text = prompt if isinstance(prompt, str) else tok.decode(rec["prompt"])
            assert text.startswith(prompt_text)
            text = text[len(prompt_text):]
        if echo_only:
            assert (text, choice["finish_reason"], choice["stop_reason"]) == ("", "length", None)
            continue
        if body.get("use_beam_search"):
            assert text == "".join(d.text for d in deltas)
            want = {"text": tok.decode(rec["prompt"] + out, body.get("skip_special_tokens", True))[
                len(tok.decode(rec["prompt"], body.get("skip_special_tokens", True))):]}
        else:
            want = expected_choice(tok, rec["prompt"], out, rec["params"], engine.max_model_len)
            if want is None:
                continue
            assert (choice["finish_reason"], choice["stop_reason"]) == (want["finish_reason"], want["stop_reason"])
        assert text == want["text"], (out, want)
        if choice["logprobs"] is not None:  # one entry per output token (and per prompt token with echo)
            entries = choice["logprobs"]["content"] if "content" in choice["logprobs"] else \
                choice["logprobs"]["tokens"]
            num_prompt_entries = len(rec["prompt"]) if body.get("echo") else 0
            if not body.get("use_beam_search"):
                assert len(entries) == num_prompt_entries + len(out)
    usage = resp["usage"]
    if usage is None:  # a stream without include_usage
        return
    prompt_tokens = sum(len(r["prompt"]) for r in recs)
    if echo_only:
        completion_tokens = 0
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
        (prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


async def send(session, path: str, body: dict):
    async with session.post(path, json=body) as resp:
        if body.get("stream"):
            assert resp.status == 200, await resp.text()
            return await sse_chunks(resp)
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_streamed_equals_non_streamed_and_both_equal_the_decoded_token_ids(servers):
    rng = random.Random(SEED)
    for case in range(NUM_CASES):
        path, body = random_body(rng)
        options = stream_options(rng)
        plain_server, stream_server = rng.choice(servers), rng.choice(servers)
        streamed_body = {**body, "stream": True, **({"stream_options": options} if options else {})}
        plain, chunks = await asyncio.wait_for(asyncio.gather(
            send(plain_server[1], path, body), send(stream_server[1], path, streamed_body)), 120)
        try:
            streamed = assemble(path, chunks, options)
            plain = normalized(path, plain)
            check_same(body, options, streamed, plain)
            check_against_engine(plain_server[0], plain_server[2], path, body, plain)
            check_against_engine(stream_server[0], stream_server[2], path, body, streamed)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {path} {json.dumps(streamed_body)}: {e}") from None
    for engine, _, _ in servers:
        await wait_idle(engine)
        assert_all_blocks_free(engine)


def check_same(body: dict, options: dict | None, streamed: dict, plain: dict) -> None:
    """A stream put together against the non-streamed response to the same request."""
    assert len(streamed["choices"]) == len(plain["choices"])
    for a, b in zip(streamed["choices"], plain["choices"]):
        keys = ("index", "text", "finish_reason", "stop_reason")
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert_same_logprobs(a["logprobs"], b["logprobs"])
        assert ("prompt_logprobs" in a) == ("prompt_logprobs" in b) == ("prompt_logprobs" in body)
        if "prompt_logprobs" in a:
            assert_same_prompt_logprobs(a["prompt_logprobs"], b["prompt_logprobs"])
            n = body.get("n", 1)  # every choice of one prompt carries the same
            assert_same_prompt_logprobs(a["prompt_logprobs"], plain["choices"][a["index"] // n * n]["prompt_logprobs"])
    if options and options.get("include_usage"):
        drop = ("prompt_tokens_details",)  # cached tokens: the second run may hit the prefix cache
        assert {k: v for k, v in streamed["usage"].items() if k not in drop} == \
            {k: v for k, v in plain["usage"].items() if k not in drop}


# ---- bad input and clients that go away ---------------------------------------------------------

# field -> bad values; each gets a 400 naming the field (param), whatever else the request holds
BAD = {
    "temperature": [-1, "hot", [1]], "top_p": [0, 1.5], "top_k": [-2, 513, 2**63], "min_p": [-0.1, 1.5],
    "repetition_penalty": [0, -1], "presence_penalty": [2.5], "frequency_penalty": [-2.5],
    "seed": [2**63, "7", 1.5], "stop": [5, [""], ["a", "b", "c", "d", "e"], [1]],
    "stop_token_ids": [[-1], [512], "x"], "min_tokens": [-1, 1000], "n": [0, 17, "2"],
    "logit_bias": [{"x": 1}, {"512": 1}, {"1" * 5000: 1}, {"-1": 1}], "priority": [2**63, "high"],
    "cache_salt": ["", 5], "ignore_eos": ["yes"], "skip_special_tokens": [1],
    "include_stop_str_in_output": [None], "stream_options": [{"include_usage": 1}, {"bogus": True}],
    "length_penalty": ["x"], "unknown_field": [1], "user": [5],
}
BAD_COMPLETIONS = {"max_tokens": [0, -1, 600, None], "logprobs": [-1, 21, True], "prompt_logprobs": [-1, 21],
                   "prompt": [[], "", [1, 512], [[1], []], [1, "a"], {"a": 1}], "echo": ["yes"],
                   "suffix": ["x"], "best_of": [5]}
BAD_CHAT = {"max_tokens": [0, 600], "max_completion_tokens": [0, 600], "top_logprobs": [-1, 21],
            "messages": [[], "hi", [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}]],
            "logprobs": [3], "tools": [[{"type": "function"}]], "response_format": [{"type": "json_object"}]}


def bad_param(field: str, value) -> str:
    """The param a 400 for ``field: value`` names (or the start of it: ``stop[0]``, ``logit_bias.5``)."""
    if field == "stream_options":
        return "stream_options." + next(iter(value))
    if field == "messages" and isinstance(value, list) and value and isinstance(value[0], dict):
        return "messages[0].content"
    return field


async def test_malformed_fields_get_400_naming_them_and_every_block_comes_back(servers):
    rng = random.Random(SEED + 1)
    engine, session, _ = servers[0]
    for case in range(150):
        path, body = random_body(rng)
        body.pop("echo", None)
        if body.get("max_tokens") == 0:
            body["max_tokens"] = 1
        table = {**BAD, **(BAD_CHAT if path == "/v1/chat/completions" else BAD_COMPLETIONS)}
        field = rng.choice(sorted(table))
        value = rng.choice(table[field])
        body = {k: v for k, v in body.items() if not (field == "logprobs" and k == "top_logprobs")}
        if field == "max_tokens":  # max_completion_tokens would win
            body.pop("max_completion_tokens", None)
        if field == "min_tokens" and value == 1000:
            body["max_tokens"] = 10
        body[field] = value
        stream = rng.random() < 0.5
        if stream or field == "stream_options":
            body["stream"] = True
        async with session.post(path, json=body) as resp:
            text = await asyncio.wait_for(resp.text(), 30)
            status = resp.status
        context = f"case {case}: {path} {json.dumps(body)[:300]}"
        assert status == 400, f"{context}: {status} {text[:300]}"
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and error["code"] is None, context
        param = bad_param(field, value)
        assert error["param"] == param or (error["param"] or "").startswith((param + ".", param + "[")), \
            f"{context}: param {error['param']!r}, not {param!r}: {error['message']}"
    async with session.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"}) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
    await wait_idle(engine)
    assert_all_blocks_free(engine)


async def test_clients_gone_mid_stream_or_mid_request_leave_every_block_free(servers):
    rng = random.Random(SEED + 2)
    for case in range(16):
        engine, session, _ = rng.choice(servers)
        path, body = random_body(rng)
        body.update(max_tokens=rng.randint(20, 200), ignore_eos=True, min_tokens=0)
        body.pop("echo", None)
        body.pop("stop", None)
        body.pop("stop_token_ids", None)
        if path == "/v1/chat/completions":
            body.pop("max_completion_tokens", None)
        if body.get("use_beam_search"):
            body["max_tokens"] = 12
        if rng.random() < 0.6:  # read a few events, then drop the connection
            resp = await session.post(path, json={**body, "stream": True})
            assert resp.status == 200
            for _ in range(rng.randint(0, 4)):
                try:
                    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 30)
                except (asyncio.IncompleteReadError, aiohttp.ClientPayloadError):
                    break
            resp.close()
        else:  # a non-streamed request the client gives up on
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.005, 0.1))
            try:
                async with session.post(path, json=body, timeout=timeout) as resp:
                    await resp.read()
            except asyncio.TimeoutError:
                pass
    for engine, _, _ in servers:
        await wait_idle(engine)
        assert_all_blocks_free(engine)


async def wait_idle(engine, timeout: float = 30.0) -> None:
    """Until the engine holds no request (aborts are applied between steps)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.output.streams or engine.scheduler.requests:
        assert asyncio.get_running_loop().time() < deadline, f"requests left: {list(engine.output.streams)}"
        await asyncio.sleep(0.02)
