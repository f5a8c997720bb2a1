"""Swap versus recompute, per block size (PagedAttention, Kwon et al., SOSP 2023, §7.3, Fig. 19).

For one request of ``--tokens`` tokens and each block size, on this machine:

- swap: the worker's own path (`CacheEngine.swap_out` then `swap_in`, i.e. `kernels.swap_blocks`
  block by block, layer by layer) moving all ceil(tokens / block_size) blocks to the host pool and
  back — the whole cost of a swap preemption;
- recompute: the worker's own prefill (`ModelRunner.execute` of a new request with those tokens,
  real model forward and sampling) — the whole cost of a recompute preemption.

Each is the median of ``--repeats`` runs after a warm-up. Beside them, what the ``auto`` cost model
(`scheduler.preemption`) would estimate from what a worker measures: bandwidth from
`measure_swap_bandwidth` (as at worker start), prefill throughput from the measured prefill, and
which mode it would pick. Both costs grow linearly with the request, so the choice does not depend
on its length; it switches where 2 x KV bytes per token / bandwidth = 1 / throughput, printed as
the bandwidth below which ``auto`` recomputes.

The paper's finding: small blocks make swapping slow (many small copies); recompute does not care
about block size. On a GPU swap goes over PCIe/NVLink; on a CPU-only machine "host" and "device"
are both DRAM, so swap is a memcpy and the comparison is against the CPU's own forward pass.

    python ops/bench_swap.py --model ../shared/models/stories260K
    python ops/bench_swap.py --dummy-medium          # a 120M-parameter Llama config, random weights
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.common.protocol import NewRequestData, StepPlan
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.cache_engine import measure_swap_bandwidth
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.model_runner import ModelRunner

BLOCK_SIZES = (8, 16, 32, 64, 128)

# A medium Llama-architecture config (about 120M parameters, GQA 16/8 heads, float32 KV of
# 2 x 8 layers x 8 heads x 64 x 4 B = 32 KiB per token): big enough that a forward pass is not all
# overhead, small enough to run on two CPU cores.
DUMMY_MEDIUM = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: page faults, lazy init, kernel selection
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype,
            num_tokens: int, repeats: int) -> list[dict]:
    """One row per block size: swap and recompute seconds, and what the auto cost model predicts."""
    rows = []
    runner = None
    for bs in BLOCK_SIZES:
        cfg = EngineConfig(**{**{f: getattr(engine_config, f) for f in engine_config.__struct_fields__},
                              "block_size": bs})
        if runner is None:
            runner = ModelRunner(cfg, device, dtype, model_config)
        runner.engine_config, runner.block_size = cfg, bs  # same weights, new block size
        runner.batch = InputBatch(cfg.max_num_seqs, runner.max_model_len, bs, model_config.vocab_size, device)
        num_blocks = -(-num_tokens // bs)
        runner.init_cache(num_blocks, num_blocks)
        bandwidth = measure_swap_bandwidth(device, (bs, model_config.num_key_value_heads, model_config.head_dim), dtype)
        pairs = [(i, i) for i in range(num_blocks)]
        swap_s = _median_seconds(lambda: (runner.cache.swap_out(pairs), runner.cache.swap_in(pairs)), device, repeats)

        token_ids = [(7 * i) % model_config.vocab_size for i in range(num_tokens)]
        step = [0]

        def prefill():
            step[0] += 1
            rid = f"bench-{step[0]}"
            runner.execute(StepPlan(step_id=step[0], new_requests=[NewRequestData(
                rid, token_ids, num_tokens, list(range(num_blocks)), 0, num_tokens, SamplingParams(temperature=0))]))
            runner.batch.remove(rid)

        recompute_s = _median_seconds(prefill, device, repeats)
        block_bytes = runner.kv_bytes_per_block
        throughput = num_tokens / recompute_s
        model_swap = 2 * num_blocks * block_bytes / bandwidth
        model_recompute = num_tokens / throughput
        rows.append({
            "block_size": bs, "num_blocks": num_blocks, "bytes": num_blocks * block_bytes,
            "swap_s": swap_s, "recompute_s": recompute_s,
            "effective_gbps": 2 * num_blocks * block_bytes / swap_s / 1e9,
            "model_swap_s": model_swap, "model_recompute_s": model_recompute,
            "auto": "swap" if model_swap < model_recompute else "recompute",
            "faster": "swap" if swap_s < recompute_s else "recompute",
            "switch_gbps": 2 * block_bytes / bs * throughput / 1e9,
            "measured_gbps": bandwidth / 1e9,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF checkpoint directory (e.g. ../shared/models/stories260K)")
    p.add_argument("--dummy-medium", action="store_true", help="a 120M-parameter Llama config, random weights")
    p.add_argument("--tokens", type=int, default=None, help="request length (default: 256 for --model, 512 dummy)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    if args.dummy_medium == (args.model is not None):
        p.error("give exactly one of --model PATH or --dummy-medium")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.dummy_medium:
        model_config = ModelConfig.from_hf_dict(DUMMY_MEDIUM, "dummy-medium-120M", None)
        engine_config = EngineConfig(load_format="dummy")
        num_tokens = args.tokens or 512
    else:
        model_config = ModelConfig.load(args.model)
        engine_config = EngineConfig(model=args.model)
        num_tokens = args.tokens or 256
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    rows = measure(model_config, engine_config, device, dtype, num_tokens, args.repeats)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    kv_token = model_config.kv_bytes_per_token(str(dtype).removeprefix("torch."))
    print(f"# swap vs recompute, {model_config.name}, {num_tokens}-token request, {str(dtype)[6:]}, "
          f"KV {kv_token} B/token, device: {device} = {name}")
    print("# 'model GB/s': swap bandwidth as the worker measures it at start (measure_swap_bandwidth: ~32 MiB of "
          "blocks of this size, one copy per block); 'auto' estimates swap time from it")
    print(f"{'block':>5} {'blocks':>6} {'KiB':>8} {'swap out+in ms':>14} {'eff GB/s':>8} {'model GB/s':>10} {'recompute ms':>12} "
          f"{'faster':>9} {'auto: swap ms':>13} {'recompute ms':>12} {'picks':>9}")
    for r in rows:
        print(f"{r['block_size']:>5} {r['num_blocks']:>6} {r['bytes'] / 1024:>8.0f} {r['swap_s'] * 1e3:>14.3f} "
              f"{r['effective_gbps']:>8.2f} {r['measured_gbps']:>10.2f} {r['recompute_s'] * 1e3:>12.2f} {r['faster']:>9} "
              f"{r['model_swap_s'] * 1e3:>13.3f} {r['model_recompute_s'] * 1e3:>12.2f} {r['auto']:>9}")
    switch = statistics.median(r["switch_gbps"] for r in rows)
    picks = sorted({r["auto"] for r in rows})
    print(f"# auto switches to recompute when bandwidth < 2 x KV bytes/token x prefill throughput "
          f"= {switch:.4f} GB/s here (measured {min(r['measured_gbps'] for r in rows):.2f}-"
          f"{max(r['measured_gbps'] for r in rows):.2f} GB/s): it picks {' or '.join(picks)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
