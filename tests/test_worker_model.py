"""The worker's model runner reproduces the golden greedy output of stories260K however the plan
splits, batches, places, copies or swaps the request's KV blocks. Driven with StepPlans, no ZMQ."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
import torch
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS
from safetensors.torch import load_file, save_file

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len, weight_files
from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.worker.cache_engine import CacheEngine
from pagedkv.worker.model import rope_inv_freq
from pagedkv.worker.model_loader import load_model
from pagedkv.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=60)
CPU = torch.device("cpu")


class Driver:
    """A minimal control plane for tests: hands out blocks from a shuffled free list and builds plans."""

    def __init__(self, model_path, block_size=16, num_blocks=96, num_cpu_blocks=16, seed=0, shuffle=True,
                 dtype=torch.float32, attention_backend=None):
        cfg = EngineConfig(model=str(model_path), block_size=block_size, seed=seed, attention_backend=attention_backend)
        self.runner = ModelRunner(cfg, CPU, dtype)
        self.runner.init_cache(num_blocks, num_cpu_blocks)
        self.bs = block_size
        self.free = list(range(num_blocks))
        if shuffle:
            random.Random(1234).shuffle(self.free)
        self.reqs: dict[str, dict] = {}
        self.step_id = 0

    def add(self, rid, token_ids, num_prompt_tokens=None, sampling=GREEDY, blocks=(), num_computed=0):
        self.reqs[rid] = dict(tokens=list(token_ids), num_prompt=num_prompt_tokens or len(token_ids),
                              blocks=list(blocks), computed=num_computed, sent=False, sampling=sampling)

    def step(self, schedule: dict[str, int], **plan_fields) -> dict[str, int]:
        """Schedule ``schedule[rid]`` tokens of each request; return the sampled token per request."""
        new, cached = [], []
        for rid, n in schedule.items():
            r = self.reqs[rid]
            fresh = [self.free.pop() for _ in range(math.ceil((r["computed"] + n) / self.bs) - len(r["blocks"]))]
            r["blocks"] += fresh
            if not r["sent"]:
                new.append(NewRequestData(rid, r["tokens"], r["num_prompt"], r["blocks"], r["computed"], n,
                                          r["sampling"]))
                r["sent"] = True
            else:
                cached.append(CachedRequestData(rid, fresh, n))
            r["computed"] += n
        result = self.runner.execute(StepPlan(self.step_id, new, cached, **plan_fields))
        self.last = result
        self.step_id += 1
        assert result.error is None and result.forward_seconds > 0
        for s in result.sampled:
            self.reqs[s.request_id]["tokens"].append(s.token_id)
        return {s.request_id: s.token_id for s in result.sampled}

    def output(self, rid) -> list[int]:
        r = self.reqs[rid]
        return r["tokens"][r["num_prompt"]:]

    def decode(self, rids, steps):
        for _ in range(steps):
            self.step({rid: 1 for rid in rids})


@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_generation_equals_golden_on_scattered_blocks(stories260k, block_size):
    d = Driver(stories260k, block_size=block_size)
    d.add("a", GOLDEN_PROMPT_IDS)
    assert d.step({"a": 5}) == {"a": 432}
    d.decode(["a"], 59)
    assert d.output("a") == GOLDEN_OUTPUT_IDS
    blocks = d.reqs["a"]["blocks"]
    assert blocks != sorted(blocks)  # the table really is scattered
    assert len(blocks) == math.ceil(64 / block_size)


@pytest.mark.parametrize("chunks", [[3, 2], [1, 4], [4, 1]])
def test_chunked_prefill_equals_golden(stories260k, chunks):
    d = Driver(stories260k, block_size=8)
    d.add("a", GOLDEN_PROMPT_IDS)
    assert d.step({"a": chunks[0]}) == {}  # a partial prefill samples nothing
    assert d.step({"a": chunks[1]}) == {"a": 432}
    d.decode(["a"], 59)
    assert d.output("a") == GOLDEN_OUTPUT_IDS


def test_prefill_chunk_crossing_block_boundaries_equals_golden(stories260k):
    # prompt = golden prompt + 20 golden tokens; prefill chunks of 7, 7 and 11 cross 4-token blocks
    d = Driver(stories260k, block_size=4)
    d.add("a", GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:20])
    d.step({"a": 7})
    d.step({"a": 7})
    assert d.step({"a": 11}) == {"a": GOLDEN_OUTPUT_IDS[20]}
    d.decode(["a"], 39)
    assert d.output("a") == GOLDEN_OUTPUT_IDS[20:]


def test_two_requests_batched_with_mixed_prefill_and_decode(stories260k):
    d = Driver(stories260k, block_size=8)
    d.add("a", GOLDEN_PROMPT_IDS)
    d.add("b", GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:7])  # a longer prompt, admitted later
    d.step({"a": 5})
    d.step({"a": 1, "b": 6})  # decode of a + first prefill chunk of b
    assert d.step({"a": 1, "b": 6}) == {"a": GOLDEN_OUTPUT_IDS[2], "b": GOLDEN_OUTPUT_IDS[7]}
    d.decode(["b", "a"], 40)
    assert d.output("a") == GOLDEN_OUTPUT_IDS[:43]
    assert d.output("b") == GOLDEN_OUTPUT_IDS[7:48]


def test_resumed_request_reuses_copied_prefix_blocks(stories260k):
    d = Driver(stories260k, block_size=8)
    d.add("a", GOLDEN_PROMPT_IDS)
    d.step({"a": 5})
    d.decode(["a"], 19)  # 25 tokens known, 24 computed: blocks 0..2 are full
    src = d.reqs["a"]["blocks"][:3]
    dst = [d.free.pop() for _ in range(3)]  # never written: all zeros until the copy
    tokens = d.reqs["a"]["tokens"]
    d.add("b", tokens, num_prompt_tokens=5, blocks=dst, num_computed=24)
    # a is dropped and b starts from a's prefix in the same plan; the copy runs before the forward
    sampled = d.step({"b": 1}, finished_request_ids=["a"], blocks_to_copy=list(zip(src, dst)))
    assert sampled == {"b": GOLDEN_OUTPUT_IDS[20]}
    assert "a" not in d.runner.batch.row_of
    d.decode(["b"], 39)
    assert d.output("b") == GOLDEN_OUTPUT_IDS


def test_swapped_out_and_back_in_request_continues_golden(stories260k):
    d = Driver(stories260k, block_size=8)
    d.add("a", GOLDEN_PROMPT_IDS)
    d.step({"a": 5})
    d.decode(["a"], 14)  # 20 known, 19 computed in 3 blocks
    old = d.reqs["a"]["blocks"]
    host = [5, 2, 9]
    d.runner.execute(StepPlan(d.step_id, finished_request_ids=["a"], blocks_to_swap_out=list(zip(old, host))))
    d.step_id += 1
    cache = d.runner.cache
    for layer in range(len(cache.k_caches)):
        cache.k_caches[layer][old] = 0.0  # the device copies are gone
    new = [d.free.pop() for _ in range(3)]
    d.add("a2", d.reqs["a"]["tokens"], num_prompt_tokens=5, blocks=new, num_computed=19)
    sampled = d.step({"a2": 1}, blocks_to_swap_in=list(zip(host, new)))
    assert sampled == {"a2": GOLDEN_OUTPUT_IDS[15]}
    d.decode(["a2"], 44)
    assert d.output("a2") == GOLDEN_OUTPUT_IDS


def test_copy_blocks_copies_every_layer_k_and_v():
    config = ModelConfig.load(None)
    cache = CacheEngine(config, num_gpu_blocks=6, num_cpu_blocks=2, block_size=4, dtype=torch.float32, device=CPU)
    for layer in range(config.num_hidden_layers):
        cache.k_caches[layer].copy_(torch.randn_like(cache.k_caches[layer]))
        cache.v_caches[layer].copy_(torch.randn_like(cache.v_caches[layer]))
    before_k = [k.clone() for k in cache.k_caches]
    before_v = [v.clone() for v in cache.v_caches]
    cache.copy([(1, 4), (3, 0)])
    for layer in range(config.num_hidden_layers):
        for src, dst in [(1, 4), (3, 0)]:
            assert torch.equal(cache.k_caches[layer][dst], before_k[layer][src])
            assert torch.equal(cache.v_caches[layer][dst], before_v[layer][src])
        for untouched in (1, 2, 3, 5):
            assert torch.equal(cache.k_caches[layer][untouched], before_k[layer][untouched])


def test_seeded_sampling_is_the_same_alone_batched_and_after_recompute(stories260k):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20)
    alone = Driver(stories260k)
    alone.add("s", GOLDEN_PROMPT_IDS, sampling=seeded)
    alone.step({"s": 5})
    alone.decode(["s"], 19)

    batched = Driver(stories260k, seed=7)
    batched.add("s", GOLDEN_PROMPT_IDS, sampling=seeded)
    batched.add("x", GOLDEN_PROMPT_IDS, sampling=SamplingParams(temperature=1.0))
    batched.step({"x": 5})
    batched.step({"s": 3, "x": 1})
    batched.step({"x": 1, "s": 2})
    batched.decode(["x", "s"], 9)
    # recompute preemption: s restarts as a new request with prompt + generated tokens, nothing cached
    tokens = batched.reqs["s"]["tokens"]
    batched.add("s_resumed", tokens, num_prompt_tokens=5, sampling=seeded)
    batched.step({"s_resumed": len(tokens), "x": 1}, finished_request_ids=["s"])
    batched.decode(["s_resumed"], 9)
    assert batched.output("s_resumed") == alone.output("s")
    assert alone.output("s") != GOLDEN_OUTPUT_IDS[:20]  # it really sampled


def test_logprobs_are_raw_log_softmax_with_top_alternatives(stories260k):
    d = Driver(stories260k)
    result = d.runner.execute(StepPlan(0, [NewRequestData("a", GOLDEN_PROMPT_IDS, 5, [0], 0, 5,
                                                          SamplingParams(temperature=0.0, logprobs=3))]))
    s = result.sampled[0]
    assert s.token_id == 432
    assert [t for t, _ in s.top_logprobs] == [432, 383, 322]
    assert s.logprob == s.top_logprobs[0][1]
    assert s.logprob == pytest.approx(-0.0317029, abs=1e-5)
    assert s.top_logprobs[0][1] > s.top_logprobs[1][1] > s.top_logprobs[2][1]


def test_embedded_default_has_seeded_dummy_weights():
    runs = []
    for seed in (0, 0, 1):
        d = ModelRunner(EngineConfig(seed=seed), CPU, torch.float32)
        d.init_cache(8, 0)
        plan = StepPlan(0, [NewRequestData("r", [256, 72, 105], 3, [1], 0, 3,
                                           SamplingParams(temperature=0.0, logprobs=5))])
        runs.append(d.execute(plan).sampled[0].top_logprobs)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert all(math.isfinite(lp) and lp > -20 for _, lp in runs[0])  # sane logits from 0.02-scale weights


def test_loader_names_the_missing_or_mismatching_tensor(stories260k, tmp_path):
    config = ModelConfig.load(str(stories260k))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_model(ModelConfig.from_hf_dict(EMBEDDED_LIKE, "x", str(tmp_path)), EngineConfig(), CPU, torch.float32)
    tensors = load_file(str(stories260k / "model.safetensors"))
    broken = dict(tensors)
    del broken["model.layers.3.mlp.up_proj.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    bad = ModelConfig.from_hf_dict(HF_STORIES, "x", str(tmp_path))
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        load_model(bad, EngineConfig(), CPU, torch.float32)
    broken = dict(tensors, **{"model.norm.weight": torch.ones(65)})
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\)"):
        load_model(bad, EngineConfig(), CPU, torch.float32)
    # an untied checkpoint without lm_head falls back to the embedding
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(ModelConfig.from_hf_dict(dict(HF_STORIES, tie_word_embeddings=False), "x", str(tmp_path)),
                       EngineConfig(), CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert config.tie_word_embeddings


def test_llama3_rope_scaling_matches_the_reference_formula():
    hf = dict(EMBEDDED_LIKE, head_dim=128, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    inv = rope_inv_freq(ModelConfig.from_hf_dict(hf, "x", None))
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    wavelen = 2 * math.pi / base
    for i in range(64):
        w, f = wavelen[i].item(), base[i].item()
        if w < 8192 / 4:  # high frequencies unchanged
            expect = f
        elif w > 8192 / 1:  # low frequencies divided by the factor
            expect = f / 8
        else:
            s = (8192 / w - 1) / (4 - 1)
            expect = (1 - s) * f / 8 + s * f
        assert inv[i].item() == pytest.approx(expect, rel=1e-5)
    assert inv[0].item() == base[0].item() and inv[-1].item() == pytest.approx(base[-1].item() / 8)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(ModelConfig.from_hf_dict(dict(hf, rope_scaling={"rope_type": "yarn", "factor": 4}), "x", None))


def test_transformers_v5_rope_parameters_give_the_same_rotary_frequencies_as_the_legacy_fields():
    # transformers >= 5 saves one `rope_parameters` dict and no top-level rope_theta / rope_scaling
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, head_dim=128, rope_theta=500000.0, rope_scaling=scaling),
                                      "x", None)
    v5 = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, head_dim=128,
                                       rope_parameters=dict(scaling, rope_theta=500000.0)), "x", None)
    assert (v5.rope_theta, v5.rope_scaling) == (500000.0, scaling) == (legacy.rope_theta, legacy.rope_scaling)
    assert torch.equal(rope_inv_freq(v5), rope_inv_freq(legacy))
    plain = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1e6}), "x", None)
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    with pytest.raises(ValueError, match=r"^rope_scaling type 'yarn' is not supported \(supported: linear, llama3\)$"):
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, rope_parameters={"rope_type": "yarn", "factor": 4.0}), "x", None)


def test_a_sliding_window_smaller_than_the_positions_caps_max_model_len():
    # Mistral 7B v0.1: a 4,096-token window over 32,768 positions; full attention equals it inside the window
    mistral = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, model_type="mistral", max_position_embeddings=32768,
                                            sliding_window=4096), "x", None)
    assert resolve_max_model_len(mistral, None) == 4096
    assert resolve_max_model_len(mistral, 4096) == 4096
    with pytest.raises(ValueError, match=r"^--max-model-len 4097 must be between 1 and the model's sliding_window "
                                         r"\(pagedkv attends to the whole context, not a window\): 4096$"):
        resolve_max_model_len(mistral, 4097)
    for hf in (dict(sliding_window=None), dict(sliding_window=4096, use_sliding_window=False),  # Qwen2's switch
               dict(sliding_window=65536)):  # larger than the positions: no cap
        assert resolve_max_model_len(ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, max_position_embeddings=32768,
                                                                   **hf), "x", None), None) == 32768


def test_a_hidden_act_other_than_silu_is_refused_by_name():
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, hidden_act="gelu"), "x", None)
    assert ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, hidden_act="silu"), "x", None).hidden_size == 256


def test_biases_and_odd_head_dims_are_refused_when_config_json_is_read_and_a_null_field_takes_its_default():
    for key in ("attention_bias", "mlp_bias"):  # refused here, so --load-format dummy cannot run without them
        with pytest.raises(ValueError, match=f"^{key} true is not supported: pagedkv's Llama layers have no biases$"):
            ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, **{key: True}), "x", None)
    plain = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, attention_bias=False, mlp_bias=False), "x", None)
    nulls = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, rms_norm_eps=None, max_position_embeddings=None,
                                          rope_theta=None, tie_word_embeddings=None), "x", None)
    assert (nulls.rms_norm_eps, nulls.max_position_embeddings, nulls.rope_theta, nulls.tie_word_embeddings) == \
        (1e-6, 2048, 10000.0, False)
    assert plain.hidden_size == nulls.hidden_size == 256
    with pytest.raises(ValueError, match=r"^head_dim 7 is odd: RoPE rotates pairs of dimensions$"):
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, head_dim=7), "x", None)
    with pytest.raises(ValueError, match=r"^head_dim 9 is odd: RoPE rotates pairs of dimensions$"):
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, hidden_size=72), "x", None)  # 72 / 8 heads
    with pytest.raises(ValueError, match=r"^rms_norm_eps must be a positive number, got '1e-5'$"):
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, rms_norm_eps="1e-5"), "x", None)


HF_STORIES = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
              "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True}
EMBEDDED_LIKE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 8,
                 "num_key_value_heads": 4, "vocab_size": 258}


def test_profile_run_uses_a_temporary_cache_and_leaves_no_state(stories260k, monkeypatch):
    from pagedkv.worker.sampler import Sampler

    cfg = EngineConfig(model=str(stories260k), block_size=16, max_num_batched_tokens=700, max_model_len=512,
                       max_num_seqs=40)
    runner = ModelRunner(cfg, CPU, torch.float32)
    rows = []
    real = Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, batch: rows.append(
        (logits.shape[0], batch.prompt_mask is not None, batch.any_seeded, batch.any_unseeded)) or real(self, logits, batch))
    projected = []
    forward = runner.model.forward
    runner.model.forward = lambda *a: projected.append(a[-1].shape[0]) or forward(*a)
    assert runner.profile_run() == (32 + 12) * runner.kv_bytes_per_block  # sequences of 512 and 188 tokens
    # every token's logits, as a prompt-logprobs chunk of max_num_batched_tokens holds them (not 2 rows)
    assert projected == [700]
    # the forward's two sampled rows, then the sampler alone at max_num_seqs rows with every stage on
    assert rows == [(2, False, False, True), (40, True, True, True)]
    assert runner.batch.row_of == {} and runner.batch.num_rows == 0 and runner.cache is None


def test_bfloat16_weights_and_cache_still_pick_the_golden_first_token(stories260k):
    runner = ModelRunner(EngineConfig(model=str(stories260k)), CPU, torch.bfloat16)
    runner.init_cache(4, 0)
    assert runner.cache.k_caches[0].dtype == torch.bfloat16
    plan = StepPlan(0, [NewRequestData("a", GOLDEN_PROMPT_IDS, 5, [2], 0, 5, GREEDY)])
    assert runner.execute(plan).sampled[0].token_id == 432


def test_bfloat16_on_the_c_kernels_continues_as_on_the_pytorch_reference(stories260k):
    """bfloat16 through the cpu backend (C RMSNorm, RoPE, KV write and attention; PyTorch SwiGLU) and the
    torch backend (every op `kernels.reference`'s): the same 40 greedy tokens over scattered blocks."""
    outputs = {}
    for backend in ("cpu", "torch"):
        d = Driver(stories260k, dtype=torch.bfloat16, attention_backend=backend)
        assert d.runner.cache.k_caches[0].dtype == torch.bfloat16
        d.add("a", GOLDEN_PROMPT_IDS)
        d.step({"a": 5})
        d.decode(["a"], 39)
        outputs[backend] = d.output("a")
    assert outputs["cpu"] == outputs["torch"] == GOLDEN_OUTPUT_IDS[:40]  # and the float32 golden, this far


def test_attention_backend_is_chosen_once_at_load_from_the_config():
    from pagedkv import kernels
    from pagedkv.kernels import cpu_kernels, reference, torch_kernels

    assert kernels.select_backend(None, CPU) is cpu_kernels
    assert kernels.select_backend("cpu", CPU) is cpu_kernels
    assert kernels.select_backend("torch", torch.device("cuda")) is torch_kernels
    assert torch_kernels.paged_attention is reference.batched_paged_attention  # the oracle only in tests
    with pytest.raises(ValueError, match="attention backend must be one of"):
        kernels.select_backend("flash", CPU)
    runner = ModelRunner(EngineConfig(attention_backend="torch"), CPU, torch.float32)
    runner.init_cache(4, 0)
    attn = runner.model.model.layers[0].self_attn
    assert runner.model.kernels is torch_kernels and attn.kernels is torch_kernels
    assert runner.cache.kernels is torch_kernels


def test_decode_graphs_are_captured_only_over_the_triton_kernels():
    """The PyTorch backend's forward reads lengths on the host (a boolean mask in write_kv_cache, .tolist()
    in the batched attention): stream capture refuses that sync, so `--attention-backend torch` (or cpu)
    on CUDA decodes eagerly instead of failing at InitCache; --enforce-eager and -tp > 1 as before."""
    import types

    from pagedkv.kernels import cpu_kernels, torch_kernels
    from pagedkv.worker.model_runner import captures_decode_graphs

    cuda, triton = torch.device("cuda"), types.ModuleType("pagedkv.kernels.triton_kernels")
    assert captures_decode_graphs(cuda, False, 1, triton)
    assert not captures_decode_graphs(cuda, False, 1, torch_kernels)
    assert not captures_decode_graphs(cuda, False, 1, cpu_kernels)
    assert not captures_decode_graphs(cuda, True, 1, triton) and not captures_decode_graphs(cuda, False, 2, triton)
    assert not captures_decode_graphs(CPU, False, 1, triton)
    assert not ModelRunner(EngineConfig(attention_backend="torch"), CPU, torch.float32).capture_graphs


def _hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax ``[len(ids), vocab]`` for the token sequence ``ids`` (the oracle)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_transformers_across_chunks_and_a_batch(stories260k):
    prompt = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:20]  # 25 tokens over two blocks of 16
    d = Driver(stories260k)
    d.add("p", prompt, sampling=SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3))
    d.add("q", GOLDEN_PROMPT_IDS)  # batched alongside, asks for nothing
    spans = []
    for schedule in ({"p": 3, "q": 5}, {"p": 15, "q": 1}, {"p": 7, "q": 1}, {"p": 1, "q": 1}):
        d.step(schedule)
        spans += d.last.prompt_logprobs
    assert [(s.request_id, s.start, len(s.logprobs)) for s in spans] == [("p", 1, 3), ("p", 4, 15), ("p", 19, 6)]
    assert d.output("q") == GOLDEN_OUTPUT_IDS[:4]  # the extra logits rows change nothing for the others
    ref = _hf_logprobs(stories260k, prompt)
    got = [lp for s in spans for lp in s.logprobs]
    want = ref[torch.arange(24), torch.tensor(prompt[1:])]  # row i predicts token i + 1
    assert torch.allclose(torch.tensor(got), want, atol=1e-4)
    ranks = [r for s in spans for r in s.ranks]
    assert ranks == ((ref[:24] > want[:, None]).sum(-1) + 1).tolist()
    tops = [t for s in spans for t in s.top_logprobs]
    assert [[tid for tid, _ in t] for t in tops] == ref[:24].topk(3).indices.tolist()
    assert d.output("p") == GOLDEN_OUTPUT_IDS[20:22]  # and it samples as usual from the prompt's end


@pytest.mark.parametrize("rope", [
    # Llama 3 scaling with an original context of 64: three of head_dim 8's four frequencies are rescaled
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},  # position interpolation
], ids=["llama3", "linear"])
def test_a_checkpoint_saved_by_transformers_v5_rotates_as_transformers_does(stories260k, tmp_path, rope):
    # stories260K's weights under a v5-style config.json: `rope_parameters` only
    hf = json.loads((stories260k / "config.json").read_text())
    del hf["rope_theta"], hf["rope_scaling"]
    hf["rope_parameters"] = rope
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for f in stories260k.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    prompt = GOLDEN_PROMPT_IDS + GOLDEN_OUTPUT_IDS[:20]
    d = Driver(tmp_path)
    d.add("p", prompt, sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    d.step({"p": len(prompt)})
    got = torch.tensor([lp for s in d.last.prompt_logprobs for lp in s.logprobs])
    ref = _hf_logprobs(tmp_path, prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=1e-4)
    # and it is not what the legacy default (theta 10,000, no scaling) would give
    legacy = _hf_logprobs(stories260k, prompt)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (legacy - want).abs().max() > 0.1


def test_logit_bias_and_min_tokens_steer_the_sampled_token(stories260k):
    d = Driver(stories260k)
    d.add("bias", GOLDEN_PROMPT_IDS, sampling=SamplingParams(temperature=0.0, logit_bias={432: -100.0, 286: 100.0}))
    d.add("eos", GOLDEN_PROMPT_IDS, sampling=SamplingParams(temperature=0.0, logit_bias={2: 100.0}, min_tokens=2))
    assert d.step({"bias": 5, "eos": 5}) == {"bias": 286, "eos": 432}  # EOS (2) is masked before min_tokens
    assert d.last.sampled[0].logprob is None
    d.decode(["bias", "eos"], 2)
    assert d.output("eos") == [432, 383, 2]  # two outputs reached: EOS allowed, and the bias wins


def test_decode_through_padded_static_buffers_equals_golden(stories260k):
    """The CUDA-graph path's padding (slot -1, seq_len 0 rows), run eagerly: outputs are unchanged."""
    d = Driver(stories260k)
    d.runner.init_decode_graphs(capture=False)
    runs = []
    real_run = d.runner.graphs.run
    d.runner.graphs.run = lambda *a: runs.append(a[0].shape[0]) or real_run(*a)
    d.add("a", GOLDEN_PROMPT_IDS)
    d.add("b", [1, 403, 407])
    d.add("c", [1, 261, 378, 432])
    d.step({"a": 5, "b": 3, "c": 4})
    d.decode(["a", "b", "c"], 29)
    assert d.output("a") == GOLDEN_OUTPUT_IDS[:30]
    assert runs == [3] * 29 and d.runner.graphs.padded_size(3) == 4
    alone = Driver(stories260k)
    alone.add("b", [1, 403, 407])
    alone.step({"b": 3})
    alone.decode(["b"], 29)
    assert d.output("b") == alone.output("b")


@pytest.mark.parametrize("host", [True, False])
def test_warm_up_leaves_no_request_and_generation_unchanged(stories260k, host):
    """Both warm-ups: the CPU's (one prefill of cpu_warm_up_tokens, 2,048 here, in sequences of at most
    max_model_len) and CUDA's (a prefill, a decode step over it, a block copy), run here on the CPU."""
    d = Driver(stories260k)
    forwards = []
    real = d.runner.model.forward
    d.runner.model.forward = lambda input_ids, *a, **k: forwards.append(input_ids.shape[0]) or real(input_ids, *a, **k)
    assert d.runner.warm_up(host=host) == (2048 if host else 0)
    d.runner.model.forward = real
    assert forwards == ([2048] if host else [511, 1])
    assert d.runner.batch.num_rows == 0 and d.runner.batch.row_of == {}
    d.add("a", GOLDEN_PROMPT_IDS)
    d.step({"a": 5})
    d.decode(["a"], 19)
    assert d.output("a") == GOLDEN_OUTPUT_IDS[:20]


def test_the_cpu_warm_up_skips_triton_which_runs_interpreted_on_a_cpu(stories260k):
    import types

    d = Driver(stories260k)
    d.runner.model.kernels = types.ModuleType("pagedkv.kernels.triton_kernels")  # no attribute: any call fails
    assert d.runner.warm_up() == 0


def test_the_cpu_warm_up_prefill_is_bounded_by_its_flops():
    from pagedkv.worker.model_runner import CPU_WARM_UP_FLOPS, cpu_warm_up_tokens

    stories = ModelConfig.from_hf_dict(HF_STORIES, "x", None)
    assert cpu_warm_up_tokens(stories, 2048) == 2048 and cpu_warm_up_tokens(stories, 256) == 256
    # ops/weights_bound_model.py's ~181M-parameter Llama: 1e11 FLOPs / (2 x 180,913,152) = 276 tokens
    llama = ModelConfig.from_hf_dict({"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
                                      "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 512,
                                      "tie_word_embeddings": True}, "x", None)
    assert llama.weight_bytes("float32") // 4 == 180_913_152 and CPU_WARM_UP_FLOPS == 1e11
    assert cpu_warm_up_tokens(llama, 2048) == 276
    big = ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, vocab_size=128256), "x", None)
    assert cpu_warm_up_tokens(big, 2048) == 1  # ~70B: a single token


def test_penalty_statistics_follow_tokens_through_steps_and_row_moves(stories260k):
    """The worker's incremental prompt masks and output counts equal ones built from the token lists."""
    from pagedkv.worker.sampler import SamplingBatch

    pen = SamplingParams(temperature=1.0, seed=5, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    d = Driver(stories260k)
    d.add("a", GOLDEN_PROMPT_IDS, sampling=pen)
    d.add("b", [1, 403, 407, 403], sampling=pen)
    d.add("c", [1, 261], sampling=GREEDY)
    d.step({"a": 5, "b": 4, "c": 2})
    d.decode(["a", "b", "c"], 6)
    d.step({"b": 1, "c": 1}, finished_request_ids=["a"])  # c moves into a's row
    d.decode(["b", "c"], 3)
    batch = d.runner.batch
    rows = [batch.row_of["b"], batch.row_of["c"]]
    assert sorted(rows) == [0, 1]
    got = batch.sampling_batch(torch.tensor(rows).numpy())
    want = SamplingBatch.from_params([pen, GREEDY], [d.reqs[r]["tokens"][:d.reqs[r]["num_prompt"]] for r in "bc"],
                                     [d.output(r) for r in "bc"], 512, CPU)
    # b's statistics are exact; c has no penalty, so its (unmaintained) statistics are never used
    assert torch.equal(got.prompt_mask[0], want.prompt_mask[0]) and torch.equal(got.output_counts[0], want.output_counts[0])
    assert got.output_counts[0].sum() == 11 and got.prompt_mask[0].sum() == 3  # prompt [1, 403, 407, 403]
    assert got.output_index.tolist() == [11, 11] and got.seeds.tolist() == [5, 0]
    assert got.repetition_penalty.tolist() == pytest.approx([1.3, 1.0])


def test_the_persistent_batch_says_when_every_drawing_row_truncates_as_from_params_does():
    """`SamplingBatch.all_truncated` (the sampler may then draw among the CANDIDATES most likely tokens)
    from the worker's rows equals the one built from the same knobs."""
    from pagedkv.worker.input_batch import InputBatch
    from pagedkv.worker.sampler import CANDIDATES, SamplingBatch

    knobs = [SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1), GREEDY,
             SamplingParams(top_k=CANDIDATES), SamplingParams(top_k=CANDIDATES + 1), SamplingParams(temperature=0.8)]
    ib = InputBatch(8, 64, 16, 512, CPU)
    for i, p in enumerate(knobs):
        ib.add(NewRequestData(f"r{i}", [1, 2], 2, [i], 0, 2, p))
    for rows in ([0, 1, 2, 3, 4], [0, 5], [3, 6], [1, 2]):  # (all greedy: no draw, no flag)
        want = SamplingBatch.from_params([knobs[r] for r in rows], [[1, 2]] * len(rows), [[]] * len(rows), 512, CPU)
        got = ib.sampling_batch(torch.tensor([ib.row_of[f"r{r}"] for r in rows]).numpy())
        assert got.all_truncated == want.all_truncated == (rows in ([0, 1, 2, 3, 4], [1, 2])), rows


def _hf_checkpoint(path, max_shard_size=None, **config):
    """A tiny random Llama saved by transformers into ``path`` (its own layout); returns the model, the oracle."""
    import transformers

    cfg = transformers.LlamaConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
                                      "max_position_embeddings": 128, **config})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than the 0.02 init, so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


GREEDY_PROMPT = [1, 17, 99, 5, 42]


def _greedy(model_dir, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids`` by pagedkv's worker (a prefill, then n - 1 decode steps)."""
    d = Driver(model_dir, block_size=4)
    d.add("a", ids, sampling=SamplingParams(temperature=0.0, max_tokens=n))
    d.step({"a": len(ids)})
    d.decode(["a"], n - 1)
    return d.output("a")


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids`` by transformers (argmax of the full forward, no EOS stop)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_a_sharded_checkpoint_loads_the_shards_its_index_names_not_every_safetensors_file(tmp_path):
    model = _hf_checkpoint(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("model-*"))) > 2
    # Mistral's repositories ship their own-format weights beside the HF shards; the index leaves them out
    save_file({"layers.0.attention.wq.weight": torch.zeros(32, 32)}, str(tmp_path / "consolidated.safetensors"))
    assert _greedy(tmp_path, GREEDY_PROMPT, 10) == _hf_greedy(model, GREEDY_PROMPT, 10)
    shard = sorted(tmp_path.glob("model-*"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"names 1 missing file.*{shard.name}"):
        weight_files(str(tmp_path))


def test_saved_rotary_buffers_are_skipped_as_transformers_skips_them(tmp_path):
    # older transformers saved each layer's rotary_emb.inv_freq, ColossalAI its cos/sin_cached: both were
    # an "unexpected tensor" error; transformers loads the checkpoint and recomputes them from the config
    model = _hf_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        tensors[f"model.layers.{i}.self_attn.rotary_emb.cos_cached"] = torch.ones(1, 1, 128, 8)
        tensors[f"model.layers.{i}.self_attn.rotary_emb.sin_cached"] = torch.zeros(1, 1, 128, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert _greedy(tmp_path, GREEDY_PROMPT, 10) == _hf_greedy(model, GREEDY_PROMPT, 10)


def test_an_unsharded_checkpoint_loads_model_safetensors_not_every_safetensors_file_beside_it(tmp_path):
    # a LoRA adapter saved next to the merged model: every *.safetensors was read and its tensors were
    # an "unexpected tensor" error; transformers (no index) loads model.safetensors alone
    model = _hf_checkpoint(tmp_path)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 32)},
              str(tmp_path / "adapter_model.safetensors"))
    assert weight_files(str(tmp_path)) == [str(tmp_path / "model.safetensors")]
    assert _greedy(tmp_path, GREEDY_PROMPT, 10) == _hf_greedy(model, GREEDY_PROMPT, 10)


def test_a_stored_lm_head_unlike_the_embedding_is_kept_under_tie_word_embeddings(tmp_path):
    # config says tied, the file holds a trained head of its own: transformers 5 keeps it, so must we
    _hf_checkpoint(tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(1))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    import transformers

    oracle = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert not torch.equal(oracle.lm_head.weight, oracle.model.embed_tokens.weight)
    assert _greedy(tmp_path, GREEDY_PROMPT, 10) == _hf_greedy(oracle, GREEDY_PROMPT, 10)
    # an equal stored head is tied, as before
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(ModelConfig.load(str(tmp_path)), EngineConfig(), CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gpu_checks_staging_case_runs_on_the_cpu_and_a_chunked_prefill_equals_the_whole(monkeypatch):
    """ops/gpu_check.py's staging check (a prompt in 16 chunks that sample nothing against the prompt in
    one step, top-5 logprobs) on the CPU: the chunked path agrees, and the GPU script, run only when a
    session is lent a GPU, still fits the plan format."""
    assert _gpu_check(monkeypatch).check_staging("cpu")


def _gpu_check(monkeypatch):
    """ops/gpu_check.py as a module."""
    import importlib.util
    import os
    from pathlib import Path
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))  # the module pops it
    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parents[1] / "ops/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_gpu_checks_graph_and_block_table_cases_run_on_the_cpu(monkeypatch):
    """ops/gpu_check.py's decode-graph check (padded replays against eager steps while requests join and
    leave, a padding row's stale slot inside a live prompt) and device block-table check (random row
    moves, growth, repeated writes before a flush) pass on the CPU's emulation of each, and so fit the
    runner's and the batch's current interfaces."""
    gpu_check = _gpu_check(monkeypatch)
    assert gpu_check.check_graphs("cpu")
    assert gpu_check.check_block_table("cpu")


@pytest.mark.parametrize("fields, error", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
     "config.json model_type 'qwen2' is not supported: pagedkv serves Llama-family checkpoints "
     "(model_type one of llama, mistral)"),
    ({"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]},  # was accepted: the architecture said Llama
     "config.json model_type 'qwen2' is not supported: pagedkv serves Llama-family checkpoints "
     "(model_type one of llama, mistral)"),
    ({"model_type": "llama", "architectures": ["GPT2LMHeadModel"]},  # was accepted: the model_type said llama
     "config.json architectures ['GPT2LMHeadModel'] is not supported: pagedkv serves Llama-family checkpoints "
     "(architectures [one of LlamaForCausalLM, LLaMAForCausalLM, MistralForCausalLM])"),
    ({"architectures": ["LlavaLlamaForCausalLM"]},  # was accepted: "Llama" in the name
     "config.json architectures ['LlavaLlamaForCausalLM'] is not supported: pagedkv serves Llama-family "
     "checkpoints (architectures [one of LlamaForCausalLM, LLaMAForCausalLM, MistralForCausalLM])"),
])
def test_a_non_llama_model_type_or_architecture_is_refused_naming_the_field(fields, error):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, **fields), "m", None)
    assert str(e.value) == error


@pytest.mark.parametrize("fields", [{}, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
                                    {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
                                    {"model_type": "mistral", "architectures": ["LlamaForCausalLM"]},
                                    {"model_type": "llama", "architectures": ["LLaMAForCausalLM"]}])
def test_llama_and_mistral_configs_are_accepted(fields):
    assert ModelConfig.from_hf_dict(dict(EMBEDDED_LIKE, **fields), "m", None).num_hidden_layers == 2
