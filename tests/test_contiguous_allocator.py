"""The contiguous baseline allocator: one first-fit run per request, reserved for its maximum length."""

import asyncio

import pytest

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.bench.contiguous_allocator import ContiguousAllocator, ExtentPool
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.request import Request
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, collect


def req(rid, prompt_len, max_tokens):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def tables(*reqs):
    return [r.block_table for r in reqs if r.block_table]


def test_admission_reserves_one_run_for_prompt_plus_max_tokens():
    kv = ContiguousAllocator(num_gpu_blocks=10, block_size=4, max_model_len=100)
    a = req("a", 5, 6)  # 11 tokens -> 3 blocks
    assert kv.num_blocks_needed([(a, 5)]) == 3
    assert kv.allocate_slots(a, 5) == [0, 1, 2]
    assert a.block_table == [0, 1, 2] and kv.num_free_blocks == 7
    a.num_computed_tokens = 5
    assert kv.num_blocks_needed([(a, 1)]) == 0 and kv.allocate_slots(a, 1) == []  # never grows
    kv.pool.check_invariants(tables(a))


def test_reservation_is_capped_by_max_model_len():
    kv = ContiguousAllocator(num_gpu_blocks=10, block_size=4, max_model_len=8)
    assert kv.reservation_blocks(req("a", 3, 100)) == 2


def test_first_fit_and_external_fragmentation():
    kv = ContiguousAllocator(num_gpu_blocks=10, block_size=1, max_model_len=100)
    a, b, c = req("a", 2, 1), req("b", 3, 1), req("c", 2, 1)  # 3, 4, 3 blocks
    for r in (a, b, c):
        assert kv.allocate_slots(r, 1) is not None
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9])
    kv.free(a)
    kv.free(c)
    # 6 blocks free in two runs of 3: a 4-block request does not fit, though 6 >= 4
    d = req("d", 3, 1)
    assert kv.num_free_blocks == 6 and kv.pool.largest_free_run == 3
    assert kv.allocate_slots(d, 3) is None and d.block_table == []
    assert kv.pool.free_runs() == [(0, 3), (7, 3)]
    e = req("e", 1, 1)  # 2 blocks: first fit takes the lowest run
    assert kv.allocate_slots(e, 1) == [0, 1]
    kv.pool.check_invariants(tables(b, e))
    kv.free(b)  # merges with the free block 2 and the run at 7: [2, 10)
    assert kv.pool.free_runs() == [(2, 8)]
    assert kv.allocate_slots(d, 3) == [2, 3, 4, 5]
    kv.pool.check_invariants(tables(d, e))


def test_free_merges_runs_and_double_free_is_caught():
    pool = ExtentPool(8)
    s1, s2, s3 = pool.allocate_run(2), pool.allocate_run(3), pool.allocate_run(3)
    assert (s1, s2, s3, pool.num_free_blocks) == (0, 2, 5, 0)
    pool.free_run(2, 3)
    pool.free_run(0, 2)
    pool.free_run(5, 3)
    assert pool.free_runs() == [(0, 8)] and pool.usage == 0.0
    with pytest.raises(AssertionError, match="double free"):
        pool.free_run(3, 1)
    pool.check_invariants([])


def test_no_sharing_no_prefix_cache():
    kv = ContiguousAllocator(num_gpu_blocks=4, block_size=4, max_model_len=16)
    a = req("a", 4, 1)
    assert kv.find_cached_prefix(a) == [] and kv.take_pending_copies() == []
    with pytest.raises(NotImplementedError, match="cannot share blocks"):
        kv.fork(a, req("b", 4, 1))
    snap = kv.snapshot()
    assert snap["allocator"] == "contiguous" and snap["block_ref_counts"] == {}


async def test_engine_under_the_contiguous_allocator_reproduces_the_golden(stories260k):
    # 12 blocks of 16 hold one 65-token reservation (5 blocks) twice: requests queue for space
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=12),
                                kv_allocator=ContiguousAllocator.factory(16))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=60)
        results = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, greedy)) for _ in range(5)])
        assert all(tokens == GOLDEN_OUTPUT_IDS and text == GOLDEN_COMPLETION for tokens, text, _ in results)
        assert engine.scheduler.num_preemptions == 0  # a reservation is never outgrown
        assert engine.kv.num_free_blocks == 12
        engine.kv.pool.check_invariants([])
        with pytest.raises(ValueError, match="^n: .*contiguous"):
            engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(max_tokens=4, n=2))
    finally:
        await engine.shutdown()
