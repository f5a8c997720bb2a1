"""Build a `LlamaForCausalLM` from a Hugging Face checkpoint directory or from seeded random weights."""

from __future__ import annotations

import re

import torch
from safetensors import safe_open

from pagedkv.common.config import EngineConfig, ModelConfig, weight_files
from pagedkv.kernels import select_backend
from pagedkv.worker.model import LlamaForCausalLM
from pagedkv.worker.parallel import TensorParallel

# fp8 KV cache scales as vLLM's fp8 checkpoints name them: self_attn.k_scale / v_scale, or the
# older self_attn.k_proj.output_scale / v_proj.output_scale (one value per layer)
_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(?:(k|v)_proj\.output_scale))")

_ROPE_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config/flag name ("float32", "float16", "bfloat16"). Raises ValueError otherwise."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: float32, float16, bfloat16)") from None


def load_model(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
               dtype: torch.dtype, tp: TensorParallel = TensorParallel()) -> LlamaForCausalLM:
    """The model (this rank's shard of it under tensor parallelism ``tp``) on ``device`` in ``dtype``, in
    eval mode, with its attention backend chosen once.

    The backend is ``engine_config.attention_backend`` ("triton" | "cpu" | "torch"), else Triton on
    CUDA and `kernels.cpu_kernels` elsewhere (`kernels.select_backend`); ``model.kernels`` holds it.

    ``load_format`` "auto" reads the checkpoint's ``*.safetensors`` shards (`common.config.weight_files`: those
    ``model.safetensors.index.json`` names, else every one in ``model_config.path``; HF names);
    "dummy", or the embedded default (path None), draws N(0, 0.02) weights from a generator
    seeded with ``engine_config.seed`` (norm weights 1), reproducible on a given device.
    Embeddings are tied when the checkpoint has no ``lm_head.weight``, or has one equal to the embedding
    and ``tie_word_embeddings`` is set (a different one is kept, as transformers v5 keeps it; dummy
    weights follow ``tie_word_embeddings``).
    The checkpoint's q/k/v_proj and gate/up_proj fill their row blocks of the fused ``qkv_proj`` and
    ``gate_up_proj`` (`checkpoint_tensors`).
    A rank reads only its slices of the split tensors (safetensors ``get_slice``); dummy weights are
    drawn whole, one tensor at a time, and sliced, so every tensor-parallel size gets the same model.
    An fp8 checkpoint's per-layer ``self_attn.k_scale``/``v_scale`` (or ``k_proj``/``v_proj.output_scale``)
    become the attention layers' KV cache scales.
    Raises FileNotFoundError when the directory holds no safetensors file, ValueError for an
    unknown attention backend or load_format or a checkpoint tensor that is missing, unexpected or of the wrong shape.
    """
    with torch.device("meta"):  # no throwaway initialisation: storage is filled below
        model = LlamaForCausalLM(model_config.shard(tp.world_size), dtype,
                                 select_backend(engine_config.attention_backend, device), tp)
        full_shapes = {name: t.shape for name, t in checkpoint_tensors(LlamaForCausalLM(model_config, dtype)).items()}
    model.to_empty(device=device)
    fmt = engine_config.load_format
    if fmt == "dummy" or model_config.path is None:
        if model_config.tie_word_embeddings:
            model.tie_weights()
        _init_dummy(model, engine_config.seed, device, full_shapes, model_config, tp)
    elif fmt == "auto":
        _load_safetensors(model, model_config, full_shapes, tp)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {fmt!r}")
    return model.eval()


# each fused projection of `LlamaForCausalLM` and the checkpoint's (HF) projections it stacks, in row order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Each checkpoint (HF) tensor name -> the tensor of ``model`` it fills, in the model's parameter order.

    That is the parameter of the same name, except in the fused projections (`FUSED`): ``q_proj.weight``,
    ``k_proj.weight`` and ``v_proj.weight`` are row blocks ``[num_heads * head_dim, hidden_size]``,
    ``[num_kv_heads * head_dim, hidden_size]`` and ``[num_kv_heads * head_dim, hidden_size]`` of
    ``qkv_proj.weight``; ``gate_proj.weight`` and ``up_proj.weight`` the halves ``[intermediate_size,
    hidden_size]`` of ``gate_up_proj.weight``. They are views: copying into one fills the parameter.
    The sizes are ``model.config``'s, so under tensor parallelism each block holds this rank's heads
    or channels. A tied LM head is listed once, as the embedding.
    """
    c = model.config
    q, kv, i = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    rows = {"qkv_proj": [q, kv, kv], "gate_up_proj": [i, i]}
    tensors = {}
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in FUSED:
            for part, block in zip(FUSED[proj], p.split(rows[proj]), strict=True):
                tensors[f"{parent}.{part}.{leaf}"] = block
        else:
            tensors[name] = p
    return tensors


def shard_of(name: str, config: ModelConfig, tp: TensorParallel) -> tuple[int, range] | None:
    """(dimension, indices) of the full checkpoint tensor ``name`` (an HF name) that rank ``tp.rank`` holds;
    None: all of it.

    Column-parallel q/k/v/gate/up split their output rows, row-parallel o/down their input columns
    (Megatron-LM); everything else (embedding, LM head, norms) is replicated.
    """
    if tp.world_size == 1:
        return None
    d, proj = config.head_dim, name.rsplit(".", 2)[-2]
    if proj in ("q_proj", "o_proj"):
        heads = tp.q_heads(config)
        return (0 if proj == "q_proj" else 1), range(heads.start * d, heads.stop * d)
    if proj in ("k_proj", "v_proj"):
        heads = tp.kv_heads(config)
        return 0, range(heads.start * d, heads.stop * d)
    if proj in ("gate_proj", "up_proj", "down_proj"):
        return (1 if proj == "down_proj" else 0), tp.intermediate(config)
    return None


def _take(tensor, shard: tuple[int, range] | None):
    """``tensor[shard]``: a torch tensor or a safetensors slice (which then reads only those bytes)."""
    if shard is None:
        return tensor[:]
    dim, idx = shard
    return tensor[idx.start:idx.stop] if dim == 0 else tensor[:, idx.start:idx.stop]


@torch.no_grad()
def _init_dummy(model: LlamaForCausalLM, seed: int, device: torch.device, full_shapes: dict,
                config: ModelConfig, tp: TensorParallel) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in checkpoint_tensors(model).items():  # in the checkpoint's order, the tied LM head once
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:  # the whole tensor, then this rank's slice: the same weights at every tensor-parallel size
            full = torch.empty(full_shapes[name], dtype=p.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            p.copy_(_take(full, shard_of(name, config, tp)))


@torch.no_grad()
def _load_safetensors(model: LlamaForCausalLM, config: ModelConfig, full_shapes: dict, tp: TensorParallel) -> None:
    files = weight_files(config.path)
    params = checkpoint_tensors(model)
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                # RoPE buffers some exporters saved (inv_freq: older transformers; cos/sin_cached:
                # ColossalAI): recomputed from the config, as transformers and vLLM skip them
                if name.endswith(_ROPE_BUFFERS):
                    continue
                if m := _KV_SCALE.fullmatch(name):  # an fp8 checkpoint's KV cache scales
                    attn = model.model.layers[int(m.group(1))].self_attn
                    setattr(attn, f"{m.group(2) or m.group(3)}_scale", float(f.get_tensor(name).float().reshape(-1)[0]))
                    continue
                if name not in params:
                    raise ValueError(f"{file}: unexpected tensor {name!r} (not a Llama parameter this "
                                     "loader knows, e.g. a bias or another architecture)")
                stored = f.get_slice(name)
                if tuple(stored.get_shape()) != tuple(full_shapes[name]):
                    raise ValueError(f"{file}: tensor {name!r} has shape {tuple(stored.get_shape())}, "
                                     f"config.json implies {tuple(full_shapes[name])}")
                params[name].copy_(_take(stored, shard_of(name, config, tp)))
                loaded.add(name)
    # tie_word_embeddings ties only an LM head the checkpoint lacks or stores equal to the embedding:
    # stored different values are the trained head, and transformers (v5) keeps them untied too
    tie = "lm_head.weight" not in loaded or (config.tie_word_embeddings and torch.equal(
        model.lm_head.weight, model.model.embed_tokens.weight))
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tie else set()))
    if missing:
        raise ValueError(f"checkpoint {config.path!r} is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if tie:
        model.tie_weights()
