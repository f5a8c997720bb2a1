"""KV memory saved by block sharing: parallel sampling and beam search (PagedAttention §6.3, Fig. 15).

For each workload the engine runs the same story prompts through the real model, and after every
step counts the KV blocks in use two ways:

- with sharing: the physical blocks referenced by live block tables (what pagedkv holds);
- without sharing: the blocks every sequence would hold with its own copy of everything,
  sum over sequences of ceil(tokens / block_size).

The saving is 1 - (time-summed blocks with sharing) / (time-summed blocks without), as the paper
reports it (6.1-9.8% for parallel sampling, 37.6-55.2% for beam search on Alpaca with OPT-13B).

    python ops/bench_sharing.py --model ../shared/models/stories260K
"""

from __future__ import annotations

import argparse
import asyncio

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine

# TinyStories-style openings, the kind of prompt stories260K was trained on.
PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.",
    "Tom and his dog Max went to the park. They saw a big red ball under a tree.",
    "One day, a small bird could not fly. It was sad and sat on the ground.",
    "Sara had a new toy car. She wanted to show it to her friend Ben, who lived next door.",
    "There was a big bear in the forest. The bear was hungry and looked for honey.",
    "Mom made a cake for Tim's birthday. Tim was very happy and wanted to eat it right away.",
    "The sun was hot and the kids went to the beach. They built a castle with sand.",
    "A little cat found a box in the garden. The box was old and had a hole in it.",
]


async def measure(engine: Engine, params: SamplingParams, prompts: list[list[int]]) -> tuple[int, int]:
    """Run all prompts concurrently; return (block-steps with sharing, block-steps without)."""
    shared = unshared = 0
    advance = engine.scheduler.advance
    bs = engine.kv.block_size

    def counting(step):
        nonlocal shared, unshared
        advance(step)
        live = [r for r in engine.scheduler.running]
        shared += len({b for r in live for b in r.block_table})
        unshared += sum(-(-r.num_tokens // bs) for r in live)

    engine.scheduler.advance = counting
    try:
        async def one(ids):
            async for _ in engine.add_request(ids, params):
                pass

        await asyncio.gather(*[one(ids) for ids in prompts])
    finally:
        engine.scheduler.advance = advance
    return shared, unshared


async def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the embedded random model)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    config = EngineConfig(model=args.model, block_size=args.block_size, swap_space=0.01,
                          enable_prefix_caching=False)  # only fork sharing, not cross-request caching
    engine = await Engine.start(config)
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        lens = sorted(len(p) for p in prompts)
        print(f"model {engine.model_config.name}, block_size {args.block_size}, {len(prompts)} prompts of "
              f"{lens[0]}-{lens[-1]} tokens, max_tokens {args.max_tokens}, all prompts concurrent, "
              f"device {engine.device}\n")
        print("| workload | blocks in use, no sharing | with sharing | saving |")
        print("|---|---:|---:|---:|")
        for kind, width in [("parallel sampling", w) for w in (2, 4, 6)] + [("beam search", w) for w in (2, 4, 6)]:
            beam = kind == "beam search"
            params = SamplingParams(n=width, use_beam_search=beam, max_tokens=args.max_tokens,
                                    temperature=0.0 if beam else 1.0, seed=args.seed, ignore_eos=True)
            shared, unshared = await measure(engine, params, prompts)
            print(f"| {kind}, {'width' if beam else 'n'} = {width} | {unshared:,} | {shared:,} | "
                  f"{100 * (1 - shared / unshared):.1f}% |")
    finally:
        await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
