"""The engine: the asyncio loop that joins requests, the scheduler and the worker.

One loop turns forever: apply aborts, ask the scheduler for a step plan, send it to the worker,
apply the sampled tokens (detokenize, check stop conditions, stream deltas to each request's
queue), free finished requests' blocks. The API and `pagedkv generate` talk to it through
`Engine.add_request`, an async iterator of `RequestOutput` deltas; closing that iterator early
aborts the request, so every block comes back whatever way a request ends.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagedkv.common.log import get_logger
from pagedkv.common.protocol import StepResult
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.common.tracing import RequestTracer, make_tracer
from pagedkv.scheduler.beam_search import BeamSearch
from pagedkv.scheduler.detokenizer import IncrementalDetokenizer
from pagedkv.scheduler.contiguous_allocator import ContiguousAllocator
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.metrics import Metrics
from pagedkv.scheduler.preemption import PreemptionPolicy
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.scheduler import ScheduledStep, Scheduler
from pagedkv.scheduler.swap import SwapSpace
from pagedkv.scheduler.tokenizer import Tokenizer
from pagedkv.scheduler.worker_client import WorkerClient, WorkerFailed

log = get_logger("pagedkv.engine")


def _child_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice ``index`` of a seeded n > 1 request; choice 0 keeps the request's own seed."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63


class TokenLogprob(msgspec.Struct):
    """A sampled token's log-probability (natural log) and the top alternatives (id, text, logprob)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[tuple[int, str, float]]


class RequestOutput(msgspec.Struct):
    """One streamed delta of one choice: the tokens and text new since the previous delta.

    finish_reason: None while running, then "stop" | "length" | "abort" | "error" (with ``error``).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


class _Stream:
    """Engine-side companion of one user request: its output queue, its choices and clocks.

    A request with n > 1 (or beam search) is served by several sibling `Request`s; each choice
    index gets its own detokenizer. The stream ends once all ``n`` choices have finished.
    """

    def __init__(self, request_id: str, params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.finished: set[int] = set()  # choice indices
        self.members: list[Request] = []  # every sequence ever created for it
        self.beam: BeamSearch | None = None
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time = arrival_time
        self.span = None  # its OpenTelemetry span, when tracing is on

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n


class Engine:
    """A running engine: control-plane state plus one worker process.

    Create with `await Engine.start(config)`; stop with `await engine.shutdown()`.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                 client: WorkerClient, num_gpu_blocks: int, num_cpu_blocks: int):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.client = client
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        self.random_weights = model_config.path is None or config.load_format == "dummy"
        self.num_cpu_blocks = num_cpu_blocks
        if config.kv_allocator == "contiguous":  # the pre-paging baseline, for `pagedkv bench`
            self.kv = ContiguousAllocator(num_gpu_blocks, config.block_size, self.max_model_len)
        else:
            self.kv = KVCacheManager(num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                                     config.prefix_caching_hash_algo)
        # swap needs the paged pool's block tables; the contiguous baseline recomputes
        swap = SwapSpace(num_cpu_blocks, self.kv.pool) if isinstance(self.kv, KVCacheManager) else None
        policy = PreemptionPolicy(config.preemption_mode, config.scheduling_policy, swap)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, policy)
        self.metrics = Metrics(model_config.name)
        self.tracer: RequestTracer | None = None
        self._streams: dict[str, _Stream] = {}  # user request id -> stream
        self._owner: dict[str, _Stream] = {}  # sequence (Request) id -> its user request's stream
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: str | None = None

    @classmethod
    async def start(cls, config: EngineConfig, *, worker_address: str | None = None,
                    external_worker: bool = False, tracer: RequestTracer | None = None) -> "Engine":
        """Read the model config and tokenizer, start the worker, size the KV pool, start the loop.

        Raises FileNotFoundError/ValueError for a bad model directory, WorkerFailed when the
        worker cannot start or load the model.
        """
        model_config = ModelConfig.load(config.model)
        resolve_max_model_len(model_config, config.max_model_len)  # fail before spawning anything
        tokenizer = Tokenizer.load(model_config)
        tracer = tracer or make_tracer(config.otlp_traces_endpoint)  # None: tracing off
        client = WorkerClient(config, worker_address, spawn=not external_worker)
        try:
            hello = await client.start()
            num_gpu_blocks = config.num_gpu_blocks or hello.max_num_gpu_blocks
            if num_gpu_blocks < 1:
                raise WorkerFailed(f"no room for a single KV block on {hello.device} "
                                   "(raise --gpu-memory-utilization or --cpu-kv-cache-space)")
            num_cpu_blocks = int(config.swap_space * 2**30) // hello.kv_bytes_per_block
            await client.init_cache(num_gpu_blocks, num_cpu_blocks)
        except BaseException:
            await client.close()
            raise
        engine = cls(config, model_config, tokenizer, client, num_gpu_blocks, num_cpu_blocks)
        engine.device = hello.device
        engine.swap_bandwidth = hello.swap_bandwidth
        engine.scheduler.policy.kv_bytes_per_block = hello.kv_bytes_per_block  # the cost model's inputs
        if hello.swap_bandwidth:
            engine.scheduler.policy.swap_bandwidth = hello.swap_bandwidth
        engine.tracer = tracer
        engine._task = asyncio.create_task(engine._loop(), name="pagedkv-engine-loop")
        log.info("engine started", model=model_config.name, random_weights=engine.random_weights,
                 device=hello.device, dtype=hello.dtype, block_size=config.block_size,
                 num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                 kv_bytes_per_block=hello.kv_bytes_per_block, max_model_len=engine.max_model_len)
        return engine

    @property
    def healthy(self) -> bool:
        return self._error is None and self._task is not None and not self._task.done()

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, priority: int = 0, cache_salt: str | None = None,
                    traceparent: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the async iterator of its output deltas (all choices).

        traceparent: the client's W3C Trace Context header; the request's span continues that trace.

        n > 1 samples n sequences that share the prompt's blocks; ``use_beam_search`` returns the
        n best beams, all at the end. Raises ValueError("<field>: <why>") when the request can
        never be served, RuntimeError when the engine has failed. Closing the iterator before
        the end aborts the request.
        """
        if not self.healthy:
            raise RuntimeError(f"engine is not serving: {self._error or 'stopped'}")
        self._validate(prompt_token_ids, params)
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        stream = _Stream(request_id, params, time.monotonic())
        group: list[Request] = []

        def member(rid: str, sampling: SamplingParams, index: int) -> Request:
            req = Request(rid, prompt_token_ids, sampling, stream.arrival_time, priority, cache_salt, group, index)
            stream.members.append(req)
            self._owner[rid] = stream
            return req

        if params.use_beam_search:
            # as transformers: keep max(2, 1 + #eos) x width candidates, so width survive the EOS ones
            keep = max(2, 1 + len(self.tokenizer.eos_token_ids)) * params.n
            beam_params = SamplingParams(temperature=0, max_tokens=params.max_tokens, logprobs=keep,
                                         use_beam_search=True, ignore_eos=True)
            leader = member(f"{request_id}-beam0", beam_params, 0)
            stream.beam = BeamSearch(params.n, params.max_tokens, params.length_penalty, params.early_stopping,
                                     self.tokenizer.eos_token_ids, len(prompt_token_ids), leader.request_id)
            members = [leader]
        else:
            members = [member(request_id if params.n == 1 else f"{request_id}-{i}",
                              msgspec.structs.replace(params, n=1, seed=_child_seed(params.seed, i)), i)
                       for i in range(params.n)]
            for req in members:
                stream.detoks[req.index] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                                                  params.stop, params.skip_special_tokens)
        if len(members) > 1 and len(prompt_token_ids) > 1:  # siblings fork at the prompt's last token
            members[0].pending_forks = members[1:]
            members = members[:1]
        self._streams[request_id] = stream
        if self.tracer is not None:
            stream.span = self.tracer.start_request(request_id, self.model_config.name, len(prompt_token_ids),
                                                    stream.arrival_time, traceparent,
                                                    attributes={"gen_ai.request.choice.count": params.n,
                                                                "gen_ai.request.max_tokens": params.max_tokens})
        for req in members:
            self.scheduler.add(req)
        self._wake.set()
        return self._iterate(stream)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.config.kv_allocator == "contiguous" and (params.n > 1 or params.use_beam_search):
            raise ValueError("n: the contiguous KV allocator cannot share blocks; n > 1 and beam search "
                             "need --kv-allocator paged")
        params.validate(max_logprobs=self.config.max_logprobs, max_n=self.config.max_n)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if bad := next((t for t in prompt_token_ids if not 0 <= t < vocab), None):
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        if n > self.max_model_len:
            raise ValueError(f"prompt: {n} tokens is longer than max_model_len ({self.max_model_len})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len})")
        if params.use_beam_search and params.stop:
            raise ValueError("stop: stop strings are not supported with beam search (EOS and max_tokens end beams)")
        per_seq = self.kv.blocks_needed(n + params.max_tokens)
        if params.use_beam_search:
            need = params.n * per_seq  # beams wait for each other: all must fit unshared
        else:  # the full blocks before the fork point are shared by all n
            shared = (n - 1) // self.kv.block_size if params.n > 1 else 0
            need = shared + params.n * (per_seq - shared)
        if need > self.kv.num_gpu_blocks:
            raise ValueError(f"prompt: prompt + max_tokens needs {need} KV blocks but the whole pool "
                             f"has {self.kv.num_gpu_blocks} (block_size {self.kv.block_size})")

    async def _iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while not (stream.done and stream.queue.empty()):
                yield await stream.queue.get()
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (applied between steps); its blocks come back. Unknown ids are ignored."""
        if request_id in self._streams:
            self._aborts.add(request_id)
            self._wake.set()

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                self._apply_aborts()
                if not (self.scheduler.waiting or self.scheduler.running or self.scheduler.swapped):
                    self._publish_gauges()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                step = self.scheduler.schedule()
                self._record_preemptions(step)
                try:
                    result = await self.client.step(step.plan)
                except WorkerFailed as e:
                    self._fail_all(str(e))
                    return
                if result.error is not None:
                    log.error("step failed", step_id=result.step_id, error=result.error)
                    failed = {self._owner[rid] for rid in step.num_scheduled_tokens if rid in self._owner}
                    for stream in failed:
                        self._end_stream(stream, RequestStatus.FINISHED_ERROR, f"worker error: {result.error}")
                    continue
                self.scheduler.policy.prefill.observe(step.plan, result.forward_seconds)
                self.scheduler.advance(step)
                self._apply_result(result)
                self._publish_gauges()
        except Exception as e:  # a bug in the control plane must not leave clients hanging
            log.exception("engine loop crashed")
            self._fail_all(f"engine loop crashed: {e!r}")

    def _publish_gauges(self) -> None:
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             self.kv.usage, self.kv.pool.num_cached_free_blocks)
        swap = self.scheduler.policy.swap
        self.metrics.on_host_pool(len(self.scheduler.swapped), swap.usage if swap else 0.0)

    def _record_preemptions(self, step: ScheduledStep) -> None:
        """Count, log and trace a step's preemptions (one per preempted sequence), resumptions and swaps."""
        self.metrics.on_swap(len(step.plan.blocks_to_swap_out), len(step.plan.blocks_to_swap_in))
        for p in step.preemptions:
            log.info("preempted", request_ids=p.request_ids, mode=p.mode, reason=p.reason, num_blocks=p.num_blocks,
                     num_tokens=p.num_tokens, swap_cost_s=p.swap_cost_s, recompute_cost_s=p.recompute_cost_s,
                     **({"fallback": p.fallback} if p.fallback else {}))
            for rid in p.request_ids:
                self.metrics.on_preemption(p.mode)
                stream = self._owner.get(rid)
                if self.tracer is not None and stream is not None and stream.span is not None:
                    self.tracer.preempt(stream.span, rid, p)
        if self.tracer is not None:
            for r in step.resumptions:
                self.tracer.resume(r.request_id, r.mode, r.num_blocks, r.time)

    def _apply_aborts(self) -> None:
        for rid in self._aborts:
            if (stream := self._streams.get(rid)) is not None:
                self._end_stream(stream, RequestStatus.FINISHED_ABORTED)
        self._aborts.clear()

    def _apply_result(self, result: StepResult) -> None:
        now = time.monotonic()
        for sampled in result.sampled:
            req = self.scheduler.requests.get(sampled.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            stream = self._owner[req.request_id]
            first = stream.first_token_time is None
            if first:
                stream.first_token_time = now
                self.metrics.on_admitted(req.num_prompt_tokens, req.num_cached_tokens)
            self.metrics.on_token(first, now - stream.last_token_time)
            stream.last_token_time = now
            if stream.beam is not None:
                self._beam_report(stream, req, sampled.top_logprobs or [])
            else:
                self._sampled(stream, req, sampled)

    def _sampled(self, stream: _Stream, req: Request, sampled) -> None:
        """Append a sampled token to one sequence, detokenize, check its stop conditions, stream it."""
        params, token, detok = req.sampling, sampled.token_id, stream.detoks[req.index]
        req.token_ids.append(token)
        status = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
            status, text = RequestStatus.FINISHED_STOPPED, detok.flush()
        else:
            text = detok.append(token)
            if detok.stopped:
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                status = RequestStatus.FINISHED_LENGTH
                text += detok.flush()
        logprobs = None
        if params.logprobs is not None and sampled.logprob is not None:
            tok = self.tokenizer.token_to_str
            logprobs = [TokenLogprob(token, tok(token), sampled.logprob,
                                     [(t, tok(t), lp) for t, lp in sampled.top_logprobs or []])]
        stream.queue.put_nowait(self._output(stream, req, req.index, [token], text, logprobs, status))
        if status is not None:
            self.scheduler.finish(req, status)
            stream.finished.add(req.index)
            if stream.done:
                self._close(stream, status)

    def _beam_report(self, stream: _Stream, req: Request, top_logprobs: list[tuple[int, float]]) -> None:
        """Collect one beam's candidates; once all beams reported, fork, extend and drop beams."""
        search = stream.beam
        if not search.report(req.request_id, top_logprobs):
            return
        live = {rid: self.scheduler.requests[rid] for rid in search.cum_logprob}
        bases = {rid: list(r.token_ids) for rid, r in live.items()}
        chosen = search.step({rid: r.output_token_ids for rid, r in live.items()})
        kept: set[str] = set()
        for parent_id, token, cum in chosen:
            parent = live[parent_id]
            if parent_id not in kept:  # the first child continues in the parent's own blocks
                kept.add(parent_id)
                parent.token_ids.append(token)
                parent.unsent_token_ids.append(token)
                search.set_beam(parent_id, cum)
                continue
            child = Request(f"{stream.request_id}-beam{len(stream.members)}", parent.prompt_token_ids,
                            parent.sampling, stream.arrival_time, parent.priority, parent.cache_salt,
                            parent.group, len(stream.members))
            child.token_ids = bases[parent_id] + [token]
            stream.members.append(child)
            self._owner[child.request_id] = stream
            self.scheduler.fork(parent, [child])
            search.set_beam(child.request_id, cum)
        for rid, beam in live.items():
            if rid not in kept:  # a beam without children gives its blocks back
                self.scheduler.finish(beam, RequestStatus.FINISHED_STOPPED)
        if search.done:
            for i, hyp in enumerate(search.results()):
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, [],
                                               stream.params.skip_special_tokens)
                text = "".join(detok.append(t) for t in hyp.token_ids) + detok.flush()
                status = RequestStatus.FINISHED_STOPPED if hyp.ended_with_eos else RequestStatus.FINISHED_LENGTH
                stream.queue.put_nowait(RequestOutput(stream.request_id, i, hyp.token_ids, text, None,
                                                      status.finish_reason, None, req.num_prompt_tokens,
                                                      len(hyp.token_ids), req.num_cached_tokens))
                stream.finished.add(i)
            self._end_stream(stream, RequestStatus.FINISHED_LENGTH)

    def _output(self, stream: _Stream, req: Request, index: int, token_ids: list[int], text: str,
                logprobs, status, error: str | None = None) -> RequestOutput:
        return RequestOutput(stream.request_id, index, token_ids, text, logprobs,
                             status.finish_reason if status else None, error, req.num_prompt_tokens,
                             req.num_output_tokens, req.num_cached_tokens)

    def _end_stream(self, stream: _Stream, status: RequestStatus, error: str | None = None) -> None:
        """Finish every live sequence of a request; unfinished choices get a final delta with ``status``."""
        for req in stream.members:
            if req.request_id in self.scheduler.requests:
                self.scheduler.finish(req, status)
        first = stream.members[0]
        for index in range(stream.n):
            if index not in stream.finished:
                req = next((m for m in stream.members if m.index == index), first)
                stream.queue.put_nowait(self._output(stream, req, index, [], "", None, status, error))
                stream.finished.add(index)
        self._close(stream, status, error)

    def _close(self, stream: _Stream, status: RequestStatus, error: str | None = None) -> None:
        """Forget a finished request and write its one log line."""
        self._streams.pop(stream.request_id, None)
        for req in stream.members:
            self._owner.pop(req.request_id, None)
        now = time.monotonic()
        self.metrics.on_finished(status.finish_reason, now - stream.arrival_time)
        self.metrics.on_request_preemptions(sum(m.num_preemptions for m in stream.members))
        if stream.span is not None:
            self.tracer.end_request(stream.span, [m.request_id for m in stream.members],
                                    sum(m.num_output_tokens for m in stream.members if m.index < stream.n),
                                    status.finish_reason, stream.arrival_time, stream.first_token_time, error)
        ttft = None if stream.first_token_time is None else round(stream.first_token_time - stream.arrival_time, 6)
        first = stream.members[0]
        log.info("request finished", request_id=stream.request_id, finish_reason=status.finish_reason,
                 n=stream.n, prompt_tokens=first.num_prompt_tokens,
                 completion_tokens=sum(m.num_output_tokens for m in stream.members if m.index < stream.n),
                 cached_tokens=first.num_cached_tokens, ttft_s=ttft, e2e_s=round(now - stream.arrival_time, 6),
                 num_preemptions=sum(m.num_preemptions for m in stream.members),
                 **({"error": error} if error else {}))

    def _fail_all(self, error: str) -> None:
        """The worker is gone: fail every request with a clear message; the engine stops serving."""
        self._error = error
        log.error("engine failed", error=error)
        for stream in list(self._streams.values()):
            self._end_stream(stream, RequestStatus.FINISHED_ERROR, error)

    # ---- introspection and shutdown -------------------------------------------------------

    def kv_cache_snapshot(self) -> dict:
        """JSON-ready state of the block pool and every live request's block table."""
        snap = self.kv.snapshot()
        snap["num_cpu_blocks"] = self.num_cpu_blocks
        swap = self.scheduler.policy.swap
        snap["num_free_cpu_blocks"] = swap.num_free_cpu_blocks if swap else self.num_cpu_blocks
        snap["cpu_usage"] = swap.usage if swap else 0.0
        snap["num_requests_swapped"] = len(self.scheduler.swapped)
        snap["swapped_requests"] = [
            {"id": r.request_id, "num_computed_tokens": r.num_computed_tokens,
             "host_block_table": list(swap.host_tables.get(r.request_id, []))}
            for r in self.scheduler.swapped
        ]
        snap["num_requests_running"] = len(self.scheduler.running)
        snap["num_requests_waiting"] = len(self.scheduler.waiting)
        snap["requests"] = [
            {"id": r.request_id, "status": r.status.value, "num_tokens": r.num_tokens,
             "num_computed_tokens": r.num_computed_tokens, "block_table": list(r.block_table),
             "num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.sampling.max_tokens}
            for r in self.scheduler.requests.values()
        ]
        return snap

    async def shutdown(self) -> None:
        """Abort everything, stop the loop, stop the worker."""
        if self._task is not None and not self._task.done():
            for rid in list(self._streams):
                self.abort(rid)
            self._apply_aborts()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.client.close()
        if self.tracer is not None:
            self.tracer.shutdown()  # flush batched spans
