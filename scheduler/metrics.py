"""Prometheus metrics of one engine (prometheus-client), named as vLLM's with a ``pagedkv:`` prefix.

Each engine has its own CollectorRegistry, so several engines (tests) never collide; the API
serves it at ``GET /metrics``. vLLM's ``vllm:kv_cache_usage_perc`` becomes
``pagedkv:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM reports it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
PREEMPTION_MODES = ("recompute", "swap")  # the `mode` label of pagedkv:num_preemptions


class Metrics:
    """The engine's gauges, counters and histograms (units: seconds, tokens, fractions)."""

    def __init__(self, model_name: str, world_size: int = 1):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.kv_cache_usage = Gauge("pagedkv:kv_cache_usage_perc", "Fraction of KV blocks referenced by live requests (0-1).", labels, registry=r)
        self.num_cached_free_blocks = Gauge("pagedkv:num_cached_free_blocks", "Free KV blocks that still hold a reusable cached prefix.", labels, registry=r)
        self.num_running = Gauge("pagedkv:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.num_waiting = Gauge("pagedkv:num_requests_waiting", "Requests waiting to be admitted.", labels, registry=r)
        # one per preempted sequence (an n = 4 request preempted once counts 4), as vLLM V1, where
        # each of the n samples is its own child request
        self.num_preemptions = Counter("pagedkv:num_preemptions", "Preempted sequences (each of a request's n samples or beams counts).", labels + ["mode"], registry=r)
        self.prompt_tokens = Counter("pagedkv:prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r)
        self.generation_tokens = Counter("pagedkv:generation_tokens", "Generated tokens.", labels, registry=r)
        self.prefix_cache_queries = Counter("pagedkv:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self.prefix_cache_hits = Counter("pagedkv:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels, registry=r)
        self.request_success = Counter("pagedkv:request_success", "Finished requests by reason.", labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("pagedkv:time_to_first_token_seconds", "Time to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedkv:inter_token_latency_seconds", "Time between consecutive output tokens.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedkv:e2e_request_latency_seconds", "Arrival to finish.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM's per-request phases. "Scheduled" is the request's first scheduling: a request preempted
        # and resumed keeps it, so its time back in the queue counts as inference, not queue (as vLLM).
        self.queue_time = Histogram("pagedkv:request_queue_time_seconds", "Arrival to first scheduled.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("pagedkv:request_prefill_time_seconds", "First scheduled to first token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("pagedkv:request_decode_time_seconds", "First token to last token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("pagedkv:request_inference_time_seconds", "First scheduled to last token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.num_swapped = Gauge("pagedkv:num_requests_swapped", "Requests swapped out to the host pool.", labels, registry=r)
        self.cpu_kv_cache_usage = Gauge("pagedkv:cpu_kv_cache_usage_perc", "Fraction of host swap blocks holding swapped-out KV (0-1).", labels, registry=r)
        self.blocks_swapped_out = Counter("pagedkv:num_blocks_swapped_out", "KV blocks copied from the device pool to the host pool.", labels, registry=r)
        self.blocks_swapped_in = Counter("pagedkv:num_blocks_swapped_in", "KV blocks copied from the host pool back to the device pool.", labels, registry=r)
        self.request_preemptions = Histogram("pagedkv:request_num_preemptions", "Preemptions of each finished request (all its sequences).", labels, buckets=_COUNT_BUCKETS, registry=r)
        self.world_size = Gauge("pagedkv:world_size", "Worker ranks serving the model (tensor parallel size).", labels, registry=r)
        self.worker_restarts = Counter("pagedkv:worker_restarts", "Worker (group) starts after a failure, counted as each begins, whether or not it comes up.", labels, registry=r)
        self.worker_restart_failures = Counter("pagedkv:worker_restart_failures", "Worker (group) restarts that did not come up: died or failed while starting, or cut short by a shutdown. Restarts minus these are the workers that came up (plus the one starting now, if any).", labels, registry=r)
        self.model_name = model_name
        self._l = {"model_name": model_name}
        # Every series exists from the first scrape (zero until something happens), so a dashboard
        # or alert sees 0 instead of "no data", and rate() has a starting point.
        for metric in vars(self).values():
            if isinstance(metric, (Counter, Gauge, Histogram)) and metric not in (self.num_preemptions, self.request_success):
                metric.labels(**self._l)
        for mode in PREEMPTION_MODES:
            self.num_preemptions.labels(mode=mode, **self._l)
        self.world_size.labels(**self._l).set(world_size)
        # bound once: labels() costs a dict lookup and a lock per call, and these run per token
        self._generation_tokens = self.generation_tokens.labels(**self._l)
        self._ttft, self._itl = self.ttft.labels(**self._l), self.itl.labels(**self._l)

    def watch(self, *, usage, num_cached_free, num_running, num_waiting, num_swapped, cpu_usage) -> None:
        """Read the pool gauges live, at scrape time, from zero-argument callables: /metrics and
        /kv_cache then agree whenever they are read at the same moment."""
        for gauge, read in ((self.kv_cache_usage, usage), (self.num_cached_free_blocks, num_cached_free),
                            (self.num_running, num_running), (self.num_waiting, num_waiting),
                            (self.num_swapped, num_swapped), (self.cpu_kv_cache_usage, cpu_usage)):
            gauge.labels(**self._l).set_function(read)

    def on_preemption(self, mode: str) -> None:
        self.num_preemptions.labels(mode=mode, **self._l).inc()

    def on_swap(self, num_blocks_out: int, num_blocks_in: int) -> None:
        """One step's swaps, in blocks each way."""
        self.blocks_swapped_out.labels(**self._l).inc(num_blocks_out)
        self.blocks_swapped_in.labels(**self._l).inc(num_blocks_in)

    def on_request_preemptions(self, num_preemptions: int) -> None:
        """A finished request was preempted ``num_preemptions`` times (all its sequences together)."""
        self.request_preemptions.labels(**self._l).observe(num_preemptions)

    def on_admitted(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prompt_tokens.labels(**self._l).inc(num_prompt_tokens)
        self.prefix_cache_queries.labels(**self._l).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(**self._l).inc(num_cached_tokens)

    def on_token(self, first: bool, latency: float | None) -> None:
        """One output token; latency: seconds since arrival (the first token) or since the previous one,
        None for a sibling's token of a step whose latency was observed already (counted, not observed)."""
        self._generation_tokens.inc()
        if latency is not None:
            (self._ttft if first else self._itl).observe(latency)

    def on_finished(self, reason: str, e2e_seconds: float) -> None:
        self.request_success.labels(finished_reason=reason, **self._l).inc()
        self.e2e.labels(**self._l).observe(e2e_seconds)

    def on_phases(self, arrival: float, scheduled: float | None, first_token: float | None,
                  last_token: float) -> None:
        """A finished request's phases from its timestamps (seconds, one monotonic clock). Never
        scheduled (aborted or failed while queued): nothing is observed; scheduled but no token
        sampled: only its queue time."""
        if scheduled is None:
            return
        self.queue_time.labels(**self._l).observe(scheduled - arrival)
        if first_token is None:
            return
        self.prefill_time.labels(**self._l).observe(first_token - scheduled)
        self.decode_time.labels(**self._l).observe(last_token - first_token)
        self.inference_time.labels(**self._l).observe(last_token - scheduled)

    def on_worker_restart(self) -> None:
        """A worker (group) start after a failure begins."""
        self.worker_restarts.labels(**self._l).inc()

    def on_worker_restart_failure(self) -> None:
        """That start did not come up: the worker died, failed to load or to allocate its pool, or a
        shutdown cut the start short."""
        self.worker_restart_failures.labels(**self._l).inc()
