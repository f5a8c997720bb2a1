"""Executes step plans: applies each plan's deltas to the persistent batch, runs the model, samples.

The control plane decides everything; the runner applies the plan's deltas (vLLM V1's
SchedulerOutput style, see `common.protocol`) to its `InputBatch` (one preallocated row per live
request) and does the math. Building a step's inputs costs O(rows + new tokens) on the host, never
O(context): tokens, block tables and penalty statistics are never rebuilt from lists.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_kv_cache_dtype, resolve_max_model_len
from pagedkv.common.protocol import CachedRequestData, NewRequestData, PromptLogprobs, SampledToken, StepPlan, StepResult
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.kernels import fp8
from pagedkv.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedkv.worker.cuda_graphs import DecodeGraphs
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.model import AttentionMetadata
from pagedkv.worker.model_loader import load_model
from pagedkv.worker.parallel import TensorParallel
from pagedkv.worker.sampler import Sampler, SamplingBatch, prompt_logprobs

# the CPU warm-up's bound, in FLOPs: 0.5-1 s of float32 GEMMs on one current core
CPU_WARM_UP_FLOPS = 1e11
_ALIGN = 16  # staged segments start at multiples of 16 elements: aligned device views, no new kernel variants


def cpu_warm_up_tokens(model_config: ModelConfig, max_num_batched_tokens: int) -> int:
    """Tokens of the CPU warm-up prefill (`ModelRunner.warm_up`): max_num_batched_tokens, fewer where that
    would cost more than `CPU_WARM_UP_FLOPS` (2 FLOPs per weight per token), at least one.
    stories260K: 2,048 (of the default 2,048); ops/weights_bound_model.py's 181M-parameter Llama: 276
    (2,048 took 5.4 s on one core)."""
    flops_per_token = 2 * model_config.weight_bytes("float32") // 4
    return max(1, min(max_num_batched_tokens, int(CPU_WARM_UP_FLOPS // flops_per_token)))


def captures_decode_graphs(device: torch.device, enforce_eager: bool, world_size: int, kernels) -> bool:
    """Whether decode-only steps replay captured CUDA graphs (`worker.cuda_graphs`): on CUDA, unless
    --enforce-eager, on a single rank, with the Triton kernels (``kernels``: the model's backend module).

    Under tensor parallelism decode steps run eagerly: NCCL all-reduces inside captured graphs have not
    been checked on a multi-GPU machine here, and a wrong replay would be silent. The PyTorch backend
    (``--attention-backend torch``, and ``cpu``, which hands CUDA tensors to it) reads lengths on the host
    in its forward (boolean-mask indexing in write_kv_cache, ``.tolist()`` in the batched attention): a
    device sync, which stream capture refuses (the worker failed at InitCache), and a graph would keep the
    capture's lengths. Those backends decode eagerly.
    """
    return (device.type == "cuda" and not enforce_eager and world_size == 1
            and kernels.__name__.endswith(".triton_kernels"))


class ModelRunner:
    """Owns the model, the KV pools and the request mirror of one worker.

    Use: ``ModelRunner(engine_config, device, dtype)``, optionally `profile_run`, then
    `init_cache`, then `execute` once per StepPlan. Under tensor parallelism (``tp``) every rank
    runs the same plans; its model and its KV pools hold its shard (``model_config`` is then the
    rank's `ModelConfig.shard`), and it samples what every other rank samples.
    """

    def __init__(self, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 model_config: ModelConfig | None = None, tp: TensorParallel = TensorParallel()):
        self.engine_config = engine_config
        full_config = model_config or ModelConfig.load(engine_config.model)
        self.model_config = full_config.shard(tp.world_size)  # this rank's heads: its KV pool holds only these
        self.tp = tp
        self.device, self.dtype = device, dtype
        self.block_size = engine_config.block_size
        self.max_model_len = resolve_max_model_len(self.model_config, engine_config.max_model_len)
        self.model = load_model(full_config, engine_config, device, dtype, tp)
        self.kv_cache_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, str(dtype).removeprefix("torch."))
        self.kv_dtype = fp8.FP8_DTYPES.get(self.kv_cache_dtype, dtype)  # the pool's torch dtype
        if engine_config.k_scale or engine_config.v_scale:  # given scales win over the checkpoint's
            self.model.kv_scales = [(engine_config.k_scale or k, engine_config.v_scale or v)
                                    for k, v in self.model.kv_scales]
        self.sampler = Sampler(engine_config.seed, device, self.model_config.eos_token_ids)
        self.cache: CacheEngine | None = None
        self.batch = InputBatch(engine_config.max_num_seqs, self.max_model_len, self.block_size,
                                self.model_config.vocab_size, device, self.model_config.eos_token_ids)
        self._pinned = device.type == "cuda"
        self._staging: dict[torch.dtype, tuple[torch.Tensor, torch.cuda.Event]] = {}  # pinned buffer, its last copy
        self.graphs: DecodeGraphs | None = None
        # decode CUDA graphs (`captures_decode_graphs`); tests set them on CPU for the emulated path
        self.capture_graphs = captures_decode_graphs(device, engine_config.enforce_eager, tp.world_size,
                                                     self.model.kernels)

    @property
    def kv_scales_ready(self) -> bool:
        """Whether every layer's fp8 scales are fixed (always, for other pools). A graph bakes the
        scales in, so with scales from the first prefill the graphs are captured after it."""
        return not fp8.is_fp8(self.kv_dtype) or all(k is not None and v is not None for k, v in self.model.kv_scales)

    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the device KV pool and the host swap pool (sizes in blocks)."""
        self.cache = self.graphs = None  # free an old pool (and graphs holding it) before allocating a new one
        self.cache = CacheEngine(self.model_config, num_gpu_blocks, num_cpu_blocks, self.block_size,
                                 self.kv_dtype, self.device, self.model.kernels)
        if self.capture_graphs and self.kv_scales_ready:  # else after the first prefill (`execute`)
            self.init_decode_graphs(capture=self.device.type == "cuda")

    @torch.inference_mode()
    def init_decode_graphs(self, capture: bool = True) -> None:
        """Capture decode forwards for batch sizes up to max_num_seqs (`worker.cuda_graphs`).

        capture=False keeps the padded static-buffer path but runs it eagerly (CPU tests).
        """
        self.graphs = DecodeGraphs(self.model, self.cache.k_caches, self.cache.v_caches,
                                   self.engine_config.max_num_seqs, self.batch.max_blocks, self.max_model_len,
                                   self.device, capture)

    @torch.inference_mode()
    def warm_up(self, host: bool | None = None) -> int:
        """Pay first-use costs at start, not in the first requests' steps (host: the CPU warm-up;
        default: off CUDA). Returns the CPU warm-up's prefill tokens (0 for CUDA's, or none).

        CUDA: run every kernel variant serving launches once, so none compiles mid-serving: a prefill
        long enough for split-K, a decode-only step over it (partials and their reduce), a block copy,
        on a temporary cache, and the split-K reduce at every other partition count; greedy, so no
        random draw is consumed.
        CPU: one prefill of `cpu_warm_up_tokens` tokens, greedy. glibc's heap grows to that step's activations
        once (its page faults; `host_memory.reuse_freed_host_memory` keeps them for later steps), and
        MKL and the C kernels set themselves up. stories260K's first served conv replay after start
        ran at the later replays' pace instead of 10-15% below it (docs/benchmarks.md, thirteenth session).
        """
        greedy = SamplingParams(temperature=0.0)
        if host if host is not None else self.device.type != "cuda":
            if self.model.kernels.__name__.endswith(".triton_kernels"):
                return 0  # Triton on a CPU runs interpreted (tests, debugging): 2,048 tokens took 40 s there
            tokens = cpu_warm_up_tokens(self.model_config, self.engine_config.max_num_batched_tokens)
            self._dummy_prefill(tokens, greedy, "warm-up")
            return tokens
        n = max(1, min(self.max_model_len - 1, 4096))
        nb = -(-(n + 1) // self.block_size)
        cache = CacheEngine(self.model_config, nb + 1, 0, self.block_size, self.kv_dtype, self.device,
                            self.model.kernels)
        scales = self.model.kv_scales  # warm-up's dummy tokens must not calibrate the fp8 scales
        try:
            self._execute(StepPlan(-2, new_requests=[NewRequestData("warm-up", [0] * n, n, list(range(nb)), 0, n,
                                                                    greedy)]), cache)
            self._execute(StepPlan(-3, cached_requests=[CachedRequestData("warm-up", [], 1)]), cache)
            cache.copy([(0, nb), (nb, 0)])
            if hasattr(self.model.kernels, "warm_up_split_k_reduce"):  # the decode met one partition count
                attn = self.model.model.layers[0].self_attn
                self.model.kernels.warm_up_split_k_reduce(attn.num_heads, attn.head_dim, self.dtype, self.device)
        finally:
            self.batch.remove("warm-up")
            self.model.kv_scales = scales
        return 0

    def _dummy_prefill(self, total: int, params: SamplingParams, name: str = "profile") -> int:
        """One step of ``total`` new tokens (id 0) in sequences of at most max_model_len, sampled with
        ``params``, on a temporary KV cache freed on return; no request is left behind, the fp8 scales
        are not calibrated by it. Returns the temporary cache's size in bytes."""
        max_len = self.max_model_len
        lens = [min(max_len, total - start) for start in range(0, total, max_len)]
        nblocks = [-(-n // self.block_size) for n in lens]
        cache = CacheEngine(self.model_config, sum(nblocks), 0, self.block_size, self.kv_dtype, self.device,
                            self.model.kernels)
        scales = self.model.kv_scales
        news, first = [], 0
        for i, (n, b) in enumerate(zip(lens, nblocks)):
            news.append(NewRequestData(f"{name}-{i}", [0] * n, n, list(range(first, first + b)), 0, n, params))
            first += b
        try:
            self._execute(StepPlan(step_id=-1, new_requests=news), cache)
        finally:
            for new in news:
                self.batch.remove(new.request_id)
            self.model.kv_scales = scales
        return sum(nblocks) * self.kv_bytes_per_block

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward of ``max_num_batched_tokens`` tokens, then the sampler at ``max_num_seqs`` rows.

        Measures peak memory. The tokens form sequences of at most max_model_len; they use a
        temporary KV cache, freed on return. They ask for prompt logprobs, so every token is projected
        to the vocabulary and scored, as a prompt_logprobs (or echo) request's chunk is: ``[tokens,
        vocab]`` float32 logits and their log-softmax, at 2,048 x 128K about 2 GiB that a forward
        sampling only each sequence's last token never holds. The sampler run uses every stage
        (penalties, top-k, top-p, min-p, seeded and unseeded draws, logprobs). Returns the temporary
        cache's size in bytes, so the caller can subtract it from the peak.
        """
        cfg = self.engine_config
        cache_bytes = self._dummy_prefill(cfg.max_num_batched_tokens,
                                          SamplingParams(top_p=0.9, top_k=50, logprobs=cfg.max_logprobs,
                                                         prompt_logprobs=cfg.max_logprobs))
        rows, vocab = cfg.max_num_seqs, self.model_config.vocab_size
        mixed = [SamplingParams(top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=0.5, logprobs=cfg.max_logprobs, seed=i if i % 2 else None)
                 for i in range(rows)]
        logits = torch.zeros(rows, vocab, dtype=torch.float32, device=self.device)
        batch = SamplingBatch.from_params(mixed, [[0]] * rows, [[0]] * rows, vocab, self.device)
        batch.all_truncated = False  # profile the heavier whole-vocabulary path (a row that does not truncate)
        self.sampler.sample(logits, batch)
        self.sampler = Sampler(cfg.seed, self.device, self.model_config.eos_token_ids)  # unseeded draws start afresh
        return cache_bytes

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
        sampled, prompt = self._execute(plan, self.cache)
        result = StepResult(step_id=plan.step_id, sampled=sampled, prompt_logprobs=prompt,
                            forward_seconds=time.perf_counter() - start)
        if self.capture_graphs and self.graphs is None and self.kv_scales_ready:  # fp8: just calibrated
            self.init_decode_graphs(capture=self.device.type == "cuda")
        return result

    def _execute(self, plan: StepPlan, cache: CacheEngine) -> tuple[list[SampledToken], list[PromptLogprobs]]:
        batch = self.batch
        for rid in plan.finished_request_ids:
            batch.remove(rid)
        batch.q_len[:batch.num_rows] = 0  # rows the plan does not schedule compute nothing
        for new in plan.new_requests:
            batch.add(new)
        cached = plan.cached_requests  # the per-request Python here is O(batch) and minimal
        try:
            rows = [batch.row_of[c.request_id] for c in cached]
        except KeyError as e:
            raise ValueError(f"cached request {e.args[0]!r} is not known to this worker") from None
        batch.q_len[rows] = [c.num_scheduled_tokens for c in cached]
        for c, row in zip(cached, rows):
            if c.new_block_ids or c.replaced_block_ids:  # copy-on-write replacements first
                batch.append_blocks(row, c.new_block_ids, c.replaced_block_ids)
            if c.new_token_ids:
                batch.append_tokens(row, c.new_token_ids)
        if plan.blocks_to_swap_out:
            cache.swap_out(plan.blocks_to_swap_out)
        if plan.blocks_to_swap_in:
            cache.swap_in(plan.blocks_to_swap_in)
        cache.copy(plan.blocks_to_copy)
        return self._run(cache)

    def _stage(self, dtype: torch.dtype, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays as device tensors: on CUDA one pinned staging buffer and one non-blocking copy.

        The buffer is rewritten every step, and a step that samples nothing and writes no block-table
        entry (whose pageable copy syncs the stream) never waits for the device: the host may run
        steps ahead of it. So a rewrite first waits for the copy that last read the buffer (its
        event), or a copy queued behind a long forward would send a later step's tokens and slots.
        """
        if not self._pinned:
            return [torch.from_numpy(p) for p in parts]
        sizes = [-(-p.size // _ALIGN) * _ALIGN for p in parts]
        total = sum(sizes)
        buf, copied = self._staging.get(dtype, (None, None))
        if copied is None:
            copied = torch.cuda.Event()
        else:
            copied.synchronize()
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, 2 * (0 if buf is None else buf.numel())), dtype=dtype, pin_memory=True)
        host = buf.numpy()
        offsets = np.cumsum([0] + sizes)
        for p, o in zip(parts, offsets):
            host[o:o + p.size] = p
        dev = buf[:total].to(self.device, non_blocking=True)
        copied.record()
        self._staging[dtype] = (buf, copied)
        return [dev[o:o + p.size] for p, o in zip(parts, offsets)]

    def _run(self, cache: CacheEngine) -> tuple[list[SampledToken], list[PromptLogprobs]]:
        """Forward every row's scheduled tokens; sample the rows whose known tokens end there, and
        score the prompt tokens of rows that asked for prompt logprobs."""
        batch, bs, n = self.batch, self.block_size, self.batch.num_rows
        q_len = batch.q_len[:n]
        num_tokens = int(q_len.sum()) if n else 0
        if num_tokens == 0:
            return [], []
        computed = batch.num_computed[:n]
        end = computed + q_len
        for bad, why in ((end > batch.num_tokens[:n], "tokens scheduled past the known tokens"),
                         (batch.num_blocks[:n] * bs < end, "too few blocks")):
            if bad.any():
                row = int(bad.argmax())
                raise ValueError(f"request {batch.request_ids[row]!r}: {why}: {int(q_len[row])} tokens scheduled "
                                 f"from {int(computed[row])}, {int(batch.num_tokens[row])} tokens known, "
                                 f"{int(batch.num_blocks[row])} blocks of {bs}")
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_len, out=query_start_loc[1:])
        seq_idx = np.repeat(np.arange(n), q_len)
        positions = np.arange(num_tokens) - query_start_loc[seq_idx] + computed[seq_idx]
        input_ids = batch.token_ids[seq_idx, positions].astype(np.int64)
        slot_mapping = batch.block_table[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        sample_rows = np.flatnonzero((q_len > 0) & (end == batch.num_tokens[:n]))
        logits_indices = query_start_loc[1:][sample_rows] - 1
        # position p's logits predict token p + 1: score the prompt tokens this chunk predicts
        scored = np.flatnonzero((batch.num_prompt_logprobs[:n] >= 0) & (q_len > 0) & (computed < batch.num_prompt[:n] - 1))
        spans = [(int(r), int(computed[r]) + 1, int(min(end[r], batch.num_prompt[r] - 1) - computed[r]))
                 for r in scored]  # (row, first prompt token scored, count): rows that asked only
        if spans:
            logits_indices = np.concatenate([np.arange(query_start_loc[r], query_start_loc[r] + c)
                                             for r, _, c in spans] + [logits_indices])
        input_ids, positions, slot_mapping, logits_indices = self._stage(
            torch.int64, [input_ids, positions, slot_mapping, logits_indices])
        seq_lens, qsl = self._stage(torch.int32, [end.astype(np.int32), query_start_loc.astype(np.int32)])
        batch.flush_block_table()
        meta = AttentionMetadata(slot_mapping, batch.block_table_dev[:n], seq_lens, qsl,
                                 max_query_len=int(q_len.max()), max_seq_len=int(end.max()))
        if self.graphs is not None and cache is self.cache and num_tokens == n and meta.max_query_len == 1 \
                and self.graphs.padded_size(n) is not None:  # decode-only: replay a captured forward
            logits = self.graphs.run(input_ids, positions, meta)[logits_indices]
        else:
            logits = self.model(input_ids, positions, meta, cache.k_caches, cache.v_caches, logits_indices)
        batch.num_computed[:n] = end
        num_scored = sum(c for _, _, c in spans)
        prompt = self._prompt_logprobs(logits[:num_scored], spans) if spans else []
        if sample_rows.size == 0:
            return [], prompt
        out = self.sampler.sample(logits[num_scored:], batch.sampling_batch(sample_rows))
        batch.record_sampled(sample_rows, np.asarray(out.token_ids, dtype=np.int64))
        ids = batch.request_ids
        return [SampledToken(ids[r], t, lp, top, rank) for r, t, lp, rank, top in
                zip(sample_rows.tolist(), out.token_ids, out.logprobs, out.ranks, out.top_logprobs)], prompt

    def _prompt_logprobs(self, logits: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[PromptLogprobs]:
        """One PromptLogprobs per (row, first token, count) span; ``logits`` ``[sum of counts, vocab]`` in span order."""
        batch = self.batch
        targets = np.concatenate([batch.token_ids[r, first:first + c] for r, first, c in spans]).astype(np.int64)
        k = int(max(batch.num_prompt_logprobs[r] for r, _, _ in spans))
        lps, ranks, tops = prompt_logprobs(logits, torch.from_numpy(targets).to(logits.device), k)
        out, at = [], 0
        for r, first, c in spans:
            want = int(batch.num_prompt_logprobs[r])
            out.append(PromptLogprobs(batch.request_ids[r], first, lps[at:at + c], ranks[at:at + c],
                                      [t[:want] for t in tops[at:at + c]]))
            at += c
        return out
