"""The scheduler: continuous batching with FCFS or priority admission, recompute or swap preemption.

Each step spends a token budget of ``max_num_batched_tokens`` across at most ``max_num_seqs``
requests. Running requests go first, in admission order, each asking for the tokens it has not
computed yet (1 when decoding, the rest of its prompt when prefilling, in chunks if the budget is
short). When one cannot get a block, a victim chosen by the policy (FCFS: the most recently
admitted) is preempted with its siblings — by recompute (its blocks are freed and it returns to the
head of the waiting queue, to recompute prompt + generated tokens later) or by swap (its blocks move
to the host pool) — until the blocks suffice or the request itself was the victim.
If nothing was preempted, swapped-out requests are swapped back in first, then waiting requests
are admitted first-come first-served while the budget, ``max_num_seqs`` and the free blocks allow.
Victim and mode (recompute or swap) are `scheduler.preemption` policy; host blocks are
`scheduler.swap` accounting. A step never swaps both ways: a host block freed by a swap-in could
be overwritten by a swap-out in the same plan. (PagedAttention, Kwon et al., SOSP 2023, §4.5.)
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.preemption import Preemption, PreemptionPolicy, Resumption, enqueue
from pagedkv.scheduler.request import Request, RequestStatus


class ScheduledStep(msgspec.Struct):
    """A step plan plus what the control plane needs to apply its result."""

    plan: StepPlan
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    preempted: list[Request]
    preemptions: list[Preemption] = []  # how each group in ``preempted`` was preempted, and why
    resumptions: list[Resumption] = []  # preempted requests that run again in this step


class Scheduler:
    """Owns the waiting and running queues and turns them into step plans."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: PreemptionPolicy | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy or PreemptionPolicy()  # default: FCFS, recompute only
        self.swapped: deque[Request] = deque()  # swapped out, in resumption order
        self._swaps_out: list[tuple[int, int]] = []  # (device, host) pairs for the next plan
        self._preemptions: list[Preemption] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # the worker must drop these mirrors in the next plan
        self._step_id = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a request; its ``pending_forks`` siblings join when it reaches its fork point."""
        self.requests[request.request_id] = request
        for child in request.pending_forks:
            self.requests[child.request_id] = child
        enqueue(self.waiting, request, self.policy)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        chosen: dict[str, tuple[Request, int, int]] = {}  # id -> (request, tokens, blocks it takes)
        need = 0  # blocks the chosen requests take
        preempted: list[Request] = []

        # 1. running requests, oldest admission first. Blocks are counted first and allocated
        # after, so a preempted group never leaves half-scheduled members behind.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:  # a beam waiting for its siblings' results
                i += 1
                continue
            blocks = self.kv.num_blocks_to_allocate(req, n)
            num_preempted = len(preempted)
            while need + blocks > self.kv.num_free_blocks:
                victims = self._group_running(self.policy.victim(self.running))
                for victim in victims:
                    if (c := chosen.pop(victim.request_id, None)) is not None:
                        budget += c[1]
                        need -= c[2]
                self._preempt_group(victims, f"kv_cache_full: no free block for {req.request_id}")
                preempted.extend(victims)
                if req.status != RequestStatus.RUNNING:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself; everything after it is gone too
            chosen[req.request_id] = (req, n, blocks)
            budget -= n
            need += blocks
            # a group preemption may have removed members before req: find it again (rare)
            i = i + 1 if len(preempted) == num_preempted else self.running.index(req) + 1

        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        for req, n, _ in chosen.values():
            new_blocks = self.kv.allocate_slots(req, n)
            assert new_blocks is not None, "blocks were counted before allocation"
            num_scheduled[req.request_id] = n
            if req.in_worker:
                replaced = self.kv.replaced_blocks.pop(req.request_id, [])
                cached_reqs.append(CachedRequestData(req.request_id, new_blocks, n, req.unsent_token_ids,
                                                     replaced))
                req.unsent_token_ids = []
            else:  # forked this step (n > 1, beam search): the worker gets it whole
                new_reqs.append(self._new_request_data(req, n))

        # 2. swap swapped-out requests back in, oldest first, unless this step preempted
        resumptions: list[Resumption] = []
        swaps_in: list[tuple[int, int]] = []
        while not preempted and self.swapped and budget > 0:
            if (resumed := self._swap_in(self._group_swapped(self.swapped[0]), budget, swaps_in)) is None:
                break
            for req, n in resumed:
                resumptions.append(Resumption(req.request_id, "swap_in", len(req.block_table), time.monotonic()))
                if n:
                    num_scheduled[req.request_id] = n
                    budget -= n
                    new_reqs.append(self._new_request_data(req, n))

        # 3. admit waiting requests FCFS once nobody is swapped out, unless this step already had
        # to preempt; a group of siblings is admitted all together or not at all
        while not preempted and not self.swapped and self.waiting and budget > 0:
            group = self._group_waiting(self.waiting[0])
            if len(self.running) + len(group) > self.max_num_seqs:
                break
            if len(group) > 1 and sum(self.kv.blocks_needed(m.num_tokens) for m in group) > self.kv.num_free_blocks:
                break
            for req in group:
                hits = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
                n = self._num_new_tokens(req, budget, len(hits) * self.kv.block_size)
                if self.kv.allocate_slots(req, n, hits) is None:
                    break  # only a lone request can fail here: FCFS, nobody overtakes it
                self.waiting.remove(req)
                if req.num_preemptions == 0:  # counted once, in the prefix-cache metrics at its first token
                    req.num_cached_tokens = len(hits) * self.kv.block_size
                else:
                    resumptions.append(Resumption(req.request_id, "recompute", len(hits), time.monotonic()))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                num_scheduled[req.request_id] = n
                budget -= n
                new_reqs.append(self._new_request_data(req, n))
            else:
                continue
            break

        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, new_requests=new_reqs, cached_requests=cached_reqs,
                        finished_request_ids=self._finished_ids, blocks_to_swap_out=self._swaps_out,
                        blocks_to_swap_in=swaps_in, blocks_to_copy=self.kv.take_pending_copies())
        self._finished_ids, self._swaps_out = [], []
        preemptions, self._preemptions = self._preemptions, []
        return ScheduledStep(plan, num_scheduled, preempted, preemptions, resumptions)

    def _num_new_tokens(self, req: Request, budget: int, num_cached: int = 0) -> int:
        """Tokens to compute this step: the rest, within the budget; a group leader stops at its fork point."""
        computed = req.num_computed_tokens + num_cached
        end = req.fork_point if req.pending_forks else req.num_tokens
        return max(min(end - computed, budget), 0)

    def _group_waiting(self, req: Request) -> list[Request]:
        """``req`` and its siblings in the waiting queue (not those still waiting to be forked)."""
        if len(req.group) == 1:
            return [req]
        queued = set(map(id, self.waiting))
        return [m for m in req.group if m.status == RequestStatus.WAITING and id(m) in queued]

    def _group_running(self, req: Request) -> list[Request]:
        """``req`` and its running siblings: preemption takes a group all or nothing."""
        return [m for m in req.group if m.status == RequestStatus.RUNNING] or [req]

    def _new_request_data(self, req: Request, n: int) -> NewRequestData:
        req.in_worker = True
        req.unsent_token_ids = []  # the whole token list travels
        self.kv.replaced_blocks.pop(req.request_id, None)  # the worker gets the whole table
        return NewRequestData(req.request_id, list(req.token_ids), req.num_prompt_tokens,
                              list(req.block_table), req.num_computed_tokens, n, req.sampling)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block, requeue at the head of the waiting queue."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._drop_from_worker(req)
        enqueue(self.waiting, req, self.policy, front=True)

    def _preempt_group(self, group: list[Request], reason: str) -> None:
        """Preempt a victim and its running siblings together, by the mode the policy picks."""
        decision = self.policy.decide(group, reason)
        self._preemptions.append(decision)
        if decision.mode == "recompute":
            for req in group:
                self._preempt(req)
            return
        self._swaps_out += self.policy.swap.swap_out(group)
        for req in group:  # swap: the blocks went to the host pool; num_computed_tokens stays
            self.running.remove(req)
            self.kv.replaced_blocks.pop(req.request_id, None)  # the worker gets the whole table back
            req.status = RequestStatus.SWAPPED
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._drop_from_worker(req)
            enqueue(self.swapped, req, self.policy, front=True)  # resumed before later arrivals

    def _group_swapped(self, req: Request) -> list[Request]:
        """``req`` and its swapped-out siblings: they went out together and come back together."""
        return [m for m in req.group if m.status == RequestStatus.SWAPPED] or [req]

    def _swap_in(self, group: list[Request], budget: int,
                 pairs: list[tuple[int, int]]) -> list[tuple[Request, int]] | None:
        """Swap a group back in and give each member this step's blocks; None when it does not fit.

        Counts first (its host blocks, the blocks its next tokens take, the copy-on-write copies of
        shared partly filled blocks), so nothing changes unless everything fits. Returns each
        member with its tokens this step (0 when the budget ran out: it runs next step). A group
        that cannot fit even with nothing running gives up its host copy and is recomputed instead.
        """
        swap, bs = self.policy.swap, self.kv.block_size
        need = swap.num_blocks_to_swap_in(group)
        tokens, left, writers = [], budget, {}
        for req in group:
            n = self._num_new_tokens(req, left)
            table = swap.host_tables[req.request_id]
            need += max(self.kv.blocks_needed(req.num_computed_tokens + n) - len(table), 0)
            if n and (index := req.num_computed_tokens // bs) < len(table):
                writers[table[index]] = writers.get(table[index], 0) + 1
            tokens.append(n)
            left -= n
        # a block k tables share, written by w of them: min(w, k - 1) copies (the last writer keeps it)
        need += sum(min(w, swap.host.blocks[h].ref_cnt - 1) for h, w in writers.items())
        if need > self.kv.num_free_blocks or len(self.running) + len(group) > self.max_num_seqs:
            if not self.running:
                for req in group:
                    self.swapped.remove(req)
                    swap.free(req)
                    req.status, req.num_computed_tokens = RequestStatus.WAITING, 0
                    enqueue(self.waiting, req, self.policy, front=True)
            return None
        pairs += swap.swap_in(group)
        for req, n in zip(group, tokens):
            self.swapped.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if n:
                assert self.kv.allocate_slots(req, n) is not None, "blocks were counted before allocation"
        return list(zip(group, tokens))

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self._finished_ids.append(req.request_id)
            req.in_worker = False

    def advance(self, step: ScheduledStep) -> None:
        """Apply a completed step: each scheduled request computed its scheduled tokens.

        A group leader that reached its fork point forks its siblings now: they share its blocks
        (reference counts up) and each computes the prompt's last token itself next step.
        """
        for rid, n in step.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += n
                if req.pending_forks and req.num_computed_tokens == req.fork_point:
                    self.fork(req, req.pending_forks)
                    req.pending_forks = []

    def fork(self, parent: Request, children: list[Request]) -> None:
        """Start ``children`` from the parent's blocks and progress, right behind it in its queue."""
        queue = self.running if parent.status == RequestStatus.RUNNING else self.waiting
        at = list(queue).index(parent) + 1
        for k, child in enumerate(children):
            self.kv.fork(parent, child)
            child.status = parent.status
            self.requests[child.request_id] = child
            queue.insert(at + k, child)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request for good: free its blocks, tell the worker, forget it."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.policy.swap.free(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # a sibling not forked yet
            for m in req.group:
                if req in m.pending_forks:
                    m.pending_forks.remove(req)
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
        self._drop_from_worker(req)
        del self.requests[req.request_id]
