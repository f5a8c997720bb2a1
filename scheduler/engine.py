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

from common.config import EngineConfig, ModelConfig, resolve_max_model_len
from common.log import get_logger
from common.protocol import StepResult
from common.sampling_params import SamplingParams
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.contiguous_allocator import ContiguousAllocator
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.metrics import Metrics
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import ScheduledStep, Scheduler
from scheduler.tokenizer import Tokenizer
from scheduler.worker_client import WorkerClient, WorkerFailed

log = get_logger("pagedkv.engine")


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
    """Engine-side companion of a request: its output queue, detokenizer and clocks."""

    def __init__(self, req: Request, detok: IncrementalDetokenizer):
        self.req = req
        self.detok = detok
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.last_token_time = req.arrival_time


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
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.metrics = Metrics(model_config.name)
        self._streams: dict[str, _Stream] = {}
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._error: str | None = None

    @classmethod
    async def start(cls, config: EngineConfig, *, worker_address: str | None = None,
                    external_worker: bool = False) -> "Engine":
        """Read the model config and tokenizer, start the worker, size the KV pool, start the loop.

        Raises FileNotFoundError/ValueError for a bad model directory, WorkerFailed when the
        worker cannot start or load the model.
        """
        model_config = ModelConfig.load(config.model)
        resolve_max_model_len(model_config, config.max_model_len)  # fail before spawning anything
        tokenizer = Tokenizer.load(model_config)
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
                    request_id: str | None = None, *, priority: int = 0,
                    cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the async iterator of its output deltas.

        Raises ValueError("<field>: <why>") when the request can never be served, RuntimeError
        when the engine has failed. Closing the iterator before the end aborts the request.
        """
        if not self.healthy:
            raise RuntimeError(f"engine is not serving: {self._error or 'stopped'}")
        self._validate(prompt_token_ids, params)
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        req = Request(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                       params.skip_special_tokens)
        stream = _Stream(req, detok)
        self._streams[request_id] = stream
        self.scheduler.add(req)
        self._wake.set()
        return self._iterate(stream)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self.config.kv_allocator == "contiguous" and (params.n > 1 or params.use_beam_search):
            raise ValueError("n: the contiguous KV allocator cannot share blocks; n > 1 and beam search "
                             "need --kv-allocator paged")
        params.validate(max_logprobs=self.config.max_logprobs, max_n=1)
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
        need = self.kv.blocks_needed(n + params.max_tokens)
        if need > self.kv.num_gpu_blocks:
            raise ValueError(f"prompt: prompt + max_tokens needs {need} KV blocks but the whole pool "
                             f"has {self.kv.num_gpu_blocks} (block_size {self.kv.block_size})")

    async def _iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        rid = stream.req.request_id
        try:
            while True:
                out = await stream.queue.get()
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            if not stream.req.is_finished:
                self.abort(rid)

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
                if not (self.scheduler.waiting or self.scheduler.running):
                    self._publish_gauges()
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                step = self.scheduler.schedule()
                for victim in step.preempted:
                    self.metrics.on_preemption("recompute")
                    log.info("preempted", request_id=victim.request_id, mode="recompute",
                             num_tokens=victim.num_tokens, num_preemptions=victim.num_preemptions)
                try:
                    result = await self.client.step(step.plan)
                except WorkerFailed as e:
                    self._fail_all(str(e))
                    return
                if result.error is not None:
                    log.error("step failed", step_id=result.step_id, error=result.error)
                    for rid in step.num_scheduled_tokens:
                        self._finish(self.scheduler.requests[rid], RequestStatus.FINISHED_ERROR,
                                     error=f"worker error: {result.error}")
                    continue
                self.scheduler.advance(step)
                self._apply_result(step, result)
                self._publish_gauges()
        except Exception as e:  # a bug in the control plane must not leave clients hanging
            log.exception("engine loop crashed")
            self._fail_all(f"engine loop crashed: {e!r}")

    def _publish_gauges(self) -> None:
        self.metrics.on_step(len(self.scheduler.running), len(self.scheduler.waiting),
                             self.kv.usage, self.kv.pool.num_cached_free_blocks)

    def _apply_aborts(self) -> None:
        for rid in self._aborts:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._aborts.clear()

    def _apply_result(self, step: ScheduledStep, result: StepResult) -> None:
        now = time.monotonic()
        for sampled in result.sampled:
            req = self.scheduler.requests.get(sampled.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            stream = self._streams[req.request_id]
            params = req.sampling
            token = sampled.token_id
            req.token_ids.append(token)
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
                self.metrics.on_admitted(req.num_prompt_tokens, req.num_cached_tokens)
            self.metrics.on_token(first, now - stream.last_token_time)
            stream.last_token_time = now

            status = None
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids):
                status, text = RequestStatus.FINISHED_STOPPED, stream.detok.flush()
            else:
                text = stream.detok.append(token)
                if stream.detok.stopped:
                    status = RequestStatus.FINISHED_STOPPED
                elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
                    status = RequestStatus.FINISHED_LENGTH
                    text += stream.detok.flush()
            logprobs = None
            if params.logprobs is not None and sampled.logprob is not None:
                tok = self.tokenizer.token_to_str
                logprobs = [TokenLogprob(token, tok(token), sampled.logprob,
                                         [(t, tok(t), lp) for t, lp in sampled.top_logprobs or []])]
            stream.queue.put_nowait(self._output(req, [token], text, logprobs, status))
            if status is not None:
                self._finish(req, status, notify=False)

    def _output(self, req: Request, token_ids: list[int], text: str, logprobs, status,
                error: str | None = None) -> RequestOutput:
        return RequestOutput(req.request_id, 0, token_ids, text, logprobs,
                             status.finish_reason if status else None, error, req.num_prompt_tokens,
                             req.num_output_tokens, req.num_cached_tokens)

    def _finish(self, req: Request, status: RequestStatus, error: str | None = None,
                notify: bool = True) -> None:
        """End a request: free its blocks, close its stream (unless the last delta already did), log it."""
        self.scheduler.finish(req, status)
        stream = self._streams.pop(req.request_id)
        if notify:
            stream.queue.put_nowait(self._output(req, [], "", None, status, error))
        now = time.monotonic()
        self.metrics.on_finished(status.finish_reason, now - req.arrival_time)
        ttft = None if req.first_token_time is None else round(req.first_token_time - req.arrival_time, 6)
        log.info("request finished", request_id=req.request_id, finish_reason=status.finish_reason,
                 prompt_tokens=req.num_prompt_tokens, completion_tokens=req.num_output_tokens,
                 cached_tokens=req.num_cached_tokens, ttft_s=ttft,
                 e2e_s=round(now - req.arrival_time, 6), num_preemptions=req.num_preemptions,
                 **({"error": error} if error else {}))

    def _fail_all(self, error: str) -> None:
        """The worker is gone: fail every request with a clear message; the engine stops serving."""
        self._error = error
        log.error("engine failed", error=error)
        for req in list(self.scheduler.requests.values()):
            self._finish(req, RequestStatus.FINISHED_ERROR, error=error)

    # ---- introspection and shutdown -------------------------------------------------------

    def kv_cache_snapshot(self) -> dict:
        """JSON-ready state of the block pool and every live request's block table."""
        snap = self.kv.snapshot()
        snap["num_cpu_blocks"] = self.num_cpu_blocks
        snap["num_requests_running"] = len(self.scheduler.running)
        snap["num_requests_waiting"] = len(self.scheduler.waiting)
        snap["requests"] = [
            {"id": r.request_id, "status": r.status.value, "num_tokens": r.num_tokens,
             "num_computed_tokens": r.num_computed_tokens, "block_table": list(r.block_table)}
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
