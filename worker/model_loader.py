"""Build a `LlamaForCausalLM` from a Hugging Face checkpoint directory or from seeded random weights."""

from __future__ import annotations

import torch
from safetensors import safe_open

from pagedkv.common.config import EngineConfig, ModelConfig, weight_files
from pagedkv.kernels import select_backend
from pagedkv.worker.model import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config/flag name ("float32", "float16", "bfloat16"). Raises ValueError otherwise."""
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: float32, float16, bfloat16)") from None


def load_model(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device,
               dtype: torch.dtype) -> LlamaForCausalLM:
    """The model on ``device`` in ``dtype``, in eval mode, with its attention backend chosen once.

    The backend is ``engine_config.attention_backend`` ("triton" | "torch"), else Triton on CUDA and
    the PyTorch reference on CPU (`kernels.select_backend`); ``model.kernels`` holds it.

    ``load_format`` "auto" reads every ``*.safetensors`` shard in ``model_config.path`` (HF names);
    "dummy", or the embedded default (path None), draws N(0, 0.02) weights from a generator
    seeded with ``engine_config.seed`` (norm weights 1), reproducible on a given device.
    Embeddings are tied when ``tie_word_embeddings`` is set or the checkpoint has no ``lm_head.weight``.
    Raises FileNotFoundError when the directory holds no safetensors file, ValueError for an
    unknown attention backend or load_format or a checkpoint tensor that is missing, unexpected or of the wrong shape.
    """
    with torch.device("meta"):  # no throwaway initialisation: storage is filled below
        model = LlamaForCausalLM(model_config, dtype, select_backend(engine_config.attention_backend, device))
    model.to_empty(device=device)
    fmt = engine_config.load_format
    if fmt == "dummy" or model_config.path is None:
        if model_config.tie_word_embeddings:
            model.tie_weights()
        _init_dummy(model, engine_config.seed, device)
    elif fmt == "auto":
        _load_safetensors(model, model_config)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {fmt!r}")
    return model.eval()


@torch.no_grad()
def _init_dummy(model: LlamaForCausalLM, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def _load_safetensors(model: LlamaForCausalLM, config: ModelConfig) -> None:
    files = weight_files(config.path)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
                    continue
                if name not in params:
                    raise ValueError(f"{file}: unexpected tensor {name!r} (not a Llama parameter this "
                                     "loader knows, e.g. a bias or another architecture)")
                tensor = f.get_tensor(name)
                if tensor.shape != params[name].shape:
                    raise ValueError(f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(params[name].shape)}")
                params[name].copy_(tensor)
                loaded.add(name)
    tie = config.tie_word_embeddings or "lm_head.weight" not in loaded
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tie else set()))
    if missing:
        raise ValueError(f"checkpoint {config.path!r} is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    if tie:
        model.tie_weights()
