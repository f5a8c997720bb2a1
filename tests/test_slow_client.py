"""A consumer that reads slower than tokens are produced, or stops reading, on the real stories260K model.

What must hold (as vLLM V1's output collector): while a request's deltas are not taken, the next delta
of the same choice merges into the waiting one, so at most one delta per choice waits, whatever the
length of the stall; the consumer that catches up gets fewer, larger deltas whose concatenation is
exactly what a consumer that kept up gets (token ids, text, logprobs, finish and stop reasons, usage),
choices kept apart by index. Over HTTP the stall is a client whose TCP window is full: the handler's
write waits, and the engine keeps generating into the merged delta.
"""

import asyncio
import gc
import json
import re
import socket

import aiohttp
import pytest
from aiohttp import web

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.output_processor import OutputQueue, RequestOutput, TokenLogprob
from conftest import GOLDEN_PROMPT, GOLDEN_PROMPT_IDS, assert_all_blocks_free, module_loop_fixtures

pytestmark = pytest.mark.asyncio(loop_scope="module")

_, engine = module_loop_fixtures()

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=500, ignore_eos=True, logprobs=5),
    "seeded-n3": SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=500, logprobs=5),
}


def per_choice(deltas) -> dict[int, tuple]:
    """Choice index -> (token ids, text, logprobs, top logprobs, finish reason, stop reason, output tokens)."""
    out = {}
    for d in deltas:
        ids, text, lps, tops, *_ = out.get(d.index, ([], "", [], [], None, None, 0))
        lps, tops = lps + [lp.logprob for lp in d.logprobs or []], tops + [lp.top_logprobs for lp in d.logprobs or []]
        out[d.index] = (ids + d.token_ids, text + d.text, lps, tops, d.finish_reason, d.stop_reason,
                        d.num_output_tokens)
    return out


def assert_same_output(slow: dict, fast: dict) -> None:
    assert slow.keys() == fast.keys()
    for i in fast:
        (ids, text, lps, tops, *rest), (f_ids, f_text, f_lps, f_tops, *f_rest) = slow[i], fast[i]
        assert (ids, text, rest) == (f_ids, f_text, f_rest)
        assert [[t for t, _, _ in top] for top in tops] == [[t for t, _, _ in top] for top in f_tops]
        assert lps == pytest.approx(f_lps, abs=1e-5)


def _delta(index, token_ids, text, finish_reason=None, **kw) -> RequestOutput:
    return RequestOutput("r", index, token_ids, text, kw.pop("logprobs", None), finish_reason, kw.pop("error", None),
                         5, kw.pop("num_output_tokens", len(token_ids)), 0, **kw)


async def test_a_waiting_delta_absorbs_the_next_of_its_choice_in_order_and_an_error_stays_apart():
    queue = OutputQueue()
    lps = [TokenLogprob(t, str(t), -0.5 * t, []) for t in (1, 2, 3)]
    first = _delta(0, [1], "a", logprobs=lps[:1], prompt_logprobs=[None])
    for out in (first, _delta(1, [9], "x"), _delta(0, [2], "b", logprobs=lps[1:2], num_output_tokens=2),
                _delta(0, [3], "c", "stop", logprobs=lps[2:], stop_reason="c", num_output_tokens=3),
                _delta(1, [], "", "error", error="worker died")):
        queue.put(out)
    assert queue.qsize() == 3
    merged, other, error = [await queue.get() for _ in range(3)]
    assert (merged.index, merged.token_ids, merged.text, merged.logprobs, merged.finish_reason, merged.stop_reason,
            merged.num_output_tokens, merged.prompt_logprobs) == (0, [1, 2, 3], "abc", lps, "stop", "c", 3, [None])
    assert (first.token_ids, first.text, first.logprobs) == ([1], "a", lps[:1])  # the sender's delta is unchanged
    assert (other.index, other.token_ids, other.text, other.finish_reason) == (1, [9], "x", None)
    assert (error.index, error.finish_reason, error.error) == (1, "error", "worker died")
    assert queue.empty()
    for i in range(1000):  # a long stall: the text comes back whole, kept meanwhile in a few pieces
        queue.put(_delta(0, [i], f"{i},"))
    assert len(queue._texts[(0, False)]) <= 11
    out = await queue.get()
    assert (out.token_ids, out.text) == (list(range(1000)), "".join(f"{i}," for i in range(1000)))


@pytest.mark.parametrize("name", PARAMS)
async def test_a_stream_not_read_holds_one_delta_per_choice_and_loses_nothing(engine, name):
    params = PARAMS[name]
    fast = [out async for out in engine.add_request(GOLDEN_PROMPT_IDS, params)]
    unread = engine.add_request(GOLDEN_PROMPT_IDS, params, f"unread-{name}")
    stream = engine.output.streams[f"unread-{name}"]
    while not stream.done:  # the request runs to its end while nothing is read
        await asyncio.sleep(0.01)
    assert stream.queue.qsize() == params.n  # each choice's whole output in one waiting delta
    slow = [out async for out in unread]
    assert sorted(d.index for d in slow) == list(range(params.n))
    assert all(d.finish_reason == "length" and len(d.token_ids) == 500 for d in slow)
    assert_same_output(per_choice(slow), per_choice(fast))
    assert len(fast) > len(slow)
    assert_all_blocks_free(engine)


async def _serve_with_a_small_send_buffer(engine) -> tuple[web.AppRunner, int]:
    """The API on a listening socket whose connections get a 4 KiB kernel send buffer (Linux: accepted
    sockets inherit it), so a client that stops reading blocks the handler's writes within ~150 KB."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(build_app(engine), handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]


def _sse_choices(body: bytes) -> tuple[list[dict], dict]:
    """The delta chunks of an SSE body (checking it ends with [DONE]) and its usage."""
    events = re.findall(rb"data: (.*?)\r?\n\r?\n", body)
    assert events[-1] == b"[DONE]"
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    assert usage["choices"] == []
    return chunks, usage["usage"]


def _sse_per_choice(chunks: list[dict]) -> dict[int, tuple]:
    """Choice index -> (text, tokens, token logprobs, top logprobs, finish reasons, stop reasons) concatenated."""
    out: dict[int, tuple] = {}
    for chunk in chunks:
        [c] = chunk["choices"]
        text, tokens, lps, tops, finishes, stops = out.get(c["index"], ("", [], [], [], [], []))
        lp = c["logprobs"]
        out[c["index"]] = (text + c["text"], tokens + lp["tokens"], lps + lp["token_logprobs"],
                           tops + [sorted(t) for t in lp["top_logprobs"]],
                           finishes + [c["finish_reason"]], stops + [c["stop_reason"]])
    return out


@pytest.mark.parametrize("name, prompt", [("greedy", GOLDEN_PROMPT), ("seeded-n3", GOLDEN_PROMPT),
                                          ("greedy", [GOLDEN_PROMPT, GOLDEN_PROMPT])],
                         ids=["greedy", "seeded-n3", "two-prompts"])
async def test_an_http_client_that_stalls_then_reads_gets_every_token_in_fewer_events(engine, name, prompt):
    params = PARAMS[name]
    num_prompts = 1 if isinstance(prompt, str) else len(prompt)
    num_choices = params.n * num_prompts
    body = {"prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "seed": params.seed, "n": params.n, "logprobs": params.logprobs,
            "ignore_eos": params.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    runner, port = await _serve_with_a_small_send_buffer(engine)
    sock = socket.socket()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                fast_chunks, fast_usage = _sse_choices(await r.read())
        gc.collect()  # logprobs left by earlier tests or the fast run above are not this request's:
        before = [o for o in gc.get_objects() if isinstance(o, TokenLogprob)]  # held, so no id is reused
        loop = asyncio.get_running_loop()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small TCP window, soon full
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        payload = json.dumps(body).encode()
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        while len(engine.output.streams) < num_prompts:
            await asyncio.sleep(0.001)
        streams = list(engine.output.streams.values())
        while not all(s.done for s in streams):  # nothing is read: the handler's write waits, the engine goes on
            assert [s.queue.qsize() <= params.n for s in streams] == [True] * num_prompts
            await asyncio.sleep(0.005)
        assert [s.queue.qsize() <= params.n for s in streams] == [True] * num_prompts
        # every delta object the server holds for it: the engine's queues (one per choice), the one being
        # written, and with several prompts the API's one slot and one in hand per prompt
        ids = {s.request_id for s in streams}
        alive = [o for o in gc.get_objects() if isinstance(o, RequestOutput) and o.request_id in ids]
        assert len(alive) <= num_choices + 1 + (num_prompts + 1 if num_prompts > 1 else 0)
        # and no logprobs but theirs: nothing already sent is kept
        unsent = {id(lp) for o in alive for lp in o.logprobs or []}
        old = set(map(id, before))
        assert {id(o) for o in gc.get_objects() if isinstance(o, TokenLogprob) and id(o) not in old} == unsent
        raw = b""
        while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**16), 30)
            assert chunk, raw[-200:]
            raw += chunk
    finally:
        sock.close()  # a failed test's stalled handler ends now, not at the runner's shutdown timeout
        await runner.cleanup()
    slow_chunks, slow_usage = _sse_choices(raw.partition(b"\r\n\r\n")[2])
    slow, fast = _sse_per_choice(slow_chunks), _sse_per_choice(fast_chunks)
    assert slow_usage == fast_usage == {"prompt_tokens": 5 * num_prompts, "completion_tokens": 500 * num_choices,
                                        "total_tokens": (5 + 500 * params.n) * num_prompts,
                                        "prompt_tokens_details": {"cached_tokens": 0}}
    assert slow.keys() == fast.keys() == set(range(num_choices))
    for i in fast:
        text, tokens, lps, tops, finishes, stops = slow[i]
        assert (text, tokens, tops) == fast[i][:2] + fast[i][3:4]
        assert len(tokens) == 500 and lps == pytest.approx(fast[i][2], abs=1e-5)
        assert [f for f in finishes if f] == ["length"] and finishes[-1] == "length" and set(stops) == {None}
    assert len(slow_chunks) < 500 * num_choices  # the stall merged deltas: fewer events than tokens
    assert_all_blocks_free(engine)
