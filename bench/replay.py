"""``pagedkv bench``: replay a request trace and measure throughput, latency and KV memory efficiency.

A trace is a CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (the Azure LLM inference
traces 2023: Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
ISCA 2024; CC-BY 4.0). Each row becomes one request: a prompt of random token ids of the
(scaled) context length and ``max_tokens`` = the (scaled) generated length with EOS ignored, as
the trace's README prescribes. Arrivals follow the trace's timestamps (times ``--time-scale``) or a
Poisson process at ``--request-rate``.

KV token-state accounting (token state, reservation, internal and external fragmentation): see
`bench.kv_accounting`; it is sampled after every engine step and whenever the engine goes idle,
through the engine's step and idle hooks (in-process), or by polling ``/kv_cache`` (``--url``).
``--kv-allocator contiguous`` plugs the pre-paging baseline (`bench.contiguous_allocator`) into
the engine in place of the paged one.

The benchmark is a measurement tool beside the server, not part of it: it drives the engine
through its public interface (`Engine.start`, `add_request`, ``step_hooks``, ``idle_hooks``) and
the CLI calls it (``pagedkv bench``); nothing in the serving path imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import msgspec

from pagedkv.bench.contiguous_allocator import ContiguousAllocator
from pagedkv.bench.kv_accounting import (KVSample, running_stats, sample_engine, sample_snapshot, step_time_fit,
                                     summarize_kv)

TRACE_NAMES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
ATTRIBUTION = ("Azure LLM inference trace 2023 (github.com/Azure/AzurePublicDataset, CC-BY 4.0): Patel et al., "
               "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024.")


# ---- the trace --------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRow:
    """One trace row: arrival in seconds since the trace's first row, token counts as recorded."""

    arrival: float
    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class BenchRequest:
    """One request to replay: arrival offset (seconds), prompt length, max_tokens it asks for and
    output_len it really generates (tokens; the client stops reading there when max_tokens is larger).
    """

    index: int
    arrival: float
    prompt_len: int
    max_tokens: int
    output_len: int


def default_trace_dir() -> Path:
    """$PAGEDKV_TRACES, else ../shared/traces/azure-llm-2023 next to the repository."""
    env = os.environ.get("PAGEDKV_TRACES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared/traces/azure-llm-2023"


def resolve_trace(trace: str) -> Path:
    """``conv`` / ``code`` name the Azure traces; anything else is a CSV path. Raises FileNotFoundError."""
    path = default_trace_dir() / TRACE_NAMES[trace] if trace in TRACE_NAMES else Path(trace)
    if not path.is_file():
        hint = " (set $PAGEDKV_TRACES to the Azure traces' folder, or give a CSV path)" if trace in TRACE_NAMES else ""
        raise FileNotFoundError(f"trace {trace!r}: no file at {path}{hint}")
    return path


def _parse_time(s: str) -> float:
    """Seconds since the epoch of '2023-11-16 18:17:03.9799600' (more fraction digits than strptime takes)."""
    base, _, frac = s.strip().partition(".")
    return datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + frac) if frac else 0.0)


def load_trace(path: Path) -> list[TraceRow]:
    """Every row of a trace CSV. Raises ValueError naming the file when a column is missing or bad."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}")
        t0 = None
        for line, rec in enumerate(reader, start=2):
            try:
                t = _parse_time(rec["TIMESTAMP"])
                c, g = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except ValueError as e:
                raise ValueError(f"{path}:{line}: {e}") from None
            t0 = t if t0 is None else t0
            rows.append(TraceRow(t - t0, c, g))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def auto_token_scale(rows: list[TraceRow], max_model_len: int) -> float:
    """max_model_len / the 99th percentile of context + generated tokens over the whole trace."""
    return max_model_len / percentile([r.context_tokens + r.generated_tokens for r in rows], 99)


def build_requests(rows: list[TraceRow], num_requests: int, max_model_len: int, token_scale: float, *,
                   time_scale: float = 1.0, request_rate: float | None = None, seed: int = 0,
                   max_tokens_policy: str = "trace") -> tuple[list[BenchRequest], int]:
    """The first ``num_requests`` rows as requests, token counts times ``token_scale``.

    Each length is rounded and at least 1; a request still longer than max_model_len has its
    prompt cut to fit (counted in the second return value). Arrivals: the trace's offsets times
    ``time_scale``, or Poisson at ``request_rate`` requests/s (math.inf: all at once).
    max_tokens_policy: "trace" asks for exactly the generated length (the trace README's rule);
    "max-model-len" asks for all the room left (max_model_len - prompt), as a client that does
    not know the output length does, and the output still ends at the generated length.
    """
    if max_tokens_policy not in ("trace", "max-model-len"):
        raise ValueError(f"max_tokens_policy must be trace or max-model-len, got {max_tokens_policy!r}")
    rng = random.Random(seed)
    out, clipped, t = [], 0, 0.0
    for i, r in enumerate(rows[:num_requests]):
        m = min(max(1, round(r.generated_tokens * token_scale)), max_model_len - 1)
        p = max(1, round(r.context_tokens * token_scale))
        if p + m > max_model_len:
            p, clipped = max_model_len - m, clipped + 1
        if request_rate is None:
            arrival = r.arrival * time_scale
        else:
            arrival = t
            t += 0.0 if math.isinf(request_rate) else rng.expovariate(request_rate)
        out.append(BenchRequest(i, arrival, p, m if max_tokens_policy == "trace" else max_model_len - p, m))
    return out, clipped


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids drawn uniformly from [0, vocab_size)."""
    return [rng.randrange(vocab_size) for _ in range(length)]


# ---- running a benchmark ----------------------------------------------------------------------

@dataclass
class RequestRecord:
    """What one request experienced, in seconds since the run's start."""

    index: int
    prompt_len: int
    max_tokens: int
    submit: float = 0.0
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache
    error: str | None = None


async def _replay(requests: list[BenchRequest], run_one, progress: bool, desc: str) -> tuple[list[RequestRecord], float]:
    """Submit each request at its arrival time; returns the records and the run's start (`time.perf_counter`).

    Times come from `time.perf_counter`, not the event loop's clock: uvloop's ``loop.time()`` counts
    whole milliseconds and stands still within a loop pass, so chunks read in one pass had one time.
    """
    from tqdm import tqdm

    start = time.perf_counter()
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress, leave=False)
    records = [RequestRecord(r.index, r.prompt_len, r.max_tokens) for r in requests]

    async def one(req: BenchRequest, rec: RequestRecord):
        rec.submit = time.perf_counter() - start
        try:
            await run_one(req, rec, lambda: time.perf_counter() - start)
        except Exception as e:  # a failed request is reported, not fatal to the run
            rec.error = f"{type(e).__name__}: {e}"
        if rec.finish is None:
            rec.finish = time.perf_counter() - start
        bar.update(1)

    tasks = []
    for req, rec in zip(requests, records):
        delay = start + req.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, rec)))
    await asyncio.gather(*tasks)
    bar.close()
    return records, start


def _latency_stats(values: list[float]) -> dict:
    return {f"p{p}": percentile(values, p) for p in (50, 90, 99)} | {
        "mean": sum(values) / len(values) if values else None}


def summarize_run(records: list[RequestRecord], samples: list[KVSample], num_preemptions: int | None) -> dict:
    """Throughput (requests/s, output tokens/s), TTFT/ITL/E2E percentiles (s), concurrency, KV accounting.
    num_preemptions: None when unknown (a server that went away before it could be asked)."""
    ok = [r for r in records if r.error is None]
    t0 = min((r.submit for r in records), default=0.0)
    t1 = max((r.finish for r in records), default=0.0)
    duration = max(t1 - t0, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.token_times[0] - r.submit for r in ok if r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.finish - r.submit for r in ok]
    peak_running, mean_running = running_stats(samples)
    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),  # prefix-cache hits (usage.prompt_tokens_details)
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "ttft_s": _latency_stats(ttft),
        "itl_s": _latency_stats(itl),
        "e2e_s": _latency_stats(e2e),
        "peak_running": peak_running,
        "mean_running": mean_running,  # time-weighted: admitted concurrency
        "num_preemptions": num_preemptions,
        "kv": summarize_kv(samples),
        "step_time_fit": step_time_fit([(s.t, s.running) for s in samples]),
    }


ALLOCATORS = ("paged", "contiguous")


async def run_in_process(config, requests: list[BenchRequest], *, kv_allocator: str = "paged", seed: int = 0,
                         progress: bool = True, desc: str = "bench", account_kv_every_step: bool = True) -> dict:
    """Start an engine with ``config`` (an EngineConfig) and ``kv_allocator``, replay ``requests``, shut it down.

    The KV pool is accounted after every engine step and when the engine goes idle (its hooks) unless
    ``account_kv_every_step`` is False (pure throughput runs). Returns `summarize_run`'s dict plus
    the engine's setup and the samples. Raises ValueError for an unknown allocator.
    """
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.scheduler.engine import Engine

    if kv_allocator not in ALLOCATORS:
        raise ValueError(f"kv_allocator must be one of {ALLOCATORS}, got {kv_allocator!r}")
    engine = await Engine.start(config, kv_allocator=ContiguousAllocator.factory(config.block_size)
                                if kv_allocator == "contiguous" else None)
    try:
        samples: list[KVSample] = []
        clock = {"start": time.perf_counter()}

        def sample(step=None):  # after a step's tokens are computed (before finished requests free), or idle
            samples.append(sample_engine(engine, time.perf_counter() - clock["start"], output_len))

        if account_kv_every_step:
            engine.step_hooks.append(sample)
            # and when the loop goes idle, finished requests freed: a sample holds until the next one,
            # so the last step's would otherwise count their blocks through the gap to the next arrival
            engine.idle_hooks.append(sample)
        rng = random.Random(seed)
        prompts = [random_prompt(rng, r.prompt_len, engine.model_config.vocab_size) for r in requests]
        output_len = {f"bench-{r.index}": r.output_len for r in requests if r.output_len < r.max_tokens}
        preemptions0 = engine.scheduler.num_preemptions

        async def run_one(req: BenchRequest, rec: RequestRecord, now):
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
            stream = engine.add_request(prompts[req.index], params, request_id=f"bench-{req.index}")
            try:
                async for out in stream:
                    t = now()
                    rec.token_times.extend(t for _ in out.token_ids)
                    rec.output_tokens, rec.cached_tokens = out.num_output_tokens, out.num_cached_tokens
                    if out.finish_reason is not None or out.num_output_tokens >= req.output_len:
                        rec.finish = t  # done (or, asked for more, at its real length: stop, as on EOS)
                        if out.finish_reason == "error":
                            rec.error = out.error
                        break
            finally:
                await stream.aclose()  # an early stop aborts the request: its blocks come back now

        records, start = await _replay(requests, run_one, progress, desc)
        for s in samples:  # sample times relative to the first submission
            s.t -= start - clock["start"]
        summary = summarize_run(records, samples, engine.scheduler.num_preemptions - preemptions0)
        summary["setup"] = {"kv_allocator": kv_allocator, "block_size": engine.kv.block_size,
                            "num_gpu_blocks": engine.kv.num_gpu_blocks, "max_model_len": engine.max_model_len,
                            "max_num_seqs": config.max_num_seqs,
                            "max_num_batched_tokens": config.max_num_batched_tokens,
                            "model": engine.model_config.name, "device": getattr(engine, "device", None)}
        summary["samples"] = [asdict(s) for s in samples]
        return summary
    finally:
        await engine.shutdown()


class _StreamChunk(msgspec.Struct):
    """What the HTTP client reads of an SSE chunk: whether it carries choices (left undecoded), and usage."""
    choices: list[msgspec.Raw] = []
    usage: dict | None = None


_decode_chunk = msgspec.json.Decoder(_StreamChunk).decode


def sse_data(partial: bytes, data: bytes) -> tuple[list[bytes], bytes]:
    """The payloads of the complete ``data:`` lines in ``partial + data`` (server-sent events, LF or CRLF
    line ends; other fields, blank lines and ``[DONE]`` left out) and the unfinished last line, to pass
    back as ``partial`` with the next bytes read."""
    *lines, partial = (partial + data).split(b"\n")
    payloads = []
    for line in lines:
        line = line.rstrip(b"\r")
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            payloads.append(line[6:])
    return payloads, partial


async def run_against_url(url: str, requests: list[BenchRequest], vocab_size: int, *, seed: int = 0,
                          poll_interval: float = 0.05, progress: bool = True, desc: str = "bench",
                          text_tokenizer: str | None = None, api: str = "pagedkv") -> dict:
    """Replay ``requests`` against a running ``pagedkv serve`` at ``url`` (streamed /v1/completions).

    KV accounting polls ``/kv_cache`` every ``poll_interval`` seconds; preemptions are read from
    ``/metrics`` before and after. Raises ConnectionError when no server answers at ``url``, aiohttp.ClientError
    when it fails before the replay; once the replay has begun, a server that goes away fails the requests
    left (each an error in the report) and leaves the preemption count unknown (None).
    text_tokenizer: a (sentencepiece-style) tokenizer.json; prompts are sent as text instead, random
    whole-word tokens (a piece "\u2581" + letters) decoded, prompt_len - 1 of them (at least one), which
    the server encodes back to prompt_len tokens with its BOS; the lengths reported are the server's (usage).
    api="transformers": a ``transformers serve`` peer: no KV accounting or preemption count (it
    has no /kv_cache or /metrics), text prompts (text_tokenizer required), and exactly max_tokens
    generated through a ``generation_config`` (min = max new tokens, EOS off) instead of ``ignore_eos``.
    """
    import aiohttp

    url = url.rstrip("/")
    pagedkv = api == "pagedkv"
    # limit=0: every request of the trace may be open at once (aiohttp's default pool holds 100
    # connections and would queue the rest client-side, capping the server's concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            async with session.get(f"{url}/v1/models") as r:
                card = (await r.json())["data"][0]
        except aiohttp.ClientConnectorError as e:
            raise ConnectionError(f"no server answers at --url {url}: {e.os_error}") from None
        model, max_model_len = card["id"], card.get("max_model_len")
        preemptions0 = await _preemptions(session, url) if pagedkv else 0
        rng = random.Random(seed)
        prompts = [random_prompt(rng, r.prompt_len, vocab_size) for r in requests]
        if text_tokenizer:  # random whole-word tokens: their text encodes back to as many tokens (+ BOS)
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(text_tokenizer)
            words = sorted(i for piece, i in tok.get_vocab().items() if piece.startswith("\u2581") and piece[1:].isalpha())
            prompts = [tok.decode([rng.choice(words) for _ in range(max(1, r.prompt_len - 1))]) for r in requests]
        samples: list[KVSample] = []
        clock = {"start": time.perf_counter()}

        async def poll():
            while True:
                try:
                    async with session.get(f"{url}/kv_cache") as r:
                        snap = await r.json()
                except aiohttp.ClientError:  # the server went away: the requests' records say so
                    return
                samples.append(sample_snapshot(snap, time.perf_counter() - clock["start"], max_model_len))
                await asyncio.sleep(poll_interval)

        async def run_one(req: BenchRequest, rec: RequestRecord, now):
            body = {"model": model, "prompt": prompts[req.index], "max_tokens": req.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if not pagedkv:
                del body["ignore_eos"]
                body["generation_config"] = json.dumps({"max_new_tokens": req.max_tokens, "do_sample": False,
                                                        "min_new_tokens": req.max_tokens})
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
                # whatever has arrived, at once: the client shares the server's cores, and one await
                # per line of the stream (two per event) was most of its cost
                partial = b""
                async for data in r.content.iter_any():
                    payloads, partial = sse_data(partial, data)
                    t = now()
                    for payload in payloads:
                        chunk = _decode_chunk(payload)
                        if chunk.choices:
                            rec.token_times.append(t)
                        if chunk.usage:
                            rec.output_tokens = chunk.usage["completion_tokens"]
                            rec.prompt_len = chunk.usage.get("prompt_tokens", rec.prompt_len)
                            rec.cached_tokens = (chunk.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rec.finish = now()

        poller = asyncio.create_task(poll()) if pagedkv else None
        try:
            records, start = await _replay(requests, run_one, progress, desc)
        finally:
            if poller:
                poller.cancel()
        for s in samples:
            s.t -= start - clock["start"]
        preemptions = 0
        if pagedkv:
            try:
                preemptions = await _preemptions(session, url) - preemptions0
            except aiohttp.ClientError:  # the server went away: report what was measured, its count unknown
                preemptions = None
        summary = summarize_run(records, samples, preemptions)
        summary["step_time_fit"] = None  # the samples are /kv_cache polls, not engine steps
        last = samples[-1] if samples else None
        summary["setup"] = {"url": url, "model": model, "max_model_len": max_model_len,
                            "pool_slots": last.pool if last else None}
        summary["samples"] = [asdict(s) for s in samples]
        return summary


async def _preemptions(session, url: str) -> int:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedkv:num_preemptions_total")))


# ---- reports ----------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


TABLE_HEADER = ("| run | req/s | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms "
                "| running peak/mean | preempt | prefix hits | token state | reservation | internal "
                "| external (of pool) |\n"
                "| --- | ---: | ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")


def table_row(name: str, s: dict) -> str:
    """One Markdown table row of a run summary (see TABLE_HEADER); prefix hits: the prompt tokens
    served from the prefix cache, of all prompt tokens."""
    lat = lambda d: "/".join(_ms(d[f"p{p}"]) for p in (50, 90, 99))  # noqa: E731
    kv = s["kv"]
    hits = s["cached_prompt_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else None
    return (f"| {name} | {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} | {lat(s['ttft_s'])} "
            f"| {lat(s['itl_s'])} | {lat(s['e2e_s'])} | {s['peak_running']}/{s['mean_running']:.1f} "
            f"| {'-' if s['num_preemptions'] is None else s['num_preemptions']} | {_pct(hits)} "
            f"| {_pct(kv['utilization'])} | {_pct(kv['reservation_frac'])} "
            f"| {_pct(kv['internal_frac'])} | {_pct(kv['external_frac_of_pool'])} |")


def markdown_report(report: dict) -> str:
    """The whole report as Markdown: setup, scaling, one row per run, comparisons, attribution."""
    w = report["workload"]
    lines = [f"# pagedkv bench: {w['trace']}", "",
             f"- requests: {w['num_requests']} (first rows of the trace), arrivals: {w['arrivals']}",
             f"- token scaling: x{w['token_scale']:.4f} ({w['token_scale_rule']}); {w['num_clipped']} prompts "
             f"cut to fit max_model_len {w['max_model_len']}",
             f"- prompt tokens mean {w['mean_prompt_len']:.1f}, output tokens mean {w['mean_output_len']:.1f}, "
             f"max_tokens mean {w['mean_max_tokens']:.1f} (--max-tokens {w['max_tokens_policy']})",
             "- utilization = token state / allocated slots; reservation and internal are fractions of allocated; "
             "external is a fraction of the pool", "", TABLE_HEADER]
    lines += [table_row(name, s) for name, s in report["runs"].items()]
    for name, s in report["runs"].items():
        st = s.get("setup", {})
        lines.append(f"\n`{name}`: " + ", ".join(f"{k}={v}" for k, v in st.items()))
        if s["num_errors"]:  # the row's figures count completed requests only
            lines.append(f"\n**`{name}`: {s['num_errors']} of {s['num_requests']} requests failed**, left out of every "
                         "figure above; first errors: " + "; ".join(f"`{e}`" for e in s["errors"]))
        if s["num_preemptions"] is None:
            lines.append(f"\n`{name}`: preemptions unknown (preempt `-`): the server's /metrics could not be read "
                         "after the run")
    if report.get("comparison"):
        c, reps = report["comparison"], report.get("comparison_repeats", [])
        lines += ["", "## paged vs contiguous (same trace, memory, model)", "",
                  "| ratio (paged / contiguous) | median | " + " | ".join(f"run {i + 1}" for i in range(len(reps))) + " |",
                  "| --- | ---: |" + " ---: |" * len(reps)]
        lines += [f"| {k} | {v:.2f}x | " + " | ".join(f"{r[k]:.2f}x" for r in reps) + " |" for k, v in c.items()]
    lines += ["", f"Trace: {ATTRIBUTION}"]
    return "\n".join(lines) + "\n"


def compare(paged: dict, contiguous: dict) -> dict:
    """Ratios paged / contiguous of admitted concurrency, throughput and utilization."""
    div = lambda a, b: a / b if b else float("nan")  # noqa: E731
    return {
        "mean_running": div(paged["mean_running"], contiguous["mean_running"]),
        "peak_running": div(paged["peak_running"], contiguous["peak_running"]),
        "request_throughput": div(paged["request_throughput"], contiguous["request_throughput"]),
        "output_token_throughput": div(paged["output_token_throughput"], contiguous["output_token_throughput"]),
        "utilization": div(paged["kv"]["utilization"], contiguous["kv"]["utilization"]),
    }


def plot_utilization(runs: dict[str, dict], path: str, title: str) -> None:
    """Stacked areas over time, one panel per run: token state, reservation, internal, external, other free."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (name, s) in zip(axes[:, 0], runs.items()):
        smp = s["samples"]
        t = [x["t"] for x in smp]
        pool = [x["pool"] or 1 for x in smp]
        series = [[x[k] / p for x, p in zip(smp, pool)] for k in ("token_state", "reservation", "internal")]
        series.append([x["external"] / p for x, p in zip(smp, pool)])
        series.append([(x["free"] - x["external"]) / p for x, p in zip(smp, pool)])
        ax.stackplot(t, *series, labels=["token state", "reservation", "internal frag.", "external frag.",
                                          "free (usable)"],
                     colors=["#2b8a3e", "#f59f00", "#e03131", "#862e9c", "#dee2e6"], step="post")
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of KV pool")
        ax.set_title(f"{name}: token state {_pct(s['kv']['utilization'])} of allocated", fontsize=10)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=5, frameon=False)
    axes[-1, 0].set_xlabel("time since first request (s)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_block_sweep(runs: dict[int, dict], path: str, title: str) -> None:
    """Utilization and output throughput against block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(runs)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(sizes, [100 * runs[b]["kv"]["utilization"] for b in sizes], "o-", color="#2b8a3e",
            label="token state / allocated (%)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("KV utilization (%)")
    ax2 = ax.twinx()
    ax2.plot(sizes, [runs[b]["output_token_throughput"] for b in sizes], "s--", color="#1c7ed6",
             label="output tokens/s")
    ax2.set_ylabel("output tokens/s")
    ax.set_ylim(0, 100)
    ax2.set_ylim(bottom=0)
    fig.legend(loc="lower left", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command ------------------------------------------------------------------------------

def _block_sizes(s: str) -> list[int]:
    try:
        sizes = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {s!r}") from None
    if not sizes or any(b < 1 or b > 256 or b & (b - 1) for b in sizes):
        raise argparse.ArgumentTypeError(f"block sizes must be powers of two in 1..256, got {s!r}")
    return sizes


def _positive_float(allow_inf: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {s!r}") from None
        if not v > 0 or (math.isinf(v) and not allow_inf):
            raise argparse.ArgumentTypeError(f"must be > 0{' (or inf)' if allow_inf else ''}, got {s}")
        return v
    return parse


def _token_scale(s: str) -> float | str:
    return s if s == "auto" else _positive_float()(s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench-specific flags (the engine flags come from `pagedkv serve`'s set)."""
    g = p.add_argument_group("benchmark")
    g.add_argument("--trace", default="conv", metavar="conv|code|CSV",
                   help="conv / code: the Azure LLM inference traces 2023; or a CSV with TIMESTAMP, ContextTokens, "
                        "GeneratedTokens")
    g.add_argument("--num-requests", type=lambda s: _int_pos(s), default=100, help="replay the first N rows")
    arr = g.add_mutually_exclusive_group()
    arr.add_argument("--time-scale", type=_positive_float(), default=1.0,
                     help="multiply the trace's arrival offsets (0.1: ten times faster)")
    arr.add_argument("--request-rate", type=_positive_float(allow_inf=True), default=None,
                     help="Poisson arrivals at this many requests/s instead of the trace's times (inf: all at once)")
    g.add_argument("--token-scale", type=_token_scale, default="auto",
                   help="multiply context and generated tokens; auto: max_model_len / the trace's p99 of "
                        "context + generated")
    g.add_argument("--max-tokens", choices=["trace", "max-model-len"], default="trace", dest="max_tokens_policy",
                   help="trace: max_tokens = the generated length (the trace README's rule); max-model-len: ask for "
                        "all the room left, as a client that does not know the output length, and stop reading at the "
                        "generated length (the engine sees an abort, as after EOS); in-process only")
    g.add_argument("--kv-cache-tokens", type=lambda s: _int_pos(s), default=None, metavar="TOKENS",
                   help="KV pool size in tokens (sets --num-gpu-blocks to TOKENS / block size): the same memory "
                        "across allocators and block sizes")
    g.add_argument("--kv-allocator", choices=ALLOCATORS, default="paged",
                   help="contiguous: the pre-paging baseline (one run per request, reserved for its maximum length)")
    g.add_argument("--compare-allocators", action="store_true",
                   help="run paged and contiguous on the same requests and memory; report the ratios")
    g.add_argument("--repeats", type=lambda s: _int_pos(s), default=1,
                   help="--compare-allocators: run the pair N times, alternating the order; ratios are medians")
    g.add_argument("--block-size-sweep", type=_block_sizes, default=None, metavar="B1,B2,...",
                   help="run once per block size (same pool in tokens)")
    g.add_argument("--url", default=None, help="benchmark a running `pagedkv serve` (e.g. http://127.0.0.1:8000) "
                                               "instead of an in-process engine")
    g.add_argument("--poll-interval", type=_positive_float(), default=0.05, metavar="SECONDS",
                   help="--url: /kv_cache polling period")
    g.add_argument("--url-api", choices=["pagedkv", "transformers"], default="pagedkv",
                   help="--url: the server's kind; transformers: a `transformers serve` peer (no /kv_cache or "
                        "/metrics; text prompts; exactly max_tokens through generation_config)")
    g.add_argument("--text-prompts", action="store_true",
                   help="--url: send the random prompts as text (decoded with the model's tokenizer.json), as "
                        "--url-api transformers must; the server's prompt lengths are reported")
    g.add_argument("--output-dir", default="bench-results", metavar="DIR",
                   help="where NAME.json, NAME.md and the PNG plots go (NAME: --name)")
    g.add_argument("--name", default=None, help="file name prefix of the outputs (default: the trace name)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNGs (matplotlib not needed)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _int_pos(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-flag checks, as argparse errors naming the flag."""
    if args.url and (args.compare_allocators or args.block_size_sweep):
        parser.error("--url benchmarks one server: --compare-allocators and --block-size-sweep need the "
                     "in-process engine")
    if args.url and args.max_tokens_policy != "trace":
        parser.error("--max-tokens max-model-len needs the in-process engine (the accounting must know each "
                     "request's real length)")
    if args.compare_allocators and args.block_size_sweep:
        parser.error("--compare-allocators and --block-size-sweep are separate runs: give one")
    if (args.url_api != "pagedkv" or args.text_prompts) and not args.url:
        parser.error("--url-api and --text-prompts describe a server: give --url")
    if args.url and not args.url.startswith(("http://", "https://")):
        parser.error(f"--url must start with http:// or https://, got {args.url!r}")
    if args.kv_cache_tokens is not None and args.num_gpu_blocks is not None:
        parser.error("--kv-cache-tokens and --num-gpu-blocks both size the pool: give one")
    if not args.no_plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error("plots need matplotlib (pip install 'pagedkv[bench]'), or pass --no-plots")


async def main(args: argparse.Namespace, config, max_model_len: int, vocab_size: int) -> int:
    """Run the benchmark described by ``args`` (engine settings in ``config``); write the reports.

    The runs go one after the other on the caller's event loop (``pagedkv bench`` runs it on
    uvloop, as ``pagedkv serve``). Returns 0, or 1 when any request failed.
    """
    path = resolve_trace(args.trace)
    rows = load_trace(path)
    if args.token_scale == "auto":
        scale, rule = auto_token_scale(rows, max_model_len), f"max_model_len / p99(context + generated) of {path.name}"
    else:
        scale, rule = args.token_scale, "--token-scale"
    requests, clipped = build_requests(rows, args.num_requests, max_model_len, scale, time_scale=args.time_scale,
                                       request_rate=args.request_rate, seed=args.seed,
                                       max_tokens_policy=args.max_tokens_policy)
    arrivals = ("all at once (--request-rate inf)" if args.request_rate == math.inf
                else f"Poisson {args.request_rate} req/s" if args.request_rate is not None
                else f"trace timestamps x{args.time_scale}")
    workload = {"trace": path.name, "num_requests": len(requests), "arrivals": arrivals, "token_scale": scale,
                "token_scale_rule": rule, "num_clipped": clipped, "max_model_len": max_model_len,
                "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
                "mean_max_tokens": sum(r.max_tokens for r in requests) / len(requests),
                "mean_output_len": sum(r.output_len for r in requests) / len(requests),
                "max_tokens_policy": args.max_tokens_policy,
                "seed": args.seed}

    def engine_config(**over):
        cfg = msgspec.structs.replace(config, **over)
        if args.kv_cache_tokens is not None:
            cfg = msgspec.structs.replace(cfg, num_gpu_blocks=max(1, args.kv_cache_tokens // cfg.block_size))
        return cfg

    progress = not args.no_progress
    runs: dict[str, dict] = {}
    if args.url:
        text = args.text_prompts or args.url_api == "transformers"
        runs["server"] = await run_against_url(args.url, requests, vocab_size, seed=args.seed,
                                               poll_interval=args.poll_interval, progress=progress, api=args.url_api,
                                               text_tokenizer=str(Path(config.model) / "tokenizer.json") if text else None)
    elif args.compare_allocators:
        repeats = []
        for i in range(args.repeats):  # alternate the order, so load drift on the machine hits both alike
            pair = {}
            for alloc in ("paged", "contiguous") if i % 2 == 0 else ("contiguous", "paged"):
                pair[alloc] = await run_in_process(engine_config(), requests, kv_allocator=alloc, seed=args.seed,
                                                   progress=progress, desc=f"{alloc} {i + 1}/{args.repeats}")
            repeats.append(pair)
        runs.update(repeats[0])
        if args.repeats > 1:
            runs.update({f"{alloc} (repeat {i + 1})": pair[alloc] for i, pair in enumerate(repeats[1:], start=1)
                         for alloc in ("paged", "contiguous")})
    elif args.block_size_sweep:
        for bs in args.block_size_sweep:
            runs[f"block_size={bs}"] = await run_in_process(engine_config(block_size=bs), requests,
                                                             kv_allocator=args.kv_allocator, seed=args.seed,
                                                             progress=progress, desc=f"block {bs}")
    else:
        runs[args.kv_allocator] = await run_in_process(engine_config(), requests, kv_allocator=args.kv_allocator,
                                                       seed=args.seed, progress=progress, desc=args.kv_allocator)
    report = {"workload": workload, "runs": runs, "attribution": ATTRIBUTION,
              "machine": machine_info()}
    if args.compare_allocators:
        ratios = [compare(pair["paged"], pair["contiguous"]) for pair in repeats]
        report["comparison"] = {k: statistics.median(r[k] for r in ratios) for k in ratios[0]}
        report["comparison_repeats"] = ratios
    name = args.name or Path(args.trace).stem
    os.makedirs(args.output_dir, exist_ok=True)
    out = Path(args.output_dir)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    md = markdown_report(report)
    (out / f"{name}.md").write_text(md)
    if not args.no_plots:
        first = {k: v for k, v in runs.items() if "repeat" not in k}  # one panel per allocator
        plot_utilization(first, str(out / f"{name}-utilization.png"), f"KV slots over time: {path.name}")
        if args.block_size_sweep:
            plot_block_sweep({int(k.split("=")[1]): v for k, v in runs.items()}, str(out / f"{name}-block-sizes.png"),
                             f"block-size sweep: {path.name}")
    print(md)
    return 0 if all(s["num_errors"] == 0 for s in runs.values()) else 1


def machine_info() -> dict:
    """CPU count and model, platform and Python: where the numbers were measured."""
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "load_average": os.getloadavg()}


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `pagedkv bench`")
