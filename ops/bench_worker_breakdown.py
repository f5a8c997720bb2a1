"""Where a worker step's CPU time goes, by model part: attention kernel, projections, MLP, norms, the rest.

Runs `ModelRunner.execute` on a real checkpoint (dummy weights without model.safetensors) in this
process, one thread, host memory set as a CPU worker sets it (`bench_worker_host.worker_host_memory`),
with each part of the forward wrapped in a thread-CPU-time counter (the wrappers cost a few
microseconds per call). Two step kinds:

- decode: N running requests at a context of C tokens (``--shape NxC``), one token each per step,
  as `ops/bench_worker_host.py` drives them; mean over the steps after two warm-up steps;
- prefill (``--prefill NxL``, or ``--prefill L1,L2,...``): new requests of those prompt lengths in
  one step, four such steps (each frees the previous requests); every step is printed.

    python ops/bench_worker_breakdown.py --model ../shared/models/stories260K --shape 256x100
    python ops/bench_worker_breakdown.py --model ../shared/models/stories260K --prefill 19x108
    python ops/bench_worker_breakdown.py --model ../shared/models/stories260K --prefill 45,48,106,11,491
    python ops/bench_worker_breakdown.py --model /tmp/llama-200m --prefill 24x85 --dtype bfloat16

The interpreter of another checkout measures that checkout's code (its ``.venv/bin/python``); in
trees before the C kernels the model had no ``kernels`` and attention counts in "rest of forward".
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_worker_host  # noqa: E402  (its decode-step driver)


def _runner(model: str, backend: str | None, num_blocks: int, max_num_seqs: int, dtype: str = "float32"):
    bench_worker_host.worker_host_memory()  # before torch is imported
    import torch

    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner

    torch.set_num_threads(1)
    mc = ModelConfig.load(model)
    dummy = not os.path.exists(os.path.join(model, "model.safetensors"))
    cfg = EngineConfig(model=model, block_size=16, max_num_seqs=max_num_seqs, attention_backend=backend,
                       load_format="dummy" if dummy else "auto")
    runner = ModelRunner(cfg, torch.device("cpu"), getattr(torch, dtype), mc)
    runner.init_cache(num_blocks, 0)
    return runner, mc


def prefill_runner(model: str, lengths: list[int], backend: str | None = None, dtype: str = "float32"):
    """`_runner` with blocks for `prefill_step` to admit prompts of these lengths whole, each its own
    blocks: returns (runner, model config)."""
    return _runner(model, backend, len(lengths) * -(-max(lengths) // 16) + 1, len(lengths), dtype)


def prefill_step(runner, step: int, prompts: list[list[int]]) -> None:
    """One step that admits ``prompts`` whole (greedy) into a `prefill_runner`'s pool, request i in
    blocks from i x the longest prompt's block count on, after finishing step - 1's requests."""
    from pagedkv.common.protocol import NewRequestData, StepPlan
    from pagedkv.common.sampling_params import SamplingParams

    per, greedy = -(-max(map(len, prompts)) // 16), SamplingParams(temperature=0.0, max_tokens=8)
    news = [NewRequestData(f"r{step}-{i}", ids, len(ids), list(range(i * per, i * per + -(-len(ids) // 16))), 0,
                           len(ids), greedy) for i, ids in enumerate(prompts)]
    previous = [f"r{step - 1}-{i}" for i in range(len(prompts))] if step else []
    result = runner.execute(StepPlan(step, new_requests=news, finished_request_ids=previous))
    assert result.error is None, result.error


def _instrument(runner, acc: dict) -> None:
    """Wrap the forward's parts (and the CPU backend's C call) in thread-CPU-time counters into ``acc``."""
    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += time.thread_time() - t
        return wrapper

    kernels = getattr(runner.model, "kernels", None)  # None in the d863b9d baseline: attention is "rest of forward"
    if getattr(kernels, "fused_available", lambda: False)():
        lib = kernels._library()
        name = "paged_attention_fused" if hasattr(lib, "paged_attention_fused") else "paged_decode_attention"
        setattr(lib, name, timed("  of attention: the C fused kernel", getattr(lib, name)))  # older trees' name too
    ref = sys.modules["pagedkv.kernels.reference"]
    if hasattr(ref, "batched_paged_attention"):
        ref.batched_paged_attention = timed("  of attention: batched torch", ref.batched_paged_attention)
    for layer in runner.model.model.layers:
        if kernels is not None:
            parts = {"paged_attention": "attention", "write_kv_cache": "write_kv_cache",
                     "rotary_embedding": "rotary_embedding (RoPE)"}  # older trees: RoPE in "rest of forward"
            layer.self_attn.kernels = type("Timed", (), {
                fn: staticmethod(timed(label, getattr(kernels, fn))) for fn, label in parts.items()
                if hasattr(kernels, fn)})
        layer.mlp.forward = timed("mlp (gate, up, silu x up, down)", layer.mlp.forward)
        for p in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj"):  # separate q/k/v in older trees
            if hasattr(layer.self_attn, p):
                getattr(layer.self_attn, p).forward = timed("q/k/v/o projections", getattr(layer.self_attn, p).forward)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = timed("rmsnorm", norm.forward)
    runner.model.lm_head.forward = timed("lm_head", runner.model.lm_head.forward)
    runner.model.forward = timed("forward", runner.model.forward)
    runner.execute = timed("execute", runner.execute)


def _report(acc: dict, steps: int) -> None:
    parts = {k: v for k, v in acc.items() if k not in ("execute", "forward")}
    top = ("attention", "write_kv_cache", "rotary_embedding (RoPE)", "mlp (gate, up, silu x up, down)",
           "q/k/v/o projections", "rmsnorm", "lm_head")
    parts["rest of forward (embedding, residual adds, cos/sin)"] = acc["forward"] - sum(acc[k] for k in top)
    parts["outside forward (inputs, sampling)"] = acc["execute"] - acc["forward"]
    print(f"  execute {1000 * acc['execute'] / steps:.2f} ms CPU per step")
    for name, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"    {name:52s} {1000 * v / steps:8.2f} ms  {100 * v / acc['execute']:5.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--shape", default="256x100", help="decode: N running x C context tokens")
    p.add_argument("--prefill", default=None, help="a prefill step instead: N new requests x L prompt tokens, "
                   "or the prompts' lengths L1,L2,...")
    p.add_argument("--steps", type=int, default=25,
                   help="decode steps to run (>= 4); the mean is over all but the first two (default: 25)")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights, activations, KV cache")
    args = p.parse_args()
    if args.steps < 4:  # bench_worker_host's driver keeps the steps after its third
        p.error(f"--steps must be at least 4, got {args.steps}")
    acc: dict[str, float] = collections.defaultdict(float)
    if args.prefill:
        if "x" in args.prefill:
            n, length = (int(x) for x in args.prefill.split("x"))
            lengths = [length] * n
        else:
            lengths = [int(x) for x in args.prefill.split(",")]
        runner, mc = prefill_runner(args.model, lengths, args.attention_backend, args.dtype)
        _instrument(runner, acc)
        for k in range(4):
            acc.clear()
            prefill_step(runner, k, [[(7 * j + i) % mc.vocab_size for j in range(n)] for i, n in enumerate(lengths)])
            print(f"prefill step {k + 1}: {len(lengths)} prompts, {sum(lengths)} tokens (longest {max(lengths)})")
            _report(acc, 1)
        return
    n, context = (int(x) for x in args.shape.split("x"))
    runner, mc = _runner(args.model, args.attention_backend, n * -(-(context + args.steps + 8) // 16), n, args.dtype)
    _instrument(runner, acc)
    execute, calls = runner.execute, [0]

    def execute_after_warm_up(plan):
        calls[0] += 1
        if calls[0] == 4:  # drop the prefill and two warm-up decode steps
            acc.clear()
        return execute(plan)

    runner.execute = execute_after_warm_up
    bench_worker_host._decode_steps(runner, n, context, mc.vocab_size, args.steps, 16)
    print(f"decode, {n} running x {context} context, mean over {args.steps - 2} steps")
    _report(acc, args.steps - 2)


if __name__ == "__main__":
    main()
