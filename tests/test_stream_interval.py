"""``--stream-interval N`` on the real stories260K model: each choice's first token goes out at once,
then its tokens in deltas of N, and its last delta as soon as it ends.

What must hold: every choice's whole output (token ids, text, finish and stop reasons, logprobs) equals
the output at N = 1; each delta's size is exact; a delta held back when the request ends early
(an abort) goes out with the final delta, and before it when the request fails (the API sends an
error delta's text nowhere), so no token is lost; every block comes back.
"""

import asyncio
import json
import os
import signal

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.output_processor import OutputProcessor
from conftest import (GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS,
                      assert_all_blocks_free, module_loop_fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="module")

start, _ = module_loop_fixtures()

WORKLOAD = [
    (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60)),
    (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60, stop=[" park"])),
    (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[GOLDEN_OUTPUT_IDS[7]])),
    (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=1)),
    (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=5)),
    (GOLDEN_PROMPT_IDS[:3], SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=40, logprobs=2)),
    (GOLDEN_PROMPT_IDS, SamplingParams(n=2, use_beam_search=True, max_tokens=12)),
]


async def _drain(stream) -> list:
    return [out async for out in stream]


async def run(engine) -> list[dict[int, list]]:
    """Per request, choice index -> its deltas in order."""
    outs = await asyncio.gather(*[_drain(engine.add_request(p, sp)) for p, sp in WORKLOAD])
    results = []
    for deltas in outs:
        choices: dict[int, list] = {}
        for o in deltas:
            choices.setdefault(o.index, []).append(o)
        results.append(choices)
    return results


def whole(deltas) -> tuple:
    return ([t for o in deltas for t in o.token_ids], "".join(o.text for o in deltas), deltas[-1].finish_reason,
            deltas[-1].stop_reason, [lp.logprob for o in deltas for lp in o.logprobs or []])


def sizes_at(interval: int, num_tokens: int) -> list[int]:
    """Tokens per delta of a choice that ends on its last sampled token: 1, then groups of ``interval``."""
    q, r = divmod(num_tokens - 1, interval)
    return [1] + [interval] * q + ([r] if r else [])


async def test_each_choice_equals_interval_one_in_deltas_of_n(start):
    results = {}
    for interval in (1, 4):
        engine = await start(stream_interval=interval)
        results[interval] = await asyncio.wait_for(run(engine), 120)  # a delta held forever hangs here
        assert_all_blocks_free(engine)
    for one, four in zip(results[1], results[4]):
        assert one.keys() == four.keys()
        for i in one:
            assert whole(four[i])[:4] == whole(one[i])[:4]
            assert whole(four[i])[4] == pytest.approx(whole(one[i])[4], abs=1e-5)
            assert all(len(o.token_ids) == 1 for o in one[i][:-1])  # N = 1: a delta per token
    greedy = results[4][0][0]
    assert whole(greedy)[:3] == (GOLDEN_OUTPUT_IDS, GOLDEN_COMPLETION, "length")
    assert [len(o.token_ids) for o in greedy] == [1] + [4] * 14 + [3]
    assert [o.finish_reason for o in greedy] == [None] * 15 + ["length"]
    stopped = results[4][1][0]  # the stop string is found across the merged deltas
    assert whole(stopped)[1:4] == (GOLDEN_COMPLETION[:GOLDEN_COMPLETION.index(" park")], "stop", " park")
    assert [len(o.token_ids) for o in results[4][2][0]] == [1, 4, 3]  # through the stop token, 8 tokens
    assert [len(o.token_ids) for o in results[4][3][0]] == [1]
    assert [len(o.token_ids) for o in results[4][4][0]] == [1, 4]
    for deltas in results[4][5].values():  # n = 3 with logprobs: each choice on its own, a logprob per token
        assert [len(o.token_ids) for o in deltas] == sizes_at(4, len(whole(deltas)[0]))
        assert all(len(o.logprobs) == len(o.token_ids) for o in deltas)
    assert [len(d) for d in results[4][6].values()] == [1, 1]  # beam search: each beam once, at the end


async def test_tokens_held_back_when_a_request_is_aborted_go_out_with_its_last_delta(start):
    engine = await start(stream_interval=100)  # longer than the request: after the first token, all are held
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60), "held")
    first = await anext(stream)
    while engine.scheduler.requests["held"].num_output_tokens < 3:
        await asyncio.sleep(0.001)
    engine.abort("held")
    rest = await _drain(stream)
    assert len(first.token_ids) == 1 and len(rest) == 1 and rest[0].finish_reason == "abort"
    tokens = first.token_ids + rest[0].token_ids
    assert len(tokens) == rest[0].num_output_tokens >= 3 and tokens == GOLDEN_OUTPUT_IDS[:len(tokens)]
    assert first.text + rest[0].text == GOLDEN_COMPLETION[:len(first.text + rest[0].text)]
    assert_all_blocks_free(engine)


async def test_tokens_held_back_when_a_request_fails_go_out_before_its_error_delta(start):
    engine = await start(stream_interval=100, max_worker_restarts=0)
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60), "failed")
    first = await anext(stream)
    while engine.scheduler.requests["failed"].num_output_tokens < 3:
        await asyncio.sleep(0.001)
    os.kill(engine.client.process.pid, signal.SIGKILL)
    rest = await asyncio.wait_for(_drain(stream), 60)
    assert [o.finish_reason for o in rest] == [None, "error"] and rest[1].token_ids == [] and rest[1].text == ""
    tokens = first.token_ids + rest[0].token_ids
    assert len(tokens) >= 3 and tokens == GOLDEN_OUTPUT_IDS[:len(tokens)]
    assert first.text + rest[0].text == GOLDEN_COMPLETION[:len(first.text + rest[0].text)]


async def test_sse_stream_sends_a_chunk_per_interval(start):
    engine = await start(stream_interval=4)
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.make_url("/v1/completions"), json={
                    "prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}) as r:
                body = (await r.read()).decode()
    finally:
        await server.close()
    events = [line.removeprefix("data: ") for line in body.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 16 + 1  # 1 + 14 x 4 + 3 tokens, then [DONE]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == GOLDEN_COMPLETION
    assert [c["finish_reason"] for c in chunks] == [None] * 15 + ["length"]


async def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval: must be at least 1, got 0"):
        OutputProcessor(None, None, 512, stream_interval=0)
