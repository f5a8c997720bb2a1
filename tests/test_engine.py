"""The engine end to end (control plane + worker process) on the real stories260K model.

Tests that need only the default config and leave the engine as they found it share one (``engine``,
module scope: each start spawns a torch process); the others start their own (``start``).
"""

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from pagedkv.common.sampling_params import SamplingParams
from conftest import (GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free,
                      collect, metric, module_loop_fixtures, record_plans)

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0, max_tokens=60)


start, engine = module_loop_fixtures()  # the shared engine has the default config (prefix caching on)


async def test_greedy_completion_equals_the_golden(engine):
    tokens, text, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY))
    assert tokens == GOLDEN_OUTPUT_IDS
    assert text == GOLDEN_COMPLETION
    assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", 5, 60)
    assert_all_blocks_free(engine)


async def test_chunked_prefill_and_block_size_8_give_the_golden(start):
    engine = await start(block_size=8, max_num_batched_tokens=3)
    tokens, _, _ = await collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY))
    assert tokens == GOLDEN_OUTPUT_IDS


async def test_sixteen_requests_on_a_tiny_pool_are_preempted_and_still_golden(start):
    engine = await start(num_gpu_blocks=12, enable_prefix_caching=False, preemption_mode="recompute")
    results = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)) for _ in range(16)])
    assert all(tokens == GOLDEN_OUTPUT_IDS and text == GOLDEN_COMPLETION for tokens, text, _ in results)
    preemptions = metric(engine, "pagedkv:num_preemptions_total", mode="recompute")
    assert preemptions == engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)
    assert metric(engine, "pagedkv:kv_cache_usage_perc") == 0.0
    assert metric(engine, "pagedkv:generation_tokens_total") >= 16 * 60


async def test_seeded_sampling_is_the_same_alone_batched_and_preempted(engine, start):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=40)
    alone_engine = engine
    alone, _, _ = await collect(alone_engine.add_request(GOLDEN_PROMPT_IDS, params))
    again, _, _ = await collect(alone_engine.add_request(GOLDEN_PROMPT_IDS, params))
    assert alone == again

    tight = await start(num_gpu_blocks=10, enable_prefix_caching=False)
    noise = [tight.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=1.0, max_tokens=40, seed=s))
             for s in range(7)]
    seeded = tight.add_request(GOLDEN_PROMPT_IDS, params)
    results = await asyncio.gather(collect(seeded), *[collect(n) for n in noise])
    assert tight.scheduler.num_preemptions > 0
    assert results[0][0] == alone
    assert_all_blocks_free(tight)


async def test_stop_string_ends_the_text_before_it(engine):
    params = SamplingParams(temperature=0, max_tokens=60, stop=["girl"])
    _, text, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, params))
    assert text == ", there was a little "
    assert last.finish_reason == "stop"
    assert_all_blocks_free(engine)


async def test_stop_token_id_ends_the_request_without_its_text(engine):
    params = SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[426])  # 426 is "."
    tokens, text, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, params))
    assert tokens == GOLDEN_OUTPUT_IDS[:11] and tokens[-1] == 426
    assert text == ", there was a little girl named Lily"
    assert last.finish_reason == "stop"


async def test_closing_the_stream_early_aborts_and_frees_every_block(engine):
    aborted = metric(engine, "pagedkv:request_success_total", finished_reason="abort")
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=200))
    async for out in stream:
        if out.num_output_tokens == 5:
            break
    await stream.aclose()
    for _ in range(100):
        if not engine.scheduler.requests:
            break
        await asyncio.sleep(0.01)
    assert_all_blocks_free(engine)
    assert metric(engine, "pagedkv:request_success_total", finished_reason="abort") == aborted + 1


async def test_an_aborted_request_ends_with_the_text_its_detokenizer_held_back(engine):
    # the whole golden is a prefix of the stop string: every token's text is held back for it
    params = SamplingParams(temperature=0, max_tokens=200, stop=[GOLDEN_COMPLETION + "!"])
    stream = engine.add_request(GOLDEN_PROMPT_IDS, params, "held-text")
    deltas = []
    async for out in stream:
        deltas.append(out)
        if out.num_output_tokens == 5:
            engine.abort("held-text")
    tokens = [t for o in deltas for t in o.token_ids]
    assert deltas[-1].finish_reason == "abort" and tokens == GOLDEN_OUTPUT_IDS[:len(tokens)]
    assert [o.text for o in deltas[:-1]] == [""] * (len(deltas) - 1)
    assert deltas[-1].text == engine.tokenizer.decode(GOLDEN_PROMPT_IDS + tokens)[len("Once upon a time"):]
    assert_all_blocks_free(engine)


async def _by_choice(stream) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in stream:
        tokens.setdefault(out.index, []).extend(out.token_ids)
    return tokens


async def test_a_request_id_naming_a_running_sequence_is_refused_and_beams_skip_taken_ids(engine):
    """Sequence ids come from the request id (``<id>-<i>`` for n > 1, ``<id>-beam<k>`` for beams). A new
    request whose sequences would take a running request's id is a ValueError naming request_id (it
    overwrote that sequence's bookkeeping, and the engine loop crashed, failing every request); a new
    beam takes the next free id. Either way each request gives what it gives alone."""
    pair = SamplingParams(temperature=0, max_tokens=8, n=2)
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=8)
    alone_pair = await _by_choice(engine.add_request(GOLDEN_PROMPT_IDS, pair, "alone-pair"))
    alone_beams = await _by_choice(engine.add_request(GOLDEN_PROMPT_IDS, beams, "alone-beams"))
    a1 = engine.add_request(GOLDEN_PROMPT_IDS, GREEDY, "a-1")
    with pytest.raises(ValueError, match="^request_id: 'a' would name sequence 'a-1', which a running request holds"):
        engine.add_request(GOLDEN_PROMPT_IDS, pair, "a")
    b = engine.add_request(GOLDEN_PROMPT_IDS, pair, "b")
    with pytest.raises(ValueError, match="^request_id: 'b-0' would name sequence 'b-0'"):
        engine.add_request(GOLDEN_PROMPT_IDS, GREEDY, "b-0")
    c1 = engine.add_request(GOLDEN_PROMPT_IDS, GREEDY, "c-beam1")  # the id c's first forked beam would take
    c = engine.add_request(GOLDEN_PROMPT_IDS, beams, "c")
    got = await asyncio.gather(collect(a1), _by_choice(b), collect(c1), _by_choice(c))
    assert got[0][0] == got[2][0] == GOLDEN_OUTPUT_IDS
    assert got[1] == alone_pair and got[3] == alone_beams
    assert_all_blocks_free(engine)


async def test_requests_that_can_never_fit_are_rejected_at_once(start):
    engine = await start(num_gpu_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="^prompt: 101 tokens is longer than max_model_len"):
        engine.add_request([1] * 101, GREEDY)
    with pytest.raises(ValueError, match="^max_tokens: "):
        engine.add_request([1] * 50, SamplingParams(max_tokens=51))
    with pytest.raises(ValueError, match="^max_tokens: prompt \\+ max_tokens needs 5 KV blocks but the whole pool has 4 "
                                         "\\(num_gpu_blocks, block_size 16\\)"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="^prompt: token id 512 is outside"):
        engine.add_request([1, 512], GREEDY)
    with pytest.raises(ValueError, match="^n: "):
        engine.add_request([1, 2], SamplingParams(n=17))
    with pytest.raises(ValueError, match="^cache_salt: must not be empty"):
        engine.add_request([1, 2], GREEDY, cache_salt="")
    assert not engine.scheduler.requests


async def test_the_submit_check_is_exact_the_last_sampled_token_never_takes_a_slot(start):
    # 5 + 60 = 65 = 4 x 16 + 1 tokens, but the 60th sampled token is never written: 64 slots, 4 blocks
    engine = await start(num_gpu_blocks=4)
    tokens, text, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=60)))
    assert tokens == GOLDEN_OUTPUT_IDS and engine.scheduler.num_preemptions == 0
    with pytest.raises(ValueError, match="^max_tokens: prompt \\+ max_tokens needs 5 KV blocks"):
        engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(max_tokens=61))
    assert_all_blocks_free(engine)


async def test_n_or_beam_width_above_max_num_seqs_is_rejected_naming_the_limit(start):
    engine = await start(max_num_seqs=2)
    for params in (SamplingParams(n=3), SamplingParams(n=3, use_beam_search=True)):
        with pytest.raises(ValueError, match="^n: 3 sequences exceed max_num_seqs \\(2\\)"):
            engine.add_request(GOLDEN_PROMPT_IDS, params)
    outs = [o async for o in engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(n=2, max_tokens=4))]
    assert {o.index for o in outs if o.finish_reason == "length"} == {0, 1}
    assert_all_blocks_free(engine)


async def test_the_loop_sleeps_instead_of_sending_empty_plans_when_nothing_can_run(start):
    engine = await start()
    plans = record_plans(engine)
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(max_tokens=4))
    engine.scheduler.max_num_seqs = 0  # before the loop sees it: nothing can be admitted, no seat
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert plans == [] and len(engine.scheduler.waiting) == 1  # asleep, not spinning on empty steps
    engine.scheduler.max_num_seqs = 8
    engine.abort(stream_id := next(iter(engine.output.streams)))  # an abort wakes it
    _, _, last = await collect(stream)
    assert last.finish_reason == "abort" and stream_id not in engine.output.streams
    assert [p.finished_request_ids for p in plans] == []  # the request never reached the worker
    assert_all_blocks_free(engine)


async def test_a_dead_worker_fails_requests_in_flight_with_a_clear_error(start):
    engine = await start(max_worker_restarts=0)  # recovery off (tests/test_worker_recovery.py has it on)
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=400))
    await stream.__anext__()
    engine.client.process.kill()
    _, _, last = await collect(stream)
    assert last.finish_reason == "error" and "worker process exited" in last.error
    assert not engine.healthy
    with pytest.raises(RuntimeError, match="not serving"):
        engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)


async def test_a_stalled_worker_is_detected_by_the_deadline(start):
    engine = await start(worker_timeout=1.0, max_worker_restarts=0)
    process = engine.client.process
    os.kill(process.pid, signal.SIGSTOP)
    _, _, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY))
    assert last.finish_reason == "error" and "did not answer within 1 s" in last.error
    assert process.poll() == -signal.SIGKILL  # killed for certain, not left holding its pool


async def test_the_worker_is_its_own_process_and_the_control_plane_never_loads_torch(stories260k):
    code = f"""
import asyncio, os, sys
from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine
async def main():
    e = await Engine.start(EngineConfig(model={str(stories260k)!r}))
    out = [o async for o in e.add_request([1, 403], SamplingParams(temperature=0, max_tokens=3))]
    print("RESULT", len(out), e.client.process.pid != os.getpid(), "torch" in sys.modules)
    await e.shutdown()
asyncio.run(main())
"""
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=120)
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT 3 True False"], out.stderr[-2000:]


async def test_engine_start_validates_its_config_before_any_worker(monkeypatch):
    from pagedkv.common.config import EngineConfig
    from pagedkv.scheduler import engine as engine_module

    def no_worker(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(engine_module, "WorkerClient", no_worker)
    with pytest.raises(ValueError) as bad:
        await engine_module.Engine.start(EngineConfig(model=None, block_size=3))
    assert str(bad.value) == "block_size: must be a power of two between 1 and 256, got 3"
    with pytest.raises(TypeError) as wrong:
        await engine_module.Engine.start(EngineConfig(model=None, max_num_seqs="8"))
    assert str(wrong.value).startswith("max_num_seqs: Expected `int`, got `str`")
