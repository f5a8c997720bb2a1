"""Write a ~200M-parameter Llama-architecture model directory for weights-bound benchmarks (dummy weights).

16 layers, hidden 1024, intermediate 2816, 16 heads (GQA 4 KV heads), stories260K's 512-token
tokenizer (copied from the shared test model: ``$PAGEDKV_STORIES260K``, else
``../shared/models/stories260K`` next to the repository, as the tests find it). No weights are
written unless ``--weights``: serve it with ``--load-format dummy``. At fp32 a decode step reads
~0.8 GB of weights, so reading weights, not per-request work, dominates a step, as on a GPU. ``--weights`` also writes random weights
(``model.safetensors``, 0.7 GB: ``--load-format dummy``'s, seed 0) for servers that cannot make
their own, such as ``transformers serve``.

    python ops/weights_bound_model.py /tmp/llama-200m             # prints the directory
    python ops/weights_bound_model.py /tmp/llama-200m-w --weights
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

STORIES = Path(os.environ.get("PAGEDKV_STORIES260K")
               or Path(__file__).resolve().parents[2] / "shared/models/stories260K")
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
          "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
          "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float32"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default="llama-200m", help="the directory to write")
    p.add_argument("--weights", action="store_true", help="also write random weights (model.safetensors)")
    args = p.parse_args()
    if not (STORIES / "tokenizer.json").is_file():
        p.error(f"no stories260K tokenizer at {STORIES} (set PAGEDKV_STORIES260K to the checkpoint directory)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(STORIES / name, out / name)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    if args.weights:  # pagedkv's own dummy weights (seed 0), saved under the checkpoint's tensor names
        import torch
        from safetensors.torch import save_file

        from pagedkv.common.config import EngineConfig, ModelConfig
        from pagedkv.worker.model_loader import checkpoint_tensors, load_model

        model = load_model(ModelConfig.load(str(out)), EngineConfig(load_format="dummy", seed=0), torch.device("cpu"),
                           torch.float32)
        tensors = {name: t.contiguous() for name, t in checkpoint_tensors(model).items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(out)


if __name__ == "__main__":
    main()
