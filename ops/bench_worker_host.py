"""Worker host cost per decode step with the forward replaced by a stub: input preparation + sampling.

What a GPU would wait for: the worker's Python and tensor bookkeeping between plans. The model is a
stub returning rows of one fixed random logits tensor (greedy sampling over ``--vocab`` ids; it
allocates nothing per step, so its own cost is not counted), so only the host path is timed:
decoding the plan's bytes (msgspec) and `ModelRunner.execute`. Shapes: ``--shapes`` NxC = N running
requests at a context of C tokens, each decoding one token per step (a new block every block_size
steps, as in serving).

``--baseline-python PY`` also runs the same measurement under another interpreter (e.g. the venv
of a worktree at an older commit), alternating baseline and this tree ``--repeats`` times, and
prints median ratios: on a shared machine only ratios from alternating runs mean anything.

    python ops/bench_worker_host.py --shapes 256x1024,256x4096,64x32768 \\
        --baseline-python /work/wt/base/.venv/bin/python --repeats 3

``--model DIR`` runs the model's real forward instead of the stub (the whole worker step) and fits
CPU ms per step against running requests over the shapes (e.g. 16x100,64x100,128x100,256x100).
``--attention-backend`` picks this tree's kernels; ``--baseline-backend B`` compares against backend
B of this same tree instead of another interpreter (e.g. the fused CPU decode kernel against the
batched PyTorch attention):

    python ops/bench_worker_host.py --model ../shared/models/stories260K \
        --shapes 16x100,64x100,128x100,256x100 --attention-backend cpu --baseline-backend torch --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker_host_memory() -> None:
    """Host memory as the measured tree's worker process sets it; call before torch is imported (huge pages)."""
    try:
        from pagedkv.worker.host_memory import reuse_freed_host_memory, use_huge_pages_for_tensors
        use_huge_pages_for_tensors()
    except ImportError:  # trees before the host_memory module: 7e71564 to 50f2756 set malloc only
        try:
            from pagedkv.worker.worker import reuse_freed_host_memory
        except ImportError:  # trees before 7e71564 left glibc's defaults
            return
    reuse_freed_host_memory()


def measure(num_requests: int, context: int, vocab: int, steps: int, block_size: int, model: str | None = None,
            attention_backend: str | None = None) -> dict:
    """Median and p90 host CPU ms per step (execute, and plan decoding) for one shape, in this process.

    CPU time of the calling thread (torch runs on one thread here), so that other processes on a
    shared machine do not count; the median wall time of execute is reported alongside.
    """
    import torch

    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    if model:  # the real model: the whole worker step, forward included
        model_config = ModelConfig.load(model)
        vocab = model_config.vocab_size
        cfg = EngineConfig(model=model, block_size=block_size, max_num_seqs=num_requests, attention_backend=attention_backend,
                           load_format="dummy" if not os.path.exists(os.path.join(model, "model.safetensors")) else "auto")
        runner = ModelRunner(cfg, torch.device("cpu"), torch.float32, model_config)
        runner.init_cache(num_requests * -(-(context + steps + 8) // block_size), 0)
    else:
        runner = _stub_runner(num_requests, context, vocab, steps, block_size)
    return _decode_steps(runner, num_requests, context, vocab, steps, block_size)


def _stub_runner(num_requests, context, vocab, steps, block_size):
    import torch

    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
          "vocab_size": vocab, "max_position_embeddings": context + steps + 64, "torch_dtype": "float32"}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(hf))
        cfg = EngineConfig(model=d, load_format="dummy", block_size=block_size, max_num_seqs=num_requests)
        model_config = ModelConfig.load(d)
        runner = ModelRunner(cfg, torch.device("cpu"), torch.float32, model_config)

    class Stub(torch.nn.Module):
        """Returns rows of one fixed random logits tensor: the stand-in forward costs (almost) nothing itself."""

        logits = torch.randn(num_requests, vocab, generator=torch.Generator().manual_seed(0))

        def forward(self, input_ids, positions, meta, k_caches, v_caches, logits_indices):
            return self.logits[:logits_indices.shape[0]]

    stub = Stub()
    stub.kernels = getattr(runner.model, "kernels", None)  # the cache engine's backend; the d863b9d baseline has none
    runner.model = stub
    runner.init_cache(1, 0)  # the stub reads no KV: block ids below are only bookkeeping
    return runner


def _decode_steps(runner, num_requests, context, vocab, steps, block_size):
    import time

    from pagedkv.common.protocol import (CachedRequestData, NewRequestData, StepPlan, decode_to_worker, encode)
    from pagedkv.common.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 8)
    nblocks = [-(-context // block_size)] * num_requests
    next_block = [0]

    def fresh(k):
        next_block[0] += k
        return list(range(next_block[0] - k, next_block[0]))

    # staggered contexts so block boundaries fall on different steps, as in serving
    lens = [context - (i % block_size) for i in range(num_requests)]
    news = [NewRequestData(f"r{i}", [(7 * j + i) % vocab for j in range(n)], n, fresh(-(-n // block_size)),
                           n - 1, 1, greedy) for i, n in enumerate(lens)]
    runner.execute(StepPlan(0, new_requests=news))
    known = [n + 1 for n in lens]
    nblocks = [-(-n // block_size) for n in lens]
    exec_ms, decode_ms, wall_ms = [], [], []
    for step in range(1, steps + 1):
        cached = []
        for i in range(num_requests):
            need = -(-known[i] // block_size) - nblocks[i]
            nblocks[i] += need
            cached.append(CachedRequestData(f"r{i}", fresh(need) if need else [], 1))
            known[i] += 1
        data = encode(StepPlan(step, cached_requests=cached))
        t0 = time.thread_time()
        plan = decode_to_worker(data)
        t1, w1 = time.thread_time(), time.perf_counter()
        result = runner.execute(plan)
        t2, w2 = time.thread_time(), time.perf_counter()
        assert result.error is None and len(result.sampled) == num_requests
        if step > 3:
            decode_ms.append(1000 * (t1 - t0))
            exec_ms.append(1000 * (t2 - t1))
            wall_ms.append(1000 * (w2 - w1))

    def p90(xs):  # nearest rank: int(0.9 * (n - 1)) rounded down, the minimum of 2 steps (below the median)
        return sorted(xs)[math.ceil(0.9 * len(xs)) - 1]

    return {"shape": f"{num_requests}x{context}", "execute_ms": statistics.median(exec_ms),
            "execute_p90_ms": p90(exec_ms), "plan_decode_ms": statistics.median(decode_ms),
            "execute_wall_ms": statistics.median(wall_ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256x1024,256x4096,64x32768")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--baseline-python", default=None, help="interpreter of the tree to compare against")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", default=None, help="a model directory: run its real forward (dummy weights without "
                   "model.safetensors) and fit CPU ms per step against running requests")
    p.add_argument("--attention-backend", default=None, help="this tree's kernels (cpu | torch | triton; default: by device)")
    p.add_argument("--baseline-backend", default=None, help="compare against this backend of this tree (with --model)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.steps < 4:  # the first three steps are warm-up: fewer left none to measure (a StatisticsError in the child)
        p.error("--steps must be >= 4")
    if args.child:
        worker_host_memory()
        print(json.dumps([measure(n, c, args.vocab, args.steps, args.block_size, args.model, args.attention_backend)
                          for n, c in shapes]))
        return
    trees = {"this": (sys.executable, args.attention_backend)}
    if args.baseline_python or args.baseline_backend:
        trees = {"baseline": (args.baseline_python or sys.executable, args.baseline_backend), **trees}
    runs: dict[str, list[list[dict]]] = {k: [] for k in trees}
    # Another interpreter must import its own tree: a PYTHONPATH naming this checkout comes before
    # its venv's site-packages and would make the baseline run this tree.
    envs = {name: {k: v for k, v in os.environ.items() if k != "PYTHONPATH" or python == sys.executable}
            for name, (python, _) in trees.items()}
    for name, (python, _) in trees.items():
        where = subprocess.run([python, "-c", "import pagedkv; print(list(pagedkv.__path__)[0])"], env=envs[name],
                               capture_output=True, text=True, check=True, cwd="/tmp").stdout.strip()
        print(f"{name}: pagedkv from {where}")
    cmd = [str(Path(__file__).resolve()), "--child", "--shapes", args.shapes, "--vocab", str(args.vocab), "--steps", str(args.steps),
           "--block-size", str(args.block_size)] + (["--model", str(Path(args.model).resolve())] if args.model else [])
    for r in range(args.repeats):
        for name, (python, backend) in (trees.items() if r % 2 == 0 else reversed(trees.items())):
            extra = ["--attention-backend", backend] if backend else []
            out = subprocess.run([python, *cmd, *extra], capture_output=True, text=True, check=True, cwd="/tmp",
                                 env=envs[name])
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    forward = f"real forward of {args.model}" if args.model else f"stub forward, vocab {args.vocab}"
    print(f"worker host CPU ms per decode step (thread time; wall in brackets), {forward}, "
          f"block_size {args.block_size}, median of {args.steps - 3} steps; median over {args.repeats} "
          "alternating repeat(s)")
    head = f"{'shape':>10} " + " ".join(f"{n + ' exec [wall]':>22} {n + ' p90':>12} {n + ' decode':>14}"
                                        for n in trees)
    print(head + ("  exec ratio" if len(trees) == 2 else ""))
    for i, (n, c) in enumerate(shapes):
        cells, med = [], {}
        for name in trees:
            rows = [run[i] for run in runs[name]]
            med[name] = statistics.median(r["execute_ms"] for r in rows)
            wall = statistics.median(r["execute_wall_ms"] for r in rows)
            cells.append(f"{med[name]:12.3f} [{wall:7.2f}] {statistics.median(r['execute_p90_ms'] for r in rows):12.3f} "
                         f"{statistics.median(r['plan_decode_ms'] for r in rows):14.3f}")
        ratio = ""
        if len(trees) == 2:
            ratios = [a[i]["execute_ms"] / b[i]["execute_ms"] for a, b in zip(runs["baseline"], runs["this"])]
            ratio = f"  {statistics.median(ratios):9.1f}x"
        print(f"{n}x{c:>5} " + " ".join(cells) + ratio)
    if args.model and len({n for n, _ in shapes}) > 1:
        for name in trees:  # least-squares CPU ms per step against running requests, per repeat
            fits = []
            for run in runs[name]:
                xs, ys = [n for n, _ in shapes], [r["execute_ms"] for r in run]
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
                fits.append((slope, my - slope * mx))
            print(f"{name}: CPU ms per step = intercept + slope x running; per repeat (slope, intercept): "
                  + ", ".join(f"({a:.4f}, {b:.2f})" for a, b in fits))


if __name__ == "__main__":
    main()
