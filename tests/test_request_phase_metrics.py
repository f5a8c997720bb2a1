"""vLLM's per-request phase histograms (queue, prefill, decode, inference), on a fake worker and a
step clock: the engine's time.monotonic() reads the number of worker steps run so far."""

from __future__ import annotations

import asyncio
import types

from conftest import metric
from test_scheduler_properties import drive, make_engine

import pagedkv.scheduler.engine as engine_module
from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.metrics import Metrics

PHASES = ("queue", "prefill", "decode", "inference")


def test_phases_from_timestamps():
    m = Metrics("x")
    m.on_phases(10.0, 12.5, 13.0, 17.0)
    m.on_phases(10.0, 11.0, None, 11.0)  # scheduled, aborted before its first token: queue time only
    m.on_phases(10.0, None, None, 10.0)  # never scheduled: nothing
    got = {p: (m.registry.get_sample_value(f"pagedkv:request_{p}_time_seconds_count", {"model_name": "x"}),
               m.registry.get_sample_value(f"pagedkv:request_{p}_time_seconds_sum", {"model_name": "x"}))
           for p in PHASES}
    assert got == {"queue": (2, 3.5), "prefill": (1, 0.5), "decode": (1, 4.0), "inference": (1, 4.5)}


def test_queue_time_ends_at_first_scheduling(monkeypatch):
    # One seat: b waits while a runs its 3 steps (prefill + 2 decodes), then runs its own 3.
    cfg = EngineConfig(block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                       async_scheduling=False)
    engine, worker = make_engine(cfg, 16, 0, 0, 0.0)
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(monotonic=lambda: float(worker.steps)))
    arrivals = [(0, rid, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)) for rid in ("a", "b")]
    assert asyncio.run(drive(engine, worker, arrivals, {})) == {"a": "length", "b": "length"}
    got = {p: (metric(engine, f"pagedkv:request_{p}_time_seconds_count"),
               metric(engine, f"pagedkv:request_{p}_time_seconds_sum")) for p in PHASES}
    # a: scheduled at 0, tokens at 1, 2, 3; b: arrived at 0, scheduled at 3, tokens at 4, 5, 6
    assert got == {"queue": (2, 3.0), "prefill": (2, 2.0), "decode": (2, 4.0), "inference": (2, 6.0)}
    assert metric(engine, "pagedkv:e2e_request_latency_seconds_sum") == 3.0 + 6.0
