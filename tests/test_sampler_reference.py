"""The batched sampler against a slow, per-row reference of vLLM's documented sampling semantics.

The reference (`reference_probs`) processes one row at a time with plain torch in vLLM's order:
logit_bias, min_tokens (EOS and stop ids masked), repetition penalty (prompt + output), presence and
frequency penalties (output only), temperature, top-k, top-p, min-p. Seeded rows make the batched
draw checkable token by token: the sampler draws ``argmax(p / E)`` with ``E = seeded_exponential``,
so the reference's argmax with the same noise must pick the same token.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedkv.common.sampling_params import MIN_TEMPERATURE, SamplingParams
from pagedkv.worker.sampler import CANDIDATES, Sampler, SamplingBatch, seeded_exponential

CPU = torch.device("cpu")
EOS = [3]


def reference_probs(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                    eos: list[int]) -> torch.Tensor:
    """The distribution one row draws from, ``[vocab]`` float64 (one-hot at the argmax when greedy)."""
    x = logits.double().clone()
    vocab = x.shape[0]
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in p.stop_token_ids + ([] if p.ignore_eos else eos):
            x[t] = -math.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.temperature < MIN_TEMPERATURE:
        one = torch.zeros(vocab, dtype=torch.float64)
        one[int(torch.argmax(x))] = 1.0  # first maximum
        return one
    x = x / p.temperature
    order = sorted(range(vocab), key=lambda t: (-x[t].item(), t))  # descending, ties by id
    keep = set(order)
    if p.top_k > 0:
        keep = set(order[:p.top_k])
    if p.top_p < 1:
        probs = torch.softmax(torch.where(torch.tensor([t in keep for t in range(vocab)]), x, -math.inf), 0)
        mass, kept = 0.0, set()
        for t in order:
            if t not in keep or mass >= p.top_p:
                break
            kept.add(t)
            mass += probs[t].item()
        keep = kept
    mask = torch.tensor([t in keep for t in range(vocab)])
    probs = torch.softmax(torch.where(mask, x, -math.inf), 0)
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    return probs / probs.sum()


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    kw = {}
    if rng.random() < 0.15:
        kw["temperature"] = 0.0
    elif rng.random() < 0.8:
        kw["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5, 100.0, 2e-5])
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([-1, 0, 1, 2, 5, 40, vocab + 7])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([1.0, 0.9, 0.5, 1e-6])
    if rng.random() < 0.3:
        kw["min_p"] = rng.choice([0.0, 0.05, 0.3])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 100.0, 3.5]) for _ in range(3)}
    if rng.random() < 0.3:
        kw["min_tokens"], kw["stop_token_ids"] = 5, [rng.randrange(vocab)]
    return SamplingParams(seed=rng.randrange(-2**63, 2**63), **kw)


@pytest.mark.parametrize("vocab", [50, 2 * CANDIDATES + 100])  # whole vocabulary; candidates path (CPU)
def test_seeded_tokens_match_the_per_row_reference_on_random_mixed_batches(vocab):
    rng, gen = random.Random(vocab), torch.Generator().manual_seed(vocab)
    rows, steps = 12, 6
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        params = [random_params(rng, vocab) for _ in range(rows)]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 8))] for _ in range(rows)]
        outputs = [[rng.randrange(6) for _ in range(rng.randrange(0, 9))] for _ in range(rows)]
        got = Sampler(0, CPU, EOS)(logits, params, prompts, outputs).token_ids
        for i, p in enumerate(params):
            probs = reference_probs(logits[i], p, prompts[i], outputs[i], EOS)
            noise = seeded_exponential(torch.tensor([p.seed]), torch.tensor([len(outputs[i])]), vocab)[0].double()
            want = int(torch.argmax(probs / noise))
            assert got[i] == want, (step, i, p, probs[got[i]].item(), probs[want].item())


def test_reference_distribution_equals_the_batched_weights():
    """The whole distribution, not just one draw: `truncated_weights` after the logit edits, per row."""
    from pagedkv.worker.sampler import apply_penalties, truncated_weights
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    vocab, rows = 40, 16
    for _ in range(5):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        params = [random_params(rng, vocab) for _ in range(rows)]
        prompts = [[rng.randrange(vocab) for _ in range(4)] for _ in range(rows)]
        outputs = [[rng.randrange(6) for _ in range(rng.randrange(0, 9))] for _ in range(rows)]
        b = SamplingBatch.from_params(params, prompts, outputs, vocab, CPU, EOS)
        x = logits.clone()
        if b.bias is not None:
            x.index_put_(b.bias[:2], b.bias[2], accumulate=True)
        if b.banned is not None:
            x[b.banned] = -math.inf
        if b.prompt_mask is not None:
            apply_penalties(x, b)
        w = truncated_weights(x, b).double()
        w = w / w.sum(-1, keepdim=True)
        for i, p in enumerate(params):
            if p.greedy:
                continue
            ref = reference_probs(logits[i], p, prompts[i], outputs[i], EOS)
            assert not (w[i] > 0)[ref == 0].any() and (w[i] > 0)[ref > 1e-30].all(), (i, p)  # float32 underflows
            assert torch.allclose(w[i], ref, atol=1e-5), (i, p)


def test_no_nan_and_a_row_with_one_unmasked_token_always_picks_it():
    vocab = 30
    logits = torch.randn(4, vocab)
    only = {t: -100.0 for t in range(vocab) if t != 17}
    params = [SamplingParams(temperature=1e-5 * 1.01, logit_bias=only, seed=1),
              SamplingParams(temperature=100.0, logit_bias={**only, 17: 100.0}, top_p=1e-6),
              SamplingParams(temperature=0.5, top_k=vocab * 10, min_p=1.0, seed=2),
              SamplingParams(temperature=2.0, min_tokens=3, stop_token_ids=list(range(vocab - 1)), ignore_eos=True)]
    for seed in range(20):
        out = Sampler(seed, CPU, EOS)(logits, params, [[0]] * 4, [[]] * 4, )
        assert out.token_ids[0] == 17 and out.token_ids[3] == vocab - 1
        assert out.token_ids[2] == int(logits[2].argmax())  # min_p 1 keeps only the top token
        assert all(0 <= t < vocab for t in out.token_ids)


def test_logprobs_are_raw_and_top_logprobs_sorted():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    logits[1, 5] = logits[1, 9] = logits[1].max() + 1  # a tie at the top
    params = [SamplingParams(logprobs=5, repetition_penalty=2.0, temperature=0.3, seed=4),
              SamplingParams(logprobs=3, temperature=0.0), SamplingParams(logprobs=0, logit_bias={2: 50.0})]
    out = Sampler(0, CPU, EOS)(logits, params, [[1, 2]] * 3, [[4]] * 3)
    raw = torch.log_softmax(logits.double(), -1)
    for i in range(3):
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-5)
        tops = out.top_logprobs[i]
        assert len(tops) == params[i].logprobs
        assert [v for _, v in tops] == sorted((v for _, v in tops), reverse=True)
        for t, v in tops:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert out.token_ids[1] == 5 and {t for t, _ in out.top_logprobs[1][:2]} == {5, 9}
    assert out.token_ids[2] == 2


def test_a_temperature_just_below_1e5_that_float32_rounds_to_it_draws_with_real_noise():
    """9.9999999e-6 is greedy to SamplingParams (float64) but 1e-5 in the float32 knobs, so the
    sampler draws for it: with its noise left uninitialised (any_unseeded False) the token was
    arbitrary, here 0 or 1 by run. Equal logits at T = 1e-5 draw uniformly with the generator's noise."""
    logits = torch.zeros(2, 10)
    params = [SamplingParams(temperature=9.9999999e-6), SamplingParams(seed=1)]
    for seed in range(4):
        want = int(torch.empty(2, 10).exponential_(generator=torch.Generator().manual_seed(seed))[0].reciprocal().argmax())
        assert Sampler(seed, CPU)(logits, params, [[]] * 2, [[]] * 2).token_ids[0] == want
