"""The engine under tensor parallelism on stories260K: -tp 2 and -tp 4 give the -tp 1 outputs (greedy,
recompute and swap preemption, n > 1, beam search), ranks started by hand join over tcp://, a killed
rank gets its group restarted with every stream recomputed as if uninterrupted, and a rank that dies or
stalls with no restarts left fails the requests with a clear error, gives every block back and leaves
no process.

The engines are shared within the module (each start spawns torch processes); the fault tests come
last in the file because they end the group they use.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import pytest_asyncio
from conftest import GOLDEN_COMPLETION, GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free, collect, metric

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK_BYTES = 20480  # stories260K, one block of 16 tokens, all 4 KV heads, float32; a rank of -tp N holds 1/N
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]
GREEDY = SamplingParams(temperature=0, max_tokens=60)
SAMPLED = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=20)
BEAM = SamplingParams(n=4, use_beam_search=True, max_tokens=30)


def tight(stories260k, tp: int, max_worker_restarts: int = 0, **kw) -> EngineConfig:
    """12 device blocks and 2 host blocks on every rank: swap and recompute preemption both happen.

    No worker restarts unless asked: a failed rank then fails the engine."""
    return EngineConfig(model=str(stories260k), tensor_parallel_size=tp, num_gpu_blocks=12, enable_prefix_caching=False,
                        preemption_mode="swap", swap_space=2 * BLOCK_BYTES / tp / 2**30, worker_timeout=30,
                        max_worker_restarts=max_worker_restarts, **kw)


async def choices(engine, prompt_ids, params):
    out: dict[int, list[int]] = {}
    last = None
    async for o in engine.add_request(prompt_ids, params):
        out.setdefault(o.index, []).extend(o.token_ids)
        last = o
    return out, last


async def workload(engine) -> dict:
    """Six golden requests at once on the tight pool (preempted), the other prompts greedy, n = 3
    seeded sampling and a beam search of width 4, each followed by a check that every block is back."""
    enc = engine.tokenizer.encode
    golden = await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY)) for _ in range(6)])
    greedy = await asyncio.gather(*[collect(engine.add_request(enc(p), GREEDY)) for p in PROMPTS])
    assert_all_blocks_free(engine)
    sampled, _ = await choices(engine, enc(PROMPTS[2]), SAMPLED)
    beam, _ = await choices(engine, GOLDEN_PROMPT_IDS, BEAM)
    assert_all_blocks_free(engine)
    return {"golden": [(t, text) for t, text, _ in golden], "greedy": [t for t, _, _ in greedy],
            "sampled": sampled, "beam": beam}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(stories260k):
    """-tp 1 and -tp 2 engines on the tight pool, and their workload outputs; the -tp 2 group may be
    restarted once (its last test kills a rank)."""
    tp1, tp2 = await asyncio.gather(Engine.start(tight(stories260k, 1)),
                                    Engine.start(tight(stories260k, 2, max_worker_restarts=1)))
    try:
        yield {1: (tp1, await workload(tp1)), 2: (tp2, await workload(tp2))}
    finally:
        await asyncio.gather(tp1.shutdown(), tp2.shutdown())


async def test_tp2_starts_two_ranks_and_reports_the_world_size(engines):
    engine, _ = engines[2]
    assert len(engine.client.processes) == 2 and len({p.pid for p in engine.client.processes}) == 2
    assert all(p.poll() is None for p in engine.client.processes)
    assert engine.kv_cache_snapshot()["world_size"] == 2
    assert metric(engine, "pagedkv:world_size") == 2 and metric(engines[1][0], "pagedkv:world_size") == 1
    # each rank's pool holds half the KV heads: 2 host blocks cost the same bytes per rank as 1 at -tp 1
    assert engine.kv_cache_snapshot()["num_cpu_blocks"] == engines[1][0].kv_cache_snapshot()["num_cpu_blocks"] == 2


async def test_each_plan_is_encoded_once_for_both_ranks(engines, monkeypatch):
    from pagedkv.common import protocol

    engine, _ = engines[2]
    encoded, steps = [], []
    encode, submit = protocol.encode, engine.client.submit
    monkeypatch.setattr(protocol, "encode", lambda msg: encoded.append(type(msg).__name__) or encode(msg))

    async def counting(plan):
        steps.append(plan.step_id)
        return await submit(plan)

    monkeypatch.setattr(engine.client, "submit", counting)
    tokens, _, _ = await collect(engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=5)))
    assert tokens == GOLDEN_OUTPUT_IDS[:5] and len(steps) == 5
    assert encoded == ["StepPlan"] * 5  # not one per rank


async def test_tp2_greedy_outputs_equal_the_golden_and_tp1_token_for_token(engines):
    (_, one), (_, two) = engines[1], engines[2]
    assert two["golden"] == [(GOLDEN_OUTPUT_IDS, GOLDEN_COMPLETION)] * 6
    assert two["greedy"] == one["greedy"] and two["greedy"][0] == GOLDEN_OUTPUT_IDS
    assert all(len(t) == 60 for t in two["greedy"])


async def test_tp2_recompute_and_swap_preemption_keep_the_outputs(engines):
    engine, out = engines[2]
    swapped = metric(engine, "pagedkv:num_preemptions_total", mode="swap")
    recomputed = metric(engine, "pagedkv:num_preemptions_total", mode="recompute")
    assert swapped > 0 and recomputed > 0 and swapped + recomputed == engine.scheduler.num_preemptions
    assert metric(engine, "pagedkv:num_blocks_swapped_in_total") == metric(engine, "pagedkv:num_blocks_swapped_out_total") > 0
    assert out["golden"] == [(GOLDEN_OUTPUT_IDS, GOLDEN_COMPLETION)] * 6


async def test_tp2_parallel_sampling_and_beam_search_equal_tp1(engines):
    (_, one), (_, two) = engines[1], engines[2]
    assert sorted(two["sampled"]) == [0, 1, 2] and len({tuple(t) for t in two["sampled"].values()}) == 3
    assert two["sampled"] == one["sampled"]
    assert sorted(two["beam"]) == [0, 1, 2, 3] and two["beam"] == one["beam"]


async def test_a_killed_rank_restarts_the_group_and_streams_go_on_as_if_uninterrupted(engines):
    """kill -9 of rank 1 while three greedy streams run on the tight pool (preempting): the whole group
    is killed and started again, every request recomputes, and each stream ends with the tokens of the
    uninterrupted -tp 2 run (which equal -tp 1's), none lost or repeated; every block comes back."""
    engine, out = engines[2]
    ranks = list(engine.client.processes)
    enc = engine.tokenizer.encode
    seen: list[int] = []

    async def stream(prompt: str) -> list[int]:
        tokens = []
        async for o in engine.add_request(enc(prompt), GREEDY):
            tokens += o.token_ids
            seen.append(len(o.token_ids))
        return tokens

    run = asyncio.gather(*[stream(p) for p in PROMPTS])
    while sum(seen) < 30:  # every stream under way
        await asyncio.sleep(0.01)
    ranks[1].kill()
    health = []
    while not health or health[-1][0]:
        health.append(engine.health())
        await asyncio.sleep(0.005)
    assert await asyncio.wait_for(run, 120) == out["greedy"]
    assert health[-1][1].startswith(f"recovering: worker rank 1 (pid {ranks[1].pid}) process exited with code -9")
    assert metric(engine, "pagedkv:worker_restarts_total") == 1 and engine.health() == (True, "ok")
    assert metric(engine, "pagedkv:worker_restart_failures_total") == 0
    new_ranks = list(engine.client.processes)
    assert len(new_ranks) == 2 and not {p.pid for p in new_ranks} & {p.pid for p in ranks}
    assert all(p.poll() is not None for p in ranks)  # rank 0 of the failed group too: killed, not left running
    assert_all_blocks_free(engine)
    await engine.shutdown()
    assert all(p.poll() is not None for p in new_ranks)


# ---- -tp 4: golden, then a stalled rank ---------------------------------------------------------

async def test_tp4_greedy_outputs_equal_tp1_and_a_stalled_rank_fails_by_the_deadline(engines, stories260k):
    _, one = engines[1]
    engine = await Engine.start(EngineConfig(model=str(stories260k), tensor_parallel_size=4, num_gpu_blocks=32,
                                             swap_space=0.001, worker_timeout=15, max_worker_restarts=0))
    try:
        ranks = list(engine.client.processes)
        assert len(ranks) == 4 and engine.kv_cache_snapshot()["world_size"] == 4
        enc = engine.tokenizer.encode
        greedy = await asyncio.gather(*[collect(engine.add_request(enc(p), GREEDY)) for p in PROMPTS])
        assert [t for t, _, _ in greedy] == one["greedy"] and greedy[0][1] == GOLDEN_COMPLETION
        assert_all_blocks_free(engine)

        os.kill(ranks[2].pid, signal.SIGSTOP)  # a stall, not a death: only deadlines can see it
        try:
            _, _, last = await collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY))
            assert last.finish_reason == "error" and "did not answer within 15 s" in last.error
            assert_all_blocks_free(engine)
            # the failed group is killed for certain (SIGKILL), the stalled rank too: none holds its pool
            assert all(ranks[r].poll() is not None for r in range(4))
        finally:
            if ranks[2].poll() is None:
                os.kill(ranks[2].pid, signal.SIGCONT)
    finally:
        await engine.shutdown()
    assert all(p.poll() is not None for p in ranks)


# ---- ranks started by hand, over tcp:// -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


async def test_two_ranks_started_by_hand_serve_the_golden_over_tcp(stories260k, tmp_path):
    http, workers, rendezvous = _free_port(), _free_port(), _free_port()
    pagedkv = [sys.executable, "-m", "pagedkv.scheduler.cli"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PAGEDKV_WORKER_SECRET="0123456789abcdef" * 4)
    server = subprocess.Popen(pagedkv + ["serve", "--model", str(stories260k), "-tp", "2", "--external-worker",
                                         "--worker-address", f"tcp://127.0.0.1:{workers}", "--port", str(http),
                                         "--num-gpu-blocks", "32", "--swap-space", "0.001", "--worker-timeout", "30",
                                         "--max-worker-restarts", "0"],
                              env=env, stderr=open(tmp_path / "serve.log", "w"))
    ranks = [subprocess.Popen(pagedkv + ["worker", "--connect", f"tcp://127.0.0.1:{workers}", "--rank", str(r),
                                         "--world-size", "2", "--dist-init-method", f"tcp://127.0.0.1:{rendezvous}"],
                              env=env, stderr=open(tmp_path / f"rank{r}.log", "w")) for r in range(2)]
    base = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                _http(base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                await asyncio.sleep(1)
        body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}
        out = json.loads(await asyncio.to_thread(_http, base + "/v1/completions", body))
        assert out["choices"][0]["text"] == GOLDEN_COMPLETION
        assert json.loads(_http(base + "/kv_cache"))["world_size"] == 2
        assert 'pagedkv:world_size{model_name="stories260K"} 2.0' in _http(base + "/metrics")

        # kill rank 1 mid-stream: the request ends with an error at once (no deadline needed), and rank 0
        # (started by hand: not the server's to terminate) exits by itself
        body = dict(body, max_tokens=300, stream=True)
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})

        def stream_until_killed() -> str:
            with urllib.request.urlopen(req, timeout=60) as r:
                first = r.readline()
                assert first.startswith(b"data: ")
                ranks[1].kill()
                return r.read().decode()

        rest = await asyncio.to_thread(stream_until_killed)
        # the error names the rank that died (its connection ended), not rank 0's failed all-reduce;
        # rank 0 leaves the broken group by itself
        assert f'"message":"external worker rank 1 (pid {ranks[1].pid}) disconnected' in rest, rest[-500:]
        ranks[0].wait(timeout=60)
        assert ranks[0].returncode == 1
    finally:
        for p in [server, *ranks]:
            if p.poll() is None:
                p.terminate()
        for p in [server, *ranks]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
