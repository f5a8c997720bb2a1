"""Configuration shared by the control plane and the workers.

Two small objects: `ModelConfig` (the architecture, read from a Hugging Face ``config.json``) and
`EngineConfig` (everything the ``pagedkv serve`` flags set). Both are msgspec Structs so they travel
to workers unchanged. Nothing here imports torch.
"""

from __future__ import annotations

import glob
import json
import os

import msgspec

# The embedded default: a small Llama-architecture model with seeded random weights and a
# byte-level tokenizer (256 byte tokens + <s> + </s>), so `pagedkv serve` runs with nothing
# downloaded. Its outputs are noise by construction; the log and /v1/models say so.
EMBEDDED_MODEL_NAME = "pagedkv-embedded-random"
EMBEDDED_HF_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 258,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

# --kv-cache-dtype values (vLLM's): auto = the model's dtype; fp8 = fp8_e4m3 (OCP FP8 E4M3, 3 mantissa
# bits, range ±448); fp8_e5m2 (2 mantissa bits, range ±57344). An fp8 pool stores K and V in one byte
# per element with one scale per layer for K and one for V (``k_scale``, ``v_scale``).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV pool's element type name: ``dtype`` (the model's, resolved) for auto, fp8 -> fp8_e4m3.

    Raises ValueError for a value outside `KV_CACHE_DTYPES`.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return dtype if kv_cache_dtype == "auto" else {"fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)


# RoPE variants `worker.model.rope_inv_freq` computes ("rope_type" of rope_scaling / rope_parameters)
ROPE_TYPES = ("default", "linear", "llama3")


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json of either transformers format.

    Before v5: top-level ``rope_theta`` and ``rope_scaling`` (None or a dict with ``rope_type``, or
    the older ``type``). The scaling returned is None for plain RoPE, else a dict whose
    ``rope_type`` is set, the one place the type is read.
    From v5 on, one ``rope_parameters`` dict holds ``rope_theta``, ``rope_type`` and the scaling's
    numbers; a checkpoint saved by v5 has no top-level ``rope_theta``, and reading only that would
    silently rotate with the wrong frequencies (Llama 3: 500,000, not 10,000). Raises ValueError
    for a type outside `ROPE_TYPES`, here rather than when the worker builds the model.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta, scaling = float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES[1:])})")
    return theta, (None if kind == "default" else {**scaling, "rope_type": kind})


# what from_hf_dict accepts ("LLaMAForCausalLM": the spelling of early converted checkpoints, which vLLM accepts too)
_MODEL_TYPES = ("llama", "mistral")
_ARCHITECTURES = ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM")


class ModelConfig(msgspec.Struct, frozen=True):
    """The architecture numbers of a Llama-family model (HF ``LlamaConfig`` field names).

    ``path`` is the checkpoint directory, or None for the embedded default.
    ``eos_token_ids`` lists every token that ends generation (HF allows one id or a list).
    """

    name: str
    path: str | None
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str
    sliding_window: int | None = None  # Mistral's local attention span (tokens); None: full attention

    @classmethod
    def from_hf_dict(cls, hf: dict, name: str, path: str | None) -> "ModelConfig":
        """Build from a parsed HF ``config.json``.

        Raises ValueError when the architecture is not Llama-family (model_type, a hidden_act other
        than silu, a RoPE scaling outside `ROPE_TYPES`, attention or MLP biases), a required field is
        missing, or a size is not a positive integer. A field set to null counts as absent.
        """
        # an explicit null is the field left out (its default): a null rms_norm_eps or
        # max_position_embeddings was a TypeError mid-step, a null rope_theta one at load
        hf = {k: v for k, v in hf.items() if v is not None}
        # Both fields must say Llama or Mistral (same weights): a Qwen2 config with architectures
        # relabelled LlamaForCausalLM still has Qwen2's biases, and model_type "llama" with
        # Qwen2ForCausalLM is not ours either. Absent fields are taken as Llama.
        model_type, archs = hf.get("model_type", "llama"), hf.get("architectures") or ["LlamaForCausalLM"]
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported: pagedkv serves "
                             f"Llama-family checkpoints (model_type one of {', '.join(_MODEL_TYPES)})")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in _ARCHITECTURES:
            raise ValueError(f"config.json architectures {archs!r} is not supported: pagedkv serves "
                             f"Llama-family checkpoints (architectures [one of {', '.join(_ARCHITECTURES)}])")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported: Llama-family MLPs use silu")
        for key in ("attention_bias", "mlp_bias"):  # else refused only at weight load, never with dummy weights
            if hf.get(key):
                raise ValueError(f"{key} true is not supported: pagedkv's Llama layers have no biases")
        eps = hf.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < float("inf"):
            raise ValueError(f"rms_norm_eps must be a positive number, got {eps!r}")
        rope_theta, rope_scaling = _rope(hf)
        # the sizes the model is built from: a 0, a negative or a string here was a ZeroDivisionError
        # traceback or a worker's shape error instead of a line naming the field
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            v = hf.get(key)
            if v is None and key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "vocab_size"):
                raise ValueError(f"config.json is missing required field {key!r}")
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{key} must be a positive integer, got {v!r}")
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if heads and kv_heads and heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if heads and not hf.get("head_dim") and hf.get("hidden_size", 0) % heads:
            raise ValueError(f"hidden_size {hf['hidden_size']} is not a multiple of num_attention_heads {heads} "
                             "(and there is no head_dim)")
        if (head_dim := hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) % 2:
            raise ValueError(f"head_dim {head_dim} is odd: RoPE rotates pairs of dimensions")  # was an unclear error mid-step
        try:
            heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            eos = hf.get("eos_token_id")
            return cls(
                name=name,
                path=path,
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hidden // heads,
                vocab_size=hf["vocab_size"],
                max_position_embeddings=hf.get("max_position_embeddings", 2048),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
                sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None

    @classmethod
    def load(cls, path: str | None) -> "ModelConfig":
        """Read ``PATH/config.json`` (or a config.json file path); None gives the embedded default.

        ``eos_token_ids`` joins config.json's and generation_config.json's. Raises FileNotFoundError
        when there is no config.json, ValueError naming the file when it is not valid JSON or not
        Llama-family.
        """
        if path is None:
            return cls.from_hf_dict(EMBEDDED_HF_CONFIG, EMBEDDED_MODEL_NAME, None)
        file = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {file!r}: --model must be a Hugging Face checkpoint directory")
        hf = read_json(file)
        if not isinstance(hf, dict):
            raise ValueError(f"{file}: not a JSON object")
        model_dir = os.path.dirname(os.path.abspath(file))
        # generation_config.json may name more end-of-sequence ids (Llama 3 instruct): they end
        # generation too, so the tokenizer and the worker's min_tokens mask see the same list.
        gen = read_json(os.path.join(model_dir, "generation_config.json")) if file.endswith("config.json") else {}
        gen_eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        for e in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
            if e not in eos:
                eos.append(e)
        try:
            return cls.from_hf_dict({**hf, "eos_token_id": eos}, os.path.basename(model_dir.rstrip("/")), model_dir)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    def shard(self, world_size: int) -> "ModelConfig":
        """The part of the model each of ``world_size`` tensor-parallel ranks holds (Megatron-LM, Shoeybi et al. 2019).

        Attention heads and the MLP's intermediate size are split evenly; KV heads are split when
        ``world_size`` divides them and replicated (each rank holds one) when ``world_size`` is a multiple
        of them; the embedding, the LM head and the norms are replicated. Every rank holds the same
        counts, so ``shard(n).kv_bytes_per_token`` and ``shard(n).weight_bytes`` are per-device figures.
        Raises ValueError naming what ``world_size`` does not divide.
        """
        if world_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {world_size}")
        if world_size == 1:
            return self
        heads, kv, inter = self.num_attention_heads, self.num_key_value_heads, self.intermediate_size
        if heads % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's {heads} attention heads")
        if kv % world_size and world_size % kv:
            raise ValueError(f"tensor parallel size {world_size} neither divides the model's {kv} KV heads "
                             "nor is a multiple of them (to replicate each on the same number of ranks)")
        if inter % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's intermediate_size {inter}")
        return msgspec.structs.replace(self, num_attention_heads=heads // world_size,
                                       num_key_value_heads=max(1, kv // world_size),
                                       intermediate_size=inter // world_size)

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """Bytes of K and V state one token occupies across all layers (2 x layers x kv heads x head_dim x dtype)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * _DTYPE_BYTES[kv_dtype]

    def weight_bytes(self, dtype: str) -> int:
        """Bytes of the model weights in ``dtype`` (embedding, untied lm_head, attention, MLP, norms)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return (embed + L * per_layer + h) * _DTYPE_BYTES[dtype]


class EngineConfig(msgspec.Struct):
    """Everything `pagedkv serve` is configured with (vLLM flag names and meanings).

    Sizes: ``block_size`` in tokens; ``num_gpu_blocks`` in blocks (None: sized from memory);
    ``cpu_kv_cache_space`` and ``swap_space`` in GiB (the host swap pool's ``num_cpu_blocks`` is
    ``swap_space`` / the worker's KV bytes per block); ``worker_timeout`` in seconds.
    ``attention_backend``: "triton" | "cpu" | "torch", or None for Triton on CUDA and cpu elsewhere; the
    worker picks the kernels once from it (`kernels.select_backend`).
    """

    model: str | None = None
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space: float = 1.0
    swap_space: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # sha256 | xxhash
    max_n: int = 16
    max_choices: int = 128  # n x prompts in one API request (OpenAI's bound on n)
    max_stop: int = 4  # stop strings per request (OpenAI's bound)
    max_logprobs: int = 20
    worker_timeout: float = 120.0
    max_worker_restarts: int = 5  # consecutive restarts of a failed worker before the engine gives up (0: none)
    attention_backend: str | None = None  # None: triton on CUDA, cpu elsewhere
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (they are captured on CUDA by default)
    async_scheduling: bool = True  # schedule step N + 1 while the worker computes N (scheduler.engine)
    stream_interval: int = 1  # output tokens per streamed delta after the first (vLLM's --stream-interval)
    preemption_mode: str = "auto"  # recompute | swap | auto (cheaper per victim; scheduler.preemption)
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower ``priority`` value first, as vLLM)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL; tracing also follows OTEL_* variables
    served_model_name: list[str] = []  # names the API answers to (the first in responses); []: the model's
    chat_template: str | None = None  # a jinja2 chat template overriding the checkpoint's (--chat-template)
    tensor_parallel_size: int = 1  # worker ranks, each holding 1/N of the heads and of the MLP (ModelConfig.shard)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2 (KV_CACHE_DTYPES)
    # fp8 scales (dequantized = stored x scale), the same for every layer; None: the checkpoint's
    # per-layer k_scale/v_scale, else computed from the first prefill
    k_scale: float | None = None
    v_scale: float | None = None

    def __post_init__(self) -> None:
        # vLLM's --dtype aliases: LLM(dtype="half") (common in ported code) was refused by validate()
        if isinstance(self.dtype, str):
            self.dtype = {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype)

    def validate(self) -> None:
        """Check every field's type and range as the ``pagedkv serve`` flags do, before a worker starts.

        Raises TypeError("<field>: ...") for a value of the wrong type and ValueError("<field>: ...")
        for one out of range or not among the choices (the `LLM` constructor's engine arguments
        come here unchecked by argparse).
        """
        check_field_types(self, TypeError)

        def check(field: str, ok: bool, want: str) -> None:
            if not ok:
                raise ValueError(f"{field}: must be {want}, got {getattr(self, field)!r}")

        for field, lo in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_n", 1), ("max_choices", 1),
                          ("max_stop", 0), ("max_logprobs", 0), ("max_worker_restarts", 0),
                          ("stream_interval", 1), ("tensor_parallel_size", 1)):
            check(field, getattr(self, field) >= lo, f">= {lo}")
        for field in ("num_gpu_blocks", "max_model_len"):
            check(field, getattr(self, field) is None or getattr(self, field) >= 1, "None or >= 1")
        b = self.block_size
        check("block_size", 1 <= b <= 256 and not b & (b - 1), "a power of two between 1 and 256")
        check("seed", 0 <= self.seed < 2**63, "between 0 and 2**63 - 1")
        check("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "> 0 and <= 1")
        check("cpu_kv_cache_space", 0 < self.cpu_kv_cache_space < float("inf"), "> 0 (GiB) and finite")
        check("swap_space", 0 <= self.swap_space < float("inf"), ">= 0 (GiB) and finite")
        check("worker_timeout", 0 < self.worker_timeout < float("inf"), "> 0 (seconds) and finite")
        for field in ("k_scale", "v_scale"):
            v = getattr(self, field)
            check(field, v is None or 0 < v < float("inf"), "None or > 0 and finite")
        for field, choices in (("load_format", ("auto", "dummy")), ("dtype", ("auto", "float32", "float16", "bfloat16")),
                               ("device", ("auto", "cpu", "cuda")), ("prefix_caching_hash_algo", ("sha256", "xxhash")),
                               ("attention_backend", (None, "cpu", "torch", "triton")),
                               ("preemption_mode", ("recompute", "swap", "auto")),
                               ("scheduling_policy", ("fcfs", "priority")), ("kv_cache_dtype", KV_CACHE_DTYPES)):
            check(field, getattr(self, field) in choices, f"one of {', '.join(map(str, choices))}")


def check_field_types(struct: msgspec.Struct, error: type[Exception]) -> None:
    """Raise ``error("<field>: <why>")`` for the first field of ``struct`` whose value is not of its
    declared type (a Struct's constructor checks none; msgspec does, as it decodes the wire)."""
    try:
        msgspec.convert(msgspec.structs.asdict(struct), type(struct))
    except msgspec.ValidationError as e:
        where = str(e).rpartition("`$.")[2].split("`")[0].split("[")[0]
        raise error(f"{where}: {str(e).split(' - at ')[0]}") from None


def read_json(path: str):
    """Parse a JSON file; {} when it does not exist. Raises ValueError naming the file when it is not JSON."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None


def weight_files(model_dir: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` files, sorted: those ``model.safetensors.index.json`` maps
    tensors to when it exists (as transformers and vLLM read them), else ``model.safetensors`` alone when
    it exists (as transformers reads it), else every one in the directory.

    The index matters where a directory holds other weights beside the Hugging Face shards (Mistral's
    repositories add ``consolidated.safetensors`` in Mistral's own names). Raises FileNotFoundError
    naming the directory when none or a file the index names is absent, ValueError naming the index
    when it is not valid JSON.
    """
    index = read_json(os.path.join(model_dir, "model.safetensors.index.json"))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if isinstance(weight_map, dict) and weight_map:
        files = sorted({os.path.join(model_dir, f) for f in weight_map.values()})
        if absent := [f for f in files if not os.path.isfile(f)]:
            raise FileNotFoundError(f"{model_dir}: model.safetensors.index.json names {len(absent)} missing "
                                    f"file(s): {', '.join(os.path.basename(f) for f in absent[:3])}")
    elif os.path.isfile(single := os.path.join(model_dir, "model.safetensors")):
        files = [single]  # transformers loads only this one: others beside it (adapter_model.safetensors) are not the model's
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (use --load-format dummy for random weights)")
    return files


def resolve_max_model_len(model: ModelConfig, requested: int | None) -> int:
    """The context limit in tokens: the model's limit unless a smaller one is asked.

    The model's limit is ``max_position_embeddings``, or its ``sliding_window`` when that is smaller:
    pagedkv attends to the whole context, which equals windowed attention only while the context
    fits in the window (vLLM's ``--disable-sliding-window`` caps the length the same way).
    Raises ValueError when ``requested`` exceeds the model's limit or is < 1.
    """
    limit, why = model.max_position_embeddings, "max_position_embeddings"
    if model.sliding_window is not None and model.sliding_window < limit:
        limit, why = model.sliding_window, "sliding_window (pagedkv attends to the whole context, not a window)"
    if requested is None:
        return limit
    if requested < 1 or requested > limit:
        raise ValueError(f"--max-model-len {requested} must be between 1 and the model's {why}: {limit}")
    return requested


def add_rank_arguments(parser) -> None:
    """Declare a worker's ``--rank``, ``--world-size`` and ``--dist-init-method`` flags on an argparse parser.

    Defaults follow the torchrun environment (RANK, WORLD_SIZE; MASTER_ADDR and MASTER_PORT make the
    rendezvous ``env://``, which joins torchrun's own store), so ``torchrun --nproc-per-node N -m
    pagedkv.worker --connect ADDR`` starts a group of N ranks. Call `check_rank_arguments` after parsing.
    """
    env = os.environ
    master = "env://" if "MASTER_ADDR" in env and "MASTER_PORT" in env else None
    g = parser.add_argument_group("tensor parallelism (one process per rank)")
    g.add_argument("--rank", type=int, default=env.get("RANK", "0"), help="this worker's rank, 0..world size-1 (env RANK)")
    g.add_argument("--world-size", type=int, default=env.get("WORLD_SIZE", "1"),
                   help="ranks in the group: the control plane's --tensor-parallel-size (env WORLD_SIZE)")
    g.add_argument("--dist-init-method", default=master, metavar="tcp://HOST:PORT",
                   help="the group's rendezvous, where rank 0 listens; the same on every rank "
                        "(env://, i.e. MASTER_ADDR:MASTER_PORT, when torchrun set them)")


def check_rank_arguments(args, parser) -> None:
    """Reject inconsistent rank flags with an argparse error naming the flag."""
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        parser.error(f"--rank must be between 0 and --world-size - 1 ({args.world_size - 1}), got {args.rank}")
    if args.world_size > 1 and not (args.dist_init_method or "").startswith(("tcp://", "env://")):
        parser.error("--dist-init-method tcp://HOST:PORT (where rank 0 listens) is needed when --world-size > 1, "
                     f"got {args.dist_init_method!r}")
