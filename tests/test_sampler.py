"""The sampler: each knob's exact effect on small hand-made logits, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.sampler import (CANDIDATES, Sampler, SamplingBatch, apply_penalties, argmax, seeded_exponential,
                                    truncated_candidates, truncated_weights)

CPU = torch.device("cpu")
LOGITS = torch.tensor([[1.0, 3.0, -2.0, 2.5, 0.0, -1.0]])


def batch(logits, params, prompts=None, outputs=None):
    n = len(params)
    return SamplingBatch.from_params(params, prompts or [[]] * n, outputs or [[]] * n, logits.shape[1], CPU)


def truncated_probs(logits, batch):
    """The distribution the sampler draws from: `truncated_weights` normalised."""
    weights = truncated_weights(logits, batch)
    return weights / weights.sum(dim=-1, keepdim=True)


def sample(logits, params, prompts=None, outputs=None, seed=0):
    n = len(params)
    return Sampler(seed, CPU)(logits, params, prompts or [[]] * n, outputs or [[]] * n)


def test_greedy_is_argmax_and_leaves_the_input_untouched():
    before = LOGITS.clone()
    assert sample(LOGITS, [SamplingParams(temperature=0.0)]).token_ids == [1]
    assert torch.equal(LOGITS, before)


def test_cpu_argmax_equals_torch_argmax_first_maximum_and_nan_included():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 5.0, 5.0, float("nan")], [2.0, 2.0, 2.0, 2.0],
                      [-1.0, float("-inf"), -0.5, -0.5]])
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() == [1, 0, 0, 2]
    assert argmax(x[:, 1:]).tolist() == x[:, 1:].argmax(dim=-1).tolist() == [0, 2, 0, 1]  # a strided view
    assert argmax(x.to(torch.bfloat16)).tolist() == [1, 0, 0, 2]  # other dtypes: torch's own argmax
    assert argmax(x).dtype == torch.int64


def test_logit_bias_and_min_tokens_apply_to_random_and_greedy_rows_of_one_batch():
    logits = LOGITS.repeat(2, 1)
    params = [SamplingParams(logit_bias={5: 100.0}, seed=1),  # random row: token 5 now holds ~all the mass
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[1])]  # greedy row
    sampler = Sampler(0, CPU, eos_token_ids=[3])
    # before min_tokens, the stop token 1 and EOS 3 (the two best) are masked: 0 (1.0) is next
    assert sampler(logits, params, [[]] * 2, [[]] * 2).token_ids == [5, 0]
    assert sampler(logits, params, [[]] * 2, [[], [4]]).token_ids == [5, 1]  # one output: min_tokens reached


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=0.99), SamplingParams(temperature=1e-4)])
def test_truncation_to_one_token_always_gives_the_argmax(params):
    for seed in range(20):
        assert sample(LOGITS, [params], seed=seed).token_ids == [1]


def test_top_k_keeps_exactly_the_k_largest():
    probs = truncated_probs(LOGITS, batch(LOGITS, [SamplingParams(top_k=3)]))
    expect = torch.softmax(torch.tensor([1.0, 3.0, -2.0, 2.5, 0.0, -1.0]).masked_fill(
        torch.tensor([False, False, True, False, True, True]), float("-inf")), -1)
    assert torch.allclose(probs[0], expect)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]]))
    # sorted: 0.5, 0.25, 0.15, 0.1; 0.5 + 0.25 = 0.75 >= 0.7, so two tokens stay
    probs = truncated_probs(logits, batch(logits, [SamplingParams(top_p=0.7)]))
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert torch.allclose(probs[0], torch.tensor([0.0, 2 / 3, 1 / 3, 0.0]))
    probs = truncated_probs(logits, batch(logits, [SamplingParams(top_p=0.8)]))
    assert (probs[0] > 0).tolist() == [False, True, True, True]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.25, 0.15]]))
    # threshold 0.29 x 0.5 = 0.145: 0.1 goes, 0.15 stays (at exactly 0.3 float rounding decides)
    probs = truncated_probs(logits, batch(logits, [SamplingParams(min_p=0.29)]))
    assert (probs[0] > 0).tolist() == [False, True, True, True]
    probs = truncated_probs(logits, batch(logits, [SamplingParams(min_p=0.31)]))
    assert (probs[0] > 0).tolist() == [False, True, True, False]


def test_temperature_divides_logits():
    probs = truncated_probs(LOGITS, batch(LOGITS, [SamplingParams(temperature=2.0)]))
    assert torch.allclose(probs[0], torch.softmax(LOGITS[0] / 2, -1))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = LOGITS.clone()
    apply_penalties(logits, batch(logits, [SamplingParams(repetition_penalty=2.0)], [[1, 2]], [[1, 4]]))
    # tokens 1 (3.0 -> 1.5), 2 (-2.0 -> -4.0), 4 (0.0 stays 0); 0, 3, 5 unseen
    assert logits[0].tolist() == [1.0, 1.5, -4.0, 2.5, 0.0, -1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = LOGITS.clone()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, batch(logits, [params], [[0, 0, 0]], [[3, 3, 5, 3]]))
    # token 3 seen 3 times: 2.5 - 0.75 - 0.5; token 5 once: -1 - 0.25 - 0.5; prompt token 0 untouched
    assert logits[0].tolist() == [1.0, 3.0, -2.0, 1.25, 0.0, -1.75]


def test_penalties_change_the_greedy_choice():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(LOGITS, [params], prompts=[[1]]).token_ids == [3]  # 3.0/2 = 1.5 < 2.5


def test_logprobs_are_the_raw_log_softmax_before_penalties_and_temperature():
    params = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=1.5, logprobs=3, seed=3)
    out = sample(LOGITS, [params], prompts=[[1]])
    raw = torch.log_softmax(LOGITS[0], -1)
    token = out.token_ids[0]
    assert out.logprobs[0] == pytest.approx(raw[token].item(), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [1, 3, 0]
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(raw[[1, 3, 0]].tolist(), abs=1e-6)


def test_logprobs_zero_returns_only_the_sampled_token_and_none_means_none():
    out = sample(LOGITS.repeat(2, 1), [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)])
    assert out.top_logprobs == [[], None]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(LOGITS[0], -1)[1].item())
    assert out.logprobs[1] is None


def test_seeded_rows_are_identical_alone_and_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    seeded = SamplingParams(temperature=1.0, seed=123)
    row = logits[2:3]
    alone = [sample(row, [seeded], outputs=[[0] * i]).token_ids[0] for i in range(30)]
    for i in range(30):
        params = [SamplingParams(temperature=0.8), SamplingParams(seed=9), seeded,
                  SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
        outputs = [[7] * (i + 3), [1] * i, [0] * i, [], [2] * 5]
        assert sample(logits, params, outputs=outputs, seed=i).token_ids[2] == alone[i]
    assert len(set(alone)) > 5  # different output indices draw different noise


def test_seeded_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    params = [SamplingParams(seed=77)]
    counts = torch.bincount(torch.tensor([sample(logits, params, outputs=[[0] * i]).token_ids[0]
                                          for i in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, torch.tensor([0.2, 0.5, 0.3]), atol=0.03)


def test_unseeded_rows_follow_the_worker_seed():
    logits = torch.zeros(4, 100)
    params = [SamplingParams()] * 4
    assert sample(logits, params, seed=5).token_ids == sample(logits, params, seed=5).token_ids
    assert sample(logits, params, seed=5).token_ids != sample(logits, params, seed=6).token_ids


def test_seeded_noise_is_a_pure_function_of_seed_index_and_token():
    seeds = torch.tensor([0, 1, 2**40 + 1, 2**63 - 1, 1])
    index = torch.tensor([0, 0, 5, 7, 0])
    noise = seeded_exponential(seeds, index, 300)
    assert noise.shape == (5, 300) and bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert torch.equal(noise[1], noise[4])  # same (seed, index): same noise, wherever the row sits
    assert torch.equal(noise[2:3], seeded_exponential(seeds[2:3], index[2:3], 300))  # batch-independent
    assert len({tuple(r) for r in noise[:4].tolist()}) == 4  # seeds, halves of a seed and indices all count
    assert not torch.equal(seeded_exponential(torch.tensor([2**32]), torch.tensor([0]), 300)[0], noise[0])
    signed = seeded_exponential(torch.tensor([-1, -(2**63), 2**63 - 1, -1]), torch.tensor([0, 0, 0, 0]), 300)
    assert torch.equal(signed[0], signed[3]) and len({tuple(r) for r in signed[:3].tolist()}) == 3  # negatives too
    many = seeded_exponential(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1000)
    assert abs(many.mean().item() - 1.0) < 0.02 and abs(many.var().item() - 1.0) < 0.05  # Exp(1)


# ---- drawing among the CANDIDATES most likely tokens (CPU, vocabularies of 2 x CANDIDATES and more) ----

def _peaked(rows, vocab, scale, seed=0):
    """Logits like a bfloat16 model's: a few tokens hold most of the mass (scale ~4; flat below 1), and
    values rounded to bfloat16, so that ties are common (the model returns bfloat16 logits as float32)."""
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16().float()


KNOBS = [SamplingParams(top_k=5, seed=1), SamplingParams(top_k=50, temperature=0.7, seed=2),
         SamplingParams(top_k=700, seed=3), SamplingParams(top_p=0.9, seed=4),
         SamplingParams(top_p=0.5, temperature=1.3, seed=5), SamplingParams(top_k=40, top_p=0.8, seed=6),
         SamplingParams(min_p=0.05, seed=7), SamplingParams(top_k=2000, min_p=0.1, seed=8),
         SamplingParams(temperature=0.0, seed=9), SamplingParams(top_p=0.95, min_p=0.02, temperature=0.8, seed=10),
         SamplingParams(top_k=20, top_p=0.9, logit_bias={7: 5.0}, seed=11),
         SamplingParams(top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.5, seed=12)]


def test_candidates_get_bit_for_bit_the_weights_the_whole_vocabulary_gives_them():
    import msgspec

    logits = _peaked(len(KNOBS) * 8, 4 * CANDIDATES, 4.0)
    params = [msgspec.structs.replace(p, seed=i) for i, p in enumerate(KNOBS * 8)]
    b = batch(logits, params, prompts=[[3, 9]] * len(params), outputs=[[9, 9, 5]] * len(params))
    x = logits.clone()
    apply_penalties(x, b)
    assert b.all_truncated
    weights, ids = truncated_candidates(x, b)
    assert weights.shape == ids.shape == (len(params), CANDIDATES)
    whole = truncated_weights(x, b)
    drawing = [i for i, p in enumerate(params) if not p.greedy]
    assert torch.equal(whole.gather(1, ids)[drawing], weights[drawing])  # exact, ties included
    assert torch.equal((whole[drawing] > 0).sum(dim=-1), (weights[drawing] > 0).sum(dim=-1))  # nothing kept outside


def test_a_seeded_row_draws_the_same_token_alone_and_beside_a_row_that_takes_the_whole_vocabulary(monkeypatch):
    """The beside row (temperature only) sends the batch down the whole vocabulary's path; alone, the
    seeded row takes the candidates. bfloat16-rounded logits: ties at the top-k and top-p boundaries."""
    import pagedkv.worker.sampler as sampler_module

    taken = []
    real = sampler_module.truncated_candidates
    monkeypatch.setattr(sampler_module, "truncated_candidates", lambda x, bb: taken.append(r := real(x, bb)) or r)
    knobs = [SamplingParams(top_k=50, seed=0), SamplingParams(top_k=20, top_p=0.9, seed=0),
             SamplingParams(top_p=0.9, seed=0), SamplingParams(min_p=0.05, temperature=1.2, seed=0)]
    drawn = set()
    for trial in range(100):
        logits = _peaked(2, 8 * CANDIDATES, 4.0, seed=trial)
        for knob in knobs:
            seeded = msgspec_replace(knob, seed=trial)
            alone = Sampler(0, CPU).sample_tensor(logits[:1], batch(logits[:1], [seeded]))
            beside = Sampler(0, CPU).sample_tensor(logits, batch(logits, [seeded, SamplingParams(temperature=1.0)]))
            assert alone.item() == beside[0].item(), (trial, knob)
            drawn.add(alone.item())
    assert len(drawn) > 100  # real draws, not argmaxes
    assert taken and all(t is not None for t in taken)  # every lone row took the candidates


def msgspec_replace(params, **changes):
    import msgspec

    return msgspec.structs.replace(params, **changes)


def test_seeded_noise_at_token_ids_equals_the_whole_vocabularys_at_those_ids():
    seeds, index = torch.tensor([0, 7, 2**40 + 3]), torch.tensor([0, 5, 11])
    full = seeded_exponential(seeds, index, 5000)
    ids = torch.randint(0, 5000, (3, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(seeded_exponential(seeds, index, ids), full.gather(1, ids))


@pytest.mark.parametrize("params, scale, fits", [
    (SamplingParams(top_p=0.95), 0.1, False),  # flat: 0.95 of the mass needs far more than CANDIDATES tokens
    (SamplingParams(top_p=0.95), 4.0, True),
    (SamplingParams(top_k=CANDIDATES + 1, top_p=0.5), 4.0, False),  # top_p over a top_k wider than the candidates
    (SamplingParams(min_p=0.5), 0.1, False), (SamplingParams(min_p=0.5), 4.0, True),
    (SamplingParams(temperature=0.0), 0.1, True)])
def test_candidates_are_used_only_where_every_kept_token_is_provably_among_them(params, scale, fits):
    logits = _peaked(3, 4 * CANDIDATES, scale, seed=2)
    b = batch(logits, [params] * 3)
    assert b.all_truncated
    assert (truncated_candidates(logits, b) is not None) == fits


def test_a_kept_tie_that_may_continue_past_the_candidates_takes_the_whole_vocabulary():
    """2,000 tokens share the top value: topk picks some of them, the stable sort the lowest ids."""
    logits = torch.full((1, 4 * CANDIDATES), -5.0)
    logits[0, 1000:3000] = 2.0
    assert truncated_candidates(logits, batch(logits, [SamplingParams(top_k=10)])) is None
    logits[0, 3000] = 9.0  # one clear winner keeps top_k=1 away from the tie
    weights, ids = truncated_candidates(logits, batch(logits, [SamplingParams(top_k=1)]))
    assert ids[0, 0] == 3000 and weights[0, 0] == 1.0 and (weights[0, 1:] == 0).all()


def test_rows_without_truncation_never_take_the_candidates(monkeypatch):
    import pagedkv.worker.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "truncated_candidates", lambda x, bb: pytest.fail("took the candidates"))
    logits = _peaked(2, 4 * CANDIDATES, 4.0)
    for p in [SamplingParams(seed=1), SamplingParams(top_k=CANDIDATES + 1, seed=1), SamplingParams(temperature=0.5)]:
        b = batch(logits, [SamplingParams(top_k=5, seed=2), p])
        assert not b.all_truncated
        Sampler(0, CPU).sample_tensor(logits, b)
    assert batch(LOGITS, [SamplingParams(top_k=5), SamplingParams(temperature=0.0)]).all_truncated


@pytest.mark.parametrize("cut, fits", [(1000, True), (1020, True), (1030, False)])
def test_a_top_p_cut_near_the_last_candidate_decides_by_the_mass_before_the_first_token_past_them(cut, fits):
    """1,100 tokens of nearly equal weight: top_p keeps about `cut` of them; the candidates serve while
    the token past them (rank 1,024) is dropped, with the same kept tokens as the whole vocabulary."""
    logits = torch.full((1, 4 * CANDIDATES), -60.0)
    logits[0, :1100] = -torch.arange(1100) * 1e-3
    top_p = float(torch.softmax(logits[0], -1)[:cut].sum()) - 1e-5
    b = batch(logits, [SamplingParams(top_p=top_p, seed=3)])
    kept = truncated_candidates(logits, b)
    assert (kept is not None) == fits
    if fits:
        weights, ids = kept
        whole = truncated_weights(logits, b)
        assert torch.equal(whole.gather(1, ids), weights) and int((weights > 0).sum()) == int((whole > 0).sum())
        assert abs(int((weights > 0).sum()) - cut) <= 1


def test_top_logprobs_list_equal_values_by_token_id_so_the_greedy_token_ranks_first():
    # three tokens tie for the maximum (bf16 logits tie often); argmax takes the lowest id, 7, and
    # CPU topk listed it third ([100, 300, 7]), so the greedy token was reported with rank 3
    from pagedkv.worker.sampler import prompt_logprobs

    logits = torch.zeros(2, 512)
    logits[:, [7, 300, 100]] = 5.0
    out = Sampler(0, torch.device("cpu")).sample(logits, SamplingBatch.greedy([3, 2]))
    assert out.token_ids == [7, 7]
    assert [[t for t, _ in top] for top in out.top_logprobs] == [[7, 100, 300], [7, 100]]
    _, ranks, tops = prompt_logprobs(logits, torch.tensor([7, 300]), 3)  # 300 ranks where it is listed
    assert ranks == [1, 3] and [[t for t, _ in top] for top in tops] == [[7, 100, 300]] * 2


def test_a_tie_cut_at_the_kth_logprob_lists_its_lowest_ids():
    # ten tokens tie for the maximum; CPU topk(9) skipped id 255 and took 459, so the 9 listed were
    # not the 9 first of the order they are ranked in (by value, equal values by token id)
    from pagedkv.worker.sampler import prompt_logprobs

    tied = torch.arange(10) * 51  # 0, 51, ..., 459
    logits = torch.zeros(2, 512)
    logits[:, tied] = 5.0
    out = Sampler(0, torch.device("cpu")).sample(logits, SamplingBatch.greedy([9, 3]))
    assert [[t for t, _ in top] for top in out.top_logprobs] == [tied[:9].tolist(), tied[:3].tolist()]
    _, _, tops = prompt_logprobs(logits, torch.tensor([0, 459]), 9)
    assert [[t for t, _ in top] for top in tops] == [tied[:9].tolist()] * 2


def test_sampled_tokens_get_their_rank_in_a_stable_sort_of_real_logits(stories260k):
    # a sampled token's rank was not reported (the offline API said None when it was not among the
    # top k); it is its place in the distribution sorted by value, equal values by token id
    import transformers
    from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS

    model = transformers.LlamaForCausalLM.from_pretrained(str(stories260k), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS])).logits[0]  # [65, 512]
    params = [SamplingParams(temperature=2.0, seed=i, logprobs=i % 3) if i % 4 else SamplingParams(seed=i)
              for i in range(len(logits))]
    out = sample(logits, params)
    order = torch.log_softmax(logits, -1).sort(dim=-1, descending=True, stable=True).indices
    want = [(order[i] == t).nonzero().item() + 1 for i, t in enumerate(out.token_ids)]
    assert out.ranks == [w if p.logprobs is not None else None for w, p in zip(want, params)]
    assert all(top is None or [t for t, _ in top] == order[i, :len(top)].tolist()
               for i, top in enumerate(out.top_logprobs))
    outside = [r for r, p in zip(out.ranks, params) if r is not None and r > p.logprobs]
    assert len(outside) >= 15 and max(outside) > 10  # many sampled tokens lie outside their top k
