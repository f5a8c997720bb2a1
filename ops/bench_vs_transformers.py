"""pagedkv against Hugging Face transformers ``generate`` with static batches, in the same run.

Same model (a Llama checkpoint directory, e.g. stories260K), same prompts (random token ids of
the trace's scaled context lengths), same output lengths (the trace's scaled GeneratedTokens,
EOS ignored), greedy, same dtype, on the same CPU with the same number of compute threads: those
pagedkv's worker takes (`worker.cpu_compute_threads`: $OMP_NUM_THREADS, else all cores but one,
left to its control plane).
All requests are available at time 0 (offline throughput).

- pagedkv: one in-process engine (its worker process), continuous batching over the paged KV
  cache; every request generates exactly its own output length.
- transformers: static batches of ``--hf-batch-size`` requests in trace order, left-padded; a
  batch runs until its longest output is done (``min_new_tokens = max_new_tokens`` = that
  length), the tool a user would otherwise reach for. Only requested tokens count as output.

Throughput = requested output tokens / wall time from the first request to the last token.

    python ops/bench_vs_transformers.py --model ../shared/models/stories260K --trace conv \\
        --num-requests 64 --hf-batch-size 8,32 [--json out.json]
    python ops/bench_vs_transformers.py --model /tmp/llama-200m --load-format dummy \\
        --num-requests 64 --hf-batch-size 8,32 --repeats 2 [--dtype bfloat16]  # weights-bound (weights_bound_model.py)

transformers (and torch) are imported here only: an optional dependency (pip install 'pagedkv[bench]').
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import sys
import time

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagedkv.worker.worker import cpu_compute_threads
from pagedkv.bench.replay import (ATTRIBUTION, auto_token_scale, build_requests, load_trace, machine_info, random_prompt,
                             resolve_trace, run_in_process)


def run_transformers(model_dir: str, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
                     threads: int | None = None, load_format: str = "auto", dtype: str = "float32") -> dict:
    """Static-batch greedy generation with transformers; returns wall seconds and token counts.
    load_format "dummy": random weights from config.json (a directory without weights), as pagedkv's;
    dtype: the weights' and activations' torch dtype name (float32, bfloat16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    if load_format == "dummy":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch_dtype)
    model.eval()
    pad = 0
    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch, outs = prompts[b:b + batch_size], max_tokens[b:b + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            new = max(outs)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
            generated += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - start
    useful = sum(max_tokens)
    return {"batch_size": batch_size, "wall_s": wall, "output_tokens": useful, "generated_tokens": generated,
            "output_token_throughput": useful / wall, "request_throughput": len(prompts) / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Llama checkpoint directory (config.json, model.safetensors)")
    p.add_argument("--trace", default="conv", help="conv, code, or a CSV path")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--hf-batch-size", default="8,32", help="static batch sizes to try, comma-separated")
    p.add_argument("--max-num-seqs", type=int, default=256, help="pagedkv's running batch limit")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of (pagedkv, each batch size), order alternating; the ratio is the median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights in both engines (a directory without weights, e.g. "
                        "ops/weights_bound_model.py's); throughput only, the outputs are noise")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights and activations in both engines (default: float32); bfloat16 on a CPU with "
                        "AMX makes a decode step weights-bound, as on a GPU (lscpu: amx_bf16)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="transformers' compute threads (default: those pagedkv's worker takes, "
                        "$OMP_NUM_THREADS, else all cores but one; both are printed)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    try:
        batch_sizes = [int(x) for x in args.hf_batch_size.split(",")]
    except ValueError:
        p.error(f"--hf-batch-size must be comma-separated integers, got {args.hf_batch_size!r}")
    if args.num_requests < 1 or args.repeats < 1 or any(b < 1 for b in batch_sizes) \
            or (args.hf_threads is not None and args.hf_threads < 1):
        p.error("--num-requests, --repeats, --hf-batch-size and --hf-threads must be >= 1")
    if importlib.util.find_spec("transformers") is None:
        p.error("this comparison needs transformers: pip install 'pagedkv[bench]'")

    worker_threads = cpu_compute_threads()  # what pagedkv's worker will take; before transformers sets any
    hf_threads = args.hf_threads or worker_threads
    model = ModelConfig.load(args.model)
    max_model_len = resolve_max_model_len(model, None)
    path = resolve_trace(args.trace)
    rows = load_trace(path)
    scale = auto_token_scale(rows, max_model_len)
    requests, clipped = build_requests(rows, args.num_requests, max_model_len, scale, request_rate=float("inf"))
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, r.prompt_len, model.vocab_size) for r in requests]
    max_tokens = [r.max_tokens for r in requests]

    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, seed=args.seed,
                          load_format=args.load_format, dtype=args.dtype)
    rounds = []  # each: (pagedkv summary, [transformers result per batch size]); load on a shared machine drifts
    for i in range(args.repeats):
        run_paged = lambda: asyncio.run(run_in_process(config, requests, seed=args.seed, progress=False,  # noqa: E731
                                                       desc="pagedkv", account_kv_every_step=False))
        run_hf = lambda: [run_transformers(args.model, prompts, max_tokens, b, threads=hf_threads,  # noqa: E731
                                           load_format=args.load_format, dtype=args.dtype) for b in batch_sizes]
        if i % 2 == 0:
            paged, hf = run_paged(), run_hf()
        else:
            hf = run_hf()
            paged = run_paged()
        paged.pop("samples", None)
        rounds.append((paged, hf))
    ratios = [[p["output_token_throughput"] / h["output_token_throughput"] for h in hf] for p, hf in rounds]
    median_ratio = [statistics.median(r[j] for r in ratios) for j in range(len(batch_sizes))]
    paged, hf = rounds[0]

    print(f"{len(requests)} requests from {path.name}, {args.dtype}, tokens x{scale:.4f} (max_model_len / p99), "
          f"{clipped} clipped; "
          f"mean prompt {sum(map(len, prompts)) / len(prompts):.1f}, "
          f"mean output {sum(max_tokens) / len(max_tokens):.1f}; "
          f"compute threads: pagedkv's worker {worker_threads}, transformers {hf_threads}")
    print("\n| engine | batching | wall s | output tok/s | req/s | pagedkv / this |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print(f"| pagedkv | continuous, paged KV | {paged['duration_s']:.2f} | {paged['output_token_throughput']:.1f} "
          f"| {paged['request_throughput']:.2f} | 1.00x |")
    for j, h in enumerate(hf):
        each = ", ".join(f"{r[j]:.2f}" for r in ratios)
        print(f"| transformers generate | static, batch {h['batch_size']} | {h['wall_s']:.2f} "
              f"| {h['output_token_throughput']:.1f} | {h['request_throughput']:.2f} | **{median_ratio[j]:.2f}x** ({each}) |")
    print(f"\n(first round shown; the ratio is the median over {args.repeats} rounds, each round's in parentheses)")
    print(f"\nTrace: {ATTRIBUTION}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": [{"pagedkv": p, "transformers": h} for p, h in rounds], "ratios": ratios,
                       "median_ratio": median_ratio, "token_scale": scale, "num_clipped": clipped,
                       "dtype": args.dtype, "threads": {"pagedkv_worker": worker_threads, "transformers": hf_threads},
                       "trace": path.name, "machine": machine_info(), "attribution": ATTRIBUTION}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
