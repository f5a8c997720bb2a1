"""The scheduler: continuous batching with FCFS or priority admission, recompute or swap preemption.

Each step spends a token budget of ``max_num_batched_tokens`` across at most ``max_num_seqs``
running sequences, in three phases, each its own function:

1. running (`_schedule_running`): in admission order, each sibling group (n > 1, beam search; a
   lone request is a group of one) asks for the tokens it has not computed yet (1 when decoding,
   the rest of its prompt when prefilling, in chunks if the budget is short). When the free blocks
   cannot hold a group's step, a victim chosen by the policy is preempted with its siblings — by
   recompute (its blocks are freed; it waits again at the head of the queue) or by swap (its
   blocks move to the host pool) — until the blocks suffice or the group itself was the victim.
2. swapped (`_schedule_swapped`), unless this step preempted: swapped-out groups come back, in
   queue order, while their blocks and seats fit. A step never swaps both ways: a host block
   freed by a swap-in could be overwritten by a swap-out in the same plan.
3. waiting (`_schedule_waiting`), once nobody is swapped out and unless this step preempted:
   groups are admitted in queue order (FCFS deque or priority heap, `scheduler.request_queue`)
   while the budget, the seats and the free blocks allow; nobody overtakes the head.

Every block count comes from the allocator's `num_blocks_needed` (`KVCacheManager`'s by default). A request that fits the pool
alone (the engine's submit check asks the same function) always finishes: an n > 1 group preempted
by recompute is readmitted as it was first admitted — one leader computes the shared prompt, the
others fork from it — so its sharing comes back and it needs no more blocks than before.
(PagedAttention, Kwon et al., SOSP 2023, §4.3-4.5.)
"""

from __future__ import annotations

import time
from typing import Protocol

import msgspec

from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
from pagedkv.scheduler.preemption import Preemption, PreemptionPolicy, Resumption
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.request_queue import make_queue


class KVAllocator(Protocol):
    """What the scheduler asks of a KV allocator: `KVCacheManager`, or a benchmark's baseline.

    Block counts in blocks, token counts in tokens. ``num_free_cpu_blocks`` is None when the
    allocator has no host pool (then every preemption is a recompute).
    """

    block_size: int
    num_gpu_blocks: int
    num_free_blocks: int
    num_free_cpu_blocks: int | None

    def num_blocks_needed(self, steps: list[tuple[Request, int]], *, empty_pool: bool = False) -> int: ...
    def find_cached_prefix(self, request: Request) -> list: ...
    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list | None = None) -> list[int] | None: ...
    def fork(self, parent: Request, child: Request) -> None: ...
    def free(self, request: Request) -> None: ...
    def take_pending_copies(self) -> list[tuple[int, int]]: ...
    def take_replaced_blocks(self, request: Request) -> list[tuple[int, int]]: ...
    def swap_out(self, group: list[Request]) -> list[tuple[int, int]]: ...
    def swap_in(self, group: list[Request]) -> list[tuple[int, int]]: ...
    def free_host(self, request: Request) -> None: ...


class ScheduledStep(msgspec.Struct):
    """A step plan plus what the control plane needs to apply its result."""

    plan: StepPlan
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    preempted: list[Request]
    preemptions: list[Preemption] = []  # how each group in ``preempted`` was preempted, and why
    resumptions: list[Resumption] = []  # preempted requests that run again in this step

    @property
    def is_empty(self) -> bool:
        """Nothing for the worker to do: no tokens, no block moves, no mirror to drop."""
        p = self.plan
        return not (self.num_scheduled_tokens or p.blocks_to_swap_out or p.blocks_to_swap_in
                    or p.blocks_to_copy or p.finished_request_ids)


class _Step:
    """What one `Scheduler.schedule` call has decided so far."""

    def __init__(self, budget: int):
        self.budget = budget  # tokens left
        self.num_blocks = 0  # free blocks the chosen running groups take
        self.chosen: dict[int, tuple[list[tuple[Request, int]], int]] = {}  # id(group) -> (steps, blocks)
        self.preempted: list[Request] = []
        self.new_reqs: list[NewRequestData] = []
        self.cached_reqs: list[CachedRequestData] = []
        self.num_scheduled: dict[str, int] = {}
        self.resumptions: list[Resumption] = []
        self.swaps_in: list[tuple[int, int]] = []


class Scheduler:
    """Owns the waiting, swapped and running queues and turns them into step plans."""

    def __init__(self, kv: KVAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: PreemptionPolicy | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy or PreemptionPolicy()  # default: FCFS, recompute only
        self.waiting = make_queue(self.policy.scheduling_policy.value)
        self.swapped = make_queue(self.policy.scheduling_policy.value)  # swapped out, in resumption order
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}
        self._swaps_out: list[tuple[int, int]] = []  # (device, host) pairs for the next plan
        self._preemptions: list[Preemption] = []
        self._finished_ids: list[str] = []  # the worker must drop these mirrors in the next plan
        self._step_id = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request; its ``pending_forks`` siblings join when it reaches its fork point."""
        self.requests[request.request_id] = request
        for child in request.pending_forks:
            self.requests[child.request_id] = child
        self.waiting.add(request)

    # ---- the submit check ----------------------------------------------------------------------

    def check_fits(self, members: list[Request], num_tokens: int) -> None:
        """Raise ValueError unless the sibling group ``members`` could run alone on an empty pool.

        ``members`` are the group's waiting sequences; ``num_tokens`` is each one's length at its
        longest: prompt plus every output token the cache ever holds (the last sampled token is never
        written). Within ``max_num_seqs`` (n and beam width count one seat each) and ``num_gpu_blocks``
        as `KVCacheManager.num_blocks_needed` counts them, sharing included. The message names the limit.
        """
        if members[0].group_width > self.max_num_seqs:
            raise ValueError(f"n: {members[0].group_width} sequences exceed max_num_seqs ({self.max_num_seqs}); "
                             "the group runs all at once")
        need = self.kv.num_blocks_needed([(m, num_tokens) for m in members], empty_pool=True)
        if need > self.kv.num_gpu_blocks:
            raise ValueError(f"max_tokens: prompt + max_tokens needs {need} KV blocks but the whole pool "
                             f"has {self.kv.num_gpu_blocks} (num_gpu_blocks, block_size {self.kv.block_size})")

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self, ahead: bool = False) -> ScheduledStep | None:
        """Decide the next step: running groups first, then swap-ins, then admissions.

        ahead: the previous step is still being computed (async scheduling, as vLLM V1's): a
        request whose last step samples a token is given one more token, the one being sampled
        (the worker keeps its own sampled tokens and computes steps in order), unless that token
        is its last by ``max_tokens``. An ahead step never preempts: when a running group's blocks
        do not fit, it returns None with nothing changed, and the caller schedules again once the
        step in flight has been applied (its finished requests' blocks freed).
        """
        step = _Step(self.max_num_batched_tokens)
        if not self._schedule_running(step, ahead):
            return None
        if not step.preempted:
            self._schedule_swapped(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)
        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, new_requests=step.new_reqs, cached_requests=step.cached_reqs,
                        finished_request_ids=self._finished_ids, blocks_to_swap_out=self._swaps_out,
                        blocks_to_swap_in=step.swaps_in, blocks_to_copy=self.kv.take_pending_copies())
        self._finished_ids, self._swaps_out = [], []
        preemptions, self._preemptions = self._preemptions, []
        return ScheduledStep(plan, step.num_scheduled, step.preempted, preemptions, step.resumptions)

    def _schedule_running(self, step: _Step, ahead: bool = False) -> bool:
        """Phase 1: every running group gets its tokens, preempting victims while blocks are short.

        Blocks are counted first and allocated after, so a preempted group never leaves
        half-scheduled members behind. Ahead of a step in flight, returns False (nothing changed)
        instead of preempting.
        """
        i = 0
        running, kv, chosen = self.running, self.kv, step.chosen
        free = kv.num_free_blocks  # changes here only when a preemption frees blocks
        while i < len(running) and step.budget > 0:
            req = running[i]
            if len(req.group) == 1:  # the common case, kept cheap: one sequence
                n = min(self._end(req, ahead) - req.num_computed_tokens, step.budget)
                steps = [(req, n if n > 0 else 0)]
                step.budget -= steps[0][1]
            else:
                if id(req.group) in chosen:
                    i += 1
                    continue
                steps = self._take_tokens(self._live(req, RequestStatus.RUNNING), step, ahead)
            need = kv.num_blocks_needed(steps)
            preempted = False
            if need > free - step.num_blocks:
                if ahead:
                    return False
                while need > kv.num_free_blocks - step.num_blocks:
                    victims = self._live(self.policy.victim(running), RequestStatus.RUNNING)
                    if (c := chosen.pop(id(victims[0].group), None)) is not None:
                        step.budget += sum(n for _, n in c[0])
                        step.num_blocks -= c[1]
                    self._preempt(victims, f"kv_cache_full: no free block for {req.request_id}")
                    step.preempted.extend(victims)
                    preempted = True
                    if victims[0].group is req.group:
                        break
                free = kv.num_free_blocks
                if req.status is not RequestStatus.RUNNING:  # the group preempted itself
                    step.budget += sum(n for _, n in steps)
                    # under priority the victim need not be the tail: the groups after it still run
                    # this step (the blocks it freed may be all they need); the ones before it are
                    # the chosen prefix of ``running``, victims removed
                    i = next((k for k, r in enumerate(running) if id(r.group) not in chosen), len(running))
                    continue
            chosen[id(req.group)] = (steps, need)
            step.num_blocks += need
            i = running.index(req) + 1 if preempted else i + 1
        num_scheduled, cached_reqs = step.num_scheduled, step.cached_reqs
        for steps, _ in chosen.values():
            for req, n in steps:
                if not n:  # a beam waiting for its siblings' results, or the budget ran out
                    continue
                new_blocks = kv.allocate_slots(req, n)
                assert new_blocks is not None, "blocks were counted before allocation"
                num_scheduled[req.request_id] = n
                if req.in_worker:
                    cached_reqs.append(CachedRequestData(req.request_id, new_blocks, n, req.unsent_token_ids,
                                                         kv.take_replaced_blocks(req)))
                    req.unsent_token_ids = []
                else:  # forked since its last step (n > 1, beam search): the worker gets it whole
                    step.new_reqs.append(self._new_request_data(req, n))
        step.num_blocks = 0  # allocated: from here on the pool's free count tells the rest
        return True

    def _schedule_swapped(self, step: _Step) -> None:
        """Phase 2: swap groups back in, in queue order, while their blocks and seats fit.

        A group that cannot come back even with nothing running gives up its host copy and waits
        to be recomputed instead.
        """
        while self.swapped and step.budget > 0:
            group = self._live(self.swapped.peek(), RequestStatus.SWAPPED)
            steps = self._take_tokens(group, step)
            need = self.kv.num_blocks_needed(steps)
            if need > self.kv.num_free_blocks or self._seats_taken() + self._seats(group) > self.max_num_seqs:
                step.budget += sum(n for _, n in steps)
                if not self.running:
                    for req in group:
                        self.swapped.remove(req)
                        self.kv.free_host(req)
                        req.num_computed_tokens = 0
                    self._requeue(group)
                return
            step.swaps_in += self.kv.swap_in(group)
            for req, n in steps:
                self.swapped.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if n:  # allocated outside the assert: `python -O` strips asserts, and with them the call
                    new_blocks = self.kv.allocate_slots(req, n)
                    assert new_blocks is not None, "blocks were counted before allocation"
                    step.num_scheduled[req.request_id] = n
                    step.new_reqs.append(self._new_request_data(req, n))
                step.resumptions.append(Resumption(req.request_id, "swap_in", len(req.block_table), time.monotonic()))

    def _schedule_waiting(self, step: _Step) -> None:
        """Phase 3: admit waiting requests in queue order while budget, seats and free blocks allow.

        One request at a time, with seats for the siblings it will fork; nobody overtakes the head.
        """
        seats = self._seats_taken()
        while self.waiting and step.budget > 0:
            req = self.waiting.peek()
            req_seats = self._seats([req])
            if seats + req_seats > self.max_num_seqs:
                return
            hits = self.kv.find_cached_prefix(req)
            n = max(min(self._end(req, False) - len(hits) * self.kv.block_size, step.budget), 0)
            if self.kv.num_blocks_needed([(req, n)]) > self.kv.num_free_blocks:
                return
            if self.kv.allocate_slots(req, n, hits) is None:
                return  # enough free blocks but no run long enough (the contiguous baseline's external fragmentation)
            self.waiting.remove(req)
            if req.num_preemptions == 0:  # counted once, in the prefix-cache metrics at its first token
                req.num_cached_tokens = len(hits) * self.kv.block_size
            else:
                step.resumptions.append(Resumption(req.request_id, "recompute", len(hits), time.monotonic()))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seats += req_seats
            step.budget -= n
            step.num_scheduled[req.request_id] = n  # even 0: a leader whose prefix hits reach its fork point forks
            step.new_reqs.append(self._new_request_data(req, n))

    # ---- helpers -------------------------------------------------------------------------------

    def _take_tokens(self, group: list[Request], step: _Step, ahead: bool = False) -> list[tuple[Request, int]]:
        """Each member's tokens this step, taken from the budget in order (0 once it runs out)."""
        steps = []
        for req in group:
            n = max(min(self._end(req, ahead) - req.num_computed_tokens, step.budget), 0)
            step.budget -= n
            steps.append((req, n))
        return steps

    @staticmethod
    def _end(req: Request, ahead: bool) -> int:
        """Tokens the request's KV should cover after its next step.

        Its known tokens; a group leader stops at its fork point. Ahead of a step in flight, a
        request that step leaves with every known token computed is sampling one more (its id is
        not known yet, the worker has it): that one too, unless it is the last by ``max_tokens``
        (then the step in flight ends the request and nothing more is computed) or a beam's (beam
        search picks its next token from the step's result).
        """
        if req.pending_forks:
            return req.fork_point
        if (ahead and req.num_computed_tokens == req.num_tokens and req.num_output_tokens + 1 < req.sampling.max_tokens
                and not req.sampling.use_beam_search):  # beams: the control plane picks the tokens
            return req.num_tokens + 1
        return req.num_tokens

    def _seats_taken(self) -> int:
        """Seats of ``max_num_seqs`` in use: a running group holds its width (n, or the beam width), forks to come included."""
        groups = {id(r.group): r.group_width for r in self.running}
        return sum(groups.values())

    @staticmethod
    def _seats(group: list[Request]) -> int:
        """Seats ``group`` takes when it starts running: its width, unless a sibling runs already."""
        first = group[0]
        if any(m.status == RequestStatus.RUNNING for m in first.group):
            return 0
        return first.group_width

    @staticmethod
    def _live(req: Request, status: RequestStatus) -> list[Request]:
        """``req`` and its siblings in ``status``: a group runs, is preempted and resumes together."""
        return [m for m in req.group if m.status == status] or [req]

    def _new_request_data(self, req: Request, n: int) -> NewRequestData:
        req.in_worker = True
        req.unsent_token_ids = []  # the whole token list travels
        self.kv.take_replaced_blocks(req)  # the worker gets the whole table
        return NewRequestData(req.request_id, list(req.token_ids), req.num_prompt_tokens,
                              list(req.block_table), req.num_computed_tokens, n, req.sampling)

    def _preempt(self, group: list[Request], reason: str) -> None:
        """Preempt a victim and its running siblings together, by the mode the policy picks."""
        decision = self.policy.decide(group, reason, self.kv.num_free_cpu_blocks)
        self._preemptions.append(decision)
        if decision.mode == "swap":
            self._swaps_out += self.kv.swap_out(group)  # num_computed_tokens stays: that KV is on the host
        for req in group:
            self.running.remove(req)
            if decision.mode == "recompute":
                self.kv.free(req)
            req.status = RequestStatus.SWAPPED if decision.mode == "swap" else RequestStatus.WAITING
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._drop_from_worker(req)
        if decision.mode == "swap":
            for req in reversed(group):
                self.swapped.prepend(req)  # resumed before later arrivals
        else:
            self._requeue(group)

    def _requeue(self, group: list[Request]) -> None:
        """Put a group preempted by recompute back at the head of the waiting queue.

        With a prompt longer than one token its first member becomes the leader again: it
        recomputes the shared prompt and the others fork from it (`advance`), so the group shares
        its prompt blocks as when first admitted.
        """
        for req in group:
            req.status = RequestStatus.WAITING
        leader = group[0]
        if len(group) > 1 and leader.fork_point > 0:
            leader.pending_forks = group[1:] + leader.pending_forks
            group = [leader]
        for req in reversed(group):
            self.waiting.prepend(req)

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self._finished_ids.append(req.request_id)
            req.in_worker = False

    # ---- applying a step and ending requests ---------------------------------------------------

    def advance(self, step: ScheduledStep) -> None:
        """Count a step's tokens as computed, once it is sent: the worker computes steps in order,
        so the next step (scheduled before this one's result, or after) builds on them.

        A group leader that reached its fork point forks its siblings now: they share its blocks
        (reference counts up) and each computes the rest of its own tokens from there.
        """
        for rid, n in step.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += n
                if req.pending_forks and req.num_computed_tokens == req.fork_point:
                    children, req.pending_forks = req.pending_forks, []
                    self.fork(req, children)

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Start ``children`` from the running parent's blocks and progress, right behind it."""
        at = self.running.index(parent) + 1
        for k, child in enumerate(children):
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.running.insert(at + k, child)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request for good: free its blocks (device and host), tell the worker, forget it."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free_host(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            for child in req.pending_forks:  # its siblings wait on it: the next one leads them
                child.status = RequestStatus.WAITING
            if req.pending_forks:
                heir, *rest = req.pending_forks
                heir.pending_forks = rest + heir.pending_forks
                req.pending_forks = []
                self.waiting.prepend(heir)
        else:  # a sibling not forked yet
            for m in req.group:
                if req in m.pending_forks:
                    m.pending_forks.remove(req)
        req.status = status
        self.kv.free(req)
        self._drop_from_worker(req)
        del self.requests[req.request_id]
