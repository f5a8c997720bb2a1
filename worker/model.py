"""The Llama forward pass over a flat mixed batch, reading and writing a paged KV cache.

Architecture: Llama 2/3 (Touvron et al. 2023; Grattafiori et al. 2024) with Hugging Face
``LlamaForCausalLM`` parameter names, except that each layer's q/k/v_proj are one ``qkv_proj`` and its
gate/up_proj one ``gate_up_proj`` (one GEMM each; `model_loader` fills their row blocks from the
checkpoint's separate tensors). Prefill chunks and decode tokens of many sequences travel together
as one ``[num_tokens]`` batch; attention finds each sequence's context through its block table
(PagedAttention, Kwon et al., SOSP 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from pagedkv.common.config import ModelConfig
from pagedkv.kernels import fp8, reference
from pagedkv.worker.parallel import TensorParallel


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends to (see `kernels.reference`).

    slot_mapping: ``[num_tokens]`` int64, block_id * block_size + offset of each new token.
    block_tables: ``[num_seqs, max_blocks]`` int32. seq_lens: ``[num_seqs]`` int32, context length
    including the new tokens. query_start_loc: ``[num_seqs + 1]`` int32, cumulative new-token counts.
    max_query_len, max_seq_len: host-side upper bounds of q_len and seq_len over the batch (None:
    unknown), so kernels can skip the prefill launch on decode-only steps and size split-K by context.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int | None = None
    max_seq_len: int | None = None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` float32 on CPU (Su et al. 2021, RoFormer).

    ``rope_scaling`` of type "linear" divides every frequency by ``factor`` (position interpolation,
    Chen et al. 2023; HF's ``_compute_linear_scaling_rope_parameters``); "llama3" rescales the low and
    medium frequencies as Meta's Llama 3.1 reference and HF's ``_compute_llama3_parameters`` do.
    The type was checked against `common.config.ROPE_TYPES` when config.json was read. Raises
    ValueError for an entry missing one of its numbers (factor; for llama3 also low_freq_factor /
    high_freq_factor / original_max_position_embeddings).
    """
    d = config.head_dim
    # explicitly on CPU: under load_model's meta-device context, meta arithmetic imports torch._dynamo (~3 s)
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    try:
        factor = scaling["factor"]
        if kind == "linear":
            return inv / factor
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"rope_scaling of type {kind} is missing {e.args[0]!r}") from None
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)  # long wavelengths: divide
    smooth = (old_len / wavelen - low) / (high - low)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)  # interpolate in between
    return torch.where(medium, (1 - smooth) * inv / factor + smooth * inv, scaled)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) with a learned weight, by ``kernels.rms_norm``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, kernels: ModuleType = reference):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) over the paged cache, with ``kernels`` (a `kernels` backend).

    Q, K and V come from one GEMM: ``qkv_proj.weight`` is ``[(num_heads + 2 * num_kv_heads) * head_dim,
    hidden_size]``, the q_proj rows, then k_proj's, then v_proj's (the loader fills each from the
    checkpoint's separate tensors), and its output is split into views (as vLLM's QKVParallelLinear).
    Under tensor parallelism ``config`` is this rank's shard (`ModelConfig.shard`): Q/K/V are
    column-parallel (this rank's heads), o_proj row-parallel, followed by one all-reduce.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, kernels: ModuleType = reference,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False, dtype=dtype)
        self.scale = d ** -0.5
        # fp8 KV cache: dequantized = stored x scale (`kernels.fp8`); None until the checkpoint, a
        # flag or the first prefill sets it
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # views, rows strided
        q, k = self.kernels.rotary_embedding(q.view(n, self.num_heads, self.head_dim),
                                             k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        ks = vs = 1.0
        if fp8.is_fp8(k_cache.dtype):
            if self.k_scale is None or self.v_scale is None:  # calibrate on the first prefill
                # from the amax over all ranks' heads: a rank's own heads gave each rank another
                # scale, and -tp N another model than -tp 1 (every rank calibrates in the same step)
                amax = torch.stack([k.detach().abs().amax() if k.numel() else k.new_zeros(()),
                                    v.detach().abs().amax() if v.numel() else v.new_zeros(())]).float()
                amax = self.tp.all_reduce_max(amax)
                if self.k_scale is None:
                    self.k_scale = fp8.scale_for(amax[:1], k_cache.dtype)
                if self.v_scale is None:
                    self.v_scale = fp8.scale_for(amax[1:], v_cache.dtype)
            ks, vs = self.k_scale, self.v_scale
        self.kernels.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        o = self.kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, self.scale, None, meta.max_query_len,
                                         meta.max_seq_len, k_scale=ks, v_scale=vs)
        return self.tp.all_reduce(self.o_proj(o.view(n, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x)).

    gate and up come from one GEMM: ``gate_up_proj.weight`` is ``[2 * intermediate_size, hidden_size]``,
    the gate_proj rows, then up_proj's; its output's two halves are views.
    Under tensor parallelism gate/up are column-parallel, down row-parallel, followed by one all-reduce.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, kernels: ModuleType = reference,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        return self.tp.all_reduce(self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, kernels: ModuleType, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, kernels, tp)
        self.mlp = LlamaMLP(config, dtype, kernels, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, kernels: ModuleType, tp: TensorParallel):
        super().__init__()
        # replicated; built around an uninitialised weight: the loader fills it, and initialising it on
        # the meta device (load_model) would import torch._dynamo, ~3 s of every worker start
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, kernels, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, kernels)


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head. Build it with `worker.model_loader.load_model` (weights, tying).

    kernels: the attention backend, a module from `kernels.select_backend` (default: the PyTorch reference).
    tp: this rank's place in a tensor-parallel group; ``config`` is then the rank's shard
    (``full_config.shard(tp.world_size)``). The LM head is replicated, so every rank returns the same logits.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, kernels: ModuleType = reference,
                 tp: TensorParallel = TensorParallel()):
        super().__init__()
        rope_inv_freq(config)  # reject an incomplete rope_scaling at construction, not mid-step
        self.config = config
        self.kernels = kernels
        self.model = LlamaModel(config, dtype, kernels, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)  # replicated
        self._inv_freq: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (``tie_word_embeddings``)."""
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_scales(self) -> list[tuple[float | None, float | None]]:
        """Each layer's fp8 KV cache (k_scale, v_scale); None where not set yet."""
        return [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in self.model.layers]

    @kv_scales.setter
    def kv_scales(self, scales: list[tuple[float | None, float | None]]) -> None:
        for layer, (k, v) in zip(self.model.layers, scales, strict=True):
            layer.self_attn.k_scale, layer.self_attn.v_scale = k, v

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run every new token through the model; return float32 logits ``[len(logits_indices), vocab]``.

        input_ids, positions: ``[num_tokens]`` int64 (position = the token's index in its sequence).
        k_caches, v_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer;
        the new tokens' K/V are written into them at ``meta.slot_mapping``.
        logits_indices: ``[num_sampled]`` int64 rows of the batch to project to the vocabulary
        (the last scheduled token of each sequence that samples), so the LM head runs only there.
        """
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config).to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.model.embed_tokens(input_ids)
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()
