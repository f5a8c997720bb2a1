"""OpenTelemetry: a span per request continuing the client's traceparent, a kv.preempt child per preemption."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.common.tracing import RequestTracer, _traces_url, make_tracer
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT, GOLDEN_PROMPT_IDS
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
STORIES_BLOCK_BYTES = 20480

PREEMPT_ATTRIBUTES = {"pagedkv.request.id", "pagedkv.preempt.request_ids", "pagedkv.preempt.mode",
                      "pagedkv.preempt.reason", "pagedkv.preempt.num_blocks_freed", "pagedkv.preempt.swap_cost_s",
                      "pagedkv.preempt.recompute_cost_s", "pagedkv.preempt.wait_s", "pagedkv.resume.mode"}


def test_tracing_is_off_without_the_variable_or_the_flag(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert make_tracer() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert make_tracer("http://collector:4318") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER must be one of .* got 'jaeger'"):
        make_tracer()


def test_otlp_endpoint_gets_the_traces_path_only_when_it_has_none(monkeypatch):
    assert _traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert _traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert _traces_url("http://collector:4318/custom/traces") == "http://collector:4318/custom/traces"
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tracer = make_tracer("http://127.0.0.1:9")  # exporting is lazy: nothing is sent until spans end
    [processor] = tracer.provider._active_span_processor._span_processors
    assert processor.span_exporter._endpoint == "http://127.0.0.1:9/v1/traces"
    tracer.shutdown()


async def test_one_kv_preempt_span_per_preemption_parented_to_its_request_span(stories260k):
    exporter = InMemorySpanExporter()
    # 2 host blocks: short victims are swapped, longer ones fall back to recompute (both kinds appear)
    engine = await Engine.start(
        EngineConfig(model=str(stories260k), num_gpu_blocks=12, enable_prefix_caching=False,
                     preemption_mode="swap", swap_space=2 * STORIES_BLOCK_BYTES / 2**30),
        tracer=make_tracer(span_exporter=exporter))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=60)

        async def run(i):
            return [t async for o in engine.add_request(GOLDEN_PROMPT_IDS, greedy, f"req-{i}",
                                                         traceparent=TRACEPARENT) for t in o.token_ids]

        assert await asyncio.gather(*[run(i) for i in range(16)]) == [GOLDEN_OUTPUT_IDS] * 16
        spans = exporter.get_finished_spans()
        requests = {s.attributes["gen_ai.response.id"]: s for s in spans if s.name == "llm_request"}
        preempts = [s for s in spans if s.name == "kv.preempt"]
        assert sorted(requests) == sorted(f"req-{i}" for i in range(16))
        counted = sum(engine.metrics.registry.get_sample_value(
            "pagedkv:num_preemptions_total", {"model_name": engine.model_config.name, "mode": m}) or 0
            for m in ("swap", "recompute"))
        assert len(preempts) == counted == engine.scheduler.num_preemptions > 0
        assert {s.attributes["pagedkv.preempt.mode"] for s in preempts} == {"swap", "recompute"}

        for span in requests.values():
            assert format(span.context.trace_id, "032x") == TRACE_ID  # the client's trace continues
            assert format(span.parent.span_id, "016x") == PARENT_ID and span.parent.is_remote
            a = span.attributes
            assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("text_completion", "stories260K")
            assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (5, 60)
            assert a["gen_ai.response.finish_reasons"] == ("length",)
            assert 0 < a["gen_ai.response.time_to_first_chunk"] == a["gen_ai.latency.time_to_first_token"]

        for span in preempts:
            a = span.attributes
            assert PREEMPT_ATTRIBUTES <= set(a)
            owner = requests[a["pagedkv.request.id"]]
            assert span.parent.span_id == owner.context.span_id and span.context.trace_id == owner.context.trace_id
            assert a["pagedkv.preempt.reason"].startswith("kv_cache_full: no free block for req-")
            assert a["pagedkv.preempt.num_blocks_freed"] >= 1
            assert a["pagedkv.preempt.swap_cost_s"] > 0 and a["pagedkv.preempt.recompute_cost_s"] > 0
            if a["pagedkv.preempt.mode"] == "swap":
                assert a["pagedkv.preempt.bytes_to_move"] == a["pagedkv.preempt.num_blocks_freed"] * STORIES_BLOCK_BYTES
                assert a["pagedkv.resume.mode"] == "swap_in"
            else:
                assert a["pagedkv.preempt.tokens_to_recompute"] > 0
                assert a["pagedkv.preempt.fallback"].startswith("host pool full:")
                assert a["pagedkv.resume.mode"] == "recompute"
            (event,) = span.events
            assert event.name == "kv.resume" and event.attributes["pagedkv.resume.mode"] == a["pagedkv.resume.mode"]
            wait = a["pagedkv.preempt.wait_s"]
            assert wait > 0 and abs((span.end_time - span.start_time) / 1e9 - wait) < 1e-3
            assert owner.start_time <= span.start_time and span.end_time <= owner.end_time
    finally:
        await engine.shutdown()


async def test_a_beam_search_span_counts_the_output_tokens_usage_counts(stories260k):
    """n = 3 beams of 8 tokens: 24 output tokens, as the returned choices (usage) count them, whatever
    sequences the search forked and dropped on the way."""
    exporter = InMemorySpanExporter()
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=64),
                                tracer=make_tracer(span_exporter=exporter))
    try:
        params = SamplingParams(n=3, use_beam_search=True, max_tokens=8, ignore_eos=True)
        outs = [o async for o in engine.add_request(GOLDEN_PROMPT_IDS, params, "beam")]
        assert sorted(o.index for o in outs) == [0, 1, 2] and sum(o.num_output_tokens for o in outs) == 24
        (span,) = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
        assert span.attributes["gen_ai.usage.output_tokens"] == 24
    finally:
        await engine.shutdown()


async def test_the_api_passes_the_traceparent_header_to_the_request_span(stories260k):
    exporter = InMemorySpanExporter()
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=16, swap_space=0.001),
                                tracer=make_tracer(span_exporter=exporter))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{server.port}/v1/completions",
                                    json={"prompt": GOLDEN_PROMPT, "max_tokens": 5, "temperature": 0},
                                    headers={"traceparent": TRACEPARENT}) as resp:
                body = await resp.json()
                assert resp.status == 200, body
        (span,) = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
        assert span.attributes["gen_ai.response.id"] == body["id"]
        assert format(span.context.trace_id, "032x") == TRACE_ID
        assert format(span.parent.span_id, "016x") == PARENT_ID
        assert span.attributes["gen_ai.usage.output_tokens"] == 5
    finally:
        await server.close()
        await engine.shutdown()


def test_console_exporter_prints_request_and_preemption_spans(stories260k):
    code = f"""
import asyncio
from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine
async def main():
    e = await Engine.start(EngineConfig(model={str(stories260k)!r}, num_gpu_blocks=6, enable_prefix_caching=False,
                                        swap_space=0.001, preemption_mode="swap"))
    p = SamplingParams(temperature=0, max_tokens=40)
    async def run(i):
        return [o async for o in e.add_request([1, 403, 407, 261, 378], p, f"r{{i}}")]
    await asyncio.gather(*[run(i) for i in range(4)])
    print("PREEMPTIONS", e.scheduler.num_preemptions)
    await e.shutdown()
asyncio.run(main())
"""
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "pagedkv-test"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    preemptions = int(out.stdout.split("PREEMPTIONS ")[1].split()[0])
    spans, depth, start = [], 0, None
    for i, ch in enumerate(out.stdout):  # the console exporter prints one JSON object per span
        if ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                spans.append(json.loads(out.stdout[start:i + 1]))
    names = [s["name"] for s in spans]
    assert names.count("llm_request") == 4
    assert names.count("kv.preempt") == preemptions > 0
    assert all(s["resource"]["attributes"]["service.name"] == "pagedkv-test" for s in spans)


def test_a_sequence_preempted_again_before_resuming_ends_its_first_preempt_span():
    """A worker restart while a sequence is swapped out preempts it again (its host KV is gone): the
    swap span ends at the second preemption instead of being dropped unended."""
    from pagedkv.scheduler.preemption import Preemption

    exporter = InMemorySpanExporter()
    tracer = make_tracer(span_exporter=exporter)
    span = tracer.start_request("r", "m", 5, arrival_time=100.0)
    swap = Preemption(["r"], "swap", "kv_cache_full", 2, 20, 40960, 0.1, 0.2, time=101.0)
    tracer.preempt(span, "r", swap)
    tracer.preempt(span, "r", Preemption(["r"], "recompute", "worker_restart: died", 0, 20, 0, 0.0, 0.2, time=103.5))
    tracer.resume("r", "recompute", 0, 104.0)
    tracer.end_request(span, ["r"], 7, "length", 100.0, 100.5)
    first, second = [s for s in exporter.get_finished_spans() if s.name == "kv.preempt"]
    assert (first.attributes["pagedkv.preempt.mode"], first.attributes["pagedkv.preempt.wait_s"]) == ("swap", 2.5)
    assert (second.attributes["pagedkv.preempt.mode"], second.attributes["pagedkv.preempt.wait_s"]) == ("recompute", 0.5)
    assert abs((first.end_time - first.start_time) / 1e9 - 2.5) < 1e-3


async def test_the_api_continues_the_tracestate_and_ignores_a_malformed_traceparent(stories260k):
    """Trace Context: the vendor ``tracestate`` travels with the traceparent into the request span's
    context (what it propagates onward); a malformed traceparent starts a new trace, the request still 200."""
    exporter = InMemorySpanExporter()
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=16),
                                tracer=make_tracer(span_exporter=exporter))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for headers in ({"traceparent": TRACEPARENT, "tracestate": "vendor=abc,other=1"},
                            {"traceparent": "00-zz-not-a-trace-01", "tracestate": "vendor=abc"}):
                async with session.post(f"http://127.0.0.1:{server.port}/v1/completions", headers=headers,
                                        json={"prompt": GOLDEN_PROMPT, "max_tokens": 2, "temperature": 0}) as resp:
                    assert resp.status == 200, await resp.text()
        continued, fresh = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
        assert format(continued.context.trace_id, "032x") == TRACE_ID
        assert dict(continued.context.trace_state) == {"vendor": "abc", "other": "1"}
        assert fresh.parent is None and format(fresh.context.trace_id, "032x") != TRACE_ID
        assert dict(fresh.context.trace_state) == {}
    finally:
        await server.close()
        await engine.shutdown()


async def test_every_preempted_log_line_names_its_request_id(stories260k):
    """The ``preempted`` line lists sequence ids (``<id>-0``, ``<id>-beam2`` for n > 1 and beams), which a
    log query on ``request_id`` misses: it also carries the request id, as every request-related line."""
    from structlog.testing import capture_logs

    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=8, enable_prefix_caching=False))
    try:
        params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=60, ignore_eos=True)

        async def run(rid):
            return [o async for o in engine.add_request(GOLDEN_PROMPT_IDS, params, rid)]

        with capture_logs() as logs:
            await asyncio.gather(run("a"), run("b"))
        preempted = [e for e in logs if e["event"] == "preempted"]
        assert len(preempted) > 0 and engine.scheduler.num_preemptions == sum(len(e["request_ids"]) for e in preempted)
        for e in preempted:
            assert e["request_ids"] == [f"{e['request_id']}-0", f"{e['request_id']}-1"]
    finally:
        await engine.shutdown()


class _HeldExporter(SpanExporter):
    """Exports only once released, as a slow or unreachable collector holds an export."""

    def __init__(self):
        self.exporting, self.release, self.spans = threading.Event(), threading.Event(), []

    def export(self, spans):
        self.exporting.set()
        self.release.wait(10)  # a guard: a flush on the event loop would otherwise hold the test for ever
        self.spans += spans
        return SpanExportResult.SUCCESS


def _held_tracer():
    exporter = _HeldExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))  # only shutdown exports
    return RequestTracer(provider), exporter


async def test_shutdown_flushes_the_spans_off_the_event_loop_and_loses_none(stories260k):
    """An unreachable collector holds the last flush for seconds (a closed port: 7 s of retries); the
    event loop runs on meanwhile, and the spans reach a collector that answers."""
    tracer, exporter = _held_tracer()
    engine = await Engine.start(EngineConfig(model=str(stories260k)), tracer=tracer)
    greedy = SamplingParams(temperature=0, max_tokens=len(GOLDEN_OUTPUT_IDS))
    assert [t async for o in engine.add_request(GOLDEN_PROMPT_IDS, greedy, "req-0") for t in o.token_ids] \
        == GOLDEN_OUTPUT_IDS
    shutdown = asyncio.ensure_future(engine.shutdown())
    assert await asyncio.to_thread(exporter.exporting.wait, 10)
    assert not shutdown.done()  # this coroutine runs while the flush waits on the collector
    exporter.release.set()
    await shutdown
    assert [(s.name, s.attributes["gen_ai.response.id"]) for s in exporter.spans] == [("llm_request", "req-0")]


def test_shutdown_gives_up_on_a_collector_that_does_not_answer():
    tracer, exporter = _held_tracer()
    tracer.end_request(tracer.start_request("r", "m", 5, arrival_time=time.monotonic()), [], 1, "stop",
                       time.monotonic(), None)
    assert tracer.shutdown(timeout_s=0.2) is False  # the export is held until released: never in time
    assert exporter.exporting.is_set() and exporter.spans == []
    exporter.release.set()
