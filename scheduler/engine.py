"""The engine: the asyncio loop that joins requests, the scheduler and the worker.

One loop turns forever: apply aborts, ask the scheduler for a step plan, send it to the worker,
hand the sampled tokens to the output processor (`scheduler.output_processor`: detokenize, check
stop conditions, stream deltas to each request's queue), free finished requests' blocks. With
async scheduling (the default) the next plan is scheduled and sent before the previous result is
taken, so the worker computes step N + 1 while this loop applies step N (`_loop`). The API
and `pagedkv generate` talk to it through `Engine.add_request`, an async iterator of
`RequestOutput` deltas; closing that iterator early aborts the request, so every block comes back
whatever way a request ends. Metrics, tracing and the request log are written here.

Faults: a step that fails ends only its cause (`_step_failed`); a worker that dies or misses its
deadline is killed and replaced, and every live request recomputes (`_recover`); when the engine
cannot go on, `failed` is set and `pagedkv serve` exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

import msgspec

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len, weight_files
from pagedkv.common.log import get_logger
from pagedkv.common.protocol import StepResult, encode
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.common.tracing import FLUSH_TIMEOUT_S, RequestTracer, make_tracer
from pagedkv.scheduler.advice import Advisor, Sample, Settings
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.metrics import Metrics
from pagedkv.scheduler.output_processor import OutputProcessor, RequestOutput, RequestStream
from pagedkv.scheduler.preemption import Preemption, PreemptionPolicy
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.scheduler import KVAllocator, ScheduledStep, Scheduler
from pagedkv.scheduler.tokenizer import Tokenizer
from pagedkv.scheduler.worker_client import WorkerClient, WorkerFailed

log = get_logger("pagedkv.engine")

_IDLE_CHECK_SECONDS = 0.5  # an idle engine checks its worker this often: a death is noticed within a second
_RESTART_BACKOFF_SECONDS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before restart k (the last repeats)
_RESTART_RESET_SECONDS = 60.0  # a worker that lived this long resets the consecutive-restart count
_INT64 = 2**63


class _EngineFailed(Exception):
    """The engine cannot serve any more (worker restarts exhausted); every request has been failed."""


def kv_cache_sizes(num_gpu_blocks: int, num_cpu_blocks: int, kv_bytes_per_block: int, world_size: int,
                   device: str) -> dict:
    """The KV pools' sizes for the start-up log, in GiB (2^30 B), rounded to 3 places.

    kv_cache_gib and swap_space_gib are what one rank allocates (its blocks hold its shard of the KV
    heads); under -tp N every rank allocates as much, so host memory is N times the swap pool (plus N
    times the KV pool on a CPU device): host_kv_gib_all_ranks says so, as --swap-space alone does not.
    """
    gib = lambda n: round(n * kv_bytes_per_block / 2**30, 3)  # noqa: E731
    host_blocks = num_cpu_blocks + (num_gpu_blocks if device.startswith("cpu") else 0)
    return {"kv_cache_gib": gib(num_gpu_blocks), "swap_space_gib": gib(num_cpu_blocks),
            "world_size": world_size, "host_kv_gib_all_ranks": gib(world_size * host_blocks)}


class Engine:
    """A running engine: control-plane state plus one worker process.

    Create with `await Engine.start(config)`; stop with `await engine.shutdown()`.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Tokenizer,
                 client: WorkerClient, kv: KVAllocator):
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.client = client
        self.max_model_len = resolve_max_model_len(model_config, config.max_model_len)
        self.random_weights = model_config.path is None or config.load_format == "dummy"
        self.kv = kv
        policy = PreemptionPolicy(config.preemption_mode, config.scheduling_policy)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, policy)
        # names the API answers to; the first is the one it reports (--served-model-name)
        self.served_model_names = list(config.served_model_name) or [model_config.name]
        self.metrics = Metrics(self.served_model_names[0], config.tensor_parallel_size)
        self.metrics.watch(usage=lambda: self.kv.usage, num_cached_free=lambda: self.kv.num_cached_free_blocks,
                           num_running=lambda: len(self.scheduler.running),
                           num_waiting=lambda: len(self.scheduler.waiting),
                           num_swapped=lambda: len(self.scheduler.swapped),
                           cpu_usage=lambda: self.kv.cpu_usage)
        self.advisor: Advisor | None = None  # set by `start`, once the worker reported its KV dtype
        self.kv_cache_dtype: str | None = None  # the pool's element type and block size in bytes (worker's)
        self.kv_bytes_per_block: int | None = None
        self.tracer: RequestTracer | None = None
        self.output = OutputProcessor(tokenizer, self.scheduler, self.max_model_len, config.stream_interval)
        self.step_hooks: list[Callable[[ScheduledStep], None]] = []  # called after each step's tokens are computed
        self.idle_hooks: list[Callable[[], None]] = []  # called each time the loop waits with no step in flight
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._advice_task: asyncio.Task | None = None
        self._error: str | None = None
        self._new_kv: Callable[[], KVAllocator] | None = None  # a fresh allocator for a new worker's pool (`start`)
        self.failed = asyncio.Event()  # set when the engine can no longer serve: the process should exit non-zero
        self._recovering: str | None = None  # why, while a worker restart is under way
        self._draining = False
        self._worker_args: dict = {}  # how to start the worker again (address, spawn, secret)
        self._pool_blocks = (0, 0)  # (device, host) blocks every worker of this engine gets (`start`)
        self._restart_min_blocks = 0  # a replacement worker must have room for this many device blocks
        self._restarts = 0  # consecutive worker restarts
        self._last_restart = 0.0
        self._quarantine: deque[RequestStream] = deque()  # suspects of a failed step, each to run a step alone first
        self._probation: RequestStream | None = None  # the suspect released from quarantine, until a step succeeds

    @classmethod
    async def start(cls, config: EngineConfig, *, worker_address: str | None = None,
                    external_worker: bool = False, tracer: RequestTracer | None = None,
                    kv_allocator: Callable[[int, int, int], KVAllocator] | None = None,
                    worker_secret: bytes | None = None) -> "Engine":
        """Read the model config and tokenizer, start the worker, size the KV pool, start the loop.

        kv_allocator(num_gpu_blocks, num_cpu_blocks, max_model_len): the KV allocator to schedule
        with (`scheduler.KVAllocator`); default the paged `KVCacheManager`. Benchmarks plug their
        baselines in here. worker_secret: the worker-channel secret (`common.protocol.Channel`);
        needed with an external worker, generated per start for a spawned one when None. Raises
        TypeError/ValueError naming an EngineConfig field out of type or range (`EngineConfig.validate`),
        FileNotFoundError/ValueError for a bad model directory or a tensor_parallel_size the model
        cannot be split by (`ModelConfig.shard`), WorkerFailed when the worker cannot start or load the model.
        """
        # everything that can be checked is checked before a worker starts
        config.validate()  # as LLM and the CLI's flags do: Engine used directly gets the same checks
        model_config = ModelConfig.load(config.model)
        resolve_max_model_len(model_config, config.max_model_len)
        model_config.shard(config.tensor_parallel_size)  # ranks that cannot split the model never start
        if model_config.path is not None and config.load_format == "auto":
            weight_files(model_config.path)
        tokenizer = Tokenizer.load(model_config, config.chat_template)
        tracer = tracer or make_tracer(config.otlp_traces_endpoint)  # None: tracing off
        client = WorkerClient(config, worker_address, spawn=not external_worker, secret=worker_secret)
        try:
            hello = await client.start()
            num_gpu_blocks = config.num_gpu_blocks or hello.max_num_gpu_blocks
            if num_gpu_blocks < 1:
                raise WorkerFailed(f"no room for a single KV block on {hello.device} "
                                   "(raise --gpu-memory-utilization or --cpu-kv-cache-space)")
            num_cpu_blocks = int(config.swap_space * 2**30) // hello.kv_bytes_per_block
            # device pool (GPU memory, or host memory on a CPU device) and the swap pool in host memory
            log.info("allocating the KV cache", num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                     block_size=config.block_size, device=hello.device,
                     **kv_cache_sizes(num_gpu_blocks, num_cpu_blocks, hello.kv_bytes_per_block,
                                      config.tensor_parallel_size, hello.device),
                     swap_gib_per_s=round(hello.swap_bandwidth / 2**30, 2) if hello.swap_bandwidth else None)
            await client.init_cache(num_gpu_blocks, num_cpu_blocks)
        except BaseException:
            await client.close()
            raise
        max_model_len = resolve_max_model_len(model_config, config.max_model_len)

        def new_kv() -> KVAllocator:
            if kv_allocator is not None:
                return kv_allocator(num_gpu_blocks, num_cpu_blocks, max_model_len)
            return KVCacheManager(num_gpu_blocks, config.block_size, config.enable_prefix_caching,
                                  config.prefix_caching_hash_algo, num_cpu_blocks)

        engine = cls(config, model_config, tokenizer, client, new_kv())
        engine._new_kv = new_kv
        engine._pool_blocks = (num_gpu_blocks, num_cpu_blocks)
        # a replacement worker must hold the pool the block tables are sized for; an explicit
        # --num-gpu-blocks above the first worker's capacity was the user's call and is not re-checked
        engine._restart_min_blocks = num_gpu_blocks if num_gpu_blocks <= hello.max_num_gpu_blocks else 0
        engine._worker_args = {"address": worker_address, "spawn": not external_worker, "secret": worker_secret}
        engine._last_restart = time.monotonic()
        engine.device = hello.device
        engine.kv_cache_dtype, engine.kv_bytes_per_block = hello.kv_cache_dtype, hello.kv_bytes_per_block
        engine.scheduler.policy.kv_bytes_per_block = hello.kv_bytes_per_block  # the cost model's inputs
        if hello.swap_bandwidth:
            engine.scheduler.policy.swap_bandwidth = hello.swap_bandwidth
        engine.tracer = tracer
        engine.advisor = Advisor(Settings(
            max_num_seqs=config.max_num_seqs, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            block_size=config.block_size, max_model_len=engine.max_model_len, kv_cache_dtype=hello.kv_cache_dtype,
            preemption_mode=config.preemption_mode, swap_space=config.swap_space))
        engine._task = asyncio.create_task(engine._loop(), name="pagedkv-engine-loop")
        engine._advice_task = asyncio.create_task(engine._advise(), name="pagedkv-advice")
        if config.max_model_len is None and engine.max_model_len == model_config.sliding_window:
            log.warning("max_model_len capped at the model's sliding_window: pagedkv attends to the whole context",
                        sliding_window=model_config.sliding_window,
                        max_position_embeddings=model_config.max_position_embeddings)
        log.info("engine started", model=model_config.name, random_weights=engine.random_weights,
                 device=hello.device, dtype=hello.dtype, kv_cache_dtype=hello.kv_cache_dtype, world_size=config.tensor_parallel_size,
                 block_size=config.block_size,
                 num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                 kv_bytes_per_block=hello.kv_bytes_per_block, max_model_len=engine.max_model_len,
                 async_scheduling=config.async_scheduling, stream_interval=config.stream_interval)
        return engine

    @property
    def healthy(self) -> bool:
        return self.health()[0]

    def health(self) -> tuple[bool, str]:
        """(serving, status): "ok"; or "recovering: <why>", "draining", "failed: <why>" (not serving)."""
        if self._error is not None or self._task is None or self._task.done():
            return False, f"failed: {self._error or 'stopped'}"
        if self._draining:
            return False, "draining"
        if self._recovering is not None:
            return False, f"recovering: {self._recovering}"
        return True, "ok"

    @property
    def accepting(self) -> bool:
        """New requests are queued (also while the worker recovers); not once failed or draining."""
        return self._error is None and self._task is not None and not self._task.done() and not self._draining


    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, priority: int = 0, cache_salt: str | None = None,
                    traceparent: str | None = None, tracestate: str | None = None,
                    prompt_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the async iterator of its output deltas (all choices).

        traceparent, tracestate: the client's W3C Trace Context headers; the request's span continues
        that trace, with its tracestate.
        prompt_only: the caller drops the sampled tokens (echo with ``max_tokens`` 0 scores the prompt:
        one token is generated, as vLLM does); the request log and span count no completion tokens.

        ``params.max_tokens`` None: up to max_model_len, as far as the pool can hold (`_max_tokens_room`).
        n > 1 samples n sequences that share the prompt's blocks; ``use_beam_search`` returns the
        n best beams, all at the end. Raises ValueError("<field>: <why>") when the request can
        never be served, RuntimeError when the engine has failed. Closing the iterator before
        the end aborts the request.
        """
        if not self.accepting:
            raise RuntimeError(f"engine is not serving: {self.health()[1]}")
        if params.max_tokens is None and isinstance(params.n, int):  # vLLM: up to max_model_len
            params = msgspec.structs.replace(params, max_tokens=self._max_tokens_room(len(prompt_token_ids), params.n))
        self._validate(prompt_token_ids, params, cache_salt)
        if not -_INT64 <= priority < _INT64:
            raise ValueError(f"priority: must fit in int64, got {priority}")
        request_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if request_id in self.output.streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if taken := next((i for i in self.output.sequence_ids(request_id, params) if i in self.output.owner), None):
            raise ValueError(f"request_id: {request_id!r} would name sequence {taken!r}, which a running request holds")
        stream, members = self.output.add(request_id, prompt_token_ids, params, time.monotonic(), priority,
                                          cache_salt)
        stream.prompt_only = prompt_only
        if self.tracer is not None:
            stream.span = self.tracer.start_request(request_id, self.model_config.name, len(prompt_token_ids),
                                                    stream.arrival_time, traceparent, tracestate,
                                                    attributes={"gen_ai.request.choice.count": params.n,
                                                                "gen_ai.request.max_tokens": params.max_tokens})
        for req in members:
            self.scheduler.add(req)
        log.debug("request added", request_id=request_id, prompt_tokens=len(prompt_token_ids),
                  max_tokens=params.max_tokens, n=params.n, priority=priority)
        self._wake.set()
        return self._iterate(stream)

    def _max_tokens_room(self, prompt_len: int, n: int = 1) -> int:
        """The most output tokens a prompt of prompt_len tokens may ask for (at least 1): up to
        max_model_len, and for n sequences (or beams) at once within the pool, as `_validate` counts
        them: they share the prompt's full blocks before their fork point, each holds prompt +
        max_tokens - 1 tokens."""
        bs, num_blocks = self.kv.block_size, self.kv.pool.num_blocks
        shared = (prompt_len - 1) // bs
        blocks_each = shared + (num_blocks - shared) // max(n, 1)
        return max(min(self.max_model_len - prompt_len, blocks_each * bs - prompt_len + 1), 1)

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None) -> None:
        """Raise ValueError("<field>: <why>") unless the request is well formed and could run alone on an empty pool."""
        params.validate(max_logprobs=self.config.max_logprobs, max_n=self.config.max_n, max_stop=self.config.max_stop)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise ValueError(f"top_k: must be -1 or 0 (disabled) or at most the vocabulary size {vocab}, "
                             f"got {params.top_k}")
        if n > self.max_model_len:  # before the id scan: a 4M-id body is refused without reading every id
            raise ValueError(f"prompt: {n} tokens is longer than max_model_len ({self.max_model_len})")
        if bad := next((t for t in prompt_token_ids if not 0 <= t < vocab), None):
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len})")
        for field in ("top_k", "max_tokens", "seed"):  # the worker's tensors hold int64
            if (v := getattr(params, field)) is not None and not -_INT64 <= v < _INT64:
                raise ValueError(f"{field}: must fit in int64, got {v}")
        try:  # what the step plan carries must encode, what block hashing reads must be valid UTF-8
            encode(params)
        except (OverflowError, UnicodeEncodeError) as e:
            raise ValueError(f"sampling: cannot be sent to the worker: {e}") from None
        if params.use_beam_search and params.stop:
            raise ValueError("stop: stop strings are not supported with beam search (EOS and max_tokens end beams)")
        if params.use_beam_search and params.logprobs is not None:  # the beams' own logprobs pick candidates
            raise ValueError("logprobs: not supported with beam search")
        if cache_salt is not None and not cache_salt:
            raise ValueError("cache_salt: must not be empty (omit it to share the prefix cache)")
        if cache_salt is not None:
            try:
                cache_salt.encode()  # block hashing reads it as UTF-8
            except UnicodeEncodeError:
                raise ValueError("cache_salt: is not valid Unicode (lone UTF-16 surrogate)") from None
        # the group at its longest: the cache holds prompt + max_tokens - 1 tokens (the last sampled
        # token is never written), n sequences (or beam width) sharing the prompt's blocks
        group: list[Request] = []
        members = [Request(f"check-{i}", prompt_token_ids, params, group=group, index=i) for i in range(params.n)]
        self.scheduler.check_fits(members, len(prompt_token_ids) + params.max_tokens - 1)

    async def _iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        try:
            while not (stream.done and stream.queue.empty()):
                yield await stream.queue.get()
        finally:
            if not stream.done:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (applied between steps); its blocks come back. Unknown ids are ignored."""
        if request_id in self.output.streams:
            self._aborts.add(request_id)
            self._wake.set()

    # ---- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        """Schedule, send, apply; with ``async_scheduling``, step N + 1 is scheduled and sent while the
        worker computes step N, and step N's result (tokens, detokenization, streaming) is applied
        while the worker computes N + 1 (vLLM V1's async scheduling). `Scheduler.schedule` says what
        a step scheduled ahead may do; when it cannot run without a preemption, or a suspect is on
        probation, the next step waits for the one in flight.
        """
        sent: deque[ScheduledStep] = deque()  # sent, results not applied yet, oldest first (at most 2)
        try:
            while True:
                self._apply_aborts()
                self._release_from_quarantine()
                ahead = bool(sent)
                if not ahead or (self.config.async_scheduling and self._probation is None):
                    if (step := self._schedule(ahead)) is not None:
                        try:
                            await self.client.submit(step.plan)
                        except (OverflowError, UnicodeEncodeError, ValueError, TypeError) as e:  # the plan did not encode
                            await self._step_failed(step, f"step plan could not be encoded: {e!r}", sent)
                            continue
                        sent.append(step)
                        if not ahead and self.config.async_scheduling:
                            continue  # schedule the next step while this one computes
                if not sent:
                    for hook in self.idle_hooks:
                        hook()
                    await self._idle()
                    continue
                step = sent.popleft()
                # one loop pass first: a consumer waiting on its request takes the last step's delta before
                # the next step's merges into it (`OutputQueue`), so one that keeps up gets a delta per step
                await asyncio.sleep(0)
                try:
                    result = await self.client.result(step.plan.step_id)
                except WorkerFailed as e:
                    sent.clear()
                    await self._recover(str(e))
                    continue
                if result.error is not None:
                    await self._step_failed(step, f"worker error: {result.error}", sent)
                    continue
                if self._probation is not None and any(self.output.owner.get(rid) is self._probation
                                                       for rid in step.num_scheduled_tokens):
                    self._probation = None  # it stepped without failing: cleared
                self.scheduler.policy.prefill.observe(step.plan, result.forward_seconds)
                for hook in self.step_hooks:
                    hook(step)
                self._apply_result(result)
                if log.is_enabled_for(logging.DEBUG):
                    self._log_step(step, result)
        except _EngineFailed:
            pass
        except Exception as e:  # a bug in the control plane: fail every request, and exit so a supervisor restarts us
            log.exception("engine loop crashed")
            self._fail_all(f"engine loop crashed: {e!r}")

    def _schedule(self, ahead: bool) -> ScheduledStep | None:
        """The next step to send, its tokens counted as computed (`Scheduler.advance`); None when
        there is nothing to send, or nothing that may be sent ahead of the step in flight."""
        if not (self.scheduler.waiting or self.scheduler.running or self.scheduler.swapped):
            return None
        step = self.scheduler.schedule(ahead=ahead)
        if step is None:
            return None
        self._record_preemptions(step)
        if step.is_empty:  # nothing can run until an arrival, an abort, a finish or a result changes that
            return None
        self.scheduler.advance(step)
        now = time.monotonic()
        for new in step.plan.new_requests:  # the first one only: a resumed request keeps its first
            stream = self.output.owner.get(new.request_id)
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = now
        return step

    def _log_step(self, step: ScheduledStep, result: StepResult) -> None:
        """One debug line per step: what ran, what moved, what is left queued (``--log-level debug``)."""
        plan, sched = step.plan, self.scheduler
        log.debug("step", step_id=plan.step_id, num_requests=len(step.num_scheduled_tokens),
                  num_new_requests=len(plan.new_requests), num_scheduled_tokens=sum(step.num_scheduled_tokens.values()),
                  num_swapped_out=len(plan.blocks_to_swap_out), num_swapped_in=len(plan.blocks_to_swap_in),
                  num_copied=len(plan.blocks_to_copy), num_preempted=len(step.preempted),
                  running=len(sched.running), waiting=len(sched.waiting), swapped=len(sched.swapped),
                  kv_usage=round(self.kv.usage, 4), forward_ms=round(result.forward_seconds * 1000, 3))

    async def _advise(self) -> None:
        """Sample the pool for the advisor every ``interval_s``; log the advice when it changes."""
        interval = self.advisor.thresholds.interval_s
        while True:
            self.advisor.record(self.advice_sample())
            self.advisor.log_if_changed(time.monotonic())
            await asyncio.sleep(interval)

    def advice_sample(self) -> Sample:
        """The state the advice rules read, now."""
        return Sample(time.monotonic(), self.kv.usage, len(self.scheduler.running), len(self.scheduler.waiting),
                      len(self.scheduler.swapped), self.kv.cpu_usage, self.scheduler.num_preemptions)

    async def _idle(self) -> None:
        """Sleep until woken (an arrival, an abort, a finish), looking at the worker every
        _IDLE_CHECK_SECONDS meanwhile: an idle worker's death is noticed within a second."""
        self._wake.clear()
        try:  # asyncio.timeout, not wait_for: this task waits on the event itself, woken one loop pass after set()
            async with asyncio.timeout(_IDLE_CHECK_SECONDS):
                await self._wake.wait()
        except TimeoutError:
            pass
        try:
            await self.client.check_alive()
        except WorkerFailed as e:
            await self._recover(str(e))

    # ---- faults: a failed step fails its cause; a failed worker is replaced -----------------

    async def _step_failed(self, step: ScheduledStep, error: str, sent: deque[ScheduledStep]) -> None:
        """A step failed (the worker raised, or the plan did not encode). Fail only its cause.

        ``sent``: the steps sent and not applied (the one scheduled ahead); their results are
        awaited and dropped first, so the worker is idle when it is replaced.

        The request on probation (a suspect running its first step since quarantine), or the only
        request of the step, is the cause: it ends with ``error``. Otherwise every request of the
        step is a suspect: each is quarantined and later runs one step with no other suspect before
        it is cleared. Either way the worker's state is no longer trusted: it is restarted and every
        live request recomputes (`_recover`).
        """
        while sent:
            try:
                await self.client.result(sent.popleft().plan.step_id)
            except WorkerFailed:
                sent.clear()  # replaced below all the same
        streams = {self.output.owner[rid] for rid in step.num_scheduled_tokens if rid in self.output.owner}
        log.error("step failed", step_id=step.plan.step_id, error=error, request_ids=sorted(s.request_id for s in streams))
        cause = self._probation if self._probation in streams else (next(iter(streams)) if len(streams) == 1 else None)
        if cause is not None:
            self._end_stream(cause, RequestStatus.FINISHED_ERROR, error)
            self._probation = None
        else:
            for stream in sorted(streams, key=lambda x: x.arrival_time):
                self._quarantine.append(stream)
        await self._recover(error)

    def _release_from_quarantine(self) -> None:
        """Requeue the next quarantined suspect once no other one is on probation."""
        while self._probation is None and self._quarantine:
            stream = self._quarantine.popleft()
            if stream.request_id not in self.output.streams:
                continue  # aborted meanwhile
            self._probation = stream
            for req in stream.queued:
                self.scheduler.add(req)
            stream.queued = []
            self._wake.set()

    async def _recover(self, reason: str) -> None:
        """Replace a failed worker and recompute every live request; raise _EngineFailed when out of restarts.

        A spawned worker is killed for certain; for an external one the bound socket stays open
        and the next worker to register (its supervisor restarts it) takes its place. A new one
        starts after a backoff
        (``--max-worker-restarts`` consecutive restarts at most; a worker that lived
        _RESTART_RESET_SECONDS resets the count) and gets a fresh KV pool; every request in flight
        (running, waiting or swapped) is requeued for recompute from its prompt plus the tokens it
        already produced, so streams go on with no token lost or repeated and seeded sampling (a
        function of seed and output index) gives what an uninterrupted run gives. While this runs,
        /health says 503 "recovering: <why>; restart k of N". Every start of a worker (group) here is
        counted in ``pagedkv:worker_restarts_total`` when it begins, and one that does not come up
        (it died or failed while starting, or a shutdown cut it short) also in
        ``pagedkv:worker_restart_failures_total``: restarts minus failures are the workers that came
        up (plus the one starting now, if any). Each recovery, however it ends, is traced as
        one ``worker.recovery`` span with its cause and the starts it took; one that ends without a
        serving worker (out of restarts, or shut down) has an error status saying which, and 0
        sequences requeued. Raises CancelledError when shut down meanwhile, after closing any
        worker it was starting.
        """
        started = time.monotonic()
        cause, attempts = reason, 0
        if self._new_kv is None:  # built around a given allocator (tests): no pool to rebuild
            self._fail_all(reason)
            raise _EngineFailed
        if started - self._last_restart >= _RESTART_RESET_SECONDS:
            self._restarts = 0
        self._recovering = reason
        log.error("worker failed", error=reason, max_worker_restarts=self.config.max_worker_restarts)
        spawn = self._worker_args.get("spawn", True)

        def trace(end: float, num_requeued: int = 0, error: str | None = None) -> None:
            if self.tracer is not None:
                self.tracer.worker_recovery(cause, started, end, self._restarts, attempts, num_requeued, error)

        try:
            if spawn:
                await self.client.close()  # kills a dead or stalled worker for certain
            else:
                await self.client.forget_worker()
            while True:
                if self._restarts >= self.config.max_worker_restarts:
                    error = (f"{reason} (after {self._restarts} worker restarts, --max-worker-restarts "
                             f"{self.config.max_worker_restarts})")
                    self._fail_all(error)
                    trace(time.monotonic(), error=error)
                    raise _EngineFailed
                delay = _RESTART_BACKOFF_SECONDS[min(self._restarts, len(_RESTART_BACKOFF_SECONDS) - 1)]
                self._restarts += 1
                self._recovering = f"{reason}; restart {self._restarts} of {self.config.max_worker_restarts}"
                await asyncio.sleep(delay)
                self._apply_aborts()  # clients that left meanwhile
                client = self.client if not spawn else WorkerClient(
                    self.config, self._worker_args.get("address"), spawn=True, secret=self._worker_args.get("secret"))
                attempts += 1
                self.metrics.on_worker_restart()  # counted as it starts: one that dies starting was a restart too
                try:
                    hello = await client.start()
                    # the scheduler keeps the first pool's size: a replacement with less room (another
                    # process took device memory) or another block size would over-allocate or corrupt
                    if hello.max_num_gpu_blocks < self._restart_min_blocks:
                        raise WorkerFailed(f"the new worker has room for {hello.max_num_gpu_blocks} KV blocks on "
                                           f"{hello.device}, the pool needs {self._pool_blocks[0]}")
                    if hello.kv_bytes_per_block != self.kv_bytes_per_block:
                        raise WorkerFailed(f"the new worker's KV block is {hello.kv_bytes_per_block} B "
                                           f"({hello.dtype}), the pool's {self.kv_bytes_per_block} B")
                    await client.init_cache(*self._pool_blocks)
                except asyncio.CancelledError:  # shut down mid-restart: leave no worker behind
                    self.metrics.on_worker_restart_failure()  # it did not come up: restarts - failures stays honest
                    client.failed = "shut down during a restart"
                    await client.close()
                    raise
                except Exception as e:  # noqa: BLE001 - any start failure counts as a failed restart
                    log.error("worker restart failed", error=str(e), restart=self._restarts)
                    self.metrics.on_worker_restart_failure()
                    if spawn:
                        client.failed = client.failed or str(e)
                        await client.close()
                    else:
                        await client.forget_worker()
                    reason = f"worker restart failed: {e}"
                    continue
                break
        except asyncio.CancelledError:
            # traced as a recovery that failed: no worker came up, and a worker failure with no span
            # after it would read as a recovery still under way
            trace(time.monotonic(), error="shut down during the recovery")
            raise
        self.client = client
        num_requeued = self._requeue_all_for_recompute(cause, started)
        self._last_restart = time.monotonic()
        self._recovering = None
        trace(self._last_restart, num_requeued)
        log.info("worker recovered", restart=self._restarts, attempts=attempts, requests_requeued=num_requeued,
                 seconds=round(self._last_restart - started, 3))

    def _requeue_all_for_recompute(self, cause: str = "", failed_at: float | None = None) -> int:
        """A fresh KV allocator and scheduler; every live sequence back in the waiting queue with nothing computed.

        Each sequence that held KV (running, or swapped: the host pool goes with the worker) loses it
        and counts a recompute preemption, as vLLM counts the running requests a KV cache reset
        preempts: in its own num_preemptions, in ``pagedkv:num_preemptions_total`` and as a recompute
        ``kv.preempt`` span (reason ``worker_restart: <cause>``) from ``failed_at`` (time.monotonic()
        s) to its resumption. A sequence still waiting has nothing to lose: requeued, not counted. The
        scheduler's own count (the advice's preemption rate, a sign of KV pressure) leaves them out.

        Each sibling group comes back as a preempted one does (`Scheduler._requeue`): its first
        member leads, recomputes the shared prompt and the others fork from it, so the group needs
        no more blocks than when first admitted. Groups keep their arrival order. Quarantined
        streams keep their sequences aside (`RequestStream.queued`) until released. Returns the
        number of sequences requeued.
        """
        old = self.scheduler
        live = sorted((r for r in old.requests.values() if not r.status.finished), key=lambda r: r.arrival_time)
        live_ids = {id(r) for r in live}
        preempted = [r for r in live if r.status is not RequestStatus.WAITING]
        preempted_ids = {id(r) for r in preempted}
        # one record per group, costed on the tables the dead worker held, before they are reset
        records = []
        if self.tracer is not None:
            at = time.monotonic() if failed_at is None else failed_at
            for group in {id(r.group): [m for m in r.group if id(m) in preempted_ids] for r in preempted}.values():
                num_blocks, num_tokens, swap_s, recompute_s = old.policy.costs(group)
                records.append(Preemption([m.request_id for m in group], "recompute", f"worker_restart: {cause}",
                                          num_blocks, num_tokens, num_blocks * self.kv_bytes_per_block, swap_s,
                                          recompute_s, time=at))
        self.kv = self._new_kv()
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens, old.policy)
        # a counter since the engine started: the advice reads its deltas, and a reset to 0 gave a
        # negative preemption count for the next 10 minutes
        self.scheduler.num_preemptions = old.num_preemptions
        self.output.scheduler = self.scheduler
        for req in live:
            req.status, req.num_computed_tokens, req.block_table, req.num_named_blocks = RequestStatus.WAITING, 0, [], 0
            req.in_worker, req.unsent_token_ids, req.pending_forks = False, [], []
        for req in preempted:
            req.num_preemptions += 1
            self.metrics.on_preemption("recompute")
        quarantined = set(map(id, self._quarantine))
        seen: set[int] = set()
        for req in live:
            if id(req.group) in seen:
                continue
            seen.add(id(req.group))
            members = [m for m in req.group if id(m) in live_ids]
            leader = members[0]
            if len(members) > 1 and leader.fork_point > 0:
                leader.pending_forks, members = members[1:], [leader]
            stream = self.output.owner.get(leader.request_id)
            for m in members:
                if stream is not None and id(stream) in quarantined:
                    stream.queued.append(m)
                else:
                    self.scheduler.add(m)
        for record in records:
            for rid in record.request_ids:
                if (stream := self.output.owner.get(rid)) is not None and stream.span is not None:
                    self.tracer.preempt(stream.span, rid, record)
        self._wake.set()
        return len(live)

    def _record_preemptions(self, step: ScheduledStep) -> None:
        """Count, log and trace a step's preemptions (one per preempted sequence), resumptions and swaps."""
        self.metrics.on_swap(len(step.plan.blocks_to_swap_out), len(step.plan.blocks_to_swap_in))
        for p in step.preemptions:
            # request_ids are sequence ids (<id>-0, <id>-beam2): request_id names the request they belong
            # to (a group is one request's), the key that log queries join on
            owner = self.output.owner.get(p.request_ids[0])
            log.info("preempted", request_id=owner.request_id if owner is not None else p.request_ids[0],
                     request_ids=p.request_ids, mode=p.mode, reason=p.reason, num_blocks=p.num_blocks,
                     num_tokens=p.num_tokens, swap_cost_s=p.swap_cost_s, recompute_cost_s=p.recompute_cost_s,
                     **({"fallback": p.fallback} if p.fallback else {}))
            for rid in p.request_ids:
                self.metrics.on_preemption(p.mode)
                stream = self.output.owner.get(rid)
                if self.tracer is not None and stream is not None and stream.span is not None:
                    self.tracer.preempt(stream.span, rid, p)
        if self.tracer is not None:
            for r in step.resumptions:
                self.tracer.resume(r.request_id, r.mode, r.num_blocks, r.time)
                # a group preempted by recompute resumes through its leader (the siblings fork from it
                # and get no Resumption of their own): their spans end with it, or a later preemption
                # of a sibling would replace its still-open span, which then never ends nor exports
                if (req := self.scheduler.requests.get(r.request_id)) is not None:
                    for sibling in req.pending_forks:
                        self.tracer.resume(sibling.request_id, r.mode, 0, r.time)

    def _apply_aborts(self) -> None:
        for rid in self._aborts:
            if (stream := self.output.streams.get(rid)) is not None:
                self._end_stream(stream, RequestStatus.FINISHED_ABORTED)
        self._aborts.clear()

    def _apply_result(self, result: StepResult) -> None:
        self.output.prompt_logprobs(result.prompt_logprobs)  # before the tokens: a first delta carries them
        now = time.monotonic()
        for sampled in result.sampled:
            req = self.scheduler.requests.get(sampled.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            stream = self.output.owner[req.request_id]
            first = stream.first_token_time is None
            if first:
                stream.first_token_time = now
                self.metrics.on_admitted(req.num_prompt_tokens, req.num_cached_tokens)
            if not stream.prompt_only:  # its one sampled token is dropped (echo, max_tokens 0): no output
                # one latency per request per step, as vLLM: siblings (n > 1, beams) sampled in the same
                # step count their tokens but observe no 0 s inter-token latency
                self.metrics.on_token(first, None if not first and now == stream.last_token_time
                                      else now - stream.last_token_time)
            stream.last_token_time = now
            if (status := self.output.process(stream, req, sampled)) is not None:
                self._close(stream, status)

    def _end_stream(self, stream: RequestStream, status: RequestStatus, error: str | None = None) -> None:
        """End a request early (abort, worker error): every sequence finishes, every choice gets a last delta."""
        self.output.end(stream, status, error)
        self._close(stream, status, error)

    def _close(self, stream: RequestStream, status: RequestStatus, error: str | None = None) -> None:
        """Forget a finished request; record its metrics, end its span and write its one log line."""
        self.output.forget(stream)
        if stream in self._quarantine:
            self._quarantine.remove(stream)
        if self._probation is stream:
            self._probation = None
        now = time.monotonic()
        self.metrics.on_finished(status.finish_reason, now - stream.arrival_time)
        self.metrics.on_phases(stream.arrival_time, stream.scheduled_time, stream.first_token_time,
                               stream.last_token_time)
        if self.advisor is not None and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            for m in stream.members:
                if m.index < stream.n:
                    self.advisor.on_finished(now, m.num_tokens)
        self.metrics.on_request_preemptions(sum(m.num_preemptions for m in stream.members))
        if stream.prompt_only:
            completion_tokens = 0
        elif stream.beam is not None:  # what usage counts: the returned beams, not the sequences that ran
            completion_tokens = stream.num_beam_output_tokens
        else:
            completion_tokens = sum(m.num_output_tokens for m in stream.members if m.index < stream.n)
        if stream.span is not None:
            self.tracer.end_request(stream.span, [m.request_id for m in stream.members], completion_tokens,
                                    status.finish_reason, stream.arrival_time, stream.first_token_time, error)
        ttft = None if stream.first_token_time is None else round(stream.first_token_time - stream.arrival_time, 6)
        first = stream.members[0]
        log.info("request finished", request_id=stream.request_id, finish_reason=status.finish_reason,
                 n=stream.n, prompt_tokens=first.num_prompt_tokens, completion_tokens=completion_tokens,
                 cached_tokens=first.num_cached_tokens, ttft_s=ttft, e2e_s=round(now - stream.arrival_time, 6),
                 num_preemptions=sum(m.num_preemptions for m in stream.members),
                 **({"error": error} if error else {}))

    def _fail_all(self, error: str) -> None:
        """The engine cannot go on: fail every request with a clear message, stop serving, and set
        `failed` (``pagedkv serve`` then exits non-zero so a supervisor restarts it)."""
        self._error = error
        self._recovering = None
        log.error("engine failed", error=error)
        for stream in list(self.output.streams.values()):
            self._end_stream(stream, RequestStatus.FINISHED_ERROR, error)
        self.failed.set()


    # ---- introspection and shutdown -------------------------------------------------------

    def kv_cache_snapshot(self) -> dict:
        """JSON-ready state of the block pool and every live request's block table."""
        snap = self.kv.snapshot()
        snap["world_size"] = self.config.tensor_parallel_size  # worker ranks; each holds every block, of its heads
        snap["kv_cache_dtype"], snap["kv_bytes_per_block"] = self.kv_cache_dtype, self.kv_bytes_per_block
        snap["num_requests_swapped"] = len(self.scheduler.swapped)
        snap["swapped_requests"] = [
            {"id": r.request_id, "num_computed_tokens": r.num_computed_tokens,
             "host_block_table": self.kv.host_block_table(r)}
            for r in self.scheduler.swapped
        ]
        snap["num_requests_running"] = len(self.scheduler.running)
        snap["num_requests_waiting"] = len(self.scheduler.waiting)
        # waiting requests in service order (0 is admitted next): arrival order is not it under the
        # priority policy, nor for a request preempted by recompute
        position = {r.request_id: i for i, r in enumerate(self.scheduler.waiting)}
        snap["requests"] = [
            {"id": r.request_id, "status": r.status.value, "num_tokens": r.num_tokens,
             "num_computed_tokens": r.num_computed_tokens, "block_table": list(r.block_table),
             "num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.sampling.max_tokens,
             "queue_position": position.get(r.request_id)}
            for r in self.scheduler.requests.values()
        ]
        return snap

    def abort_all(self) -> None:
        """Abort every request (applied between steps)."""
        for rid in list(self.output.streams):
            self.abort(rid)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown, first half: refuse new requests (`accepting` turns false, /health 503
        "draining"), let those in flight finish for up to ``timeout`` seconds, then abort the rest.
        Call `shutdown` after."""
        self._draining = True
        log.info("draining", requests=len(self.output.streams), timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while self.output.streams and time.monotonic() < deadline and not self.failed.is_set():
            await asyncio.sleep(0.05)
        if self.output.streams:
            log.warning("drain deadline passed; aborting", requests=sorted(self.output.streams))
            self.abort_all()
            for _ in range(100):  # the loop applies aborts between steps
                if not self.output.streams or self._task is None or self._task.done():
                    break
                await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        """Abort everything, stop the loop, stop the worker."""
        if self._advice_task is not None:
            self._advice_task.cancel()
        if self._task is not None and not self._task.done():
            for rid in list(self.output.streams):
                self.abort(rid)
            self._apply_aborts()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.client.close()
        # flush batched spans off the event loop: an unreachable collector holds the flush for seconds
        if self.tracer is not None and not await asyncio.to_thread(self.tracer.shutdown):
            log.warning("traces not flushed: the collector did not answer", timeout_s=FLUSH_TIMEOUT_S)
