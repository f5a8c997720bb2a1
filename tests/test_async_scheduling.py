"""Async scheduling (``--async-scheduling``, on by default): step N + 1 is scheduled and sent while the
worker computes step N, on the real stories260K model.

What must hold: the worker gets its next plan before the control plane has applied the previous
result; outputs (token ids, text, finish reasons, logprobs) equal the synchronous loop's for every
sampling mode, with stop strings, EOS-free length limits, sharing and preemption in the mix; every
block comes back.
"""

import asyncio

import pytest

from pagedkv.common.sampling_params import SamplingParams
from conftest import (GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free,
                      module_loop_fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="module")


start, _ = module_loop_fixtures()


def record_channel(engine) -> list[tuple[str, int]]:
    """("submit" | "result", step id) for every plan sent and every result taken, in order."""
    events, client = [], engine.client
    submit, result = client.submit, client.result

    async def submitting(plan):
        events.append(("submit", plan.step_id))
        return await submit(plan)

    async def taking(step_id):
        out = await result(step_id)
        events.append(("result", step_id))
        return out

    client.submit, client.result = submitting, taking
    return events


async def drain(stream) -> list:
    return [out async for out in stream]


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_each_step_is_sent_before_the_previous_result_is_taken_and_none_past_max_tokens(
        start, async_scheduling):
    engine = await start(async_scheduling=async_scheduling)
    events = record_channel(engine)
    outs = await drain(engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=10)))
    assert [t for o in outs for t in o.token_ids] == GOLDEN_OUTPUT_IDS[:10]
    await asyncio.sleep(0.2)  # the loop is idle: no request, nothing more to send
    if async_scheduling:
        # 1 and 2 go out together; each later plan goes out before the result of the one before it
        # is taken; the request's 10th token is sampled by step 10, so nothing is computed after it
        expected = [("submit", 1), ("submit", 2), ("result", 1)]
        for k in range(3, 11):
            expected += [("submit", k), ("result", k - 1)]
        expected += [("result", 10)]
    else:
        expected = [(kind, k) for k in range(1, 11) for kind in ("submit", "result")]
    assert events == expected
    assert_all_blocks_free(engine)


def workload() -> list[tuple[list[int], SamplingParams]]:
    """Every sampling mode the engine has, each ending in its own way."""
    return [
        (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60)),
        (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60, stop=[" park"])),
        (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[GOLDEN_OUTPUT_IDS[7]])),
        (GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=1)),
        (GOLDEN_PROMPT_IDS[:3], SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=40,
                                               logprobs=2)),
        (GOLDEN_PROMPT_IDS, SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=50, min_tokens=5,
                                           stop=["."], include_stop_str_in_output=True)),
        (GOLDEN_PROMPT_IDS, SamplingParams(n=2, use_beam_search=True, max_tokens=12)),
        ([1, 403, 407, 261], SamplingParams(temperature=0, max_tokens=30, presence_penalty=0.5,
                                            frequency_penalty=0.3, repetition_penalty=1.2)),
    ] * 3


async def run(engine) -> list[dict]:
    """Per request, choice index -> (token ids, text, finish reason, stop reason, the tokens' logprobs)."""
    outs = await asyncio.gather(*[drain(engine.add_request(p, sp)) for p, sp in workload()])
    results = []
    for stream in outs:
        choices = {}
        for o in stream:  # the choices' deltas interleave as steps happen to go: compare each choice whole
            ids, text, _, _, lps = choices.get(o.index, ([], "", None, None, []))
            choices[o.index] = (ids + o.token_ids, text + o.text, o.finish_reason, o.stop_reason,
                                lps + [lp.logprob for lp in o.logprobs or []])
        results.append(choices)
    return results


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
async def test_outputs_equal_the_synchronous_loop_with_preemption_in_the_mix(start, preemption_mode):
    results, preemptions = {}, {}
    for async_scheduling in (True, False):
        engine = await start(async_scheduling=async_scheduling, num_gpu_blocks=24, block_size=8,
                             enable_prefix_caching=False, preemption_mode=preemption_mode)
        results[async_scheduling] = await run(engine)
        preemptions[async_scheduling] = engine.scheduler.num_preemptions
        assert_all_blocks_free(engine)
    for on, off in zip(results[True], results[False]):  # logprobs: batches differ, so do float sums' orders
        assert {i: c[:4] for i, c in on.items()} == {i: c[:4] for i, c in off.items()}
        for i in on:
            assert on[i][4] == pytest.approx(off[i][4], abs=1e-4)
    assert preemptions[True] > 0 and preemptions[False] > 0
    assert results[True][0][0][:3] == (GOLDEN_OUTPUT_IDS, GOLDEN_COMPLETION, "length")
    ids, text, *reasons, _ = results[True][1][0]
    assert (text, reasons) == (GOLDEN_COMPLETION[:GOLDEN_COMPLETION.index(" park")], ["stop", " park"])
    assert results[True][2][0][0] == GOLDEN_OUTPUT_IDS[:8]  # through the stop token
    assert results[True][3][0][:3] == (GOLDEN_OUTPUT_IDS[:1], ",", "length")
    assert sorted(results[True][4]) == [0, 1, 2] and sorted(results[True][6]) == [0, 1]

