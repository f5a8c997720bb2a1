"""Executes step plans: mirrors each request's state, builds the flat batch, runs the model, samples.

The control plane decides everything; the runner applies the plan's deltas (vLLM V1's
SchedulerOutput style, see `common.protocol`) to its mirror and does the math.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagedkv.common.protocol import PromptLogprobs, SampledToken, StepPlan, StepResult
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedkv.worker.model import AttentionMetadata
from pagedkv.worker.model_loader import load_model
from pagedkv.worker.sampler import Sampler, prompt_logprobs


@dataclass
class RequestState:
    """The worker's mirror of one request: every known token, its block table and its progress."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams


class ModelRunner:
    """Owns the model, the KV pools and the request mirror of one worker.

    Use: ``ModelRunner(engine_config, device, dtype)``, optionally `profile_run`, then
    `init_cache`, then `execute` once per StepPlan.
    """

    def __init__(self, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 model_config: ModelConfig | None = None):
        self.engine_config = engine_config
        self.model_config = model_config or ModelConfig.load(engine_config.model)
        self.device, self.dtype = device, dtype
        self.block_size = engine_config.block_size
        self.model = load_model(self.model_config, engine_config, device, dtype)
        self.sampler = Sampler(engine_config.seed, device, self.model_config.eos_token_ids)
        self.cache: CacheEngine | None = None
        self.requests: dict[str, RequestState] = {}

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.dtype)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device KV pool and the host swap pool (sizes in blocks)."""
        self.cache = None  # free an old pool before allocating a new one
        self.cache = CacheEngine(self.model_config, num_gpu_blocks, num_cpu_blocks, self.block_size,
                                 self.dtype, self.device, self.model.kernels)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward + sampling of ``max_num_batched_tokens`` tokens, to measure peak memory.

        The tokens form sequences of at most max_model_len; they use a temporary KV cache, freed on
        return. Returns that cache's size in bytes, so the caller can subtract it from the peak.
        """
        total = self.engine_config.max_num_batched_tokens
        max_len = resolve_max_model_len(self.model_config, self.engine_config.max_model_len)
        lens = [min(max_len, total - start) for start in range(0, total, max_len)]
        nblocks = [-(-n // self.block_size) for n in lens]
        cache = CacheEngine(self.model_config, sum(nblocks), 0, self.block_size, self.dtype, self.device,
                            self.model.kernels)
        params = SamplingParams(top_p=0.9, top_k=50, logprobs=self.engine_config.max_logprobs)
        scheduled, first = [], 0
        for i, (n, b) in enumerate(zip(lens, nblocks)):
            state = RequestState(f"profile-{i}", [0] * n, n, list(range(first, first + b)), 0, params)
            scheduled.append((state, n))
            first += b
        self._run(scheduled, cache)
        self.sampler = Sampler(self.engine_config.seed, self.device,  # unseeded draws start as if unprofiled
                               self.model_config.eos_token_ids)
        return sum(nblocks) * self.kv_bytes_per_block

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply one plan and return its sampled tokens.

        Order: drop finished requests, add new ones, apply cached-request deltas, swap out, swap in,
        copy, forward, sample. Raises ValueError for a plan inconsistent with the mirror (unknown
        request, tokens scheduled past the known tokens, block table too short) and RuntimeError
        before `init_cache`. After a raise the mirror of that step's requests is undefined: the
        control plane fails them and lists them in ``finished_request_ids``.
        """
        if self.cache is None:
            raise RuntimeError("step plan before InitCache: the KV cache is not allocated")
        start = time.perf_counter()
        for rid in plan.finished_request_ids:
            self.requests.pop(rid, None)
        scheduled: list[tuple[RequestState, int]] = []
        for new in plan.new_requests:
            state = RequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                                 new.num_computed_tokens, new.sampling)
            self.requests[new.request_id] = state
            scheduled.append((state, new.num_scheduled_tokens))
        for cached in plan.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                raise ValueError(f"cached request {cached.request_id!r} is not known to this worker")
            for index, block_id in cached.replaced_block_ids:  # copy-on-write moved this block
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids)
            state.token_ids.extend(cached.new_token_ids)
            scheduled.append((state, cached.num_scheduled_tokens))
        self.cache.swap_out(plan.blocks_to_swap_out)
        self.cache.swap_in(plan.blocks_to_swap_in)
        self.cache.copy(plan.blocks_to_copy)
        sampled, prompt = self._run([(s, n) for s, n in scheduled if n > 0], self.cache)
        return StepResult(step_id=plan.step_id, sampled=sampled, prompt_logprobs=prompt,
                          forward_seconds=time.perf_counter() - start)

    def _run(self, scheduled: list[tuple[RequestState, int]],
             cache: CacheEngine) -> tuple[list[SampledToken], list[PromptLogprobs]]:
        """Forward the scheduled tokens of each request, sample where a request's known tokens end,
        and score the prompt tokens of requests that asked for prompt logprobs."""
        if not scheduled:
            return [], []
        bs = self.block_size
        input_ids: list[int] = []
        starts, lens, tables, sample_rows, samplers = [], [], [], [], []
        prompt_rows: list[int] = []  # rows whose logits predict a prompt token, for prompt logprobs
        prompt_spans: list[tuple[RequestState, int, int]] = []  # (request, first prompt token scored, count)
        for state, n in scheduled:
            begin, end = state.num_computed_tokens, state.num_computed_tokens + n
            if end > len(state.token_ids):
                raise ValueError(f"request {state.request_id!r}: {n} tokens scheduled from {begin}, "
                                 f"but only {len(state.token_ids)} tokens are known")
            if len(state.block_ids) * bs < end:
                raise ValueError(f"request {state.request_id!r}: {len(state.block_ids)} blocks of {bs} "
                                 f"cannot hold {end} tokens")
            input_ids.extend(state.token_ids[begin:end])
            # position p's logits predict token p + 1: score the prompt tokens this chunk predicts
            if state.sampling.prompt_logprobs is not None and begin < state.num_prompt_tokens - 1:
                count = min(end, state.num_prompt_tokens - 1) - begin
                first_row = len(input_ids) - n
                prompt_rows.extend(range(first_row, first_row + count))
                prompt_spans.append((state, begin + 1, count))
            starts.append(begin)
            lens.append(n)
            tables.append(state.block_ids)
            if end == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                samplers.append(state)
        dev = self.device
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        q_lens = torch.tensor(lens)
        seq_idx = torch.repeat_interleave(torch.arange(len(lens)), q_lens)
        query_start_loc = torch.zeros(len(lens) + 1, dtype=torch.int32)
        query_start_loc[1:] = q_lens.cumsum(0)
        positions = torch.arange(len(input_ids)) - query_start_loc[:-1].long()[seq_idx] + torch.tensor(starts)[seq_idx]
        slot_mapping = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(slot_mapping.to(dev), block_tables.to(dev),
                                 (torch.tensor(starts) + q_lens).to(torch.int32).to(dev), query_start_loc.to(dev))
        logits = self.model(torch.tensor(input_ids, device=dev), positions.to(dev), meta, cache.k_caches,
                            cache.v_caches, torch.tensor(prompt_rows + sample_rows, dtype=torch.int64, device=dev))
        for state, n in scheduled:
            state.num_computed_tokens += n
        prompt = self._prompt_logprobs(logits[:len(prompt_rows)], prompt_spans)
        logits = logits[len(prompt_rows):]
        if not samplers:
            return [], prompt
        out = self.sampler(logits, [s.sampling for s in samplers],
                           [s.token_ids[:s.num_prompt_tokens] for s in samplers],
                           [s.token_ids[s.num_prompt_tokens:] for s in samplers])
        result = []
        for i, state in enumerate(samplers):
            token = out.token_ids[i]
            if not state.sampling.use_beam_search:  # beam search: the control plane picks and sends tokens
                state.token_ids.append(token)
            result.append(SampledToken(state.request_id, token, out.logprobs[i], out.top_logprobs[i]))
        return result, prompt

    def _prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[RequestState, int, int]]) -> list[PromptLogprobs]:
        """One PromptLogprobs per span; ``logits`` ``[sum of counts, vocab]``, rows in span order."""
        if not spans:
            return []
        targets = [t for state, first, count in spans for t in state.token_ids[first:first + count]]
        k = max(state.sampling.prompt_logprobs for state, _, _ in spans)
        lps, ranks, tops = prompt_logprobs(logits, torch.tensor(targets, device=logits.device), k)
        out, row = [], 0
        for state, first, count in spans:
            want = state.sampling.prompt_logprobs
            out.append(PromptLogprobs(state.request_id, first, lps[row:row + count], ranks[row:row + count],
                                      [t[:want] for t in tops[row:row + count]]))
            row += count
        return out
