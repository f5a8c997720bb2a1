"""The scheduler: continuous batching with FCFS admission and recompute preemption.

Each step spends a token budget of ``max_num_batched_tokens`` across at most ``max_num_seqs``
requests. Running requests go first, in admission order, each asking for the tokens it has not
computed yet (1 when decoding, the rest of its prompt when prefilling, in chunks if the budget is
short). When one cannot get a block, the most recently admitted running request is preempted
(recompute: its blocks are freed and it returns to the head of the waiting queue, to recompute
prompt + generated tokens later) — until the blocks suffice or the request itself was the victim.
If nothing was preempted, waiting requests are then admitted first-come first-served while the
budget, ``max_num_seqs`` and the free blocks allow. (PagedAttention, Kwon et al., SOSP 2023, §4.5.)
"""

from __future__ import annotations

from collections import deque

import msgspec

from common.protocol import CachedRequestData, NewRequestData, StepPlan
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus


class ScheduledStep(msgspec.Struct):
    """A step plan plus what the control plane needs to apply its result."""

    plan: StepPlan
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    preempted: list[Request]


class Scheduler:
    """Owns the waiting and running queues and turns them into step plans."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # the worker must drop these mirrors in the next plan
        self._step_id = 0
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []

        # 1. running requests, oldest admission first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while (new_blocks := self.kv.allocate_slots(req, n)) is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break  # req preempted itself; everything after it is gone too
            num_scheduled[req.request_id] = n
            budget -= n
            if req.in_worker:
                replaced = self.kv.replaced_blocks.pop(req.request_id, [])
                cached_reqs.append(CachedRequestData(req.request_id, new_blocks, n, replaced_block_ids=replaced))
            else:  # resumed after preemption within the running queue (not reachable today)
                new_reqs.append(self._new_request_data(req, n))
            i += 1

        # 2. admit waiting requests FCFS, unless this step already had to preempt
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            n = min(req.num_tokens - req.num_computed_tokens - len(hits) * self.kv.block_size, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * self.kv.block_size
                self.kv.record_prefix_query(req.num_prompt_tokens, req.num_cached_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            new_reqs.append(self._new_request_data(req, n))

        self._step_id += 1
        plan = StepPlan(step_id=self._step_id, new_requests=new_reqs, cached_requests=cached_reqs,
                        finished_request_ids=self._finished_ids,
                        blocks_to_copy=self.kv.take_pending_copies())
        self._finished_ids = []
        return ScheduledStep(plan, num_scheduled, preempted)

    def _new_request_data(self, req: Request, n: int) -> NewRequestData:
        req.in_worker = True
        self.kv.replaced_blocks.pop(req.request_id, None)  # the worker gets the whole table
        return NewRequestData(req.request_id, list(req.token_ids), req.num_prompt_tokens,
                              list(req.block_table), req.num_computed_tokens, n, req.sampling)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block, requeue at the head of the waiting queue."""
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._drop_from_worker(req)
        self.waiting.appendleft(req)

    def _drop_from_worker(self, req: Request) -> None:
        if req.in_worker:
            self._finished_ids.append(req.request_id)
            req.in_worker = False

    def advance(self, step: ScheduledStep) -> None:
        """Apply a completed step: each scheduled request computed its scheduled tokens."""
        for rid, n in step.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += n

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request for good: free its blocks, tell the worker, forget it."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.kv.forget(req)
        self._drop_from_worker(req)
        del self.requests[req.request_id]
