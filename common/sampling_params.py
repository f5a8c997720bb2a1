"""Sampling parameters of one request (vLLM's names and meanings).

Validated once in the control plane (`SamplingParams.validate`), then sent to the worker inside the
step plan. The sampler's randomness is a pure function of (``seed``, output index), so a seeded
request produces the same tokens alone, batched or after a preemption.
"""

from __future__ import annotations

import math
from array import array

import msgspec

from pagedkv.common.config import check_field_types

# Temperatures below this are greedy: dividing logits by 1e-45 overflows to inf and the softmax to
# NaN. vLLM draws the same line (its _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
_MIN_TEMPERATURE_F32 = array("f", [MIN_TEMPERATURE])[0]


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick each next token and when to stop.

    temperature: below MIN_TEMPERATURE (1e-5, compared in float32), 0 included, means greedy. top_p in (0, 1]; top_k -1 or 0 disables; min_p in [0, 1].
    repetition_penalty > 0 (1 = off, applies to prompt and output tokens, as in HF/vLLM);
    presence_penalty and frequency_penalty in [-2, 2] (output tokens only, as OpenAI).
    max_tokens: output tokens at most; None: up to max_model_len (as vLLM; the engine resolves it
    per prompt, also bounded by what the KV pool can hold). logprobs: None, or how many top alternatives to return
    with each sampled token's own log-probability (0 = only the sampled token's).
    stop: strings that end the output; stop_token_ids: token ids that end it; neither is in the
    text unless include_stop_str_in_output. A single stop string and None (for stop,
    stop_token_ids, logit_bias) are accepted as in vLLM and normalized in ``__post_init__``. ignore_eos: keep going past the model's EOS.
    min_tokens: output tokens before EOS, a stop token or a stop string may end it (vLLM).
    logit_bias: token id -> value in [-100, 100] added to its logit before sampling (OpenAI).
    prompt_logprobs: None, or how many top alternatives to return with each prompt token's own
    log-probability (vLLM; the first prompt token has none). Computed in the prefill's forward, so
    such a request does not reuse prefix-cache blocks (a cached block has no fresh logits).
    n: completions per prompt; use_beam_search/length_penalty/early_stopping: beam search.
    detokenize: False returns token ids without text (vLLM): text "" and no decoded tokens in the
    offline API's logprobs; stop strings need it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = {}
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    n: int = 1
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    def __post_init__(self) -> None:
        # vLLM takes stop="x" and None for these; a str reached the worker as a list field it could
        # not decode, so the step was dropped and generate() hung
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", [self.stop])
        for f, empty in (("stop", list), ("stop_token_ids", list), ("logit_bias", dict)):
            if getattr(self, f) is None:
                msgspec.structs.force_setattr(self, f, empty())

    @property
    def greedy(self) -> bool:
        # in float32, as the worker's knob tensors compare it: a temperature that rounds to
        # float32(1e-5) draws there, so it is no greedy row anywhere (its noise must exist)
        return array("f", [self.temperature])[0] < _MIN_TEMPERATURE_F32

    def validate(self, max_logprobs: int = 20, max_n: int = 1, max_stop: int | None = None) -> None:
        """Raise ValueError("<field>: <why>") for the first invalid field (a wrong type included).

        max_stop: most stop strings accepted (None: no limit).
        """
        check_field_types(self, ValueError)  # a type the worker cannot decode would hang its step

        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field}: {why}")

        def finite(field: str, v: float) -> None:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(field, f"must be a finite number, got {v!r}")

        for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "length_penalty"):
            finite(f, getattr(self, f))
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            bad("logprobs", f"must be between 0 and {max_logprobs}, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            bad("prompt_logprobs", f"must be between 0 and {max_logprobs}, got {self.prompt_logprobs}")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            bad("min_tokens", f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for token, bias in self.logit_bias.items():
            finite(f"logit_bias.{token}", bias)
            if not -100 <= bias <= 100:
                bad(f"logit_bias.{token}", f"must be between -100 and 100, got {bias}")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:  # any int64, as vLLM's API takes
            bad("seed", f"must fit in int64 ([-2**63, 2**63)), got {self.seed}")
        if max_stop is not None and len(self.stop) > max_stop:
            bad("stop", f"at most {max_stop} stop strings (--max-stop), got {len(self.stop)}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings are matched in the text, so they need detokenize=True")
        if self.n < 1 or self.n > max_n:
            bad("n", f"must be between 1 and {max_n} (--max-n), got {self.n}")
        if self.use_beam_search and self.n < 1:
            bad("n", "beam search needs a beam width n >= 1")
        if self.use_beam_search:
            for f in ("prompt_logprobs", "logit_bias", "min_tokens"):
                if getattr(self, f):
                    bad(f, "is not supported with beam search")


class BeamSearchParams(msgspec.Struct, frozen=True):
    """vLLM's offline beam search knobs, for `LLM.beam_search`; run as SamplingParams' beam search.

    beam_width: beams kept and returned (at most the engine's max_n); max_tokens: output tokens at
    most; ignore_eos: EOS is an ordinary token; temperature: 0 only (pagedkv's beams continue the
    most likely candidates; vLLM's may also take one sampled at this temperature); length_penalty:
    a beam scores cum_logprob / output tokens ** length_penalty (as transformers; vLLM's
    ``LLM.beam_search`` counts the prompt's tokens too); include_stop_str_in_output: taken, without
    effect (beam search takes no stop strings).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_n: int) -> SamplingParams:
        """The SamplingParams running this search. Raises ValueError("<field>: <why>") for a wrong
        type, a beam_width outside [1, max_n] or a temperature other than 0."""
        check_field_types(self, ValueError)
        if not 1 <= self.beam_width <= max_n:
            raise ValueError(f"beam_width: must be between 1 and max_n ({max_n}), got {self.beam_width}")
        if self.temperature != 0:
            raise ValueError(f"temperature: beam search here keeps the most likely candidates, so only 0 is "
                             f"taken, got {self.temperature}")
        return SamplingParams(n=self.beam_width, use_beam_search=True, temperature=0, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, length_penalty=self.length_penalty)
