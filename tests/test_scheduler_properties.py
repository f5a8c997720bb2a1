"""Property test: the real engine, scheduler and KV cache manager against a fake worker.

Random workloads (n 1-8, beam width 1-4, prompt and output lengths, pools down to one request's
worth, max_num_seqs, swap space on and off, every preemption mode, both scheduling policies,
prefix caching on and off, random aborts) run through `Engine` with a worker that samples random
tokens and keeps a model of the KV pool's contents, slot by slot. After every step:

- every block table, reference count and host table is consistent (`check_invariants`);
- the worker reads back, for every position a request attends to, the very token that request has
  there (sharing, prefix hits, copy-on-write, swaps and recomputes never mix up KV);
- running <= max_num_seqs;
- no preemption when the next tokens of every running request fit the free blocks;
- every accepted request finishes within a bounded number of steps without progress, and the loop
  never sleeps while a request is left;
- at the end every device and host block is free.

And the submit check's verdict equals what the scheduler can do alone on an empty pool: an accepted
request runs to its last token alone without a preemption; a rejected n-sampling request cannot.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import random
import time

import pytest

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.common.protocol import SampledToken, StepPlan, StepResult
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import RequestStatus
from pagedkv.scheduler.tokenizer import Tokenizer
from conftest import Violation, WatchedEvent, run_engine_until_idle

MODEL = ModelConfig.load(None)  # the embedded byte-level model: vocab 258, EOS 257
TOKENIZER = Tokenizer.load(MODEL)
EOS = 257
MAX_STEPS_WITHOUT_PROGRESS = 200


class FakeWorker:
    """Executes plans as the real worker does, on a model of the KV pool: slot -> (token, position)."""

    def __init__(self, engine_ref: list, block_size: int, seed: int, eos_rate: float):
        self.engine_ref = engine_ref
        self.bs = block_size
        self.rng = random.Random(seed)
        self.eos_rate = eos_rate
        self.mirror: dict[str, list] = {}  # request id -> [token_ids, num_prompt, block_ids, computed, sampling]
        self.device: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}
        self.steps = 0
        self.steps_without_progress = 0
        self.on_step = None  # test hook: called with the plan before it runs
        self.sent: collections.deque[StepPlan] = collections.deque()  # submitted, not run yet

    def _move(self, src: dict, dst: dict, pairs) -> None:
        for s, d in pairs:
            for off in range(self.bs):
                if (s * self.bs + off) in src:
                    dst[d * self.bs + off] = src[s * self.bs + off]
                else:
                    dst.pop(d * self.bs + off, None)

    async def step(self, plan: StepPlan) -> StepResult:
        await asyncio.sleep(0)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(plan)
        for rid in plan.finished_request_ids:
            self.mirror.pop(rid, None)
        scheduled = []
        for new in plan.new_requests:
            self.mirror[new.request_id] = [list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                           new.num_computed_tokens, new.sampling]
            scheduled.append((new.request_id, new.num_scheduled_tokens))
        for c in plan.cached_requests:
            m = self.mirror[c.request_id]
            for index, block in c.replaced_block_ids:
                m[2][index] = block
            m[2].extend(c.new_block_ids)
            m[0].extend(c.new_token_ids)
            scheduled.append((c.request_id, c.num_scheduled_tokens))
        self._move(self.device, self.host, plan.blocks_to_swap_out)
        self._move(self.host, self.device, plan.blocks_to_swap_in)
        self._move(dict(self.device), self.device, plan.blocks_to_copy)
        sampled, progress = [], False
        for rid, n in scheduled:
            if n == 0:
                continue
            tokens, num_prompt, blocks, begin, sampling = self.mirror[rid]
            end = begin + n
            if end > len(tokens) or len(blocks) * self.bs < end:
                raise Violation(f"{rid}: {n} tokens from {begin} but {len(tokens)} known, {len(blocks)} blocks")
            if end > num_prompt + sampling.max_tokens - 1:  # the last sampled token is never written
                raise Violation(f"{rid}: computes position {end - 1}, past prompt + max_tokens - 1")
            for pos in range(begin, end):
                self.device[blocks[pos // self.bs] * self.bs + pos % self.bs] = (tokens[pos], pos)
            for pos in range(end):  # attention reads every earlier position of this request
                got = self.device.get(blocks[pos // self.bs] * self.bs + pos % self.bs)
                if got != (tokens[pos], pos):
                    raise Violation(f"{rid}: KV at position {pos} holds {got}, expected {(tokens[pos], pos)}")
            self.mirror[rid][3] = end
            if end == len(tokens):
                progress = True
                if sampling.use_beam_search:
                    top = [(t, -0.1 * (i + 1) - self.rng.random()) for i, t in
                           enumerate(self.rng.sample(range(256), sampling.logprobs))]
                    top.sort(key=lambda p: -p[1])
                    sampled.append(SampledToken(rid, top[0][0], top[0][1], top))
                else:
                    token = EOS if self.rng.random() < self.eos_rate else self.rng.randrange(256)
                    tokens.append(token)
                    sampled.append(SampledToken(rid, token, None, None))
        self.steps_without_progress = 0 if progress else self.steps_without_progress + 1
        if self.steps_without_progress > MAX_STEPS_WITHOUT_PROGRESS:
            raise Violation(f"{MAX_STEPS_WITHOUT_PROGRESS} steps without a sampled token")
        return StepResult(step_id=plan.step_id, sampled=sampled)

    async def submit(self, plan: StepPlan) -> None:
        self.sent.append(plan)

    async def result(self, step_id: int) -> StepResult:
        """Run the oldest plan sent (plans run in the order sent, as the worker's do)."""
        plan = self.sent.popleft()
        if plan.step_id != step_id:
            raise Violation(f"result of step {step_id} asked for, step {plan.step_id} is next")
        return await self.step(plan)

    async def check_alive(self) -> None:
        pass  # it never dies

    async def close(self) -> None:
        pass


def make_engine(cfg: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int, seed: int, eos_rate: float):
    ref: list = []
    worker = FakeWorker(ref, cfg.block_size, seed, eos_rate)
    kv = KVCacheManager(num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching, "sha256", num_cpu_blocks)
    engine = Engine(cfg, MODEL, TOKENIZER, worker, kv)
    engine._wake = WatchedEvent()
    ref.append(engine)
    return engine, worker


def check_step_invariants(engine: Engine, worker: FakeWorker, plan: StepPlan) -> None:
    s, kv = engine.scheduler, engine.kv
    if len(s.running) > s.max_num_seqs:
        raise Violation(f"{len(s.running)} running > max_num_seqs {s.max_num_seqs}")
    kv.pool.check_invariants([r.block_table for r in s.requests.values()])
    kv.swap.check_invariants()


def running_fits(engine: Engine) -> bool:
    """Whether every running request's remaining tokens fit the free blocks: allocate them on a copy."""
    s = engine.scheduler
    kv, running = copy.deepcopy((s.kv, s.running))
    for req in running:
        end = req.fork_point if req.pending_forks else req.num_tokens
        if end > req.num_computed_tokens and kv.allocate_slots(req, end - req.num_computed_tokens) is None:
            return False
    return True


def watch_schedule(engine: Engine, worker: FakeWorker) -> None:
    """Check each step as it is decided: no preemption when everything running fits."""
    schedule = engine.scheduler.schedule

    def checked(ahead: bool = False):
        fits = running_fits(engine)
        step = schedule(ahead)
        if step is None:
            if not ahead:
                raise Violation("schedule() returned None with no step in flight")
            return step
        if fits and step.preempted:
            raise Violation(f"preempted {[r.request_id for r in step.preempted]} although everything running fit")
        check_step_invariants(engine, worker, step.plan)
        return step

    engine.scheduler.schedule = checked


async def drive(engine: Engine, worker: FakeWorker, arrivals: list, aborts: dict[int, list[str]],
                tokens: dict | None = None) -> dict:
    """Submit ``arrivals`` [(step, id, prompt, params)] and abort ids at their steps; run until all end.

    Returns request id -> "rejected" | the finish reason of its last delta. tokens, when given,
    gets (request id, choice index) -> (tokens streamed, finish reason) for every choice.
    """
    outcome: dict[str, str] = {}
    consumers = []
    tokens = {} if tokens is None else tokens

    async def consume(rid, stream):
        async for out in stream:
            count, _ = tokens.get((rid, out.index), (0, None))
            tokens[(rid, out.index)] = (count + len(out.token_ids), out.finish_reason)
            if out.finish_reason is not None and out.index == 0:
                outcome[rid] = out.finish_reason

    def submit(due: int) -> None:
        for step, rid, prompt, params in arrivals:
            if step == due:
                try:
                    stream = engine.add_request(prompt, params, rid)
                except ValueError:
                    outcome[rid] = "rejected"
                    continue
                consumers.append(asyncio.create_task(consume(rid, stream)))
        for rid in aborts.get(due, []):
            engine.abort(rid)

    last_due = max([a[0] for a in arrivals] + list(aborts) + [0])
    hook = worker.on_step
    worker.on_step = lambda plan: (hook(plan) if hook else None, submit(worker.steps))
    await run_engine_until_idle(engine, worker, last_due, submit)
    await asyncio.gather(*consumers)
    engine._task.cancel()
    return outcome


def assert_all_blocks_back(engine: Engine) -> None:
    kv = engine.kv
    assert not engine.scheduler.requests and not engine.output.streams
    assert kv.num_free_blocks == kv.num_gpu_blocks and kv.num_free_cpu_blocks == kv.swap.num_cpu_blocks
    kv.pool.check_invariants([])
    kv.swap.check_invariants()


def solo_need(bs: int, prompt_len: int, max_tokens: int, n: int) -> int:
    """Blocks a group needs alone at its longest, written out independently of the code under test."""
    per_seq = -(-(prompt_len + max_tokens - 1) // bs)
    shared = (prompt_len - 1) // bs if n > 1 and prompt_len > 1 else 0
    return shared + n * (per_seq - shared)


request_st = st.tuples(
    st.integers(1, 12),  # prompt length
    st.integers(1, 16),  # max_tokens
    st.sampled_from([1, 1, 1, 2, 2, 3, 4, 8]),  # n
    st.booleans(),  # beam search (width = min(n, 4))
    st.integers(0, 2),  # priority
    st.booleans(),  # shares the first request's prompt (prefix hits)
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(),
       requests=st.lists(request_st, min_size=2, max_size=6),
       block_size=st.sampled_from([1, 2, 4]),
       pool_factor=st.floats(1.0, 1.3),
       max_num_seqs=st.sampled_from([1, 2, 4, 8, 8]),
       budget=st.sampled_from([2, 8, 32, 64]),
       num_cpu_blocks=st.sampled_from([0, 8, 64]),
       mode=st.sampled_from(["recompute", "swap", "auto"]),
       policy=st.sampled_from(["fcfs", "priority"]),
       prefix=st.booleans(),
       eos_rate=st.sampled_from([0.0, 0.0, 0.1]),
       async_scheduling=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_workloads_finish_and_give_every_block_back(data, requests, block_size, pool_factor, max_num_seqs,
                                                          budget, num_cpu_blocks, mode, policy, prefix, eos_rate,
                                                          async_scheduling, seed):
    rng = random.Random(seed)
    base = [rng.randrange(256) for _ in range(12)]
    arrivals, specs = [], {}
    for i, (plen, max_tokens, n, beam, prio, shared) in enumerate(requests):
        width = min(n, 4) if beam else n
        prompt = base[:plen] if shared else [rng.randrange(256) for _ in range(plen)]
        params = SamplingParams(n=width, max_tokens=max_tokens, use_beam_search=beam, ignore_eos=eos_rate == 0)
        rid = f"r{i}"
        arrivals.append((data.draw(st.sampled_from([0, 0, 0, 1, 3]), label=f"arrival {rid}"), rid, prompt, params))
        specs[rid] = (prompt, params)
    needs = [solo_need(block_size, len(p), sp.max_tokens, sp.n) for p, sp in specs.values()]
    num_gpu_blocks = int(max(needs) * pool_factor)  # down to one request's worth: the others must wait their turn
    aborts: dict[int, list[str]] = {}
    for rid in data.draw(st.lists(st.sampled_from(sorted(specs)), max_size=2, unique=True), label="aborted"):
        aborts.setdefault(data.draw(st.integers(0, 30), label=f"abort step {rid}"), []).append(rid)
    cfg = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       preemption_mode=mode, scheduling_policy=policy, enable_prefix_caching=prefix, max_n=8,
                       max_model_len=64, async_scheduling=async_scheduling)
    event(f"pool {num_gpu_blocks} blocks")

    async def main():
        engine, worker = make_engine(cfg, num_gpu_blocks, num_cpu_blocks, seed, eos_rate)
        engine.scheduler.policy.kv_bytes_per_block = 1000
        watch_schedule(engine, worker)
        outcome = await drive(engine, worker, arrivals, aborts, tokens)
        assert_all_blocks_back(engine)
        event("preempted" if engine.scheduler.num_preemptions else "no preemption")
        event("swapped" if engine.kv.swap.num_blocks_swapped_out else "no swap")
        event("rejected" if "rejected" in outcome.values() else "all accepted")
        return outcome

    tokens: dict = {}
    outcome = asyncio.run(main())
    aborted = {rid for rids in aborts.values() for rid in rids}
    for rid, (prompt, params) in specs.items():
        assert rid in outcome, f"{rid} never finished"
        if outcome[rid] != "rejected" and rid not in aborted:
            assert outcome[rid] in ("stop", "length"), (rid, outcome[rid])
            for index in range(params.n):  # exactly max_tokens, or fewer ending in EOS: none lost, none extra
                count, reason = tokens[(rid, index)]
                assert count == params.max_tokens if reason == "length" else 0 < count <= params.max_tokens, \
                    (rid, index, count, reason, params.max_tokens)
        verdict_ok = outcome[rid] != "rejected"
        assert verdict_ok == (params.n <= max_num_seqs and
                              solo_need(block_size, len(prompt), params.max_tokens, params.n) <= num_gpu_blocks)
        solo = asyncio.run(run_alone(cfg, num_gpu_blocks, num_cpu_blocks, prompt, params, seed))
        if verdict_ok:
            assert solo == "finished", f"{rid} was accepted but alone on an empty pool it {solo}"
        elif not params.use_beam_search:
            assert solo != "finished", f"{rid} was rejected but alone on an empty pool it finished"


async def run_alone(cfg, num_gpu_blocks, num_cpu_blocks, prompt, params, seed) -> str:
    """Run one request to its last token (no EOS) alone on an empty pool, past the submit check.

    Returns "finished" when it ends without a preemption, else what stopped it.
    """
    params = SamplingParams(n=params.n, max_tokens=params.max_tokens, use_beam_search=params.use_beam_search,
                            ignore_eos=True)
    engine, worker = make_engine(cfg, num_gpu_blocks, num_cpu_blocks, seed, 0.0)
    stream, members = engine.output.add("solo", prompt, params, time.monotonic())
    for req in members:
        engine.scheduler.add(req)
    engine._task = asyncio.create_task(engine._loop())
    try:
        while True:
            await asyncio.sleep(0)
            if not engine.scheduler.requests:
                break
            if engine.scheduler.num_preemptions:
                return "was preempted"
            if engine._task.done() or (engine._wake.sleeping and not engine._wake.is_set()):
                return "could not be scheduled"
            if worker.steps > 400:
                return "did not finish"
        return "finished"
    finally:
        engine._task.cancel()


def test_beams_preempted_by_recompute_come_back_sharing_their_prompt():
    # Beams run in lockstep: one beam waits for the others' candidates. Width 2, a 9-token prompt
    # (2 full blocks of 4) and 4 tokens: 4 blocks with the prompt shared, 6 without. In 5 blocks
    # 'x' forces the beams out; readmitted one by one without their sharing, the first beam would
    # wait for ever for a second that never fits. Readmitted leader first, they fork and fit.
    cfg = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="recompute",
                       enable_prefix_caching=False, max_model_len=64)
    arrivals = [(0, "x", [9] * 4, SamplingParams(max_tokens=16, ignore_eos=True)),
                (0, "beams", list(range(1, 10)), SamplingParams(n=2, max_tokens=4, use_beam_search=True))]

    async def main():
        engine, worker = make_engine(cfg, 5, 0, 0, 0.0)
        watch_schedule(engine, worker)
        outcome = await drive(engine, worker, arrivals, {})
        assert engine.scheduler.num_preemptions > 0  # the beams were preempted (and came back)
        assert_all_blocks_back(engine)
        return outcome

    assert asyncio.run(main()) == {"x": "length", "beams": "length"}


def test_group_readmitted_with_prefix_hits_past_its_fork_point_forks_again():
    # The counterexample this property test found: block_size 1, a pool of exactly r1's worth (7
    # blocks), prefix caching on. r0 grows into r1's blocks, so r1 (n=2) is preempted by recompute
    # after its siblings sampled a token each. Readmitted, its leader's cached blocks cover its
    # prompt (2 tokens) although the siblings fork after 1: its prefix hits must stop at the fork
    # point, or it computes past it, never forks, and the loop sleeps with r1 unfinished.
    cfg = EngineConfig(block_size=1, max_num_seqs=8, max_num_batched_tokens=8, preemption_mode="recompute",
                       enable_prefix_caching=True, max_n=8, max_model_len=64)
    arrivals = [(0, "r0", [5], SamplingParams(max_tokens=3, ignore_eos=True)),
                (0, "r1", [7, 8], SamplingParams(n=2, max_tokens=3, ignore_eos=True))]
    resumptions = []

    async def main():
        engine, worker = make_engine(cfg, 7, 0, 0, 0.0)
        watch_schedule(engine, worker)
        schedule = engine.scheduler.schedule

        def recorded(ahead: bool = False):
            step = schedule(ahead)
            if step is not None:
                resumptions.extend((r.request_id, r.mode, r.num_blocks) for r in step.resumptions)
            return step

        engine.scheduler.schedule = recorded
        outcome = await drive(engine, worker, arrivals, {})
        assert engine.scheduler.num_preemptions == 2  # both siblings, once
        assert_all_blocks_back(engine)
        return outcome

    assert asyncio.run(main()) == {"r0": "length", "r1": "length"}
    assert resumptions == [("r1-0", "recompute", 1)]  # one prefix hit: the block before the fork point
