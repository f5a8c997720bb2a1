"""Accuracy of the fp8 KV cache against the unquantized one: KL divergence and greedy agreement.

For each prompt, the unquantized cache (the model's dtype) generates greedily and records the
next-token distribution at every generated position; the fp8 cache then reads the *same* tokens
(teacher forcing: the prompt, then the reference's tokens one decode step at a time) and records
its own distributions. Reported per cache dtype, over all positions:

- mean KL(P_ref || P_fp8) in nats, and its 99th percentile and maximum;
- greedy agreement: the share of positions where both caches' most likely token is the same;
- free-running: how many greedy tokens the fp8 engine generates before its first difference from
  the reference (teacher forcing hides how one early difference changes the rest).

Scales are calibrated as the engine does: on the first prefill (the first prompt), then fixed.

Prompts: the golden prompt of the model folder's PROVENANCE.md ("Once upon a time") and a replayed
trace: the first N rows of an Azure trace with token counts scaled to the model's context
(``pagedkv bench``'s scaling); each prompt is in-distribution text (the model's own seeded sample
from BOS: BOS and a window of it, of the row's context length) and the reference generates the
row's output length.

    python ops/bench_kv_quant.py --model ../shared/models/stories260K --trace conv --num-requests 100
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.kernels import fp8
from pagedkv.bench.replay import auto_token_scale, build_requests, load_trace, resolve_trace
from pagedkv.worker.cache_engine import CacheEngine
from pagedkv.worker.model import AttentionMetadata
from pagedkv.worker.model_loader import load_model

GOLDEN_PROMPT_IDS = [1, 403, 407, 261, 378]
BLOCK = 16


class Sequence:
    """One sequence in a private paged cache: prefill, then decode one token at a time, returning logits."""

    def __init__(self, model, cache: CacheEngine):
        self.model, self.cache, self.n = model, cache, 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Run ``token_ids`` as the next tokens; returns float32 logits ``[len(token_ids), vocab]``."""
        n, start = len(token_ids), self.n
        self.n += n
        blocks = torch.arange(-(-self.n // BLOCK), dtype=torch.int32)
        pos = torch.arange(start, self.n)
        meta = AttentionMetadata(slot_mapping=pos.to(torch.int64), block_tables=blocks[None, :],
                                 seq_lens=torch.tensor([self.n], dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, n], dtype=torch.int32))
        return self.model(torch.tensor(token_ids), pos, meta, self.cache.k_caches, self.cache.v_caches,
                          torch.arange(n)).float()


def prompts(model, config: ModelConfig, trace: str, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, tokens to generate): the golden prompt, then the trace's rows."""
    rows = load_trace(resolve_trace(trace))
    reqs, _ = build_requests(rows, num_requests, config.max_position_embeddings,
                             auto_token_scale(rows, config.max_position_embeddings))
    out = [(GOLDEN_PROMPT_IDS, 60)]
    gen = torch.Generator().manual_seed(seed)
    stories = []
    for _ in range(4):  # the model's own stories, sampled at temperature 1 from BOS
        n = config.max_position_embeddings
        seq, tokens = Sequence(model, CacheEngine(config, -(-n // BLOCK), 0, BLOCK, torch.float32, torch.device("cpu"))), [1]
        logits = seq.feed(tokens)
        while len(tokens) < n:
            tokens.append(int(torch.multinomial(logits[-1].softmax(-1), 1, generator=gen)))
            logits = seq.feed(tokens[-1:])
        stories.append(tokens[1:])
    for i, r in enumerate(reqs):  # BOS + a window of a story, the row's context length
        story = stories[i % len(stories)]
        start = (i * 37) % (len(story) - r.prompt_len + 2)
        out.append(([1] + story[start:start + r.prompt_len - 1], r.output_len))
    return out


def measure(model, config: ModelConfig, cases, kv_dtypes: list[str]) -> dict:
    cpu = torch.device("cpu")
    per = {d: {"kl": [], "agree": 0, "positions": 0, "free_run": []} for d in kv_dtypes}
    for d in kv_dtypes:  # scales: calibrated on the first prefill of the first prompt, then fixed
        model.kv_scales = [(None, None)] * config.num_hidden_layers
        for prompt, n_out in cases:
            blocks = -(-(len(prompt) + n_out) // BLOCK)
            ref = Sequence(model, CacheEngine(config, blocks, 0, BLOCK, torch.float32, cpu))
            q = Sequence(model, CacheEngine(config, blocks, 0, BLOCK, fp8.FP8_DTYPES[d], cpu))
            free = Sequence(model, CacheEngine(config, blocks, 0, BLOCK, fp8.FP8_DTYPES[d], cpu))
            lr, lq, lf = ref.feed(prompt)[-1], q.feed(prompt)[-1], free.feed(prompt)[-1]
            diverged = None
            for i in range(n_out):
                p_ref, p_q = lr.log_softmax(-1), lq.log_softmax(-1)
                per[d]["kl"].append(float((p_ref.exp() * (p_ref - p_q)).sum()))
                t = int(lr.argmax())
                per[d]["agree"] += int(lq.argmax()) == t
                per[d]["positions"] += 1
                if diverged is None and int(lf.argmax()) != t:
                    diverged = i
                if i + 1 < n_out:
                    lr, lq = ref.feed([t])[-1], q.feed([t])[-1]
                    if diverged is None:
                        lf = free.feed([t])[-1]
            per[d]["free_run"].append((n_out if diverged is None else diverged, n_out))
        per[d]["scales"] = model.kv_scales
    out = {}
    for d, r in per.items():
        kl = sorted(r["kl"])
        golden_run = r["free_run"][0][0]
        out[d] = {"positions": r["positions"], "mean_kl_nats": sum(kl) / len(kl),
                  "p99_kl_nats": kl[min(len(kl) - 1, math.ceil(0.99 * len(kl)) - 1)], "max_kl_nats": kl[-1],
                  "greedy_agreement": r["agree"] / r["positions"],
                  "golden_free_run_tokens": golden_run,
                  "mean_free_run_fraction": sum(a / b for a, b in r["free_run"]) / len(r["free_run"]),
                  "k_scales": [k for k, _ in r["scales"]], "v_scales": [v for _, v in r["scales"]]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--trace", default="conv")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-dtypes", default="fp8_e4m3,fp8_e5m2")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = ModelConfig.load(args.model)
    model = load_model(config, EngineConfig(model=args.model), torch.device("cpu"), torch.float32)
    cases = prompts(model, config, args.trace, args.num_requests, args.seed)
    golden = measure(model, config, cases[:1], args.kv_cache_dtypes.split(","))
    trace = measure(model, config, cases[1:], args.kv_cache_dtypes.split(","))
    print(json.dumps({"model": config.name, "trace": args.trace, "num_trace_prompts": len(cases) - 1,
                      "trace_tokens": sum(n for _, n in cases[1:]), "golden": golden, "trace_prompts": trace},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
