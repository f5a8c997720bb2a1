"""OpenTelemetry tracing: one span per request, a ``kv.preempt`` child span per preemption.

Configured by the standard variables: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console`` or ``none``),
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (read by the OTLP exporter,
HTTP/protobuf) and ``OTEL_SERVICE_NAME``; ``--otlp-traces-endpoint URL`` turns on OTLP export to that
URL. One departure from the SDK's defaults: with neither the variable nor the flag set, tracing is
off, rather than exporting to localhost:4318 from every server. Off costs nothing: opentelemetry is
not even imported, and `make_tracer` returns None, which callers check.

Request spans follow the OpenTelemetry GenAI semantic conventions (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.response.id``, ``gen_ai.usage.input_tokens`` /
``output_tokens``, ``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk``)
and continue a W3C ``traceparent`` (Trace Context, https://www.w3.org/TR/trace-context/) when the
client sent one. Preemption spans carry ``pagedkv.preempt.*`` attributes (see `RequestTracer.preempt`).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

EXPORTERS = ("otlp", "console", "none")
# vLLM's name for the same quantity, kept beside the semconv one so its dashboards port unchanged
TTFT_VLLM_ATTRIBUTE = "gen_ai.latency.time_to_first_token"
# How long shutdown waits for the last batched spans: the OTLP exporter's default timeout for one export
# (OTEL_EXPORTER_OTLP_TIMEOUT). A collector that is down or unreachable costs at most this much.
FLUSH_TIMEOUT_S = 10.0


def _traces_url(endpoint: str) -> str:
    """``http://host:4318`` -> ``http://host:4318/v1/traces``; a URL with a path is taken as is."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def make_tracer(otlp_traces_endpoint: str | None = None, span_exporter: Any = None,
                service_name: str = "pagedkv") -> "RequestTracer | None":
    """The engine's tracer, or None when tracing is off.

    span_exporter: an SDK SpanExporter to use instead of the environment's choice (tests pass an
    InMemorySpanExporter). Raises ValueError for an OTEL_TRACES_EXPORTER other than otlp, console
    or none (a comma-separated list takes its first entry).
    """
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")[0].strip().lower()
    if choice and choice not in EXPORTERS:
        raise ValueError(f"OTEL_TRACES_EXPORTER must be one of {EXPORTERS}, got {choice!r}")
    if span_exporter is None:
        if choice == "none" or (not choice and not otlp_traces_endpoint):
            return None
        choice = choice or "otlp"

    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    # OTEL_SERVICE_NAME wins over our default (Resource.create reads it; explicit attributes would override)
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    if span_exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    elif choice == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=_traces_url(otlp_traces_endpoint) if otlp_traces_endpoint else None)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return RequestTracer(provider)


def _ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as OpenTelemetry's epoch nanoseconds."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTracer:
    """Opens and closes the spans of requests and their preemptions (all times time.monotonic() s)."""

    def __init__(self, provider):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pagedkv")
        self._propagator = TraceContextTextMapPropagator()
        self._preempt_spans: dict[str, tuple[Any, float]] = {}  # sequence id -> (kv.preempt span, start)

    def start_request(self, request_id: str, model: str, num_prompt_tokens: int, arrival_time: float,
                      traceparent: str | None = None, tracestate: str | None = None,
                      attributes: dict | None = None):
        """Open the span of one request, as a child of the client's ``traceparent`` when given.

        A malformed traceparent is ignored (Trace Context: start a new trace).
        """
        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        context = self._propagator.extract(carrier) if carrier else None
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span(
            "llm_request", context=context, kind=SpanKind.SERVER, start_time=_ns(arrival_time),
            attributes={"gen_ai.operation.name": "text_completion", "gen_ai.request.model": model,
                        "gen_ai.response.id": request_id, "gen_ai.usage.input_tokens": num_prompt_tokens,
                        **(attributes or {})})

    def preempt(self, request_span, sequence_id: str, record) -> None:
        """Open a ``kv.preempt`` span under ``request_span`` for one `scheduler.preemption.Preemption`.

        It stays open until `resume` (or `end_request`): its duration is the time the request
        waited. Attributes: request id, mode, reason, blocks freed, tokens to recompute or bytes to
        move, both cost estimates in seconds.
        """
        from opentelemetry import trace

        attrs = {
            "pagedkv.request.id": sequence_id,
            "pagedkv.preempt.request_ids": list(record.request_ids),
            "pagedkv.preempt.mode": record.mode,
            "pagedkv.preempt.reason": record.reason,
            "pagedkv.preempt.num_blocks_freed": record.num_blocks,
            "pagedkv.preempt.swap_cost_s": record.swap_cost_s,
            "pagedkv.preempt.recompute_cost_s": record.recompute_cost_s,
        }
        if record.mode == "swap":
            attrs["pagedkv.preempt.bytes_to_move"] = record.num_bytes
        else:
            attrs["pagedkv.preempt.tokens_to_recompute"] = record.num_tokens
        if record.fallback:
            attrs["pagedkv.preempt.fallback"] = record.fallback
        if (open_entry := self._preempt_spans.pop(sequence_id, None)) is not None:
            # preempted again before resuming (a worker restart drops a swapped sequence's host KV):
            # end the earlier span here, or it is replaced in the map and never ends nor exports
            open_entry[0].set_attribute("pagedkv.preempt.wait_s", record.time - open_entry[1])
            open_entry[0].end(end_time=_ns(record.time))
        span = self.tracer.start_span("kv.preempt", context=trace.set_span_in_context(request_span),
                                      start_time=_ns(record.time), attributes=attrs)
        self._preempt_spans[sequence_id] = (span, record.time)

    def resume(self, sequence_id: str, mode: str, num_blocks: int, at: float) -> None:
        """End the open ``kv.preempt`` span of a sequence that runs again (``mode``: swap_in | recompute).

        Adds a ``kv.resume`` event and ``pagedkv.preempt.wait_s`` (seconds from preemption to resumption).
        Unknown ids are ignored (a sibling preempted with a group resumes without a span of its own).
        """
        entry = self._preempt_spans.pop(sequence_id, None)
        if entry is None:
            return
        span, start = entry
        span.set_attribute("pagedkv.preempt.wait_s", at - start)
        span.set_attribute("pagedkv.resume.mode", mode)
        span.add_event("kv.resume", {"pagedkv.resume.mode": mode, "pagedkv.resume.num_blocks": num_blocks},
                       timestamp=_ns(at))
        span.end(end_time=_ns(at))

    def end_request(self, span, sequence_ids: list[str], num_output_tokens: int, finish_reason: str,
                    arrival_time: float, first_token_time: float | None, error: str | None = None) -> None:
        """Close a request span (and any preemption span of its sequences still open: it never resumed)."""
        now = time.monotonic()
        for sid in sequence_ids:
            entry = self._preempt_spans.pop(sid, None)
            if entry is not None:
                entry[0].set_attribute("pagedkv.preempt.wait_s", now - entry[1])
                entry[0].end()
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        if first_token_time is not None:
            span.set_attribute("gen_ai.response.time_to_first_chunk", first_token_time - arrival_time)
            span.set_attribute(TTFT_VLLM_ATTRIBUTE, first_token_time - arrival_time)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def worker_recovery(self, reason: str, start: float, end: float, restart: int, attempts: int,
                        num_requeued: int, error: str | None = None) -> None:
        """Record one worker recovery as a ``worker.recovery`` span from failure to a serving worker,
        or to the end of trying (times time.monotonic() s), with the failure that caused it, the
        consecutive restart number, the worker starts it took (those that failed included) and the
        sequences requeued. error: why it ended with no serving worker (out of restarts, shut down),
        set as the span's ERROR status description; None for a recovery that brought one up."""
        span = self.tracer.start_span("worker.recovery", start_time=_ns(start), attributes={
            "pagedkv.recovery.reason": reason, "pagedkv.recovery.restart": restart,
            "pagedkv.recovery.attempts": attempts, "pagedkv.recovery.num_requeued": num_requeued})
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=_ns(end))

    def shutdown(self, timeout_s: float = FLUSH_TIMEOUT_S) -> bool:
        """Flush and stop the exporters (batched spans are sent now), waiting at most timeout_s seconds.

        Blocks the calling thread: on an event loop, call it through asyncio.to_thread. Returns False
        when the flush did not end in time (the SDK retries an unreachable collector with backoff): it
        goes on in a daemon thread, which does not hold the process's exit, and its spans may be lost.
        """
        thread = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        thread.start()
        thread.join(timeout_s)
        return not thread.is_alive()
