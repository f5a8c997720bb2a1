"""Next-token selection: penalties, temperature, top-k / top-p / min-p, seeded sampling, logprobs.

Order per row (as HF's and vLLM's samplers): logit bias (OpenAI ``logit_bias``) and, before
``min_tokens`` output tokens, EOS and the stop token ids masked out (vLLM); repetition penalty (prompt + output tokens; HF
``RepetitionPenaltyLogitsProcessor``: positive logits divided, negative multiplied), presence and
frequency penalties (output tokens only; OpenAI API: ``logit -= frequency * count + presence *
(count > 0)``), then greedy argmax when temperature is 0, else divide by temperature, keep the
top_k, keep the smallest set of most likely tokens whose probability reaches top_p, drop tokens
below min_p x the top probability, and draw from what is left.

Randomness is a pure function of (seed, output index): a seeded row draws its noise from a fresh
generator seeded by a hash of both, so its token does not depend on the batch, the step or a
preemption. Unseeded rows draw from the sampler's own generator (EngineConfig.seed).

Logprobs follow vLLM's default (``logprobs_mode="raw_logprobs"``): log-softmax of the model's raw
logits, before penalties, temperature and truncation, so they describe the model's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed mixing ``seed`` and ``output_index`` (splitmix64 finaliser, Steele et al. 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplerOutput:
    """Per row: the chosen token id, its raw logprob and the top alternatives (None when not asked)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Samples one token per row of a logits batch; see the module docstring for the exact semantics."""

    def __init__(self, seed: int, device: torch.device, eos_token_ids: list[int] = ()):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids)  # masked with the stop token ids before min_tokens

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                 output_ids: list[list[int]]) -> SamplerOutput:
        """Pick the next token of each row.

        logits: ``[num_rows, vocab]`` (any float dtype; not modified). params, prompt_ids,
        output_ids: one entry per row; a row's output index is ``len(output_ids[i])``.
        """
        raw = logits
        logits = logits.to(torch.float32, copy=True)
        apply_bias_and_min_tokens(logits, params, output_ids, self.eos_token_ids)
        apply_penalties(logits, params, prompt_ids, output_ids)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = truncated_probs(logits[idx], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(random_rows) if params[i].seed is None]
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator)
            for j, i in enumerate(random_rows):
                if params[i].seed is not None:
                    gen = torch.Generator(device=probs.device).manual_seed(row_seed(params[i].seed, len(output_ids[i])))
                    noise[j].exponential_(generator=gen)
            # argmax(p / E), E ~ Exp(1), draws from p (the exponential race, equivalent to Gumbel-max)
            tokens[idx] = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
        return SamplerOutput(tokens.tolist(), *self._logprobs(raw, tokens, params))

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]):
        n = len(params)
        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return logprobs, tops
        idx = torch.tensor(rows, device=raw.device)
        lp = torch.log_softmax(raw[idx].float(), dim=-1)
        chosen = lp.gather(1, tokens[idx, None]).squeeze(1).tolist()
        k = max(params[i].logprobs for i in rows)
        top_vals, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            logprobs[i] = chosen[j]
            want = params[i].logprobs
            tops[i] = list(zip(top_ids[j][:want], top_vals[j][:want]))
        return logprobs, tops


def apply_bias_and_min_tokens(logits: torch.Tensor, params: list[SamplingParams], output_ids: list[list[int]],
                              eos_token_ids: list[int]) -> None:
    """Add each row's ``logit_bias``; while a row has fewer than ``min_tokens`` outputs, forbid
    its stop token ids and (unless ``ignore_eos``) EOS. ``logits`` ``[num_rows, vocab]`` float32, in place."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if len(output_ids[i]) < p.min_tokens:
            stop = p.stop_token_ids + ([] if p.ignore_eos else eos_token_ids)
            if stop:
                logits[i, torch.tensor(stop, dtype=torch.int64, device=logits.device)] = float("-inf")


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Log-probabilities of ``targets`` under ``logits``: the prompt-logprobs math (raw logits, as
    the sampler's logprobs).

    logits ``[rows, vocab]``; targets ``[rows]`` int64 (the prompt token each row predicts).
    Returns python lists: logprob ``[rows]``, 1-based rank ``[rows]``, and the top ``k`` (token_id,
    logprob) pairs per row.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_vals, top_ids = lp.topk(min(k, lp.shape[1]), dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    tops = [list(zip(ids, vals)) for ids, vals in zip(top_ids.tolist(), top_vals.tolist())]
    return chosen.squeeze(1).tolist(), ranks.tolist(), tops


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
                    output_ids: list[list[int]]) -> None:
    """Apply repetition, presence and frequency penalties to ``logits`` ``[num_rows, vocab]`` in place."""
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt_ids[i]) | set(output_ids[i])), dtype=torch.int64,
                                device=logits.device)
            if seen.numel():
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]:
            ids, counts = torch.tensor(output_ids[i], device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


def truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[rows, vocab]`` float32 after temperature, top-k, top-p and min-p.

    top_k <= 0 disables it; top_p 1 disables it; the most likely token is always kept.
    """
    dev = logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp_max(vocab)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the more likely ones already reach top_p
        beyond = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        sorted_logits.masked_fill_(beyond & (top_p < 1)[:, None], float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
