"""The sampler at serving shapes: drawing among `sampler.CANDIDATES` against the whole vocabulary, alternated.

For each (rows x vocabulary) shape and knob mix it times `Sampler.sample` on one set of logits,
once with the batch as the worker builds it (candidates where every row truncates) and once with
``all_truncated`` cleared (the whole-vocabulary path: a sort and noise for every token), alternating
``--repeats`` times, and prints the median CPU ms per call of the calling thread and the median ratio.
The logits are Gaussian times 4 rounded to bfloat16 (a few tokens hold most of the mass, as on a
trained model, and ties are common, as in a bfloat16 model's logits; at temperature 1, top_p 0.9
keeps a few dozen). Both paths also give their tokens: the seeded rows must agree, and the script
says if they do not. The fallback mix shows what a batch pays when one row does not truncate: the
candidates' check, then the whole vocabulary.

    python ops/bench_sampler.py [--shapes 32x32000,256x32000,32x128256,256x128256] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.sampler import Sampler, SamplingBatch

MIXES = {
    "top_p 0.9, temperature 0.7": lambda i: SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50 + top_p 0.9, half seeded": lambda i: SamplingParams(top_k=50, top_p=0.9, seed=i if i % 2 else None),
    "top_p 0.95 + min_p 0.05, all seeded": lambda i: SamplingParams(top_p=0.95, min_p=0.05, seed=i),
    "top_p 0.9, one row without (whole vocabulary)": lambda i: SamplingParams(
        temperature=0.7, top_p=0.9 if i else 1.0),
    "temperature 1 only (whole vocabulary on both)": lambda i: SamplingParams(temperature=1.0),
}


def cpu_ms(fn, iters: int) -> float:
    start = time.thread_time()
    for _ in range(iters):
        fn()
    return 1000 * (time.thread_time() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x32000,256x32000,32x128256,256x128256")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    repeats = f"median of {args.repeats} alternating repeats" if args.repeats > 1 else "1 repeat"
    print(f"Sampler.sample, CPU ms per call ({args.threads} thread(s)), {repeats}")
    print("candidates: the worker's path (truncation and the draw among each row's 1,024 most likely tokens, where "
          "they provably hold every kept token); whole: the whole vocabulary's (a sort, noise for every token)")
    print(f"{'rows x vocab':>14}  {'knobs':<46} {'candidates':>11} {'whole':>9} {'whole/cand':>10}  seeded equal")
    for shape in args.shapes.split(","):
        rows, vocab = (int(x) for x in shape.split("x"))
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4).bfloat16().float()
        for name, make in MIXES.items():
            params = [make(i) for i in range(rows)]
            batch = SamplingBatch.from_params(params, [[0]] * rows, [[0]] * rows, vocab, torch.device("cpu"))
            whole = copy.copy(batch)
            whole.all_truncated = False
            seeded = torch.tensor([q.seed is not None for q in params])
            same = torch.equal(Sampler(0, torch.device("cpu")).sample_tensor(logits, batch)[seeded],
                               Sampler(0, torch.device("cpu")).sample_tensor(logits, whole)[seeded])
            iters = max(1, int(2e7 // (rows * vocab)))
            times = {"cand": [], "whole": []}
            for r in range(args.repeats):
                order = [("cand", batch), ("whole", whole)]
                for key, b in order if r % 2 == 0 else order[::-1]:
                    sampler = Sampler(0, torch.device("cpu"))
                    sampler.sample(logits, b)  # warm-up
                    times[key].append(cpu_ms(lambda: sampler.sample(logits, b), iters))
            ratio = statistics.median(w / c for c, w in zip(times["cand"], times["whole"]))
            print(f"{shape:>14}  {name:<46} {statistics.median(times['cand']):11.1f} "
                  f"{statistics.median(times['whole']):9.1f} {ratio:9.1f}x  "
                  + (("yes" if same else "NO") if seeded.any() else "n/a (none seeded)"))


if __name__ == "__main__":
    main()
