"""Capacity planner: how many KV tokens, blocks and concurrent requests fit on one GPU, or on each of N.

The arithmetic a serving engine does at start-up, on paper (PagedAttention, Kwon et al., SOSP
2023, §3: the KV cache is what limits the batch). All sizes in bytes unless named otherwise:

    budget   = gpu_memory_gib x 2^30 x gpu_memory_utilization
    kv_bytes = budget - weight_bytes - activation_reserve_gib x 2^30
    tokens   = floor(kv_bytes / kv_bytes_per_token)          (kv_bytes_per_token = 2 x layers x
                                                               kv_heads x head_dim x kv dtype bytes)
    blocks   = floor(tokens / block_size)
    requests = floor(blocks / ceil(context_len / block_size))  (each at its full context length)

With ``--tensor-parallel-size N`` every figure is per device: each holds `ModelConfig.shard` (1/N of
the attention and MLP weights, the embedding and LM head whole, 1/N of the KV heads or one replicated
KV head), and every device holds every block, so the token, block and request counts are the engine's.

The activation reserve stands in for what an engine measures by profiling one forward pass at
``max_num_batched_tokens`` (activations, logits, CUDA context and graphs); measure it on your
device for a precise figure (``pagedkv serve`` profiles it).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from pagedkv.common.config import _DTYPE_BYTES, ModelConfig, resolve_max_model_len

GIB = 2**30
DEFAULT_ACTIVATION_RESERVE_GIB = 4.0


@dataclass(frozen=True)
class Capacity:
    """The result of `plan`. Bytes, tokens, blocks and requests are integers; memory sizes in bytes."""

    model: str
    dtype: str
    kv_cache_dtype: str
    gpu_memory_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int
    weight_bytes: int
    activation_reserve_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    block_size: int
    num_blocks: int
    context_len: int
    blocks_per_request: int
    max_concurrent_requests: int
    tensor_parallel_size: int = 1


def _resolve_dtype(dtype: str, model: ModelConfig) -> str:
    if dtype == "auto":
        dtype = model.torch_dtype
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)} or auto, got {dtype!r}")
    return dtype


def plan(model: ModelConfig, gpu_memory_gib: float, *, gpu_memory_utilization: float = 0.9,
         dtype: str = "auto", kv_cache_dtype: str = "auto",
         activation_reserve_gib: float = DEFAULT_ACTIVATION_RESERVE_GIB, block_size: int = 16,
         context_len: int | None = None, tensor_parallel_size: int = 1) -> Capacity:
    """Size the KV cache of ``model`` on a GPU of ``gpu_memory_gib`` GiB, or on each of ``tensor_parallel_size``
    such GPUs holding one shard each (see the module docstring); bytes are per device.

    dtype: weight dtype ("auto": the checkpoint's torch_dtype); kv_cache_dtype: "auto" follows
    dtype, "fp8" stores K/V in one byte. context_len (tokens) defaults to the model's context limit
    (`resolve_max_model_len`: max_position_embeddings, or a smaller sliding_window).
    Raises ValueError for an unknown dtype, non-positive sizes, a tensor-parallel size the model's heads
    or intermediate size do not divide, or when weights and the activation reserve leave no room for a block.
    """
    if gpu_memory_gib <= 0 or not 0 < gpu_memory_utilization <= 1 or activation_reserve_gib < 0:
        raise ValueError("gpu memory must be > 0, utilization in (0, 1], activation reserve >= 0")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    dtype = _resolve_dtype(dtype, model)
    kv_dtype = dtype if kv_cache_dtype == "auto" else _resolve_dtype(kv_cache_dtype, model)
    context_len = resolve_max_model_len(model, None) if context_len is None else context_len
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    gpu_bytes = int(gpu_memory_gib * GIB)
    budget = int(gpu_bytes * gpu_memory_utilization)
    shard = model.shard(tensor_parallel_size)
    weights = shard.weight_bytes(dtype)
    reserve = int(activation_reserve_gib * GIB)
    kv_bytes = budget - weights - reserve
    per_token = shard.kv_bytes_per_token(kv_dtype)
    tokens = max(kv_bytes, 0) // per_token
    blocks = tokens // block_size
    if blocks < 1:
        raise ValueError(f"no room for a KV block: budget {budget} B - weights {weights} B - activation "
                         f"reserve {reserve} B = {kv_bytes} B")
    per_request = -(-context_len // block_size)
    return Capacity(model.name, dtype, kv_dtype, gpu_bytes, gpu_memory_utilization, budget, weights, reserve,
                    kv_bytes, per_token, tokens, block_size, blocks, context_len, per_request,
                    blocks // per_request, tensor_parallel_size)


def format_report(c: Capacity) -> str:
    """The plan as text, one line per step of the arithmetic."""
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    tp = c.tensor_parallel_size
    return "\n".join([
        f"model {c.model}: weights {c.dtype}, KV cache {c.kv_cache_dtype}",
        *([f"tensor parallel = {tp} devices, each with 1/{tp} of the heads and MLP, the embedding and LM head "
           "whole; bytes below are per device"] if tp > 1 else []),
        f"budget          = {g(c.gpu_memory_bytes)} x {c.gpu_memory_utilization} = {c.budget_bytes:,} B ({g(c.budget_bytes)})",
        f"weights         = {c.weight_bytes:,} B ({g(c.weight_bytes)})",
        f"activations     = {c.activation_reserve_bytes:,} B ({g(c.activation_reserve_bytes)}, reserved)",
        f"KV cache        = budget - weights - activations = {c.kv_cache_bytes:,} B ({g(c.kv_cache_bytes)})",
        f"KV bytes/token  = 2 (K,V) x layers x kv_heads{' per device' if tp > 1 else ''} x head_dim x dtype bytes "
        f"= {c.kv_bytes_per_token:,} B",
        f"KV tokens       = {c.kv_cache_bytes:,} / {c.kv_bytes_per_token:,} = {c.kv_tokens:,} tokens",
        f"blocks          = {c.kv_tokens:,} / {c.block_size} = {c.num_blocks:,} blocks of {c.block_size} tokens",
        f"requests        = {c.num_blocks:,} / ceil({c.context_len:,} / {c.block_size}) = "
        f"{c.max_concurrent_requests:,} concurrent requests at {c.context_len:,} tokens each",
    ])


def _positive(kind, name: str, allow_zero: bool = False, hi: float | None = None, power_of_two: bool = False):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if v < 0 or (v == 0 and not allow_zero) or v != v or (hi is not None and v > hi):
            bound = f"{'>=' if allow_zero else '>'} 0" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"{name} must be {bound}, got {s}")
        if v == float("inf"):  # --gpu-memory-gib inf was an OverflowError traceback
            raise argparse.ArgumentTypeError(f"{name} must be finite, got {s}")
        if power_of_two and (v > 256 or v & (v - 1)):  # as `pagedkv serve --block-size`
            raise argparse.ArgumentTypeError(f"{name} must be a power of two, 1..256, got {s}")
        return v
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``pagedkv capacity`` flags (the CLI calls this, then `main`)."""
    parser.add_argument("--model-config", required=True, metavar="PATH",
                        help="a Hugging Face config.json, or the directory holding it")
    parser.add_argument("--gpu-memory-gib", required=True, type=_positive(float, "--gpu-memory-gib"),
                        metavar="GIB", help="device memory in GiB (PyTorch reports 79.11 GiB for an '80 GB' H100)")
    parser.add_argument("--gpu-memory-utilization", type=_positive(float, "--gpu-memory-utilization", hi=1.0),
                        default=0.9, help="fraction of device memory the engine may use (default 0.9)")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                        help="weight dtype; auto: the checkpoint's torch_dtype")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                                      "fp8_e5m2"],
                        default="auto", help="KV cache dtype; auto: same as --dtype")
    parser.add_argument("--activation-reserve-gib", type=_positive(float, "--activation-reserve-gib", True),
                        default=DEFAULT_ACTIVATION_RESERVE_GIB, metavar="GIB",
                        help="memory kept for activations, CUDA context and graphs (default 4)")
    parser.add_argument("--block-size", type=_positive(int, "--block-size", power_of_two=True), default=16, help="tokens per block")
    parser.add_argument("--context-len", type=_positive(int, "--context-len"), default=None, metavar="TOKENS",
                        help="tokens per request for the concurrency figure; default: max_position_embeddings")
    parser.add_argument("--tensor-parallel-size", "-tp", type=_positive(int, "--tensor-parallel-size"), default=1,
                        metavar="N", help="devices the model is sharded over; figures are then per device")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def main(args: argparse.Namespace) -> int:
    """Run ``pagedkv capacity``: print the plan (text or JSON). Returns 0, or 2 on bad input."""
    import sys

    try:
        model = ModelConfig.load(args.model_config)
        c = plan(model, args.gpu_memory_gib, gpu_memory_utilization=args.gpu_memory_utilization,
                 dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                 activation_reserve_gib=args.activation_reserve_gib, block_size=args.block_size,
                 context_len=args.context_len, tensor_parallel_size=args.tensor_parallel_size)
    except (OSError, ValueError) as e:
        print(f"pagedkv capacity: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(c), indent=2) if args.json else format_report(c))
    return 0
