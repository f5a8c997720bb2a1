"""Beam search over paged block tables (PagedAttention, Kwon et al., SOSP 2023, §4.4).

Each live beam is a `Request` whose block table shares blocks with its siblings. Every step each
beam computes its newest token and the worker returns the top ``2 x width`` log-probabilities at
that position (log-softmax of the raw logits). Once every live beam has reported, `BeamSearch.step`
chooses the next beams the way Hugging Face transformers' ``generate(num_beams=width,
do_sample=False)`` does: candidates ranked by cumulative log-probability; a candidate ending in EOS
among the top ``width`` becomes a finished hypothesis scored ``sum_logprobs / generated_len **
length_penalty``; the best ``width`` other candidates continue. A surviving beam keeps its
`Request`; a second child of the same parent forks it (block table shared, reference counts up,
copy-on-write at the fork block); a beam without children is dropped and gives its blocks back.
"""

from __future__ import annotations

import msgspec


class Hypothesis(msgspec.Struct):
    """A finished beam: its output tokens, cumulative log-probability and length-penalised score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    ended_with_eos: bool


class BeamSearch:
    """The beam state of one request. Beams are identified by their request ids.

    width: beams kept (and hypotheses returned); max_tokens: generated tokens at most.
    early_stopping: True stops once ``width`` hypotheses are finished; False stops when no running
    beam can beat the worst finished one (transformers' heuristic).
    """

    def __init__(self, width: int, max_tokens: int, length_penalty: float, early_stopping: bool,
                 eos_token_ids: list[int], num_prompt_tokens: int, leader_id: str):
        self.width = width
        self.max_tokens = max_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos = set(eos_token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.cum_logprob: dict[str, float] = {leader_id: 0.0}  # live beams
        self.reports: dict[str, list[tuple[int, float]]] = {}
        self.finished: list[Hypothesis] = []
        self.done = False

    def report(self, beam_id: str, top_logprobs: list[tuple[int, float]]) -> bool:
        """Store a beam's candidates; True when every live beam has reported (time to `step`)."""
        self.reports[beam_id] = top_logprobs
        return self.reports.keys() >= self.cum_logprob.keys()

    def step(self, outputs: dict[str, list[int]]) -> list[tuple[str, int, float]]:
        """Choose the next beams. ``outputs`` maps each live beam to its output tokens so far.

        Returns (parent beam id, token, cumulative logprob) for each continuing beam, best first;
        empty when the search is done. Register each new beam with `set_beam`.
        """
        generated = len(next(iter(outputs.values()))) + 1  # tokens per beam after this step
        candidates = sorted(
            ((self.cum_logprob[b] + lp, b, tok) for b in self.cum_logprob for tok, lp in self.reports[b]),
            key=lambda c: -c[0])[: max(2, 1 + len(self.eos)) * self.width]
        self.reports.clear()
        at_max = generated >= self.max_tokens
        chosen: list[tuple[float, str, int]] = []
        for rank, (score, beam, tok) in enumerate(candidates):
            if tok in self.eos or at_max:
                if rank < self.width:  # as transformers: only top-ranked candidates may finish
                    self._add_hypothesis(outputs[beam] + [tok], score, tok in self.eos, generated)
            elif len(chosen) < self.width:
                chosen.append((score, beam, tok))
        if at_max or not chosen or self._can_stop(chosen[0][0], generated):
            self.done = True
            self.cum_logprob = {}
            return []
        self.cum_logprob = {}
        return [(beam, tok, score) for score, beam, tok in chosen]

    def set_beam(self, beam_id: str, cum_logprob: float) -> None:
        self.cum_logprob[beam_id] = cum_logprob

    def _add_hypothesis(self, tokens: list[int], cum: float, eos: bool, generated: int) -> None:
        score = cum / (generated ** self.length_penalty)
        self.finished.append(Hypothesis(tokens, cum, score, eos))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]

    def _can_stop(self, best_running_cum: float, generated: int) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping:
            return True
        best_possible = best_running_cum / (generated ** self.length_penalty)
        return self.finished[-1].score >= best_possible

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (at most ``width``)."""
        return list(self.finished)
