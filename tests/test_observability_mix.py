"""Metrics and traces against what the requests' outputs say, over a seeded random mix (n > 1, beam
search, aborts, stop strings) on a pool small enough to preempt by swap and by recompute."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.common.tracing import make_tracer
from pagedkv.scheduler.engine import Engine
from conftest import GOLDEN_PROMPT_IDS, metric

STORIES_BLOCK_BYTES = 20480


async def test_metric_totals_gauges_and_preempt_spans_match_a_random_mix(stories260k):
    rng = random.Random(1234)
    exporter = InMemorySpanExporter()
    # 3 host blocks: short victims are swapped, longer ones fall back to recompute
    engine = await Engine.start(
        EngineConfig(model=str(stories260k), num_gpu_blocks=14, preemption_mode="swap",
                     swap_space=3 * STORIES_BLOCK_BYTES / 2**30),
        tracer=make_tracer(span_exporter=exporter))
    try:
        prompts = [GOLDEN_PROMPT_IDS, GOLDEN_PROMPT_IDS[:3], [1, 261, 378, 403, 407, 261, 378, 403, 407], [1]]
        specs = []
        for i in range(28):
            prompt = rng.choice(prompts)
            kind = rng.choice(["n1", "n1", "n", "n", "beam", "stop"])
            max_tokens = rng.randint(8, 48)
            if kind == "beam":
                params = SamplingParams(n=rng.randint(2, 3), use_beam_search=True, max_tokens=rng.randint(4, 12))
            else:
                params = SamplingParams(temperature=rng.choice([0, 0.8, 1.2]), seed=i, max_tokens=max_tokens,
                                        n=rng.randint(2, 3) if kind == "n" else 1, ignore_eos=rng.random() < 0.5,
                                        stop=["the", "a ", "."] if kind == "stop" else [])
            abort_after = rng.choice([None, None, None, 0, 3, 10]) if kind != "beam" else None
            specs.append((f"mix-{i}", prompt, params, abort_after, rng.random() * 0.05))

        streams = {}

        async def run(rid, prompt, params, abort_after, delay):
            await asyncio.sleep(delay)
            it = engine.add_request(prompt, params, rid)
            streams[rid] = engine.output.streams[rid]
            outs = []
            async for out in it:
                outs.append(out)
                if abort_after is not None and sum(len(o.token_ids) for o in outs) >= abort_after:
                    engine.abort(rid)  # applied between steps; the stream still ends with its last deltas
            return outs

        results = await asyncio.gather(*[run(*s) for s in specs])
        for _ in range(50):  # the loop settles its gauges after the last result
            if not (engine.scheduler.running or engine.scheduler.waiting or engine.scheduler.swapped):
                break
            await asyncio.sleep(0.01)

        m = lambda name, **labels: metric(engine, name, **labels)  # noqa: E731
        beams = {rid for rid, _, p, _, _ in specs if p.use_beam_search}
        tokens = {s[0]: sum(len(o.token_ids) for o in outs) for s, outs in zip(specs, results)}
        aborted = {s[0] for s, outs in zip(specs, results) if any(o.finish_reason == "abort" for o in outs)}
        started = {s[0] for s, outs in zip(specs, results) if tokens[s[0]] or s[0] in beams}  # a first token sampled
        assert aborted and len(started) > len(aborted)

        # counters: each event once
        assert sum(m("pagedkv:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")) \
            == len(specs)
        assert m("pagedkv:request_success_total", finished_reason="abort") == len(aborted)
        assert m("pagedkv:prompt_tokens_total") == sum(len(s[1]) for s in specs if s[0] in started)
        non_beam = sum(t for rid, t in tokens.items() if rid not in beams)
        assert m("pagedkv:generation_tokens_total") >= non_beam + sum(1 for rid in beams)  # beams: every beam's token
        preempted = {mode: m("pagedkv:num_preemptions_total", mode=mode) for mode in ("swap", "recompute")}
        assert preempted["swap"] > 0 and preempted["recompute"] > 0, preempted
        assert sum(preempted.values()) == engine.scheduler.num_preemptions
        # histograms: once per request, in seconds
        assert m("pagedkv:e2e_request_latency_seconds_count") == len(specs)
        assert m("pagedkv:time_to_first_token_seconds_count") == len(started)
        assert m("pagedkv:request_num_preemptions_count") == len(specs)
        assert m("pagedkv:request_num_preemptions_sum") == sum(preempted.values())
        assert 0 < m("pagedkv:e2e_request_latency_seconds_sum") < 60 * len(specs)
        n1 = [rid for rid, _, p, _, _ in specs if p.n == 1 and not p.use_beam_search]
        assert m("pagedkv:inter_token_latency_seconds_count") >= sum(max(tokens[r] - 1, 0) for r in n1)
        # gauges: idle
        for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                      "kv_cache_usage_perc", "cpu_kv_cache_usage_perc"):
            assert m(f"pagedkv:{gauge}") == 0, gauge

        # traces: every request ends its span; every preemption is a kv.preempt child of its request's span
        spans = exporter.get_finished_spans()
        requests = {s.attributes["gen_ai.response.id"]: s for s in spans if s.name == "llm_request"}
        assert sorted(requests) == sorted(s[0] for s in specs)
        preempts = Counter()
        for span in spans:
            if span.name == "kv.preempt":
                owner = requests[_owner(span.attributes["pagedkv.request.id"], streams)]
                assert span.parent.span_id == owner.context.span_id
                assert owner.start_time <= span.start_time <= span.end_time <= owner.end_time
                preempts[owner.attributes["gen_ai.response.id"]] += 1
        for rid, stream in streams.items():
            assert preempts[rid] == sum(r.num_preemptions for r in stream.members), rid
            if rid not in beams:
                assert requests[rid].attributes["gen_ai.usage.output_tokens"] == tokens[rid], rid
        assert sum(preempts.values()) == sum(preempted.values())
    finally:
        await engine.shutdown()


def _owner(sequence_id: str, streams: dict) -> str:
    return next(rid for rid, s in streams.items() if any(r.request_id == sequence_id for r in s.members))


async def test_siblings_sampled_in_one_step_observe_one_inter_token_latency(start):
    engine = await start()
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=10, ignore_eos=True)
    outs = [o async for o in engine.add_request(GOLDEN_PROMPT_IDS, params, "siblings")]
    assert sum(len(o.token_ids) for o in outs) == 30
    assert metric(engine, "pagedkv:generation_tokens_total") == 30
    assert metric(engine, "pagedkv:time_to_first_token_seconds_count") == 1
    # 10 steps: one latency between each two, none of 0 s for the siblings' tokens of the same step
    assert metric(engine, "pagedkv:inter_token_latency_seconds_count") == 9
