"""Preemption policy: victim choice under fcfs and priority, and the swap-versus-recompute cost model."""

from __future__ import annotations

import asyncio

import pytest

from pagedkv.common.config import EngineConfig
from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
from pagedkv.common.sampling_params import SamplingParams
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, collect, metric, run_step
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.preemption import DEFAULT_PREFILL_THROUGHPUT, PreemptionPolicy, PrefillThroughput
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.request_queue import make_queue
from pagedkv.scheduler.scheduler import Scheduler

SP = SamplingParams(max_tokens=8)


def req(rid, priority=0, arrival=0.0, blocks=(), computed=0):
    r = Request(rid, [1] * max(computed, 1), SP, arrival_time=arrival, priority=priority)
    r.block_table, r.num_computed_tokens = list(blocks), computed
    return r


# ---- victim choice and queue order ---------------------------------------------------------

def test_fcfs_victim_is_the_most_recently_admitted():
    running = [req("a", arrival=3.0), req("b", arrival=1.0), req("c", arrival=2.0)]
    assert PreemptionPolicy(scheduling_policy="fcfs").victim(running).request_id == "c"


def test_priority_victim_is_the_lowest_priority_latest_arrival():
    running = [req("a", priority=5, arrival=1.0), req("b", priority=0, arrival=9.0),
               req("c", priority=5, arrival=2.0), req("d", priority=1, arrival=3.0)]
    policy = PreemptionPolicy(scheduling_policy="priority")
    assert policy.victim(running).request_id == "c"
    assert policy.victim(running[:2]).request_id == "a"
    with pytest.raises(ValueError, match="no running request to preempt"):
        policy.victim([])


def test_unknown_mode_or_policy_is_an_error():
    with pytest.raises(ValueError, match="'fast' is not a valid PreemptionMode"):
        PreemptionPolicy(mode="fast")
    with pytest.raises(ValueError, match="'lifo' is not a valid SchedulingPolicy"):
        PreemptionPolicy(scheduling_policy="lifo")


def test_priority_queue_orders_by_priority_then_arrival_and_preempted_go_before_their_equals():
    q = make_queue("priority")
    for r in [req("a", 1, 1.0), req("b", 0, 2.0), req("c", 1, 0.5), req("d", 0, 2.0)]:
        q.add(r)
    assert [r.request_id for r in q] == ["b", "d", "c", "a"]
    e = req("e", 0, 2.0)
    q.prepend(e)
    assert [r.request_id for r in q] == ["e", "b", "d", "c", "a"] and q.peek() is e and len(q) == 5
    q.remove(e)
    assert q.peek().request_id == "b" and e not in q
    with pytest.raises(ValueError, match="not queued"):
        q.remove(e)
    q2 = make_queue("fcfs")
    for r in [req("x", 9), req("y", 0)]:
        q2.add(r)
    q2.prepend(req("z"))
    assert [r.request_id for r in q2] == ["z", "x", "y"] and q2.peek().request_id == "z"
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        make_queue("lifo")


# ---- the cost model --------------------------------------------------------------------------

def test_costs_follow_bytes_over_bandwidth_and_tokens_over_prefill_throughput():
    policy = PreemptionPolicy("auto", kv_bytes_per_block=1000, swap_bandwidth=1e6)
    victim = req("v", blocks=[0, 1, 2], computed=40)
    assert policy.costs([victim]) == (3, 40, 2 * 3000 / 1e6, 40 / DEFAULT_PREFILL_THROUGHPUT)
    d = policy.decide([victim], "kv_cache_full: test", num_free_cpu_blocks=8)
    assert (d.mode, d.num_blocks, d.num_tokens, d.num_bytes, d.fallback) == ("recompute", 3, 40, 3000, None)
    assert (d.swap_cost_s, d.recompute_cost_s) == (0.006, 0.004)
    policy.swap_bandwidth = 1e7  # swap 0.0006 s < recompute 0.004 s
    assert policy.decide([victim], "r", 8).mode == "swap"


def test_shared_blocks_of_a_group_count_once():
    policy = PreemptionPolicy("swap", kv_bytes_per_block=10, swap_bandwidth=1.0)
    group = [req("a", blocks=[0, 1, 2], computed=10), req("b", blocks=[0, 1, 3], computed=10)]
    assert policy.costs(group) == (4, 20, 80.0, 20 / DEFAULT_PREFILL_THROUGHPUT)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full_or_there_is_nothing_to_keep():
    policy = PreemptionPolicy("swap", kv_bytes_per_block=10)
    big = req("big", blocks=[0, 1, 2], computed=30)
    d = policy.decide([big], "r", num_free_cpu_blocks=2)
    assert (d.mode, d.fallback) == ("recompute", "host pool full: 3 blocks needed, 2 free")
    assert policy.decide([req("small", blocks=[3, 4], computed=20)], "r", 2).mode == "swap"
    d = policy.decide([req("fresh", blocks=[5], computed=0)], "r", 2)
    assert (d.mode, d.fallback) == ("recompute", "no computed tokens: nothing to keep")
    d = policy.decide([big], "r", num_free_cpu_blocks=None)
    assert (d.mode, d.fallback) == ("recompute", "no host pool (the allocator cannot swap)")
    assert PreemptionPolicy("recompute").decide([big], "r", 8).mode == "recompute"


def _plan(new_tokens=(), cached_tokens=(), swap_out=(), swap_in=()):
    sp = SamplingParams()
    return StepPlan(step_id=1, new_requests=[NewRequestData(f"n{i}", [1] * n, n, [0], 0, n, sp)
                                             for i, n in enumerate(new_tokens)],
                    cached_requests=[CachedRequestData(f"c{i}", [], n) for i, n in enumerate(cached_tokens)],
                    blocks_to_swap_out=list(swap_out), blocks_to_swap_in=list(swap_in))


def test_prefill_throughput_counts_only_prefill_steps_without_swaps():
    t = PrefillThroughput(prior=123.0, window=2)
    assert t.tokens_per_second == 123.0
    t.observe(_plan(cached_tokens=[1, 1, 1]), 0.5)  # decode only: per-step overhead, not prefill cost
    t.observe(_plan(new_tokens=[100], swap_in=[(0, 1)]), 0.5)  # its time includes a swap
    assert t.tokens_per_second == 123.0
    t.observe(_plan(new_tokens=[100], cached_tokens=[1]), 0.101)
    assert t.tokens_per_second == pytest.approx(1000.0)
    t.observe(_plan(cached_tokens=[300, 1]), 0.301)
    t.observe(_plan(cached_tokens=[50]), 0.1)  # the window keeps the last 2 prefill steps
    assert t.tokens_per_second == pytest.approx((301 + 50) / 0.401)


# ---- the scheduler under the priority policy --------------------------------------------------


def test_priority_scheduling_admits_by_priority_and_preempts_the_lowest_even_if_admitted_first():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    s = Scheduler(kv, 8, 64, PreemptionPolicy("recompute", "priority"))
    s.add(Request("low", [1] * 4, SamplingParams(max_tokens=8), arrival_time=1.0, priority=2))
    step = run_step(s)  # 'low' runs alone
    s.add(Request("high", [2] * 4, SamplingParams(max_tokens=8), arrival_time=2.0, priority=0))
    s.add(Request("mid", [3] * 4, SamplingParams(max_tokens=8), arrival_time=1.5, priority=1))
    assert [r.request_id for r in s.waiting] == ["high", "mid"]
    step = run_step(s)
    assert [nr.request_id for nr in step.plan.new_requests] == ["high", "mid"]
    preempted = []
    while s.requests:
        step = run_step(s)
        preempted += [v.request_id for v in step.preempted]
        if step.preempted and preempted[0] == "low":
            # 'low' was admitted first, so it sits before the request that needed the block:
            # it is taken out of this step's batch, its tokens go back to the budget
            assert "low" not in step.num_scheduled_tokens
    assert preempted[0] == "low" and "high" not in preempted
    assert kv.num_free_blocks == 4


# ---- the engine: auto picks each mode when it is the cheaper one ------------------------------

async def test_auto_swaps_when_the_link_is_fast_and_recomputes_when_it_is_slow(stories260k):
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=12, enable_prefix_caching=False,
                                             swap_space=0.01, preemption_mode="auto"))
    try:
        policy = engine.scheduler.policy
        assert policy.kv_bytes_per_block == 20480 and policy.swap_bandwidth > 0  # measured at worker start
        greedy = SamplingParams(temperature=0, max_tokens=60)
        policy.swap_bandwidth = 1e18  # swapping costs ~0 s: cheaper than any recompute
        out = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, greedy)) for _ in range(16)])
        assert [tokens for tokens, _, _ in out] == [GOLDEN_OUTPUT_IDS] * 16
        swaps = metric(engine, "pagedkv:num_preemptions_total", mode="swap")
        assert swaps > 0 and metric(engine, "pagedkv:num_preemptions_total", mode="recompute") == 0

        policy.swap_bandwidth = 1.0  # 1 byte/s: a block takes hours to move, recompute wins
        out = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, greedy)) for _ in range(16)])
        assert [tokens for tokens, _, _ in out] == [GOLDEN_OUTPUT_IDS] * 16
        assert metric(engine, "pagedkv:num_preemptions_total", mode="swap") == swaps
        recomputes = metric(engine, "pagedkv:num_preemptions_total", mode="recompute")
        assert recomputes > 0 and swaps + recomputes == engine.scheduler.num_preemptions
        assert engine.kv.num_free_blocks == 12
        assert engine.kv.num_free_cpu_blocks == engine.kv.swap.num_cpu_blocks > 0
    finally:
        await engine.shutdown()


async def test_priority_policy_in_the_engine_never_preempts_the_urgent_request(stories260k):
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=12, enable_prefix_caching=False,
                                             swap_space=0.01, preemption_mode="swap", scheduling_policy="priority"))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=60)
        streams = [engine.add_request(GOLDEN_PROMPT_IDS, greedy, f"bulk-{i}", priority=1) for i in range(15)]
        streams.append(engine.add_request(GOLDEN_PROMPT_IDS, greedy, "urgent", priority=0))  # arrives last
        urgent = engine.output.streams["urgent"].members[0]
        out = await asyncio.gather(*[collect(s) for s in streams])
        assert [tokens for tokens, _, _ in out] == [GOLDEN_OUTPUT_IDS] * 16
        assert engine.scheduler.num_preemptions > 0 and urgent.num_preemptions == 0
    finally:
        await engine.shutdown()


def test_cli_flags_reach_the_engine_config(stories260k):
    from pagedkv.scheduler.cli import _engine_config, build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", str(stories260k), "--preemption-mode", "swap",
                              "--scheduling-policy", "priority", "--otlp-traces-endpoint", "http://otel:4318",
                              "--swap-space", "0.5"])
    cfg = _engine_config(args, parser)
    assert (cfg.preemption_mode, cfg.scheduling_policy, cfg.otlp_traces_endpoint, cfg.swap_space) == (
        "swap", "priority", "http://otel:4318", 0.5)
    defaults = _engine_config(parser.parse_args(["serve", "--model", str(stories260k)]), parser)
    assert (defaults.preemption_mode, defaults.scheduling_policy, defaults.otlp_traces_endpoint) == ("auto", "fcfs", None)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "--preemption-mode", "sometimes"])
    assert e.value.code == 2


def test_a_sibling_groups_shared_prompt_counts_once_in_the_tokens_to_recompute():
    # n = 3, a 101-token prompt, 10 tokens each after it: a recompute computes the prompt's 100
    # shared tokens once (the leader) and each sibling's own 10, 130 tokens, not 3 x 110
    a = Request("a", [1] * 101, SP)
    siblings = [a, Request("b", [1] * 101, SP, group=a.group, index=1), Request("c", [1] * 101, SP, group=a.group, index=2)]
    for i, r in enumerate(siblings):
        r.token_ids += [2] * 9
        r.num_computed_tokens = 110
        r.block_table = [0, 1, 2, 3, 4, 5, 6 + i]  # 16-token blocks: the first 6 full ones shared
    policy = PreemptionPolicy("auto", kv_bytes_per_block=1000, swap_bandwidth=1e6)
    num_blocks, num_tokens, swap_s, recompute_s = policy.costs(siblings)
    assert (num_blocks, num_tokens) == (9, 130)
    assert (swap_s, recompute_s) == (2 * 9000 / 1e6, 130 / DEFAULT_PREFILL_THROUGHPUT)
    d = policy.decide(siblings, "r", num_free_cpu_blocks=64)  # recompute 0.013 s < swap 0.018 s
    assert (d.mode, d.num_tokens) == ("recompute", 130)


def test_a_group_that_preempts_itself_under_priority_leaves_the_groups_after_it_their_tokens():
    # 3 blocks of 4: 'low' (admitted first, priority 1) needs a second block for its 5th token,
    # none is free, and it is the lowest priority: it preempts itself. 'hi2' and 'hi3' each write
    # into the block they hold. Before, the step broke off there and scheduled nothing at all.
    kv = KVCacheManager(3, 4, enable_prefix_caching=False)
    s = Scheduler(kv, 8, 64, PreemptionPolicy("recompute", "priority"))
    s.add(Request("low", [1] * 3, SamplingParams(max_tokens=8), arrival_time=1.0, priority=1))
    run_step(s)
    s.add(Request("hi2", [2] * 2, SamplingParams(max_tokens=8), arrival_time=2.0, priority=0))
    s.add(Request("hi3", [3] * 2, SamplingParams(max_tokens=8), arrival_time=3.0, priority=0))
    assert run_step(s).num_scheduled_tokens == {"low": 1, "hi2": 2, "hi3": 2}
    step = run_step(s)
    assert [r.request_id for r in step.preempted] == ["low"]
    assert step.num_scheduled_tokens == {"hi2": 1, "hi3": 1}
