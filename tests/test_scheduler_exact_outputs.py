"""Differential test: every request's exact output in a random mix equals its output alone.

The real `Engine`, scheduler and KV cache manager run against a fake worker whose "model" is a pure
function of what its attention reads back from a slot-by-slot model of the KV pool: the next
token's scores hash the tokens found at positions 0..p, greedy takes the best, seeded sampling adds
noise that depends only on (seed, output index) (as the real sampler's), and beam search gets the
top log-probabilities. So a request's tokens depend on nothing but its own KV, and any slip of the
control plane (a block shared or freed too early, a copy-on-write missed, a swap or a recompute
that loses or repeats a token, an ahead step that emits one token too many) changes what it emits.
As in the real forward (worker/model.py), a step writes every new token's K/V before any of its
requests attends: a request may hit a prefix block that another one fills in the same step.

Each seeded workload mixes arrivals at random steps, n = 1..4, beam search, prompts sharing
prefixes with prefix caching on (and cache salts), stop strings, stop token ids, min_tokens, EOS,
max_tokens, aborts (of a random request, or of one that is waiting, waiting to fork, swapped,
running, or admitted in the step just scheduled ahead), clients that disconnect mid-stream, and
worker faults (a worker that dies: replaced, every live request recomputes; a failed step: its
cause ends with an error), on a pool small enough to preempt by recompute or by swap (a small host
pool too), with async scheduling on or off and stream intervals above 1. Checked:

- after every scheduled step, every applied result and every round of aborts: reference counts
  equal the block tables holding each block, the free queue holds exactly the blocks with count 0,
  host tables likewise; a running sequence holds exactly the blocks its computed tokens fill (none
  reserved early or kept late), a waiting or swapped one none; running groups take at most
  max_num_seqs seats; scheduled tokens <= max_num_batched_tokens;
- the worker reads back, at every position, the token the request has there; it never computes
  past prompt + max_tokens - 1; its mirror of each request's tokens agrees with the control plane's;
- nothing hangs: the loop never sleeps while a request is left, every request ends;
- at the end every device and host block is free and no per-request state is left behind;
- every request emits exactly (token ids, text, finish reason, stop reason per choice) what it
  emits alone on a large pool without preemption, with synchronous scheduling and prefix caching
  off; one aborted, disconnected or failed emits a prefix of that, unless it had finished.

`test_scheduler_properties` (random tokens) checks the bookkeeping but cannot check exact outputs
across preemption, prefix hits, async scheduling and worker restarts; nor stop strings, stop token
ids and min_tokens ending requests while a step is in flight, aborts aimed at a request in a given
state, the token budget, or block tables sized exactly. The last two tests run such mixes on the real
worker process and stories260K, the second with every sampling knob the worker keeps per row
(penalties, logit bias, min_tokens, top-k / min-p, logprobs, prompt logprobs) and priority admission.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import random
import types
from array import array
from unittest import mock

import msgspec
import pytest

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.common.protocol import SampledToken, StepPlan, StepResult
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler import engine as engine_module
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import RequestStatus
from pagedkv.scheduler.tokenizer import Tokenizer
from pagedkv.scheduler.worker_client import WorkerFailed
from conftest import (GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, Violation, WatchedEvent, assert_all_blocks_free,
                      run_engine_until_idle)

MODEL = ModelConfig.load(None)  # the embedded byte-level model: vocab 258, EOS 257
TOKENIZER = Tokenizer.load(MODEL)
EOS = 257
ALPHABET = "abcdefghij"  # the fake model emits these bytes (and EOS): stop strings over it do match
VOCAB = [ord(c) for c in ALPHABET] + [EOS]
MAX_MODEL_LEN = 64
MAX_STEPS_WITHOUT_PROGRESS = 100
NUM_SEEDS = 100  # workloads, over 4 tests
STATES = ("waiting", "forking", "swapped", "running", "ahead")  # abort targets (`drive`)


def _digest(*parts: int | list[int]) -> int:
    """A 64-bit hash of ints and int lists, stable across processes (unlike hash() of str)."""
    data = array("q")
    for p in parts:
        data.extend(p if isinstance(p, list) else [p])
        data.append(-1)  # separator: ([1], 2) differs from ([1, 2],)
    return int.from_bytes(hashlib.blake2b(data.tobytes(), digest_size=8).digest(), "little")


class ModelWorker:
    """A worker whose next token is a pure function of the KV it reads (slot -> (token, position)).

    eos_scale scales EOS's score (0: never EOS). Plans run in the order sent, as the real worker's.
    """

    def __init__(self, block_size: int, eos_scale: float, deaths: set[int] = frozenset(),
                 errors: set[int] = frozenset()):
        self.bs = block_size
        self.eos_scale = eos_scale
        self.deaths, self.errors = deaths, errors  # worker steps at which it dies, or fails the step
        self.num_restarts = 0
        self.broken = False  # a step failed: every step fails until the worker is replaced
        self.mirror: dict[str, list] = {}  # request id -> [token_ids, num_prompt, block_ids, computed, sampling]
        self.device: dict[int, tuple[int, int]] = {}
        self.host: dict[int, tuple[int, int]] = {}
        self.steps = 0  # plans run
        self.steps_without_progress = 0
        self.on_step = None  # test hook: called with each plan before it runs
        self.sent: collections.deque[StepPlan] = collections.deque()  # submitted, not run yet

    def scores(self, context: list[int]) -> list[float]:
        """The model: a score per VOCAB token after ``context``."""
        rng = random.Random(_digest(context))
        s = [rng.random() for _ in VOCAB]
        s[-1] *= self.eos_scale
        return s

    def sample(self, context: list[int], num_prompt: int, sampling: SamplingParams) -> SampledToken | None:
        scores = self.scores(context)
        if sampling.use_beam_search:  # log-softmax of 4 x scores, top ``logprobs`` pairs
            z = math.log(sum(math.exp(4 * s) for s in scores))
            top = sorted(((t, 4 * s - z) for t, s in zip(VOCAB, scores)), key=lambda p: -p[1])[:sampling.logprobs]
            return SampledToken("", top[0][0], top[0][1], top)
        output_index = len(context) - num_prompt
        if not sampling.greedy:  # noise from (seed, output index) only, as the real sampler's
            rng = random.Random(_digest(sampling.seed, output_index))
            scores = [s + 0.5 * rng.random() for s in scores]
        if output_index < sampling.min_tokens:  # EOS and stop tokens masked out, as the real sampler does
            banned = {EOS, *sampling.stop_token_ids}
            scores = [-1.0 if t in banned else s for t, s in zip(VOCAB, scores)]
        return SampledToken("", VOCAB[max(range(len(VOCAB)), key=scores.__getitem__)])

    @staticmethod
    def _move(src: dict, dst: dict, pairs, bs: int) -> None:
        for s, d in pairs:
            for off in range(bs):
                if (s * bs + off) in src:
                    dst[d * bs + off] = src[s * bs + off]
                else:
                    dst.pop(d * bs + off, None)

    def run(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_request_ids:
            self.mirror.pop(rid, None)
        scheduled = []
        for new in plan.new_requests:
            if new.request_id in self.mirror:
                raise Violation(f"{new.request_id} sent new while the worker still mirrors it")
            self.mirror[new.request_id] = [list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                           new.num_computed_tokens, new.sampling]
            scheduled.append((new.request_id, new.num_scheduled_tokens))
        for c in plan.cached_requests:
            if c.request_id not in self.mirror:
                raise Violation(f"{c.request_id} continued but the worker does not mirror it")
            m = self.mirror[c.request_id]
            for index, block in c.replaced_block_ids:
                m[2][index] = block
            m[2].extend(c.new_block_ids)
            m[0].extend(c.new_token_ids)
            scheduled.append((c.request_id, c.num_scheduled_tokens))
        if len({rid for rid, _ in scheduled}) != len(scheduled):
            raise Violation(f"step {plan.step_id} schedules a request twice")
        self._move(self.device, self.host, plan.blocks_to_swap_out, self.bs)
        self._move(self.host, self.device, plan.blocks_to_swap_in, self.bs)
        self._move(dict(self.device), self.device, plan.blocks_to_copy, self.bs)
        scheduled = [(rid, n) for rid, n in scheduled if n]
        for rid, n in scheduled:  # every layer writes the step's new K/V before it attends (worker/model.py)
            tokens, num_prompt, blocks, begin, sampling = self.mirror[rid]
            end = begin + n
            if end > len(tokens) or len(blocks) * self.bs < end:
                raise Violation(f"{rid}: {n} tokens from {begin} but {len(tokens)} known, {len(blocks)} blocks")
            if end > num_prompt + sampling.max_tokens - 1:  # the last sampled token is never written
                raise Violation(f"{rid}: computes position {end - 1}, past prompt + max_tokens - 1")
            for pos in range(begin, end):
                self.device[blocks[pos // self.bs] * self.bs + pos % self.bs] = (tokens[pos], pos)
        sampled, progress = [], False
        for rid, n in scheduled:
            tokens, num_prompt, blocks, begin, sampling = self.mirror[rid]
            end = begin + n
            context = []
            for pos in range(end):  # attention reads every earlier position of this request
                got = self.device.get(blocks[pos // self.bs] * self.bs + pos % self.bs)
                if got != (tokens[pos], pos):
                    raise Violation(f"{rid}: KV at position {pos} holds {got}, expected {(tokens[pos], pos)}")
                context.append(got[0])
            self.mirror[rid][3] = end
            if end == len(tokens):
                progress = True
                out = self.sample(context, num_prompt, sampling)
                out.request_id = rid
                if not sampling.use_beam_search:  # the control plane chooses a beam's tokens
                    tokens.append(out.token_id)
                sampled.append(out)
        self.steps_without_progress = 0 if progress else self.steps_without_progress + 1
        if self.steps_without_progress > MAX_STEPS_WITHOUT_PROGRESS:
            raise Violation(f"{MAX_STEPS_WITHOUT_PROGRESS} steps without a sampled token")
        return StepResult(step_id=plan.step_id, sampled=sampled)

    async def submit(self, plan: StepPlan) -> None:
        self.sent.append(plan)

    async def result(self, step_id: int) -> StepResult:
        await asyncio.sleep(0)
        plan = self.sent.popleft()
        if plan.step_id != step_id:
            raise Violation(f"result of step {step_id} asked for, step {plan.step_id} is next")
        self.steps += 1
        if self.on_step is not None:
            self.on_step(plan)
        if self.steps in self.deaths:
            raise WorkerFailed("killed by the test")
        if self.steps in self.errors or self.broken:  # after a failed step its mirror is undefined
            self.broken = True
            return StepResult(step_id=step_id, error="failed by the test")
        return self.run(plan)

    async def check_alive(self) -> None:
        pass

    async def forget_worker(self) -> None:
        """The engine replaces a failed worker (`Engine._recover`): a fresh one knows nothing."""
        self.mirror, self.device, self.host, self.sent = {}, {}, {}, collections.deque()
        self.broken = False
        self.num_restarts += 1

    async def start(self) -> types.SimpleNamespace:
        return self.hello  # what the engine checks a replacement's capacity against

    async def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    async def close(self) -> None:
        pass


def check_state(engine: Engine, where: str) -> None:
    """Every bookkeeping invariant that must hold between the loop's actions."""
    s, kv, bs = engine.scheduler, engine.kv, engine.kv.block_size
    try:
        kv.pool.check_invariants([r.block_table for r in s.requests.values()])
        kv.swap.check_invariants()
    except AssertionError as e:
        raise Violation(f"{where}: {e}") from None
    seats = {id(r.group): r.group_width for r in s.running}
    if sum(seats.values()) > s.max_num_seqs:
        raise Violation(f"{where}: running groups take {sum(seats.values())} seats > max_num_seqs {s.max_num_seqs}")
    for rid, req in s.requests.items():
        st = req.status
        if st is RequestStatus.RUNNING:
            if len(req.block_table) != -(-req.num_computed_tokens // bs):
                raise Violation(f"{where}: {req} holds {len(req.block_table)} blocks for "
                                f"{req.num_computed_tokens} computed tokens")
            if req not in s.running:
                raise Violation(f"{where}: {rid} running but not in the running queue")
        elif st is RequestStatus.SWAPPED:
            if req.block_table or rid not in kv.swap.host_tables or req not in s.swapped:
                raise Violation(f"{where}: swapped {req} has device blocks or no host table or is not queued")
        elif st is RequestStatus.WAITING:
            if req.block_table or req.num_computed_tokens or rid in kv.swap.host_tables:
                raise Violation(f"{where}: waiting {req} holds blocks or progress")
        else:
            raise Violation(f"{where}: finished {req} is still known to the scheduler")
    live = set(s.requests)
    if stale := set(kv.swap.host_tables) - live:
        raise Violation(f"{where}: host tables of finished requests {stale}")
    if stale := set(kv._replaced) - live:
        raise Violation(f"{where}: copy-on-write records of finished requests {stale}")


def instrument(engine: Engine) -> None:
    """Check the state after each step scheduled (and advanced), each result and each round of aborts."""
    schedule, apply_result, apply_aborts = engine._schedule, engine._apply_result, engine._apply_aborts

    def scheduled(ahead: bool):
        step = schedule(ahead)
        if step is not None:
            for p in step.preemptions:
                engine.exercised[p.mode] += 1  # survives a worker restart (a fresh scheduler)
            if sum(step.num_scheduled_tokens.values()) > engine.scheduler.max_num_batched_tokens:
                raise Violation(f"step {step.plan.step_id} schedules {sum(step.num_scheduled_tokens.values())} "
                                f"tokens > max_num_batched_tokens")
            check_state(engine, f"after scheduling step {step.plan.step_id} (ahead={ahead})")
        return step

    def applied(result):
        apply_result(result)
        check_state(engine, f"after applying step {result.step_id}")
        # the worker's mirror never contradicts the control plane (it may be one sampled token ahead)
        for rid, req in engine.scheduler.requests.items():
            m = engine.client.mirror.get(rid)
            if m is not None and req.in_worker and m[0][:req.num_tokens] != req.token_ids[:len(m[0])]:
                raise Violation(f"{rid}: worker mirror {m[0]} != control plane {req.token_ids}")

    def aborted():
        apply_aborts()
        check_state(engine, "after aborts")

    engine._schedule, engine._apply_result, engine._apply_aborts = scheduled, applied, aborted


def make_engine(cfg: EngineConfig, num_gpu_blocks: int, num_cpu_blocks: int, eos_scale: float,
                kv_bytes_per_block: int = 1000, deaths: set[int] = frozenset(),
                errors: set[int] = frozenset()) -> tuple[Engine, ModelWorker]:
    worker = ModelWorker(cfg.block_size, eos_scale, deaths, errors)

    def new_kv() -> KVCacheManager:
        return KVCacheManager(num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching, "sha256", num_cpu_blocks)

    engine = Engine(cfg, MODEL, TOKENIZER, worker, new_kv())
    # a failed worker is replaced in place (an "external" one) and every live request recomputes
    engine._new_kv, engine._worker_args = new_kv, {"spawn": False}
    engine._pool_blocks = (num_gpu_blocks, num_cpu_blocks)
    engine.scheduler.policy.kv_bytes_per_block = engine.kv_bytes_per_block = kv_bytes_per_block
    worker.hello = types.SimpleNamespace(max_num_gpu_blocks=num_gpu_blocks, kv_bytes_per_block=kv_bytes_per_block)
    engine._wake = WatchedEvent()
    engine.exercised = collections.Counter()  # preemptions by mode (`instrument`)
    instrument(engine)
    return engine, worker


Choice = tuple  # (token ids, text, finish reason, stop reason)


async def drive(engine: Engine, worker: ModelWorker, arrivals: list, aborts: dict[int, list],
                disconnects: dict[str, int]) -> tuple[dict[str, dict[int, Choice]], set[str], collections.Counter]:
    """Submit ``arrivals`` [(step, id, prompt, params, priority, cache salt)] at their steps, apply
    ``aborts`` {step: [target]}.

    A target is a request id, or a state ("waiting", "forking", "swapped", "running", "ahead": new in
    the step just sent ahead of the one in flight): a live request in that state is picked, at its
    step or at the first step after it that has one.
    disconnects: request id -> deltas its client reads before closing the stream.
    Returns each request's choices, the requests aborted (or disconnected) before they ended, and
    how many abort targets of each kind found a request.
    """
    outputs: dict[str, dict[int, Choice]] = {}
    aborted: set[str] = set()
    hits = collections.Counter()  # abort targets that found a request
    pending: list = []  # abort targets due that found none yet
    consumers = []
    pick = random.Random(len(arrivals))

    async def consume(rid, stream):
        choices = outputs.setdefault(rid, {})
        k = 0
        async for out in stream:
            ids, text, *_ = choices.get(out.index, ([], "", None, None))
            choices[out.index] = (ids + out.token_ids, text + out.text, out.finish_reason, out.stop_reason)
            k += 1
            if k == disconnects.get(rid) and rid in engine.output.streams:
                aborted.add(rid)
                await stream.aclose()
                return

    def state_of(rid: str) -> set[str]:
        stream = engine.output.streams[rid]
        states = set()
        for m in stream.members:
            if m.request_id not in engine.scheduler.requests:
                continue
            if m.status is RequestStatus.WAITING:
                states.add("waiting" if m in engine.scheduler.waiting else "forking")
            elif m.status is RequestStatus.SWAPPED:
                states.add("swapped")
            elif m.status is RequestStatus.RUNNING:
                states.add("running")
        if worker.sent and any(engine.output.owner.get(n.request_id) is stream
                               for n in worker.sent[-1].new_requests):
            states.add("ahead")
        return states

    def on_step(_plan) -> None:
        due = worker.steps
        for step, rid, prompt, params, priority, salt in arrivals:
            if step == due:
                stream = engine.add_request(prompt, params, rid, priority=priority, cache_salt=salt)
                consumers.append(asyncio.create_task(consume(rid, stream)))
        pending.extend(aborts.get(due, []))
        for target in list(pending):  # each waits for a request to aim at (states are fleeting)
            live = sorted(engine.output.streams)
            if target not in live:
                live = [rid for rid in live if target in state_of(rid)]
            if live:
                rid = pick.choice(live)
                aborted.add(rid)
                engine.abort(rid)
                pending.remove(target)
                hits[target if target in STATES else "by id"] += 1

    last_due = max([a[0] for a in arrivals] + list(aborts) + [0])
    worker.on_step = on_step
    await run_engine_until_idle(engine, worker, last_due, lambda step: on_step(None))
    if engine.output.streams:
        raise Violation(f"the loop sleeps with streams {sorted(engine.output.streams)} not ended")
    await asyncio.gather(*consumers)
    engine._task.cancel()
    return outputs, aborted, hits


def assert_nothing_left(engine: Engine) -> None:
    s, kv = engine.scheduler, engine.kv
    assert not s.requests and not engine.output.streams and not engine.output.owner
    assert not s.running and not s.waiting and not s.swapped
    assert kv.num_free_blocks == kv.num_gpu_blocks and kv.num_free_cpu_blocks == kv.swap.num_cpu_blocks
    assert not kv.swap.host_tables and not kv._replaced and not kv._pending_copies
    kv.pool.check_invariants([])
    kv.swap.check_invariants()


_reference_cache: dict = {}


def reference(block_size: int, eos_scale: float, prompt: list[int], params: SamplingParams) -> dict[int, Choice]:
    """The request's choices alone: a large pool, no preemption, no prefix cache, synchronous steps."""
    key = (block_size, eos_scale, tuple(prompt), msgspec.msgpack.encode(params))
    if key not in _reference_cache:
        cfg = EngineConfig(block_size=block_size, max_num_seqs=16, max_num_batched_tokens=4096,
                           enable_prefix_caching=False, max_model_len=MAX_MODEL_LEN, async_scheduling=False)

        async def main():
            engine, worker = make_engine(cfg, 4096, 0, eos_scale)
            outputs, *_ = await drive(engine, worker, [(0, "solo", prompt, params, 0, None)], {}, {})
            assert engine.scheduler.num_preemptions == 0
            assert_nothing_left(engine)
            return outputs["solo"]

        _reference_cache[key] = asyncio.run(main())
    return _reference_cache[key]


def solo_need(bs: int, prompt_len: int, max_tokens: int, n: int) -> int:
    """Blocks a group needs alone at its longest (as test_scheduler_properties writes it out)."""
    per_seq = -(-(prompt_len + max_tokens - 1) // bs)
    shared = (prompt_len - 1) // bs if n > 1 and prompt_len > 1 else 0
    return shared + n * (per_seq - shared)


def workload(seed: int) -> dict:
    """One random workload: engine settings, arrivals, aborts and disconnects, all from ``seed``."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    base = [rng.choice(VOCAB[:-1]) for _ in range(16)]
    arrivals, specs = [], {}
    for i in range(rng.randint(4, 10)):
        plen = rng.randint(1, 14)
        shared = rng.randrange(plen + 1) if rng.random() < 0.6 else 0  # a prefix of the common base
        prompt = base[:shared] + [rng.choice(VOCAB[:-1]) for _ in range(plen - shared)]
        n = rng.choice([1, 1, 2, 3, 4])
        max_tokens = rng.randint(1, 24) if rng.random() < 0.3 else rng.randint(12, 24)
        if rng.random() < 0.2:
            params = SamplingParams(n=n, max_tokens=max_tokens, use_beam_search=True,
                                    early_stopping=rng.random() < 0.5, length_penalty=rng.choice([0.5, 1.0, 2.0]))
        else:
            stop = [rng.choice(ALPHABET) + rng.choice(["", rng.choice(ALPHABET), rng.choice(ALPHABET)])
                    for _ in range(rng.choice([0, 0, 0, 1, 2]))]
            stop_ids = rng.sample(VOCAB[:-1], rng.choice([0, 0, 0, 0, 1]))
            greedy = n == 1 and rng.random() < 0.5
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0 if greedy else 1.0,
                                    seed=None if greedy else rng.randrange(2**31), stop=stop, stop_token_ids=stop_ids,
                                    include_stop_str_in_output=rng.random() < 0.3, ignore_eos=rng.random() < 0.3,
                                    min_tokens=min(rng.choice([0, 0, 0, 2, 5]), max_tokens))
        rid = f"r{i}"
        arrivals.append((rng.choice([0, 0, 0, 1, 2, 3, 5, 10]), rid, prompt, params, rng.randint(0, 2),
                         rng.choice([None, None, None, "tenant"])))
        specs[rid] = (prompt, params)
    needs = [solo_need(bs, len(p), sp.max_tokens, sp.n) for p, sp in specs.values()]
    num_gpu_blocks = max(needs) + rng.choice([0, 0, 1, 2])  # down to the largest request's worth
    aborts: dict[int, list] = {}
    for _ in range(rng.choice([0, 1, 2, 3])):
        target = rng.choice(sorted(specs) + list(STATES) * 2 + ["ahead"] * 2)
        aborts.setdefault(rng.randint(0, 40), []).append(target)
    disconnects = {rid: rng.randint(1, 6) for rid in rng.sample(sorted(specs), rng.choice([0, 0, 1]))}
    mode = rng.choice(["recompute", "swap", "swap", "auto"])
    if mode != "recompute" and rng.random() < 0.5:  # the first request swapped out (states are fleeting)
        aborts.setdefault(rng.randint(0, 20), []).append("swapped")
    cfg = EngineConfig(block_size=bs, max_num_seqs=rng.choice([4, 8, 8, 16]),
                       max_num_batched_tokens=rng.choice([1, 3, 8, 16, 64]),
                       preemption_mode=mode,
                       scheduling_policy=rng.choice(["fcfs", "fcfs", "priority"]),
                       enable_prefix_caching=rng.random() < 0.8, max_n=8, max_model_len=MAX_MODEL_LEN,
                       async_scheduling=rng.random() < 0.6, max_worker_restarts=100,
                       stream_interval=rng.choice([1, 1, 1, 4]))
    deaths = set(rng.sample(range(1, 50), rng.choice([1, 2]))) if rng.random() < 0.25 else set()
    errors = {rng.randrange(1, 50)} if rng.random() < 0.1 else set()
    return dict(cfg=cfg, specs=specs, arrivals=arrivals, aborts=aborts, disconnects=disconnects,
                deaths=deaths, errors=errors, num_gpu_blocks=num_gpu_blocks,
                num_cpu_blocks=rng.choice([0, 4, 12, 64, 64]),  # host blocks: none, too few for some, plenty
                eos_scale=rng.choice([0.0, 0.0, 0.5, 0.8]),
                kv_bytes_per_block=rng.choice([1000, 10**9]))  # under "auto": swap is cheap, or dear


def run_workload(seed: int) -> dict:
    """Run workload ``seed`` and check it against each request alone; returns what it exercised."""
    w = workload(seed)
    cfg = w["cfg"]

    async def main():
        engine, worker = make_engine(cfg, w["num_gpu_blocks"], w["num_cpu_blocks"], w["eos_scale"],
                                     w["kv_bytes_per_block"], w["deaths"], w["errors"])
        outputs, aborted, hits = await drive(engine, worker, w["arrivals"], w["aborts"], w["disconnects"])
        assert_nothing_left(engine)
        return outputs, aborted, hits, engine, worker

    with mock.patch.object(engine_module, "_RESTART_BACKOFF_SECONDS", (0.0,)):  # restart at once
        outputs, aborted, hits, engine, worker = asyncio.run(main())
    # how a choice may end early: "abort" when aborted, "error" when a step failed, no last delta
    # when its client left; a choice that ended otherwise ends exactly as alone
    early = {"error"} if w["errors"] else set()
    for rid, (prompt, params) in w["specs"].items():
        ref = reference(cfg.block_size, w["eos_scale"], prompt, params)
        got = outputs[rid]
        may_end = early | ({"abort"} if rid in aborted else set()) | ({None} if rid in w["disconnects"] else set())
        if None not in may_end:  # every choice gets its last delta
            assert sorted(got) == sorted(ref), f"seed {seed}: {rid} choices {sorted(got)} != {sorted(ref)}"
        for i, (ids, text, reason, _) in got.items():
            ref_ids, ref_text, *_ = ref[i]
            if reason in may_end:
                assert ids == ref_ids[:len(ids)] and ref_text.startswith(text), \
                    f"seed {seed}: {rid}[{i}] ended {reason!r} with {ids!r}, no prefix of {ref_ids!r}"
            else:
                assert got[i] == ref[i], f"seed {seed}: {rid}[{i}] {params}\n got {got[i]}\n ref {ref[i]}"
    return {"recompute": engine.exercised["recompute"] > 0, "swap": engine.exercised["swap"] > 0,
            "aborted": bool(aborted), "async": cfg.async_scheduling, "restarted": worker.num_restarts > 0,
            **{f"abort {k}": v for k, v in hits.items()}}


@pytest.mark.parametrize("chunk", range(4))
def test_every_request_emits_exactly_what_it_emits_alone(chunk):
    seen = collections.Counter()
    for seed in range(chunk, NUM_SEEDS, 4):
        seen.update(k for k, v in run_workload(seed).items() if v)
    # the workloads exercise what they are for (keeps a change to the generator from hollowing it out)
    assert seen["recompute"] >= 5 and seen["swap"] >= 3 and seen["restarted"] >= 3, seen
    assert seen["aborted"] >= 10 and sum(seen[f"abort {s}"] for s in STATES) >= 5 and seen["async"] >= 10, seen


# ---- the same on the real model: the worker process, stories260K --------------------------------

def real_workload(seed: int) -> tuple[list, dict]:
    """Requests [(prompt, params, deltas read before the client leaves or None)] and engine settings."""
    rng = random.Random(seed)
    base = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS  # a prefix of this is a prompt sharing blocks
    requests = []
    for _ in range(rng.randint(6, 12)):
        k = rng.randint(1, 30)
        prompt = base[:k] if rng.random() < 0.6 else [1] + [rng.randrange(3, 512) for _ in range(k - 1)]
        n, max_tokens = rng.choice([1, 1, 2, 3, 4]), rng.randint(1, 40)
        if rng.random() < 0.2:
            params = SamplingParams(n=n, use_beam_search=True, max_tokens=max_tokens)
        else:
            greedy = n == 1 and rng.random() < 0.5
            params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0 if greedy else rng.choice([0.7, 1.0]),
                                    top_p=rng.choice([1.0, 0.9]), seed=None if greedy else rng.randrange(2**31),
                                    stop=rng.sample([" park", ".", "Lily", " the", ","], rng.choice([0, 0, 1, 2])),
                                    stop_token_ids=rng.sample(GOLDEN_OUTPUT_IDS[:20], rng.choice([0, 0, 1])),
                                    ignore_eos=rng.random() < 0.3)
        requests.append((prompt, params, rng.randint(1, 8) if rng.random() < 0.15 else None))
    bs = rng.choice([1, 2, 4, 8, 16])
    need = max(-(-(len(p) + sp.max_tokens) // bs) * sp.n for p, sp, _ in requests)
    cfg = dict(block_size=bs, num_gpu_blocks=need + 1, max_num_batched_tokens=rng.choice([8, 32, 512]),
               preemption_mode=rng.choice(["recompute", "swap"]), enable_prefix_caching=rng.random() < 0.8,
               async_scheduling=rng.random() < 0.5, max_num_seqs=rng.choice([8, 16]))
    return requests, cfg


async def _choices(stream, leave_after: int | None = None) -> dict[int, Choice]:
    choices, k = {}, 0
    async for out in stream:
        ids, text, *_ = choices.get(out.index, ([], "", None, None))
        choices[out.index] = (ids + out.token_ids, text + out.text, out.finish_reason, out.stop_reason)
        k += 1
        if k == leave_after:
            await stream.aclose()  # the client leaves: the engine aborts it
            break
    return choices


@pytest.mark.parametrize("seed", [0, 3, 10])  # swap + async; recompute; recompute + async, block_size 1
async def test_on_the_real_model_every_request_emits_what_it_emits_alone(start, seed):
    # The worker process and stories260K in place of the fake: a tight pool preempting (recompute or
    # swap), prefix hits, async scheduling on or off, chunked prefill; each request alone (a large
    # pool, one at a time, synchronous) gives the reference.
    requests, cfg = real_workload(seed)
    alone = await start(num_gpu_blocks=512, block_size=16, enable_prefix_caching=False, async_scheduling=False,
                        max_num_seqs=16)
    refs = [await _choices(alone.add_request(p, sp)) for p, sp, _ in requests]
    engine = await start(**cfg)
    got = await asyncio.gather(*[_choices(engine.add_request(p, sp), leave) for p, sp, leave in requests])
    for (p, sp, leave), g, ref in zip(requests, got, refs):
        if leave is None:
            assert g == ref, (p, sp)
        else:  # left early: each choice so far is a prefix of its whole (or ended as alone)
            assert all(ref[i][0][:len(ids)] == ids for i, (ids, *_) in g.items()), (p, sp)
    assert engine.scheduler.num_preemptions > 0
    for _ in range(100):  # a client that left is aborted between steps
        if not engine.output.streams:
            break
        await asyncio.sleep(0.01)
    assert_all_blocks_free(engine)


def knob_workload() -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, priority): every sampling knob the worker keeps per row, several prompts
    sharing full blocks of one prefix (block size 8), each request ending in its own way."""
    base = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS
    return [
        (base[:20], SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5,
                                   frequency_penalty=0.7, logprobs=3), 0),
        (base[:21], SamplingParams(temperature=1.0, seed=5, n=2, top_k=40, min_p=0.05, max_tokens=36,
                                   logit_bias={GOLDEN_OUTPUT_IDS[0]: -100.0, 261: 5.0}), 1),
        (base[:17], SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[267, 426],
                                   logprobs=0), -1),  # 267 is banned as output 3 and ends output 18
        (base[:25], SamplingParams(temperature=0.8, seed=9, top_p=0.9, max_tokens=24, prompt_logprobs=2,
                                   logprobs=2), 0),
        (base[:18], SamplingParams(n=2, use_beam_search=True, max_tokens=16), 2),
        (base[:24], SamplingParams(temperature=1.2, seed=3, n=3, max_tokens=28, frequency_penalty=1.0,
                                   presence_penalty=-0.5, top_k=5), -1),
        (base[:16], SamplingParams(temperature=0, max_tokens=40, stop=[" ball"], include_stop_str_in_output=True), 1),
        ([1, 403, 407], SamplingParams(temperature=0.7, seed=11, max_tokens=40, min_p=0.2, repetition_penalty=0.8,
                                       stop_token_ids=[2]), 0),
    ]


async def _full_choices(stream) -> dict:
    """Per choice: (token ids, text, finish reason, stop reason), the sampled tokens' (id, logprob,
    top ids, top logprobs), the prompt tokens' (id, logprob, top ids, top logprobs); and the
    request's cached prompt tokens."""
    choices, cached = {}, 0
    async for out in stream:
        c = choices.setdefault(out.index, [[], "", None, None, [], None])
        c[0] += out.token_ids
        c[1] += out.text
        c[2], c[3] = out.finish_reason, out.stop_reason
        c[4] += [(lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs], [v for _, _, v in lp.top_logprobs])
                 for lp in out.logprobs or []]
        if out.prompt_logprobs is not None:
            c[5] = [None if lp is None else (lp.token_id, lp.logprob, [t for t, _, _ in lp.top_logprobs],
                                             [v for _, _, v in lp.top_logprobs]) for lp in out.prompt_logprobs]
        cached = max(cached, out.num_cached_tokens)
    return {"choices": choices, "cached": cached}


def _assert_logprobs_equal(got: list, want: list) -> None:
    """Lists of (token id, logprob, top ids, top logprobs) or None: ids exact, logprobs within 1e-4
    (the batches differ, so do the float sums' orders)."""
    assert [None if x is None else (x[0], x[2]) for x in got] == [None if x is None else (x[0], x[2]) for x in want]
    for x, y in zip(got, want):
        if x is not None:
            assert [x[1], *x[3]] == pytest.approx([y[1], *y[3]], abs=1e-4)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
async def test_on_the_real_model_every_sampling_knob_emits_what_it_emits_alone(start, preemption_mode):
    # Penalties (the worker's per-row prompt masks and output counts, rebuilt on resumption), logit
    # bias, min_tokens, min_p / top_k / top_p, logprobs and prompt logprobs, beams and n > 1, on a
    # pool that preempts, with prefix hits, async scheduling, 16-token chunks and priority
    # admission: each request emits what it emits alone on a large pool.
    requests = knob_workload()
    alone = await start(num_gpu_blocks=512, block_size=16, enable_prefix_caching=False, async_scheduling=False)
    refs = [await _full_choices(alone.add_request(p, sp)) for p, sp, _ in requests]
    engine = await start(block_size=8, num_gpu_blocks=20, max_num_batched_tokens=16, async_scheduling=True,
                         preemption_mode=preemption_mode, scheduling_policy="priority", max_num_seqs=8)
    got = await asyncio.gather(*[_full_choices(engine.add_request(p, sp, priority=prio)) for p, sp, prio in requests])
    assert [[(len(c[0]), c[2], c[3]) for c in r["choices"].values()] for r in refs] == [
        [(40, "length", None)], [(36, "length", None)] * 2, [(18, "stop", 267)], [(24, "length", None)],
        [(16, "length", None)] * 2, [(28, "length", None)] * 3, [(28, "stop", " ball")], [(40, "length", None)]]
    for (p, sp, _), g, ref in zip(requests, got, refs):
        assert sorted(g["choices"]) == list(range(sp.n)), sp
        for i, c in g["choices"].items():
            r = ref["choices"][i]
            assert c[:4] == r[:4], (p, sp, i)
            _assert_logprobs_equal(c[4], r[4])
            assert (c[5] is None) == (r[5] is None)
            if c[5] is not None:
                _assert_logprobs_equal(c[5], r[5])
    assert engine.scheduler.num_preemptions > 0 and any(g["cached"] for g in got)
    assert (engine.kv.swap.num_blocks_swapped_out > 0) == (preemption_mode == "swap")
    assert_all_blocks_free(engine)
