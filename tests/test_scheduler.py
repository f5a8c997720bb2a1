"""Scheduler policy: budgets, FCFS admission, chunked prefill, recompute preemption of the newest."""

import random

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.scheduler import Scheduler
from conftest import run_step


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, prefix=False):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens)


def test_prefill_then_decode_one_token_per_step():
    s = make()
    s.add(Request("a", [1] * 10, SamplingParams(max_tokens=3)))
    step = run_step(s)
    assert step.num_scheduled_tokens == {"a": 10}
    assert step.plan.new_requests[0].block_ids == [0, 1, 2]
    step = run_step(s)
    assert step.num_scheduled_tokens == {"a": 1}
    assert step.plan.cached_requests[0].new_block_ids == []  # token 11 fits block 2
    run_step(s)
    assert not s.requests and s.kv.num_free_blocks == 64


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = make(max_num_batched_tokens=8)
    s.add(Request("a", list(range(20)), SamplingParams(max_tokens=1)))
    assert [run_step(s).num_scheduled_tokens["a"] for _ in range(3)] == [8, 8, 4]
    assert not s.requests


def test_decodes_and_prefills_share_a_step_under_the_budget():
    s = make(max_num_batched_tokens=10)
    s.add(Request("a", [1] * 4, SamplingParams(max_tokens=5)))
    run_step(s)
    s.add(Request("b", [2] * 20, SamplingParams(max_tokens=5)))
    step = run_step(s)
    assert step.num_scheduled_tokens == {"a": 1, "b": 9}


def test_max_num_seqs_caps_the_running_batch_and_admission_is_fcfs():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(Request(rid, [1, 2], SamplingParams(max_tokens=4)))
    step = run_step(s)
    assert list(step.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_the_newest_running_request_is_preempted_and_requeued_at_the_head():
    s = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add(Request("old", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("new", [2] * 4, SamplingParams(max_tokens=8)))
    run_step(s)  # both prefilled: blocks [0] and [1], one sampled token each
    run_step(s)  # both need a second block: [2] and [3]
    assert s.kv.num_free_blocks == 0
    for _ in range(3):
        run_step(s)  # both write into their second blocks
    step = run_step(s)  # 'old' needs a third block: 'new' must go
    assert [v.request_id for v in step.preempted] == ["new"]
    new = s.requests["new"]
    assert new.status == RequestStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert s.waiting.peek() is new and new.num_preemptions == 1
    assert step.plan.finished_request_ids == ["new"]  # the worker drops its mirror in this step


def test_a_preempted_request_recomputes_prompt_and_generated_tokens():
    s = make(num_blocks=3, block_size=4)
    s.add(Request("a", [1] * 4, SamplingParams(max_tokens=8)))
    s.add(Request("b", [2] * 4, SamplingParams(max_tokens=3)))
    outcomes = []
    for _ in range(40):
        if not s.requests:
            break
        step = run_step(s)
        outcomes.append(step)
    resumed = [nr for st in outcomes for nr in st.plan.new_requests if nr.request_id == "b"][1]
    assert (resumed.token_ids, resumed.num_prompt_tokens) == ([2, 2, 2, 2, 7], 4)
    assert (resumed.num_computed_tokens, resumed.num_scheduled_tokens) == (0, 5)
    assert [v.request_id for st in outcomes for v in st.preempted] == ["b"]
    assert not s.requests and s.kv.num_free_blocks == 3


def test_the_running_request_preempts_itself_when_it_is_the_newest():
    s = make(num_blocks=2, block_size=2, max_num_batched_tokens=64)
    s.add(Request("a", [1, 1], SamplingParams(max_tokens=4)))
    s.add(Request("b", [2, 2], SamplingParams(max_tokens=4)))
    run_step(s)
    step = run_step(s)  # 'a' needs block 3 of 2: 'b' goes; then 'a' fits
    assert [v.request_id for v in step.preempted] == ["b"]
    assert step.num_scheduled_tokens == {"a": 1}


def test_prefix_hits_skip_cached_tokens_in_the_prefill():
    s = make(prefix=True)
    s.add(Request("a", list(range(10)), SamplingParams(max_tokens=1)))
    run_step(s)
    s.add(Request("b", list(range(10)), SamplingParams(max_tokens=1)))
    step = s.schedule()
    nr = step.plan.new_requests[0]
    assert (nr.num_computed_tokens, nr.num_scheduled_tokens) == (8, 2)
    assert s.requests["b"].num_cached_tokens == 8


# ---- requests that fit always finish (the hangs of issue 9) ----------------------------------------

def group(rid, prompt, n, max_tokens):
    """A leader and its n - 1 siblings, forked at the prompt's last token (as the engine builds them)."""
    lead = Request(f"{rid}-0", prompt, SamplingParams(max_tokens=max_tokens))
    lead.pending_forks = [Request(f"{rid}-{i}", prompt, SamplingParams(max_tokens=max_tokens), group=lead.group,
                                  index=i) for i in range(1, n)]
    return lead


def run_to_end(s, max_steps=300):
    """Run steps until every request finished; returns the steps. Fails when they never do."""
    preempted = []
    for k in range(max_steps):
        if not s.requests:
            return k, preempted
        preempted += [r.request_id for r in run_step(s).preempted]
    raise AssertionError(f"not finished after {max_steps} steps: {list(s.requests.values())}")


def test_a_sibling_group_preempted_by_recompute_comes_back_sharing_its_prompt_and_finishes():
    # 7 blocks of 4: the n = 2 group needs 1 shared + 2 x 3 = 7 blocks at its longest, 'x' 5; they
    # cannot run together, so the group is preempted. Counted without its sharing (as before), the
    # group needed 8 blocks to come back and never did: everything waited behind it for ever.
    s = make(num_blocks=7, block_size=4)
    s.add(Request("x", [9] * 4, SamplingParams(max_tokens=16)))
    s.add(group("g", [1] * 5, n=2, max_tokens=10))
    steps, preempted = run_to_end(s)
    assert sorted(set(preempted)) == ["g-0", "g-1"]
    assert s.kv.num_free_blocks == 7
    s.kv.pool.check_invariants([])


def test_a_lone_n2_request_that_fits_the_pool_never_preempts_itself():
    # prompt 6 tokens, block 4: both siblings write the prompt's last token into the shared partial
    # block; one copy (n - 1), not two. 3 blocks hold the whole group: 1 shared + 2 own.
    s = make(num_blocks=3, block_size=4)
    s.add(group("g", [1] * 6, n=2, max_tokens=3))
    steps, preempted = run_to_end(s)
    assert preempted == [] and s.num_preemptions == 0 and s.kv.num_free_blocks == 3


def test_running_never_exceeds_max_num_seqs_when_a_leader_forks():
    s = make(max_num_seqs=3)
    s.add(group("g", [1] * 5, n=3, max_tokens=4))
    s.add(Request("x", [2] * 3, SamplingParams(max_tokens=4)))
    seen = []
    while s.requests:
        run_step(s, check=lambda step: seen.append(len(s.running)))
    assert max(seen) == 3


# ---- policy invariants, step by step, on random workloads ----------------------------------------

def _check_policy_step(s, step, budget, before_running, before_waiting, left):
    """One step against the policy as documented (module docstring of `scheduler.scheduler`)."""
    n = step.num_scheduled_tokens
    assert sum(n.values()) <= budget and len(s.running) <= s.max_num_seqs
    assert all(x > 0 for x in n.values()), n  # every scheduled chunk progresses (no prefix cache here)
    admitted = [r for r in before_waiting if r.status is RequestStatus.RUNNING]
    assert admitted == before_waiting[:len(admitted)], "nobody overtakes the head of the waiting queue"
    kept = [r for r in before_running if r.status is RequestStatus.RUNNING]
    if step.preempted and s.policy.scheduling_policy.value == "priority":
        assert max((r.priority, r.arrival_time) for r in kept or [step.preempted[0]]) <= \
            min((r.priority, r.arrival_time) for r in step.preempted), "the lowest priority, latest arrival goes"
    elif step.preempted:
        assert all(before_running.index(k) < before_running.index(v) for k in kept for v in step.preempted)
    # running decodes go first: none is left out while a prefill takes a chunk
    skipped = [r for r in kept if left[r.request_id] == 1 and r.request_id not in n]
    assert not (skipped and any(x > 1 for x in n.values())), (skipped, n)
    # a step with runnable requests is never empty (it was, under priority, when a group preempted itself)
    assert n or not s.running or step.plan.blocks_to_swap_out or step.plan.blocks_to_swap_in


def test_random_workloads_keep_budget_seats_order_victims_and_finish():
    from pagedkv.scheduler.preemption import PreemptionPolicy

    for seed in range(1000):
        rng = random.Random(seed)
        bs, budget = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 5, 8, 16, 64])  # budgets below a block too
        specs = [(rng.randint(1, 20), rng.randint(1, 12), rng.randint(0, 2), rng.choice([0, 0, 0, 1, 2, 5]))
                 for _ in range(rng.randint(2, 6))]  # prompt, max_tokens, priority, arrival step
        need = max(-(-(p + m - 1) // bs) for p, m, _, _ in specs)  # the longest alone: down to a pool of just that
        kv = KVCacheManager(need + rng.randint(0, 3), bs, enable_prefix_caching=False,
                            num_cpu_blocks=rng.choice([0, 8, 64]))
        policy = PreemptionPolicy(rng.choice(["recompute", "swap"]), rng.choice(["fcfs", "priority"]))
        s = Scheduler(kv, rng.choice([1, 2, 3, 8]), budget, policy)
        for k in range(1000):
            for i, (p, m, prio, at) in enumerate(specs):
                if at == k:
                    s.add(Request(f"r{i}", [i] * p, SamplingParams(max_tokens=m), arrival_time=at * 10.0 + i, priority=prio))
            if not s.requests and k > 5:
                break
            before_running, before_waiting = list(s.running), list(s.waiting)
            left = {r.request_id: r.num_tokens - r.num_computed_tokens for r in s.running}
            run_step(s, check=lambda step: _check_policy_step(s, step, budget, before_running, before_waiting, left))
        assert not s.requests, f"seed {seed}: not finished: {list(s.requests.values())}"
        assert kv.num_free_blocks == kv.num_gpu_blocks
