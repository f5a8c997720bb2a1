"""Next-token selection for a whole batch: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Order per row (as HF's and vLLM's samplers): logit bias (OpenAI ``logit_bias``) and, before
``min_tokens`` output tokens, EOS and the stop token ids masked out (vLLM); repetition penalty (prompt + output tokens; HF
``RepetitionPenaltyLogitsProcessor``: positive logits divided, negative multiplied), presence and
frequency penalties (output tokens only; OpenAI API: ``logit -= frequency * count + presence *
(count > 0)``), then greedy argmax when temperature is below MIN_TEMPERATURE (1e-5; 0 included),
else divide by temperature, keep the top_k, keep the smallest set of most likely tokens whose
probability reaches top_p, drop tokens below min_p x the top probability, and draw from what is left.

Every step is a tensor op over all rows (`SamplingBatch` holds the per-row knobs as tensors and the
penalties' token statistics as ``[rows, vocab]`` tensors); no Python runs per row except to build
the logprob lists of rows that ask for them.

Draws use the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token draws from ``p``
(equivalent to Gumbel-max). A seeded row's noise is a pure function of (seed, output index, token
id): a counter-based hash (`seeded_exponential`) turned into ``E = -log(U)`` with tensor ops, so its
token does not depend on the batch, the step or a preemption, and no generator object exists per
row. Unseeded rows draw from the sampler's own generator (EngineConfig.seed).

On the CPU, when every row that draws truncates (a top_k up to `CANDIDATES`, a top_p or a min_p)
and the vocabulary is large, truncation and the draw run among each row's `CANDIDATES` most likely
tokens (`truncated_candidates`) wherever its kept tokens provably lie there: one partial selection
instead of a sort, noise for 1,024 tokens instead of the vocabulary (7-22x faster at 32-256 rows of
32K-128K, `ops/bench_sampler.py`). The candidates get bit for bit the weights the whole vocabulary's
path gives them, so a seeded row draws the same token on either path, whatever else is in the batch;
unseeded rows draw fewer numbers from the generator, so their stream differs between the paths.

Logprobs follow vLLM's default (``logprobs_mode="raw_logprobs"``): log-softmax of the model's raw
logits, before penalties, temperature and truncation, so they describe the model's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.common.sampling_params import MIN_TEMPERATURE, SamplingParams

_M32 = 0xFFFFFFFF
# the most likely tokens `truncated_candidates` draws among: top-k, top-p and min-p keep far fewer
# on trained models, and a vocabulary of 2 x CANDIDATES or more is worth the detour
CANDIDATES = 1024


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix of int64 tensors holding values in [0, 2**32).

    xorshift-multiply rounds (the shape of murmur3's fmix32) with multipliers below 2**31, so every
    product stays below 2**63: exact in int64, the same on every device, no reliance on overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    return x ^ (x >> 16)


def seeded_exponential(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int | torch.Tensor) -> torch.Tensor:
    """Exp(1) noise float32, a pure function of (seed, output index, token id): ``[rows, vocab]`` for
    every token id below ``vocab`` (an int), or ``[rows, k]`` at the token ids of an int64 ``[rows, k]``
    tensor (the same values those ids get in the full form).

    seeds: ``[rows]`` int64, any; output_index: ``[rows]`` int64 (the output token being drawn).
    Each row's key hashes both 32-bit halves of the seed (two's complement) and the index; each
    token's uniform is the hash of (key, token id) mapped to (0, 1). Batch-independent by construction.
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(_mix32(lo ^ _mix32(hi ^ 0x5BD1E995)) ^ (output_index & _M32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :] if isinstance(vocab, int) else vocab
    tokens = (ids * 0x9E3779B1) & _M32
    h = _mix32(_mix32(key[:, None] ^ tokens) ^ key[:, None])
    u = (h.double() + 0.5) * 2.0**-32  # in (0, 1)
    return (-torch.log(u)).float()


@dataclass
class SamplingBatch:
    """The knobs of ``rows`` sampled rows as tensors on the logits' device (see `SamplingParams`).

    temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty: ``[rows]``
    float32; top_k ``[rows]`` int64 (<= 0 disables); seeds ``[rows]`` int64 and seeded ``[rows]``
    bool; output_index ``[rows]`` int64. prompt_mask ``[rows, vocab]`` bool (token in the prompt) and
    output_counts ``[rows, vocab]`` int32 (occurrences in the output), both None when no row has a
    penalty. num_logprobs: per row, None or how many alternatives (host list). The host flags
    (all_greedy, any_seeded, any_unseeded, any_top_k_top_p, any_min_p) let whole stages be
    skipped without a device sync; a flag left True only costs time. all_truncated: every row that
    draws has a top_k of 1 to `CANDIDATES`, a top_p below 1 or a min_p (`Sampler` may then draw among
    the most likely tokens only); False only costs time. bias and banned: the sparse
    logit edits of `bias_and_bans` (``logit_bias``; stop tokens before ``min_tokens``), or None.
    `greedy` builds a batch whose knob tensors are all None, for rows that only take the argmax.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    seeded: torch.Tensor
    output_index: torch.Tensor
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None
    num_logprobs: list[int | None]
    all_greedy: bool
    any_seeded: bool
    any_unseeded: bool
    any_top_k_top_p: bool = True
    any_min_p: bool = True
    all_truncated: bool = False
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def greedy(cls, num_logprobs: list[int | None], bias=None, banned=None) -> "SamplingBatch":
        """Rows that all take the argmax with no penalty: no knob tensor is needed (they are None)."""
        return cls(*[None] * 12, num_logprobs, True, False, False, False, False, False, bias, banned)

    @classmethod
    def from_params(cls, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
                    vocab_size: int, device: torch.device, eos_token_ids: list[int] = ()) -> "SamplingBatch":
        """Build from per-row Python objects (tests, tools); the worker keeps these tensors incrementally.

        eos_token_ids: masked with each row's stop token ids while it has fewer than ``min_tokens`` outputs.
        """
        def col(name, dtype):
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        rows = len(params)
        penalties = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params)
        prompt_mask = output_counts = None
        if penalties:
            prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
            output_counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)
            for i in range(rows):
                prompt_mask[i, torch.tensor(prompt_ids[i], dtype=torch.int64, device=device)] = True
                output_counts[i] = torch.bincount(torch.tensor(output_ids[i], dtype=torch.int64),
                                                  minlength=vocab_size)[:vocab_size].to(device)
        return cls(col("temperature", torch.float32), col("top_k", torch.int64), col("top_p", torch.float32),
                   col("min_p", torch.float32), col("repetition_penalty", torch.float32),
                   col("presence_penalty", torch.float32), col("frequency_penalty", torch.float32),
                   torch.tensor([p.seed or 0 for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.seed is not None for p in params], device=device),
                   torch.tensor([len(o) for o in output_ids], dtype=torch.int64, device=device),
                   prompt_mask, output_counts, [p.logprobs for p in params],
                   all(p.greedy for p in params), any(not p.greedy and p.seed is not None for p in params),
                   any(not p.greedy and p.seed is None for p in params),
                   any(p.top_k > 0 or p.top_p < 1 for p in params), any(p.min_p > 0 for p in params),
                   all_truncated(*(np.array([getattr(p, knob) for p in params])
                                   for knob in ("greedy", "top_k", "top_p", "min_p"))),
                   *bias_and_bans(list(range(rows)), params, [len(o) for o in output_ids], list(eos_token_ids), device))


def all_truncated(greedy: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray) -> bool:
    """`SamplingBatch.all_truncated` of rows with these knobs (``[rows]`` host arrays; greedy bool): every
    row that draws has a top_k of 1 to `CANDIDATES`, a top_p below 1 or a min_p."""
    return bool((greedy | ((top_k > 0) & (top_k <= CANDIDATES)) | (top_p < 1) | (min_p > 0)).all())


@dataclass
class SamplerOutput:
    """Per row: the chosen token id, its raw logprob, its 1-based rank (`ranks`) and the top
    alternatives (the last three None when not asked)."""

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row of a logits batch; see the module docstring for the exact semantics."""

    def __init__(self, seed: int, device: torch.device, eos_token_ids: list[int] = ()):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)  # masked with the stop token ids before min_tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                 output_ids: list[list[int]]) -> SamplerOutput:
        """`sample` with the rows given as Python objects; a row's output index is ``len(output_ids[i])``."""
        batch = SamplingBatch.from_params(params, prompt_ids, output_ids, logits.shape[1], logits.device,
                                          self.eos_token_ids)
        return self.sample(logits, batch)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Pick the next token of each row. logits: ``[rows, vocab]`` (any float dtype; not modified)."""
        tokens = self.sample_tensor(logits, batch)
        return SamplerOutput(tokens.tolist(), *self._logprobs(logits, tokens, batch.num_logprobs))

    def sample_tensor(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The chosen token ids ``[rows]`` int64 on the logits' device, without a host sync."""
        if batch.all_greedy and batch.prompt_mask is None and batch.bias is None and batch.banned is None:
            return argmax(logits)
        x = logits.to(torch.float32, copy=True)
        if batch.bias is not None:
            rows, ids, values = batch.bias
            x.index_put_((rows, ids), values, accumulate=True)
        if batch.banned is not None:
            x[batch.banned] = float("-inf")
        if batch.prompt_mask is not None:
            apply_penalties(x, batch)
        tokens = argmax(x)
        if batch.all_greedy:
            return tokens
        # candidates on the CPU only: their check costs a device sync, and the sort they avoid is cheap on a GPU
        candidates = batch.all_truncated and x.device.type == "cpu" and x.shape[1] >= 2 * CANDIDATES
        kept = truncated_candidates(x, batch) if candidates else None
        weights, ids = kept if kept is not None else (truncated_weights(x, batch), None)
        noise = torch.empty_like(weights)
        if batch.any_unseeded:
            noise.exponential_(generator=self.generator)
        if batch.any_seeded:
            seeded = seeded_exponential(batch.seeds, batch.output_index, weights.shape[1] if ids is None else ids)
            noise = torch.where(batch.seeded[:, None], seeded, noise)
        drawn = argmax(weights / noise.clamp_min_(1e-20))
        if ids is not None:
            drawn = ids.gather(1, drawn[:, None]).squeeze(1)
        return torch.where(batch.temperature < MIN_TEMPERATURE, tokens, drawn)  # below it: greedy

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_logprobs: list[int | None]):
        n = len(num_logprobs)
        logprobs: list[float | None] = [None] * n
        ranks: list[int | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        if not rows:
            return logprobs, ranks, tops
        idx = torch.tensor(rows, device=raw.device)
        lp = torch.log_softmax(raw[idx].float(), dim=-1)
        chosen = lp.gather(1, tokens[idx, None]).squeeze(1).tolist()
        rank = _ranks(lp, tokens[idx]).tolist()
        k = max(num_logprobs[i] for i in rows)
        top_vals, top_ids = _top_by_id(lp, k)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            logprobs[i], ranks[i] = chosen[j], rank[j]
            want = num_logprobs[i]
            tops[i] = list(zip(top_ids[j][:want], top_vals[j][:want]))
        return logprobs, ranks, tops


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index, ``[rows]`` int64, of ``x`` ``[rows, vocab]``; NaN counts as maximal.

    float32 CPU tensors go through numpy, whose argmax is about 10x faster than torch's CPU
    reduction at serving shapes (0.02 against 0.26 ms at 256 x 512); same result, ties included.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def bias_and_bans(rows: list[int], params: list[SamplingParams], output_index: list[int],
                  eos_token_ids: list[int], device: torch.device):
    """The sparse logit edits of the given rows: ``(bias, banned)`` for `SamplingBatch`, each None when empty.

    rows: batch row indices; params and output_index: that row's knobs and output tokens so far.
    bias is ``(rows, token ids, values)`` (``[k]`` int64, int64, float32): each row's ``logit_bias``;
    banned is ``(rows, token ids)``: while a row has fewer than ``min_tokens`` outputs, its stop
    token ids and (unless ``ignore_eos``) EOS. Python runs only for the rows passed, which callers
    limit to rows with a bias or a pending ``min_tokens``.
    """
    b_rows, b_ids, b_vals, x_rows, x_ids = [], [], [], [], []
    for row, p, index in zip(rows, params, output_index):
        if p.logit_bias:
            b_rows += [row] * len(p.logit_bias)
            b_ids += p.logit_bias.keys()
            b_vals += p.logit_bias.values()
        if index < p.min_tokens:
            stop = p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)
            x_rows += [row] * len(stop)
            x_ids += stop
    def longs(v):
        return torch.tensor(v, dtype=torch.int64, device=device)
    bias = (longs(b_rows), longs(b_ids), torch.tensor(b_vals, dtype=torch.float32, device=device)) if b_rows else None
    return bias, ((longs(x_rows), longs(x_ids)) if x_rows else None)


def _top_by_id(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``lp`` ``[rows, vocab]`` in the order `_ranks` ranks them: by value, equal
    values by token id, so a tie cut at the k-th value lists its lowest ids. topk leaves both to
    chance: CPU torch listed three equal logits [100, 300, 7] (a greedy token, the lowest id of a
    tie, listed after tokens equal to it), and took higher ids than others of a tie at the k-th value."""
    if not k:
        return lp[:, :0], lp[:, :0].long()
    k = min(k, lp.shape[1])
    vals, ids = _ties_by_id(*lp.topk(k, dim=-1))
    # positions from `above` on hold the k-th value: put there the lowest ids holding it, the
    # n-th of them found by a binary search in the running count of the tie along the vocabulary
    last = vals[:, -1:]
    above = (lp > last).sum(dim=-1, keepdim=True)
    nth = torch.arange(1, k + 1, device=lp.device)[None, :] - above
    tied = torch.searchsorted((lp == last).cumsum(dim=-1, dtype=torch.int32), nth.clamp_min(1).int())
    return vals, torch.where(nth >= 1, tied, ids)


def _ranks(lp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's token ``[rows]`` int64 in ``lp`` ``[rows, vocab]``: 1 + the tokens
    more likely, and of those equally likely the ones of lower id (the order `_top_by_id` lists).
    Without ties this is vLLM's rank (it counts a tie as ranked ahead: ``(lp >= chosen).sum()``)."""
    chosen = lp.gather(1, tokens[:, None])
    lower = torch.arange(lp.shape[1], device=lp.device)[None, :] < tokens[:, None]
    return ((lp > chosen) | ((lp == chosen) & lower)).sum(dim=-1) + 1


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Log-probabilities of ``targets`` under ``logits``: the prompt-logprobs math (raw logits, as
    the sampler's logprobs).

    logits ``[rows, vocab]``; targets ``[rows]`` int64 (the prompt token each row predicts).
    Returns python lists: logprob ``[rows]``, 1-based rank ``[rows]`` (`_ranks`), and the top ``k``
    (token_id, logprob) pairs per row.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])
    top_vals, top_ids = _top_by_id(lp, k)
    tops = [list(zip(ids, vals)) for ids, vals in zip(top_ids.tolist(), top_vals.tolist())]
    return chosen.squeeze(1).tolist(), _ranks(lp, targets).tolist(), tops


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Apply repetition, presence and frequency penalties to ``logits`` ``[rows, vocab]`` float32 in place.

    Needs ``batch.prompt_mask`` and ``batch.output_counts``; rows with neutral knobs are unchanged.
    """
    counts = batch.output_counts.to(torch.float32)
    seen = batch.prompt_mask | (batch.output_counts > 0)
    rep = batch.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= batch.frequency_penalty[:, None] * counts + batch.presence_penalty[:, None] * (counts > 0)


def truncated_weights(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Unnormalised probabilities ``[rows, vocab]`` float32 after temperature, top-k, top-p and min-p:
    ``e^(logit / T - max)`` for kept tokens (1 for the most likely), 0 for the others.

    top_k <= 0 disables it; top_p 1 disables it; the most likely token is always kept. Over the first
    CANDIDATES + 1 ranks ties go by token id, so top_k and top_p keep the lower ids of a tie there, as
    `truncated_candidates` does (past them, in the sort's own order: a stable sort of the whole
    vocabulary cost 30% more). min_p drops a token whose weight is below min_p (the top token's is
    1). Greedy rows (temperature below MIN_TEMPERATURE, 0 included) come out as if temperature were
    1; the caller takes their argmax.
    """
    x = _tempered(logits, batch)
    if batch.any_top_k_top_p:  # one sort serves both
        vals, order = x.sort(dim=-1, descending=True)
        n = min(CANDIDATES + 1, x.shape[1])
        vals[:, :n], order[:, :n] = _ties_by_id(vals[:, :n], order[:, :n])
        _top_k_top_p(vals, x, batch)
        x = torch.empty_like(x).scatter_(1, order, vals)
    return _weights(x, batch)


def _ties_by_id(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[rows, n]`` with their token ids, sorted by value descending and equal values by id."""
    ids, by_id = ids.sort(dim=-1)
    vals, by_value = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, by_value)


def _tempered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    temperature = torch.where(batch.temperature >= MIN_TEMPERATURE, batch.temperature, 1.0)
    return logits / temperature[:, None]


def _top_k_top_p(vals: torch.Tensor, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k then top-p IN PLACE on each row's tempered logits sorted descending, ties by token id:
    ``vals`` ``[rows, n]``, the whole vocabulary or its first CANDIDATES + 1; dropped tokens become
    -inf. x: the same logits ``[rows, vocab]`` unsorted. Returns each rank's probability mass before
    it, ``[rows, n]`` (top_p drops a rank once that reaches top_p).

    Every quantity a rank's fate depends on is computed the same way at either width: top_p's mass is
    normalised over the first CANDIDATES sorted values when 0 < top_k <= CANDIDATES, else over x
    (the whole vocabulary; a top_k above CANDIDATES takes the full-width masked row, right only at
    full width), and a cumulative sum's prefix does not depend on what follows it. So the
    candidates' ranks come out bit for bit as the vocabulary's first ones (`truncated_candidates`).
    """
    rank = torch.arange(vals.shape[1], device=vals.device)[None, :]
    vals.masked_fill_((batch.top_k > 0)[:, None] & (rank >= batch.top_k[:, None]), float("-inf"))
    norm = vals[:, :CANDIDATES].logsumexp(dim=-1)  # 0 < top_k <= CANDIDATES
    wide, whole = (batch.top_k > CANDIDATES) & (batch.top_p < 1), (batch.top_k <= 0) & (batch.top_p < 1)
    cpu = x.device.type == "cpu"  # there a host check is free, and skips a pass over the vocabulary
    if not cpu or bool(wide.any()):
        norm = torch.where(wide, vals.logsumexp(dim=-1), norm)
    if not cpu or bool(whole.any()):
        norm = torch.where(whole, x.logsumexp(dim=-1), norm)
    probs = (vals - norm[:, None]).exp()
    before = probs.cumsum(dim=-1) - probs
    vals.masked_fill_((before >= batch.top_p[:, None]) & (batch.top_p < 1)[:, None], float("-inf"))
    return before


def _weights(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``e^(x - row max)`` with min_p applied (weights below it set to 0); x in any column order."""
    weights = (x - x.max(dim=-1, keepdim=True).values).exp()
    if batch.any_min_p:
        weights.masked_fill_(weights < batch.min_p[:, None], 0.0)
    return weights


def truncated_candidates(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`truncated_weights` among the `CANDIDATES` most likely tokens of each row, when every row's
    kept tokens provably lie among them; else None (the caller takes the whole vocabulary).

    Returns weights ``[rows, CANDIDATES]`` float32 and their token ids ``[rows, CANDIDATES]`` int64,
    most likely first (ties by token id). The candidates are the first CANDIDATES + 1 ranks of the
    whole vocabulary's path, and `_top_k_top_p` and `_weights` give them bit for bit the values that
    path gives them. A row qualifies when the token just past the candidates is dropped there: by its
    top_k (1 to CANDIDATES), by top_p (the mass before it reaches top_p, under top_k <= 0), or by
    min_p (its weight below min_p); margins of 1e-6 keep float rounding of the ranks beyond from
    deciding that. A tie at that token's value may continue past the candidates, where either path
    holds an arbitrary part of it: a row that keeps a token of that value does not qualify (so it
    takes the whole vocabulary's path in every batch). Greedy rows always qualify (their argmax is
    taken elsewhere). So a seeded row draws the same token on both paths (`seeded_exponential` at a
    token's id is the same noise), whatever the batch, barring an exact tie of weight / noise
    between two tokens. NaN logits: undefined on either path.

    Why: the whole vocabulary's path sorts every row and draws noise for every token. At 256 rows of
    a 128K vocabulary that took 7-9 s a step on one CPU thread, 3.9 s of it hashing seeded noise;
    here a partial selection (topk), two short sorts and a log-sum-exp read the vocabulary.
    """
    k = CANDIDATES
    x = _tempered(logits, batch)
    vals, ids = _ties_by_id(*x.topk(k + 1, dim=-1))  # every value above the (k + 1)-th, and some of its ties
    raw = vals.clone()
    before = _top_k_top_p(vals, x, batch)
    weights = _weights(vals, batch)
    last = raw[:, k]  # the first token past the candidates
    by_k = (batch.top_k > 0) & (batch.top_k <= k)
    by_p = (batch.top_p < 1) & (batch.top_k <= 0) & (before[:, k] >= batch.top_p + 1e-6)
    by_min_p = ((batch.min_p > 0) & ((last - raw[:, 0]).exp() < batch.min_p * (1 - 1e-6))
                & ((batch.top_p >= 1) | (batch.top_k <= k)))  # top_p over a wider top_k: not at hand here
    tied = ((raw[:, :k] == last[:, None]) & (weights[:, :k] > 0)).any(dim=-1)
    if not bool((((by_k | by_p | by_min_p) & ~tied) | (batch.temperature < MIN_TEMPERATURE)).all()):
        return None
    return weights[:, :k], ids[:, :k]
