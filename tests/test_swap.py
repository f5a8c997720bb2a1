"""Swap preemption: host-pool accounting, the scheduler's swap-out/swap-in plans, and the engine end to end.

PagedAttention (Kwon et al., SOSP 2023) §4.5: a swapped request keeps its KV in host memory and
resumes without recompute; all of its blocks move together; when the host pool is full the victim
is recomputed instead. The engine tests run the real stories260K model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from conftest import (GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free,
                      collect, metric, run_step)
from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.preemption import PreemptionPolicy
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.scheduler import Scheduler
from pagedkv.scheduler.swap import SwapSpace

STORIES_BLOCK_BYTES = 20480  # 2 x 5 layers x 16 tokens x 4 kv heads x 8 head_dim x 4 bytes (float32)


# ---- SwapSpace: host blocks accounted exactly as device blocks --------------------------------

def test_swap_out_and_in_move_every_block_and_free_both_sides():
    device = BlockPool(8)
    swap = SwapSpace(4, device)
    req = Request("a", [1] * 10, SamplingParams())
    req.block_table = [b.block_id for b in device.allocate(3)]  # [0, 1, 2]
    req.num_computed_tokens = 10
    out = swap.swap_out([req])
    assert out == [(0, 0), (1, 1), (2, 2)]
    assert req.block_table == [] and req.num_computed_tokens == 10  # its KV now lives on the host
    assert (device.num_free_blocks, swap.num_free_cpu_blocks) == (8, 1)
    assert swap.host_tables == {"a": [0, 1, 2]}
    device.allocate(2)  # blocks 3, 4 (the free queue hands out 3..7 first, then the freed 2, 1, 0)
    back = swap.swap_in([req])
    assert back == [(0, 5), (1, 6), (2, 7)]
    assert req.block_table == [5, 6, 7]
    assert (device.num_free_blocks, swap.num_free_cpu_blocks, swap.host_tables) == (3, 4, {})
    assert (swap.num_blocks_swapped_out, swap.num_blocks_swapped_in) == (3, 3)
    device.check_invariants([req.block_table, [3, 4]])
    swap.check_invariants()


def test_siblings_sharing_blocks_swap_as_one_and_stay_shared():
    device = BlockPool(8)
    swap = SwapSpace(8, device)
    a = Request("a", [1] * 9, SamplingParams())
    b = Request("b", [1] * 9, SamplingParams(), group=a.group, index=1)
    a.block_table = [b_.block_id for b_ in device.allocate(3)]  # [0, 1, 2]
    device.touch([device.blocks[0], device.blocks[1]])
    b.block_table = [0, 1] + [device.allocate(1)[0].block_id]  # shares 0 and 1, owns 3
    out = swap.swap_out([a, b])
    assert out == [(0, 0), (1, 1), (2, 2), (3, 3)]  # a shared block moves once
    assert swap.host_tables == {"a": [0, 1, 2], "b": [0, 1, 3]}
    assert [swap.host.blocks[h].ref_cnt for h in range(4)] == [2, 2, 1, 1]
    assert device.num_free_blocks == 8
    assert swap.num_blocks_to_swap_in([a, b]) == 4
    swap.swap_in([a, b])
    assert a.block_table[:2] == b.block_table[:2]  # still shared on the device
    assert [device.blocks[x].ref_cnt for x in a.block_table + b.block_table[2:]] == [2, 2, 1, 1]
    device.check_invariants([a.block_table, b.block_table])
    swap.check_invariants()
    assert swap.num_free_cpu_blocks == 8


def test_a_host_pool_too_small_refuses_the_whole_request_and_changes_nothing():
    device = BlockPool(8)
    swap = SwapSpace(2, device)
    req = Request("a", [1] * 10, SamplingParams())
    req.block_table = [b.block_id for b in device.allocate(3)]
    assert not swap.can_swap_out([req])
    with pytest.raises(ValueError, match="host pool has 2 free blocks, too few to swap out"):
        swap.swap_out([req])
    assert req.block_table == [0, 1, 2] and device.num_free_blocks == 5 and swap.num_free_cpu_blocks == 2
    assert not SwapSpace(0, device).can_swap_out([req])


def test_dropping_a_swapped_request_frees_its_host_blocks():
    device = BlockPool(4)
    swap = SwapSpace(4, device)
    req = Request("a", [1] * 5, SamplingParams())
    req.block_table = [b.block_id for b in device.allocate(2)]
    swap.swap_out([req])
    swap.free(req)
    assert swap.num_free_cpu_blocks == 4 and swap.host_tables == {}
    swap.check_invariants()


# ---- the scheduler: swap-out and swap-in in the plans --------------------------------------

def make(num_blocks=4, num_cpu_blocks=8, block_size=4, mode="swap", max_num_batched_tokens=64):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, num_cpu_blocks=num_cpu_blocks)
    policy = PreemptionPolicy(mode, "fcfs", kv_bytes_per_block=1024)
    return Scheduler(kv, 8, max_num_batched_tokens, policy)



def test_the_victim_is_swapped_out_whole_and_resumes_where_it_stopped():
    s = make()
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    for _ in range(5):
        run_step(s)  # both prefilled, then four decodes: 'old' [0, 2], 'new' [1, 3], both full
    new = s.requests["new"]
    assert (new.block_table, new.num_computed_tokens) == ([1, 3], 8)
    step = run_step(s)  # 'old' needs a third block: 'new' is swapped out
    assert [v.request_id for v in step.preempted] == ["new"]
    assert step.plan.blocks_to_swap_out == [(1, 0), (3, 1)] and step.plan.blocks_to_swap_in == []
    assert step.plan.finished_request_ids == ["new"]
    assert (new.status, new.block_table, new.num_computed_tokens) == (RequestStatus.SWAPPED, [], 8)
    assert list(s.swapped) == [new] and s.kv.swap.host_tables == {"new": [0, 1]}
    (p,) = step.preemptions
    assert (p.request_ids, p.mode, p.num_blocks, p.num_tokens, p.num_bytes, p.fallback) == (["new"], "swap", 2, 8, 2048, None)
    assert p.reason == "kv_cache_full: no free block for old"

    plans = [step.plan]
    while "old" in s.requests:
        plans.append(run_step(s).plan)
        assert not plans[-1].blocks_to_swap_in  # 'old' holds 3 blocks, 1 free: 'new' (2 blocks) waits
    step = run_step(s)  # 'old' finished and gave its blocks back: 'new' comes back in
    (resumed,) = step.plan.new_requests
    assert step.plan.blocks_to_swap_in == [(0, 1), (1, 3)] and step.plan.blocks_to_swap_out == []
    assert (resumed.request_id, resumed.num_computed_tokens, resumed.num_scheduled_tokens) == ("new", 8, 1)
    assert resumed.block_ids == [1, 3, 2] and resumed.token_ids == [2] * 4 + [7] * 5
    assert [(r.request_id, r.mode, r.num_blocks) for r in step.resumptions] == [("new", "swap_in", 3)]
    while s.requests:
        plans.append(run_step(s).plan)
    assert all(not (p.blocks_to_swap_in and p.blocks_to_swap_out) for p in plans)
    assert s.kv.num_free_blocks == 4 and s.kv.swap.num_free_cpu_blocks == 8 and not s.swapped
    s.kv.pool.check_invariants([])
    s.kv.swap.check_invariants()


def test_a_swap_in_takes_the_blocks_of_its_step_with_asserts_stripped():
    # The scenario above under `python -O`, which strips assert statements: the swap-in allocated
    # the step's new block inside an assert, so with -O 'new' resumed with [1, 3] and its ninth
    # token had no block (the worker fails the step; a shared block would be written uncopied).
    # Found by tests/test_scheduler_exact_outputs.py run with -O.
    code = textwrap.dedent("""
        from pagedkv.common.sampling_params import SamplingParams
        from pagedkv.scheduler.kv_cache_manager import KVCacheManager
        from pagedkv.scheduler.preemption import PreemptionPolicy
        from pagedkv.scheduler.request import Request, RequestStatus
        from pagedkv.scheduler.scheduler import Scheduler

        kv = KVCacheManager(4, 4, enable_prefix_caching=False, num_cpu_blocks=8)
        s = Scheduler(kv, 8, 64, PreemptionPolicy("swap", "fcfs", kv_bytes_per_block=1024))
        s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
        s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
        while True:
            step = s.schedule()
            s.advance(step)
            for rid in step.num_scheduled_tokens:
                req = s.requests[rid]
                if req.num_computed_tokens == req.num_tokens:
                    req.token_ids.append(7)
                    if req.num_output_tokens >= req.sampling.max_tokens:
                        s.finish(req, RequestStatus.FINISHED_LENGTH)
            if step.plan.blocks_to_swap_in:
                (resumed,) = step.plan.new_requests
                print(resumed.request_id, resumed.num_scheduled_tokens, resumed.block_ids)
                break
    """)
    run = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "new 1 [1, 3, 2]"


def test_blocks_swapped_back_in_are_named_in_the_prefix_cache_again():
    # The scenario above with prefix caching: 'new' kept num_named_blocks 2 from before its swap-out,
    # so the blocks it got back ([1, 3], the old copies evicted meanwhile) were never named and a
    # later request with its 8 tokens as prefix hit nothing (cached_tokens 0, now 8).
    kv = KVCacheManager(4, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    s = Scheduler(kv, 8, 64, PreemptionPolicy("swap", "fcfs", kv_bytes_per_block=1024))
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    swapped_in = []
    while s.requests:
        step = run_step(s)
        if step.plan.blocks_to_swap_in:
            swapped_in.append([(b, kv.pool.blocks[b].block_hash is not None) for b in s.requests["new"].block_table])
    assert swapped_in == [[(1, True), (3, True), (2, False)]]  # the 9th token is not computed yet
    late = Request("late", [2] * 4 + [7] * 4 + [5], SamplingParams(max_tokens=1))
    s.add(late)
    run_step(s)
    assert late.num_cached_tokens == 8 and not s.requests
    assert kv.num_free_blocks == 4 and sorted(b.block_id for b in kv.pool.cached.values()) == [1, 3]
    kv.pool.check_invariants([])


def test_a_swapped_request_given_up_for_recompute_names_its_new_blocks():
    # The give-up path (Scheduler._schedule_swapped drops the host copy and requeues): the stale
    # num_named_blocks 2 left its recomputed blocks unnamed too.
    kv = KVCacheManager(6, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    req = Request("r", [3] * 9, SamplingParams())
    kv.allocate_slots(req, 9)  # blocks 0, 1 named, 2 partial
    req.num_computed_tokens = 9
    kv.swap_out([req])
    evictor = Request("e", [4] * 20, SamplingParams())
    assert kv.allocate_slots(evictor, 20) == [3, 4, 5, 2, 1]  # evicts r's block 1
    kv.free(evictor)
    kv.free_host(req)  # what the give-up does
    req.num_computed_tokens = 0
    hits = kv.find_cached_prefix(req)
    assert [b.block_id for b in hits] == [0]
    assert kv.allocate_slots(req, 5, hits) == [1, 2]
    assert [b.block_id for b in kv.find_cached_prefix(Request("c", [3] * 9, SamplingParams()))] == [0, 1]
    kv.free(req)
    kv.pool.check_invariants([])


def test_a_block_swapped_in_beside_its_free_cached_copy_takes_over_the_name():
    # Swap-in copies 'r' into blocks 3, 4, 5 while its old blocks 0, 1 still sit free with the same
    # hashes. Keeping the free copies' names lost the prefix once they were evicted, though 'r'
    # still held it: the live block now takes the name.
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, num_cpu_blocks=8)
    req = Request("r", [3] * 9, SamplingParams())
    kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.swap_out([req])
    assert kv.num_cached_free_blocks == 2
    kv.swap_in([req])
    assert req.block_table == [3, 4, 5]
    req.token_ids.append(7)
    kv.allocate_slots(req, 1)
    assert kv.num_cached_free_blocks == 0 and [kv.pool.lookup(h).block_id for h in req.block_hashes] == [3, 4]
    evictor = Request("e", [4] * 17, SamplingParams())
    assert kv.allocate_slots(evictor, 17) == [6, 7, 2, 1, 0]
    assert [b.block_id for b in kv.find_cached_prefix(Request("c", [3] * 9, SamplingParams()))] == [3, 4]
    kv.pool.check_invariants([req.block_table, evictor.block_table])


def test_swapped_requests_resume_before_waiting_requests_are_admitted():
    s = make()
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    for _ in range(6):
        run_step(s)  # the sixth step swaps 'new' out
    s.add(Request("late", [3] * 2, SamplingParams(max_tokens=1)))
    admitted = []
    while s.requests:
        step = run_step(s)
        admitted += [nr.request_id for nr in step.plan.new_requests]
    assert admitted == ["new", "late"]  # 'late' fits a free block earlier, but waits for the swapped one


def test_a_victim_too_big_for_the_host_pool_is_recomputed():
    s = make(num_cpu_blocks=1)
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    for _ in range(5):
        run_step(s)
    step = run_step(s)
    (p,) = step.preemptions
    assert (p.mode, p.fallback) == ("recompute", "host pool full: 2 blocks needed, 1 free")
    assert step.plan.blocks_to_swap_out == []
    new = s.requests["new"]
    assert (new.status, new.num_computed_tokens, s.waiting.peek()) == (RequestStatus.WAITING, 0, new)
    resumes = []
    while s.requests:
        resumes += run_step(s).resumptions
    assert [(r.request_id, r.mode) for r in resumes] == [("new", "recompute")]
    assert s.kv.num_free_blocks == 4 and s.kv.swap.num_free_cpu_blocks == 1


def test_aborting_a_swapped_request_frees_its_host_blocks():
    s = make()
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    for _ in range(6):
        run_step(s)
    new = s.requests["new"]
    assert new.status == RequestStatus.SWAPPED
    s.finish(new, RequestStatus.FINISHED_ABORTED)
    assert not s.swapped and s.kv.swap.num_free_cpu_blocks == 8 and s.kv.swap.host_tables == {}
    s.kv.swap.check_invariants()


def test_a_sibling_group_swaps_out_and_in_together_keeping_its_shared_blocks():
    s = make(num_blocks=6, num_cpu_blocks=8)
    a = Request("a", [1] * 6, SamplingParams(max_tokens=4))  # the group needs 5 blocks, 'first' 4
    b = Request("b", [1] * 6, SamplingParams(max_tokens=4), group=a.group, index=1)
    a.pending_forks = [b]
    s.add(Request("first", [5] * 4, SamplingParams(max_tokens=12)))
    s.add(a)
    run_step(s)  # 'first' prefills 4 tokens in block 0; 'a' prefills 5 (its fork point) in 1, 2; b forks
    assert b.status == RequestStatus.RUNNING and b.block_table == a.block_table == [1, 2]
    run_step(s)  # a and b compute the prompt's last token: the shared partial block 2 is copied for one
    assert a.block_table[0] == b.block_table[0] == 1 and a.block_table[1] != b.block_table[1]
    out = None
    for _ in range(12):
        step = run_step(s)
        if step.preempted:
            out = step
            break
    assert sorted(v.request_id for v in out.preempted) == ["a", "b"]
    (p,) = out.preemptions
    # 8 tokens each, the first 5 (the fork point) shared: 5 + 3 + 3 distinct tokens kept
    assert (p.mode, sorted(p.request_ids), p.num_blocks, p.num_tokens) == ("swap", ["a", "b"], 3, 11)
    assert out.plan.blocks_to_swap_out == [(1, 0), (4, 1), (2, 2)]  # the shared block 1 moves once
    assert s.kv.swap.host_tables == {"a": [0, 1], "b": [0, 2]}
    swapped_in = []

    def check(step):
        if step.plan.blocks_to_swap_in:
            swapped_in.append(step.plan.blocks_to_swap_in)
            assert a.block_table[0] == b.block_table[0] and s.kv.pool.blocks[a.block_table[0]].ref_cnt == 2
            assert [(r.request_id, r.mode) for r in step.resumptions] == [("a", "swap_in"), ("b", "swap_in")]
            assert {nr.request_id: nr.num_computed_tokens for nr in step.plan.new_requests} == {"a": 8, "b": 8}

    while s.requests:
        run_step(s, check=check)
    assert len(swapped_in) == 1 and len(swapped_in[0]) == 3
    assert s.kv.num_free_blocks == 6 and s.kv.swap.num_free_cpu_blocks == 8
    s.kv.pool.check_invariants([])
    s.kv.swap.check_invariants()


# ---- the engine end to end on stories260K ----------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=60)


async def test_sixteen_requests_swapped_on_a_tiny_pool_are_all_golden_and_every_block_comes_back(start):
    engine = await start(enable_prefix_caching=False, num_gpu_blocks=12, preemption_mode="swap")
    assert engine.kv_cache_snapshot()["num_cpu_blocks"] == int(0.01 * 2**30) // STORIES_BLOCK_BYTES == 524
    results = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)) for _ in range(16)])
    assert all(tokens == GOLDEN_OUTPUT_IDS and text == GOLDEN_COMPLETION for tokens, text, _ in results)
    swap = engine.kv.swap
    swaps = metric(engine, "pagedkv:num_preemptions_total", mode="swap")
    assert swaps == engine.scheduler.num_preemptions > 0
    assert metric(engine, "pagedkv:num_preemptions_total", mode="recompute") == 0
    assert metric(engine, "pagedkv:num_blocks_swapped_out_total") == swap.num_blocks_swapped_out > 0
    assert metric(engine, "pagedkv:num_blocks_swapped_in_total") == swap.num_blocks_swapped_in == swap.num_blocks_swapped_out
    assert metric(engine, "pagedkv:request_num_preemptions_count") == 16
    assert metric(engine, "pagedkv:request_num_preemptions_sum") == swaps
    assert_all_blocks_free(engine)


async def test_seeded_sampling_swapped_out_and_in_equals_its_unpreempted_run(start):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=40)
    alone_engine = await start(enable_prefix_caching=False)
    alone, _, _ = await collect(alone_engine.add_request(GOLDEN_PROMPT_IDS, params))

    tight = await start(enable_prefix_caching=False, num_gpu_blocks=10, preemption_mode="swap")
    noise = [tight.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=1.0, max_tokens=40, seed=s))
             for s in range(7)]
    seeded = tight.add_request(GOLDEN_PROMPT_IDS, params)  # the latest arrival: the first victim
    results = await asyncio.gather(collect(seeded), *[collect(n) for n in noise])
    assert metric(tight, "pagedkv:num_preemptions_total", mode="swap") == tight.scheduler.num_preemptions > 0
    assert results[0][0] == alone
    assert_all_blocks_free(tight)


async def test_with_a_host_pool_too_small_victims_are_recomputed_and_all_finish(start):
    # 2 host blocks: a victim holding 3+ blocks (33+ tokens) cannot be swapped and is recomputed
    engine = await start(enable_prefix_caching=False, num_gpu_blocks=12, preemption_mode="swap",
                         swap_space=2 * STORIES_BLOCK_BYTES / 2**30)
    assert engine.kv_cache_snapshot()["num_cpu_blocks"] == 2
    results = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)) for _ in range(16)])
    assert all(tokens == GOLDEN_OUTPUT_IDS for tokens, _, _ in results)
    recomputed = metric(engine, "pagedkv:num_preemptions_total", mode="recompute")
    swapped = metric(engine, "pagedkv:num_preemptions_total", mode="swap")
    assert recomputed > 0 and recomputed + swapped == engine.scheduler.num_preemptions
    assert_all_blocks_free(engine)


async def test_parallel_sampling_groups_swap_as_one_and_stay_golden(start):
    engine = await start(enable_prefix_caching=False, num_gpu_blocks=12, preemption_mode="swap")
    params = SamplingParams(temperature=0, max_tokens=60, n=2)

    async def choices(stream):
        out: dict[int, list[int]] = {}
        async for o in stream:
            out.setdefault(o.index, []).extend(o.token_ids)
        return out

    results = await asyncio.gather(*[choices(engine.add_request(GOLDEN_PROMPT_IDS, params)) for _ in range(8)])
    assert all(r == {0: GOLDEN_OUTPUT_IDS, 1: GOLDEN_OUTPUT_IDS} for r in results)
    assert metric(engine, "pagedkv:num_preemptions_total", mode="swap") == engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


async def test_kv_cache_snapshot_lists_swapped_requests_and_host_blocks(start):
    engine = await start(enable_prefix_caching=False, num_gpu_blocks=12, preemption_mode="swap")
    seen = []
    streams = [collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)) for _ in range(16)]

    async def watch():
        while len(seen) < 1 and engine.scheduler.requests:
            snap = engine.kv_cache_snapshot()
            if snap["num_requests_swapped"]:
                seen.append(snap)
            await asyncio.sleep(0)

    await asyncio.gather(watch(), *streams)
    (snap,) = seen
    held = sum(len(r["host_block_table"]) for r in snap["swapped_requests"])
    assert len(snap["swapped_requests"]) == snap["num_requests_swapped"] > 0
    assert snap["num_free_cpu_blocks"] == snap["num_cpu_blocks"] - held  # n = 1: no shared host blocks
    assert snap["cpu_usage"] == pytest.approx(held / snap["num_cpu_blocks"])
    assert all(r["num_computed_tokens"] > 0 for r in snap["swapped_requests"])


def test_the_swap_microbenchmark_times_every_block_size_on_the_real_model(stories260k):
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
    from bench_swap import BLOCK_SIZES, measure

    from pagedkv.common.config import ModelConfig

    rows = measure(ModelConfig.load(str(stories260k)), EngineConfig(model=str(stories260k)),
                   torch.device("cpu"), torch.float32, num_tokens=40, repeats=1)
    assert all(r["measured_gbps"] > 0 for r in rows)
    assert [(r["block_size"], r["num_blocks"], r["bytes"]) for r in rows] == [
        (bs, -(-40 // bs), -(-40 // bs) * bs * 1280) for bs in BLOCK_SIZES]  # 1280 B of KV per token
    assert all(r["swap_s"] > 0 and r["recompute_s"] > 0 and r["auto"] in ("swap", "recompute") for r in rows)
