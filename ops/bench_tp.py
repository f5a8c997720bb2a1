"""Step time at tensor-parallel size 1 and 2, and the communication share of a -tp 2 step.

Runs the engine's own model (`worker.model`, dummy weights, paged KV cache) on a Llama config large
enough that the matmuls dominate, in two rank processes joined by torch.distributed (gloo on CPU,
NCCL when --device cuda and two GPUs). One step is a forward of ``--tokens`` new tokens (a prefill
chunk of one sequence, ``--context`` tokens already in the cache). Measured, alternating the order
in every repeat:

- tp1: rank 0 alone runs the whole model (rank 1 waits in a barrier, which costs no CPU);
- tp1 x2 threads (CPU only): the same with two intra-op threads, the other way to use a second core;
- tp2: both ranks run their shard, two all-reduces per layer.

Communication: the time rank 0 spends inside the step's all-reduces (which includes waiting for the
slower rank), and a pure all-reduce loop of the same count and sizes with no compute. Reports medians
and ratios from the same run; on a shared machine say so next to them.

    python ops/bench_tp.py --layers 2 --hidden 2048 --intermediate 5632 --tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.common.config import EMBEDDED_HF_CONFIG, EngineConfig, ModelConfig
from pagedkv.worker.cache_engine import CacheEngine
from pagedkv.worker.model import AttentionMetadata
from pagedkv.worker.model_loader import load_model
from pagedkv.worker.parallel import TensorParallel

BLOCK = 16
_allreduce_seconds = [0.0]


class TimedTensorParallel(TensorParallel):
    """TensorParallel that adds the wall time of each all-reduce to ``_allreduce_seconds``."""

    def all_reduce(self, x):
        start = time.perf_counter()
        super().all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        _allreduce_seconds[0] += time.perf_counter() - start
        return x


def model_config(args) -> ModelConfig:
    hf = dict(EMBEDDED_HF_CONFIG, hidden_size=args.hidden, intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
              head_dim=args.hidden // args.heads, vocab_size=args.vocab, max_position_embeddings=8192)
    return ModelConfig.from_hf_dict(hf, "bench-tp", None)


class Step:
    """One prefill chunk of ``tokens`` new tokens after ``context`` cached ones, on one rank's shard."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, tokens: int, context: int, device, dtype):
        self.model = load_model(config, EngineConfig(load_format="dummy", seed=0), device, dtype, tp)
        total = context + tokens
        nblocks = -(-total // BLOCK)
        self.cache = CacheEngine(config.shard(tp.world_size), nblocks, 0, BLOCK, dtype, device, self.model.kernels)
        table = torch.arange(nblocks, dtype=torch.int32)[None]
        pos = torch.arange(context, total)
        self.meta = AttentionMetadata((table[0, pos // BLOCK].long() * BLOCK + pos % BLOCK).to(device), table.to(device),
                                      torch.tensor([total], dtype=torch.int32, device=device),
                                      torch.tensor([0, tokens], dtype=torch.int32, device=device))
        self.ids = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).to(device)
        self.pos, self.last = pos.to(device), torch.tensor([tokens - 1], device=device)
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    @torch.inference_mode()
    def __call__(self) -> None:
        self.model(self.ids, self.pos, self.meta, self.cache.k_caches, self.cache.v_caches, self.last)
        self.sync()


def timed(fn, iters: int) -> tuple[float, float]:
    """Median seconds of ``iters`` calls after one warm-up call, and the median of their all-reduce seconds."""
    fn()
    times, comm = [], []
    for _ in range(iters):
        _allreduce_seconds[0] = 0.0
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        comm.append(_allreduce_seconds[0])
    return statistics.median(times), statistics.median(comm)


def rank_main(rank: int, args, init_method: str, out_path: str) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    dtype = getattr(torch, args.dtype)
    config = model_config(args)
    tp2 = Step(config, TimedTensorParallel(rank, 2), args.tokens, args.context, device, dtype)
    tp1 = Step(config, TensorParallel(), args.tokens, args.context, device, dtype) if rank == 0 else None
    comm = torch.zeros(args.tokens, args.hidden, dtype=dtype, device=device)
    results: dict[str, list[float]] = {"tp1": [], "tp2": [], "tp2_in_allreduce": [], "allreduce_only": []}
    if not cuda:
        results["tp1_2threads"] = []

    def run_tp1() -> None:
        dist.barrier()
        if rank == 0:
            results["tp1"].append(timed(tp1, args.iters)[0])
            if not cuda:
                torch.set_num_threads(2)
                results["tp1_2threads"].append(timed(tp1, args.iters)[0])
                torch.set_num_threads(1)
        dist.barrier()

    def run_tp2() -> None:
        dist.barrier()
        step, in_allreduce = timed(tp2, args.iters)
        results["tp2"].append(step)
        results["tp2_in_allreduce"].append(in_allreduce)
        dist.barrier()

        def allreduce_only():
            for _ in range(2 * args.layers):
                dist.all_reduce(comm)
            if cuda:
                torch.cuda.synchronize(device)
        results["allreduce_only"].append(timed(allreduce_only, args.iters)[0])

    for repeat in range(args.repeats):
        for run in ((run_tp1, run_tp2) if repeat % 2 == 0 else (run_tp2, run_tp1)):
            run()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per step")
    p.add_argument("--context", type=int, default=128, help="tokens already in the KV cache")
    p.add_argument("--iters", type=int, default=3, help="timed steps per measurement (median)")
    p.add_argument("--repeats", type=int, default=5, help="alternating tp1/tp2 measurements")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--port", type=int, default=29533)
    p.add_argument("--out", default="bench_tp.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("bench_tp: --device cuda needs two GPUs", file=sys.stderr)
        return 2
    raw = args.out + ".raw"
    mp.spawn(rank_main, args=(args, f"tcp://127.0.0.1:{args.port}", raw), nprocs=2, join=True)
    with open(raw) as f:
        results = json.load(f)
    os.remove(raw)  # rank 0's hand-over only: the report below keeps it as raw_s
    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "config": vars(args), "medians_s": med, "raw_s": results,
        "tp2_speedup_over_tp1": med["tp1"] / med["tp2"],
        "tp2_allreduce_share_in_step": med["tp2_in_allreduce"] / med["tp2"],
        "tp2_pure_allreduce_share": med["allreduce_only"] / med["tp2"],
        "per_repeat_speedup": [a / b for a, b in zip(results["tp1"], results["tp2"])],
    }
    if "tp1_2threads" in med:
        report["tp2_speedup_over_tp1_2threads"] = med["tp1_2threads"] / med["tp2"]
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k not in ("raw_s", "config")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
