"""`pagedkv bench`: trace replay, the KV token-state accounting (exact, in slots) and the reports.

A few requests only (seconds); no timing is asserted, only fields, counts and identities.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import sys
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestServer

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.api import build_app
from pagedkv.bench.replay import (TABLE_HEADER, BenchRequest, TraceRow, build_requests, load_trace, markdown_report,
                                  percentile, random_prompt, run_against_url, run_in_process, sse_data, table_row)
from pagedkv.bench.contiguous_allocator import ContiguousAllocator
from pagedkv.bench.kv_accounting import account_kv, running_stats, sample_engine, sample_snapshot, summarize_kv
from pagedkv.scheduler.cli import main
from pagedkv.scheduler.engine import Engine
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.preemption import PreemptionPolicy
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.request_queue import FCFSQueue
from pagedkv.scheduler.scheduler import Scheduler

KV_FIELDS = {"pool", "allocated", "token_state", "reservation", "internal", "external", "free"}


def assert_identities(s: dict) -> None:
    """token state + reservation + internal = allocated; allocated + free = pool; external within free."""
    assert all(isinstance(s[k], int) and s[k] >= 0 for k in KV_FIELDS), s
    assert s["token_state"] + s["reservation"] + s["internal"] == s["allocated"], s
    assert s["allocated"] + s["free"] == s["pool"], s
    assert 0 <= s["external"] <= s["free"], s


def test_accounting_classifies_every_slot_of_a_request():
    # block_size 4; a request with 6 computed tokens that will hold 9 in 4 blocks (16 slots)
    s = account_kv(0.0, 4, 10, 6, [([0, 1, 2, 3], 6, 9)], lambda: [6], 0, 1, 0)
    assert (s.allocated, s.token_state, s.reservation, s.internal, s.free) == (16, 6, 3, 7, 24)
    assert s.external == 0  # nothing waits


def test_shared_blocks_count_once_in_their_best_class():
    # two requests share block 0 (4 tokens, full) and hold one block each of their own
    holders = [([0, 1], 6, 8), ([0, 2], 5, 5)]
    s = account_kv(0.0, 4, 4, 1, holders, lambda: [1], 0, 2, 0)
    assert s.allocated == 12 and s.token_state == 4 + 2 + 1 and s.reservation == 2 and s.internal == 3
    assert s.token_state + s.reservation + s.internal == s.allocated


def test_external_fragmentation_is_free_runs_too_short_for_the_waiting_head():
    # 8 free blocks in runs of 3, 3 and 2; the head needs 4 blocks: none can serve it
    s = account_kv(0.0, 2, 10, 8, [([3, 4], 4, 4)], lambda: [3, 3, 2], 4, 1, 1)
    assert s.free == 16 and s.external == 16


def _contiguous_engine(num_blocks: int, block_size: int, max_model_len: int, held: list[tuple[int, int]],
                       free: list[int]):
    """A stand-in engine for `sample_engine`: a contiguous pool with one running request per (prompt,
    max_tokens) in ``held``, allocated in order from block 0, then those at the indexes in ``free`` freed."""
    kv = ContiguousAllocator(num_blocks, block_size, max_model_len)
    reqs = [Request(f"r{i}", [1] * p, SamplingParams(max_tokens=m, ignore_eos=True)) for i, (p, m) in enumerate(held)]
    for r in reqs:
        assert kv.allocate_slots(r, r.num_prompt_tokens) is not None
        r.num_computed_tokens = r.num_prompt_tokens
    for i in free:
        kv.free(reqs[i])
    live = [r for i, r in enumerate(reqs) if i not in free]
    sched = SimpleNamespace(requests={r.request_id: r for r in live}, running=live, waiting=FCFSQueue())
    return SimpleNamespace(kv=kv, scheduler=sched, max_model_len=max_model_len)


def _wait(engine, prompt_len: int, max_tokens: int) -> None:
    head = Request("head", [1] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.scheduler.requests["head"] = head
    engine.scheduler.waiting.add(head)


@pytest.mark.parametrize("head_tokens, external", [
    (None, 0),   # nothing waits
    (16, 24),    # 4 blocks: 6 free in runs of 3 and 3, none long enough; 6 x 4 slots kept out by fragmentation
    (12, 0),     # 3 blocks: either run takes it at the next step; no run keeps it out
    (32, 0),     # 8 blocks but only 6 free: too little memory, not fragmentation
    (44, 0),     # 11 blocks, more than the whole pool of 10
])
def test_contiguous_external_fragmentation_counts_free_slots_only_when_runs_keep_the_head_out(head_tokens, external):
    # block_size 4, 10 blocks; three requests hold 3, 4 and 3 blocks, the first and last finish:
    # free runs [0, 3) and [7, 10), 6 blocks (24 slots), the 4-block run [3, 7) held
    engine = _contiguous_engine(10, 4, 64, [(8, 4), (9, 7), (8, 4)], free=[0, 2])
    assert engine.kv.pool.free_runs() == [(0, 3), (7, 3)]
    if head_tokens is not None:
        _wait(engine, head_tokens - 1, 1)
    s = sample_engine(engine, 0.0)
    assert (s.allocated, s.token_state, s.free, s.external) == (16, 9, 24, external)
    assert (s.running, s.waiting) == (1, 0 if head_tokens is None else 1)


def test_contiguous_external_fragmentation_is_zero_while_a_run_fits_the_head_beside_shorter_runs():
    # trace-timed replay: a request that arrived during the step waits for the next one, though
    # the run [5, 10) holds it; the 1-block run [0, 1) keeps nobody out
    engine = _contiguous_engine(10, 4, 64, [(3, 1), (15, 1), (17, 3)], free=[0, 2])
    assert engine.kv.pool.free_runs() == [(0, 1), (5, 5)]
    _wait(engine, 10, 2)  # 12 tokens: 3 blocks
    s = sample_engine(engine, 0.0)
    assert (s.allocated, s.free, s.external) == (16, 24, 0)


def test_summary_fractions_come_from_slot_totals():
    a = account_kv(0.0, 4, 10, 6, [([0, 1, 2, 3], 6, 9)], lambda: [], 0, 1, 0)
    b = account_kv(0.0, 4, 10, 8, [([0, 1], 8, 8)], lambda: [], 0, 1, 0)
    kv = summarize_kv([a, b])  # no time between them: they weigh alike
    assert kv["slot_totals"]["allocated"] == 24 and kv["slot_totals"]["token_state"] == 14
    assert kv["utilization"] == 14 / 24


def test_kv_fractions_are_weighted_by_time_not_by_step():
    # 16 slots allocated, 4 of token state for 3 s; then 16 of 16 for 1 s (the last sample ends the run).
    # By step the utilization read (4 + 16) / 32 = 62.5%; over time the memory held token state
    # (4 * 3 + 16 * 1) / (16 * 4) = 43.75% of the allocated slot-seconds
    a = account_kv(0.0, 4, 10, 6, [([0, 1, 2, 3], 4, 16)], lambda: [], 0, 1, 0)
    b = account_kv(3.0, 4, 10, 6, [([0, 1, 2, 3], 16, 16)], lambda: [], 0, 1, 0)
    c = account_kv(4.0, 4, 10, 10, [], lambda: [], 0, 0, 0)
    kv = summarize_kv([a, b, c])
    assert kv["utilization"] == 28 / 64 and kv["reservation_frac"] == 36 / 64
    assert kv["allocated_frac_of_pool"] == 64 / 160
    assert kv["slot_totals"]["token_state"] == 20  # the integer per-sample sums stay


async def test_the_pool_is_accounted_empty_once_the_engine_goes_idle(stories260k):
    # each sample holds until the next one: the last one before an idle gap (between trace arrivals)
    # must show the pool after the finished requests freed, not the step before, or it counts their
    # blocks as allocated for the whole gap
    requests = [BenchRequest(0, 0.0, 20, 3, 3), BenchRequest(1, 0.0, 33, 3, 3)]
    out = await run_in_process(EngineConfig(model=str(stories260k), num_gpu_blocks=16), requests, progress=False)
    last = out["samples"][-1]
    assert (last["allocated"], last["free"], last["running"], last["waiting"]) == (0, 256, 0, 0)
    assert max(s["allocated"] for s in out["samples"]) == 16 * 5  # 20 + 2 and 33 + 2 tokens: 2 + 3 blocks


def test_trace_loading_scaling_and_clipping(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.5000000,100,10\n"
                   "2023-11-16 18:00:02.0000000,2000,300\n2023-11-16 18:00:03.2500000,7,0\n")
    rows = load_trace(csv)
    assert rows == [TraceRow(0.0, 100, 10), TraceRow(1.5, 2000, 300), TraceRow(2.75, 7, 0)]
    reqs, clipped = build_requests(rows, 3, 512, 0.5, time_scale=2.0)
    assert [(r.arrival, r.prompt_len, r.max_tokens) for r in reqs] == [(0.0, 50, 5), (3.0, 362, 150), (5.5, 4, 1)]
    assert clipped == 1  # 1000 + 150 > 512: the prompt is cut to 362
    reqs, _ = build_requests(rows, 2, 512, 1.0, request_rate=math.inf)
    assert [r.arrival for r in reqs] == [0.0, 0.0]
    reqs, _ = build_requests(rows, 1, 512, 1.0, max_tokens_policy="max-model-len")
    assert (reqs[0].prompt_len, reqs[0].max_tokens, reqs[0].output_len) == (100, 412, 10)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:00:00,1\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(bad)


def test_mean_running_is_weighted_by_time():
    mk = lambda t, running: account_kv(t, 4, 10, 10, [], lambda: [], 0, running, 0)  # noqa: E731
    assert running_stats([mk(0.0, 2), mk(1.0, 10), mk(1.5, 0), mk(3.0, 0)]) == (10, (2 * 1.0 + 10 * 0.5) / 3.0)


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None


def test_bench_compares_allocators_and_the_accounting_adds_up(stories260k, tmp_path, capsys):
    plots = importlib.util.find_spec("matplotlib") is not None
    argv = ["bench", "--model", str(stories260k), "--trace", "code", "--num-requests", "6", "--request-rate", "inf",
            "--compare-allocators", "--kv-cache-tokens", "1024", "--output-dir", str(tmp_path), "--name", "smoke",
            "--no-progress"] + ([] if plots else ["--no-plots"])
    assert main(argv) == 0
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert set(report["runs"]) == {"paged", "contiguous"}
    assert "Splitwise" in report["attribution"] and "Splitwise" in (tmp_path / "smoke.md").read_text()
    w = report["workload"]
    assert w["num_requests"] == 6 and w["token_scale"] > 0 and "p99" in w["token_scale_rule"]
    for name, run in report["runs"].items():
        assert run["num_completed"] == 6 and run["num_errors"] == 0
        assert run["setup"]["kv_allocator"] == name and run["setup"]["num_gpu_blocks"] == 1024 // 16
        for key in ("request_throughput", "output_token_throughput", "duration_s", "mean_running"):
            assert run[key] > 0
        for lat in ("ttft_s", "itl_s", "e2e_s"):
            assert set(run[lat]) == {"p50", "p90", "p99", "mean"}
        assert run["peak_running"] >= 1
        assert run["kv"]["num_samples"] == len(run["samples"]) > 0
        for s in run["samples"]:
            assert_identities(s)
        tot = run["kv"]["slot_totals"]
        assert tot["token_state"] + tot["reservation"] + tot["internal"] == tot["allocated"]
        assert 0 < run["kv"]["utilization"] <= 1
    assert all(s["external"] == 0 for s in report["runs"]["paged"]["samples"])  # paging: none, by construction
    assert report["runs"]["contiguous"]["num_preemptions"] == 0  # a reservation is never outgrown
    # ignore_eos + max_tokens: every request produced exactly its scaled GeneratedTokens
    assert report["runs"]["paged"]["output_tokens"] == report["runs"]["contiguous"]["output_tokens"]
    assert set(report["comparison"]) == {"mean_running", "peak_running", "request_throughput",
                                         "output_token_throughput", "utilization"}
    if plots:
        assert (tmp_path / "smoke-utilization.png").stat().st_size > 0
    assert "| paged |" in capsys.readouterr().out
    # a run with failed requests says so under its table, whose figures count completed requests only
    report["runs"]["paged"].update(num_errors=2, errors=["RuntimeError: HTTP 400: x", "TimeoutError: "])
    assert ("**`paged`: 2 of 6 requests failed**, left out of every figure above; first errors: "
            "`RuntimeError: HTTP 400: x`; `TimeoutError: `") in markdown_report(report)
    assert "requests failed" not in markdown_report({**report, "runs": {"contiguous": report["runs"]["contiguous"]}})


def test_sse_data_splits_events_across_reads_with_either_line_end():
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\n: comment\nevent: x\ndata: [DONE]\n\n'
    for cut in range(len(stream) + 1):  # every split of the stream into two reads
        first, partial = sse_data(b"", stream[:cut])
        second, partial = sse_data(partial, stream[cut:])
        assert first + second == [b'{"a":1}', b'{"b":2}'] and partial == b""
    assert sse_data(b"", b'data: {"a"') == ([], b'data: {"a"')


async def test_bench_against_a_server_polls_kv_cache(stories260k):
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=32),
                                kv_allocator=ContiguousAllocator.factory(16))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        rows = [TraceRow(0.0, 40, 20)] * 4
        reqs, _ = build_requests(rows, 4, engine.max_model_len, 1.0, request_rate=math.inf)
        run = await run_against_url(str(server.make_url("/")), reqs, engine.model_config.vocab_size,
                                    poll_interval=0.01, progress=False)
    finally:
        await server.close()
        await engine.shutdown()
    assert run["num_completed"] == 4 and run["output_tokens"] == 80
    assert run["samples"] and all(assert_identities(s) is None for s in run["samples"])
    # 4 reservations of 4 blocks (60 tokens) in a 32-block pool: everything fits, nothing waits long
    assert max(s["allocated"] for s in run["samples"]) <= 4 * 4 * 16


async def test_a_second_replay_of_the_same_trace_shows_its_prefix_cache_hits(stories260k):
    """The report's prefix hits (usage.prompt_tokens_details.cached_tokens): none on a fresh server; on
    a second replay of the same prompts, every full block but one token's (2 of 40 tokens' 2.5 blocks)."""
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=64))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        reqs, _ = build_requests([TraceRow(0.0, 40, 4)] * 4, 4, engine.max_model_len, 1.0, request_rate=math.inf)
        runs = [await run_against_url(str(server.make_url("/")), reqs, engine.model_config.vocab_size,
                                      progress=False) for _ in range(2)]
    finally:
        await server.close()
        await engine.shutdown()
    assert [r["prompt_tokens"] for r in runs] == [160, 160]
    assert [r["cached_prompt_tokens"] for r in runs] == [0, 4 * 32]
    hits = [table_row(name, r).split("|")[9].strip() for name, r in zip(("first", "second"), runs)]
    assert hits == ["0.0%", "80.0%"] and TABLE_HEADER.split("|")[9].strip() == "prefix hits"


async def test_text_prompts_reach_the_server_at_the_requested_token_lengths(stories260k):
    engine = await Engine.start(EngineConfig(model=str(stories260k), num_gpu_blocks=32))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    try:
        rows = [TraceRow(0.0, n, 3) for n in (2, 17, 40, 100)]
        reqs, _ = build_requests(rows, 4, engine.max_model_len, 1.0, request_rate=math.inf)
        run = await run_against_url(str(server.make_url("/")), reqs, engine.model_config.vocab_size, progress=False,
                                    text_tokenizer=str(stories260k / "tokenizer.json"))
    finally:
        await server.close()
        await engine.shutdown()
    # whole-word pieces re-encode one token each; the server adds BOS: the prompt lengths asked for
    assert run["num_completed"] == 4 and run["output_tokens"] == 12
    assert run["prompt_tokens"] == 2 + 17 + 40 + 100


_WORKLOAD = {"trace": "stand-in", "num_requests": 8, "arrivals": "all at once (--request-rate inf)", "token_scale": 1.0,
             "token_scale_rule": "none", "num_clipped": 0, "max_model_len": 512, "mean_prompt_len": 8.0,
             "mean_output_len": 2.0, "mean_max_tokens": 2.0, "max_tokens_policy": "trace"}


async def test_a_server_that_goes_away_mid_run_still_gives_a_report(capsys):
    """A stand-in server: even requests stream two tokens, odd ones lose their connection, and the
    /metrics read after the replay finds no server. The run reports both halves and an unknown
    preemption count; a --url where nothing listens is one clear line."""
    from aiohttp import web

    metrics_reads = []

    async def models(request):
        return web.json_response({"data": [{"id": "stand-in", "max_model_len": 512}]})

    async def metrics(request):
        metrics_reads.append(1)
        if len(metrics_reads) > 1:  # gone by the end of the run
            request.transport.close()
        return web.Response(text="pagedkv:num_preemptions_total 0.0\n")

    async def gone(request):
        request.transport.close()
        return web.Response()

    async def completions(request):
        body = await request.json()
        if body["prompt"][1] % 2:  # the prompts are seeded: about half of them
            request.transport.close()
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2):
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}\n\n'
                         b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.get("/metrics", metrics), web.get("/kv_cache", gone),
                    web.post("/v1/completions", completions)])
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        reqs, _ = build_requests([TraceRow(0.0, 8, 2)] * 8, 8, 512, 1.0, request_rate=math.inf)
        run = await run_against_url(str(server.make_url("/")), reqs, 512, poll_interval=0.01, progress=False)
        url = str(server.make_url("/"))
    finally:
        await server.close()
    rng = random.Random(0)  # run_against_url's prompts (seed 0): which requests the server dropped
    failed = sum(random_prompt(rng, 8, 512)[1] % 2 for _ in range(8))
    assert 0 < failed < 8 and run["num_errors"] == failed and run["num_completed"] == 8 - failed
    assert run["output_tokens"] == 2 * (8 - failed) and run["num_preemptions"] is None
    assert all(e.startswith(("ClientOSError", "ServerDisconnectedError", "ClientPayloadError")) for e in run["errors"])
    assert "| - |" in table_row("server", run) and run["step_time_fit"] is None  # polls are not engine steps
    assert "preemptions unknown" in markdown_report({"workload": _WORKLOAD, "runs": {"server": run}})
    with pytest.raises(ConnectionError, match=r"^no server answers at --url http://127\.0\.0\.1:\d+: "):
        await run_against_url(url, reqs, 512, progress=False)


@pytest.mark.parametrize("extra,flag", [(["--num-requests", "0"], "--num-requests"),
                                        (["--url-api", "transformers"], "--url-api"),
                                        (["--block-size-sweep", "8,12"], "--block-size-sweep"),
                                        (["--request-rate", "-1"], "--request-rate"),
                                        (["--token-scale", "x"], "--token-scale"),
                                        (["--url", "localhost:8000"], "--url"),
                                        (["--compare-allocators", "--block-size-sweep", "8,16"], "--compare-allocators")])
def test_bad_bench_flags_are_argparse_errors_naming_the_flag(extra, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--no-plots"] + extra)
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_asking_for_max_model_len_stops_at_the_real_length_and_still_adds_up(stories260k, tmp_path):
    argv = ["bench", "--model", str(stories260k), "--trace", "conv", "--num-requests", "4", "--request-rate", "inf",
            "--kv-allocator", "contiguous", "--max-tokens", "max-model-len", "--kv-cache-tokens", "1024",
            "--output-dir", str(tmp_path), "--name", "mml", "--no-progress", "--no-plots"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "mml.json").read_text())
    w, run = report["workload"], report["runs"]["contiguous"]
    assert w["max_tokens_policy"] == "max-model-len" and w["mean_max_tokens"] > w["mean_output_len"]
    assert w["arrivals"] == "all at once (--request-rate inf)"
    assert run["num_completed"] == 4 and run["output_tokens"] == round(4 * w["mean_output_len"])
    # each request reserves its whole context: at most 2 of 512 tokens fit in 1024 slots
    assert run["peak_running"] <= 2
    for s in run["samples"]:
        assert_identities(s)
    assert run["kv"]["slot_totals"]["internal"] > run["kv"]["slot_totals"]["token_state"]


def test_control_plane_microbenchmark_keeps_every_request_running():
    spec = importlib.util.spec_from_file_location(
        "bench_control_plane", __import__("pathlib").Path(__file__).resolve().parents[1] / "ops/bench_control_plane.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = mod.measure(16, steps=20)
    assert row["running"] == 16 and row["steps"] == 20
    assert set(row) >= {"total_ms_median", "schedule_ms_median", "plan_codec_ms_median", "result_codec_ms_median",
                        "apply_ms_median"}


def _ops_module(name: str):
    spec = importlib.util.spec_from_file_location(name, __import__("pathlib").Path(__file__).resolve().parents[1] / f"ops/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_soak_percentiles_are_nearest_rank():
    p = _ops_module("soak")._percentile
    assert p([1.0, 2.0], 0.5) == 1.0  # was 2.0: int(q * n) is one rank high when q * n is whole
    assert p([float(i) for i in range(1, 101)], 0.99) == 99.0 and p([float(i) for i in range(1, 101)], 0.5) == 50.0
    assert p([3.0, 1.0, 2.0], 0.5) == 2.0 and p([5.0], 0.99) == 5.0 and p([], 0.5) is None


async def test_soak_counts_a_hung_request_as_an_error_not_a_walkaway():
    """A client not drawn to walk away whose request outlives the session's timeout was counted
    "aborted", so a soak whose server hung passed (exit 0)."""
    import argparse

    import aiohttp
    from aiohttp import web

    soak = _ops_module("soak")

    async def completions(request):
        await asyncio.sleep(5)
        return web.json_response({"choices": [{}]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        s = soak.Soak(argparse.Namespace(seed=0))
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
            await s.one(session, url, {"stream": False, "n": 1}, None, None)  # hangs: an error
            await s.one(session, url, {"stream": False, "n": 1}, 0.05, None)  # walks away: aborted
    finally:
        await server.close()
    assert s.errors == {"timeout": 1} and s.outcomes == {"aborted": 1} and s.done == 2


def test_control_plane_and_worker_host_p90_is_not_below_the_median():
    """int(0.9 * (n - 1)) rounded down: with two measured steps the "p90" was the faster one."""
    row = _ops_module("bench_control_plane").measure(4, steps=2)
    assert row["total_ms_p90"] >= row["total_ms_median"]
    row = _ops_module("bench_worker_host").measure(2, 16, 64, 5, 16)  # steps 4 and 5 measured, stub forward
    assert row["execute_p90_ms"] >= row["execute_ms"]


def test_kernel_bench_peak_bandwidth_takes_the_most_specific_device_name():
    peak = _ops_module("bench_kernels").peak_gbps
    assert peak("NVIDIA GH200 480GB", None) == 4000.0  # was H200's 4800: "H200" matched first
    assert peak("NVIDIA H200", None) == 4800.0 and peak("NVIDIA H100 80GB HBM3", None) == 3350.0
    assert peak("NVIDIA H100 PCIe", None) == 2000.0 and peak("NVIDIA H200", 1234.0) == 1234.0


def test_before_after_runs_each_tree_from_its_own_venv_whatever_pythonpath_names(tmp_path, monkeypatch):
    """A PYTHONPATH naming this checkout (as a session's setup exports) came before the baseline venv's
    editable install: the baseline's server and bench ran this tree, and the ratio compared it with itself."""
    from pathlib import Path

    mod = _ops_module("bench_before_after")

    def tree(name: str, imports: Path) -> Path:  # a venv whose editable install (after PYTHONPATH) names ``imports``
        root, pkg = tmp_path / name, tmp_path / f"{name}-pkg"
        (root / ".venv/bin").mkdir(parents=True)
        pkg.mkdir()
        (pkg / "pagedkv").symlink_to(imports)
        (root / ".venv/bin/pagedkv").write_text("")
        python = root / ".venv/bin/python"
        python.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{pkg}" exec {sys.executable} "$@"\n')
        python.chmod(0o755)
        return root

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pagedkv").symlink_to(mod.HERE)
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    base = tree("base", tmp_path / "base")
    command, env = mod.pagedkv_command(base)
    assert command == [str(base / ".venv/bin/pagedkv")] and "PYTHONPATH" not in env and env["OMP_NUM_THREADS"]
    stray = tree("stray", mod.HERE)  # its venv installs another checkout
    with pytest.raises(RuntimeError, match=rf"^pagedkv run for {stray} imports .*"):
        mod.pagedkv_command(stray)
    with pytest.raises(RuntimeError, match="has no .venv/bin/pagedkv"):
        mod.pagedkv_command(tmp_path / "shadow")


def test_snapshot_fragmentation_reads_the_head_of_the_queue_not_the_first_arrival():
    # `--url` accounting: 6 free blocks in runs of 3 and 3 (block_size 4). The first arrival (12 tokens,
    # 3 blocks) would fit a run, but a later one with higher priority (16 tokens, 4 blocks) is admitted
    # next and no run holds it: 24 free slots are kept out by fragmentation, not 0.
    held = {"id": "r1", "status": "running", "num_tokens": 13, "num_computed_tokens": 13, "block_table": [3, 4, 5, 6],
            "num_prompt_tokens": 9, "max_tokens": 7, "queue_position": None}
    first = {"id": "r0", "status": "waiting", "num_tokens": 11, "num_computed_tokens": 0, "block_table": [],
             "num_prompt_tokens": 11, "max_tokens": 1, "queue_position": 1}
    urgent = {**first, "id": "r2", "num_tokens": 15, "num_prompt_tokens": 15, "queue_position": 0}
    snap = {"block_size": 4, "num_gpu_blocks": 10, "num_free_blocks": 6, "allocator": "contiguous",
            "free_runs": [[0, 3], [7, 3]], "requests": [held, first, urgent],
            "num_requests_running": 1, "num_requests_waiting": 2}
    assert sample_snapshot(snap, 0.0, 64).external == 24
    assert sample_snapshot({**snap, "requests": [held, first]}, 0.0, 64).external == 0


def test_kv_cache_snapshot_gives_waiting_requests_their_place_in_the_service_order():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(kv, 8, 64, PreemptionPolicy("recompute", "priority"))
    for rid, arrival, priority in [("low", 1.0, 2), ("high", 2.0, 0), ("mid", 1.5, 1)]:
        sched.add(Request(rid, [1] * 4, SamplingParams(max_tokens=8), arrival_time=arrival, priority=priority))
    engine = SimpleNamespace(kv=kv, scheduler=sched, config=SimpleNamespace(tensor_parallel_size=1),
                             kv_cache_dtype="float32", kv_bytes_per_block=0)
    snap = Engine.kv_cache_snapshot(engine)
    assert {r["id"]: r["queue_position"] for r in snap["requests"]} == {"low": 2, "high": 0, "mid": 1}
