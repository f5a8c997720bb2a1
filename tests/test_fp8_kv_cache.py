"""The fp8 KV cache (``--kv-cache-dtype fp8``): quantizing writes, attention that dequantizes inside
the kernel (the CPU reference here; Triton, interpreted, in tests/test_kernels.py), 8-bit block copies and swaps, the scales (given,
from the checkpoint, from the first prefill), and the pool's block count in the same memory.

The oracle is dequantize-then-attend: the fp8 cache turned back into float32 (x scale) and given
to the per-sequence reference attention, which knows nothing of fp8.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, assert_all_blocks_free, collect
from fp8_batches import dequantize_then_attend, fp8_batch
from safetensors.torch import load_file, save_file

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.kernels import fp8, reference

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
CPU = torch.device("cpu")


# ---- quantization -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8)
def test_write_quantizes_to_the_nearest_fp8_value_and_saturates(dtype):
    limit = torch.finfo(dtype).max
    key = torch.tensor([[[0.1, -0.37, 2.0, 1e6]]])  # 1e6 / 0.5 is far past the range
    cache = torch.zeros(2, 4, 1, 4, dtype=dtype)
    other = torch.zeros_like(cache)
    reference.write_kv_cache(key, key, cache, other, torch.tensor([5]), 0.5, 2.0)
    stored = cache.view(-1, 1, 4)[5, 0]
    assert torch.equal(stored, (key[0, 0] / 0.5).clamp(-limit, limit).to(dtype))  # round to nearest even
    assert stored[3].float() == limit and torch.isfinite(cache.float()).all()
    assert torch.equal(other.view(-1, 1, 4)[5, 0], (key[0, 0] / 2.0).clamp(-limit, limit).to(dtype))
    assert cache.float().count_nonzero() == 4  # only slot 5 was written


def test_first_prefill_scale_maps_the_largest_value_to_half_the_range():
    x = torch.tensor([0.5, -3.0, 2.0])
    assert fp8.scale_for(x, torch.float8_e4m3fn) == 3.0 * 2 / 448
    assert fp8.scale_for(x, torch.float8_e5m2) == 3.0 * 2 / 57344
    assert fp8.scale_for(torch.zeros(3), torch.float8_e4m3fn) == 1.0


# ---- attention dequantizes inside the kernel ----------------------------------------------------

BATCHES = [([1, 1, 1], [1, 17, 40]),  # decode
           ([5, 1, 16], [5, 33, 50]),  # prefill, decode and extend in one batch
           ([1], [300])]  # long decode: split into partitions


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_lens, seq_lens", BATCHES)
def test_cpu_attention_on_fp8_equals_dequantize_then_attend(dtype, q_lens, seq_lens):
    args, ks, vs = fp8_batch(dtype, q_lens, seq_lens)
    want = dequantize_then_attend(args, ks, vs)
    got = reference.paged_attention(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    from pagedkv.kernels import cpu_kernels, select_backend  # the CPU backends: fused decode, and batched
    assert select_backend(None, CPU) is cpu_kernels and cpu_kernels.fused_available(dtype)
    for attend in (cpu_kernels.paged_attention, reference.batched_paged_attention):
        torch.testing.assert_close(attend(*args, k_scale=ks, v_scale=vs), want,
                                   atol=1e-5, rtol=0)  # they sum in another order


# ---- blocks move as 8-bit blocks ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", FP8)
def test_copy_and_swap_move_fp8_blocks_byte_for_byte(dtype):
    from pagedkv.worker.cache_engine import CacheEngine
    from pagedkv.common.config import ModelConfig

    config = ModelConfig.load(None)
    cache = CacheEngine(config, num_gpu_blocks=6, num_cpu_blocks=3, block_size=4, dtype=dtype, device=CPU)
    g = torch.Generator().manual_seed(0)
    for t in cache.k_caches + cache.v_caches:
        t.copy_((torch.randn(t.shape, generator=g) * 50).to(dtype))
    before = [t.clone() for t in cache.k_caches + cache.v_caches]
    assert cache.k_caches[0].element_size() == 1
    cache.copy([(1, 4), (2, 5)])  # the reference copy on CPU (Triton's: tests/test_kernels.py)
    cache.swap_out([(0, 2), (3, 0)])
    for t in cache.k_caches + cache.v_caches:
        t[0].zero_()
        t[3].zero_()
    cache.swap_in([(2, 3), (0, 0)])
    for b, t in zip(before, cache.k_caches + cache.v_caches):
        want = b.clone()
        want[4], want[5], want[0], want[3] = b[1], b[2], b[3], b[0]
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


# ---- scales: given, from the checkpoint, from the first prefill ---------------------------------

def runner(stories260k, **kw):
    from pagedkv.worker.model_runner import ModelRunner

    r = ModelRunner(EngineConfig(model=str(stories260k), **kw), CPU, torch.float32)
    r.init_cache(8, 0)
    return r


def prefill(r, token_ids, rid="a", step=0, first_block=0):
    from pagedkv.common.protocol import NewRequestData, StepPlan

    n = len(token_ids)
    blocks = list(range(first_block, first_block + -(-n // 16)))
    plan = StepPlan(step, [NewRequestData(rid, list(token_ids), n, blocks, 0, n,
                                          SamplingParams(temperature=0, max_tokens=1))])
    return r.execute(plan).sampled[0].token_id


def test_scales_come_from_the_first_prefill_not_from_profiling(stories260k):
    r = runner(stories260k, kv_cache_dtype="fp8")
    assert r.kv_dtype == torch.float8_e4m3fn and r.kv_cache_dtype == "fp8_e4m3"
    r.profile_run()
    assert r.model.kv_scales == [(None, None)] * 5  # the profile's dummy tokens calibrated nothing
    # the first prefill's K of layer 0, recomputed by hand: amax x 2 / 448
    from pagedkv.kernels.reference import rotary_embedding
    from pagedkv.worker.model import rope_inv_freq

    attn = r.model.model.layers[0].self_attn
    with torch.no_grad():
        x = r.model.model.layers[0].input_layernorm(r.model.model.embed_tokens(torch.tensor(GOLDEN_PROMPT_IDS)))
        freqs = torch.arange(5).float()[:, None] * rope_inv_freq(r.model_config)[None, :]
        q, k, v = attn.qkv_proj(x).split([64, 32, 32], dim=-1)  # stories260K: 8 heads, 4 KV heads, head_dim 8
        _, k = rotary_embedding(q.reshape(5, 8, 8), k.reshape(5, 4, 8), freqs.cos(), freqs.sin())
    assert prefill(r, GOLDEN_PROMPT_IDS) == GOLDEN_OUTPUT_IDS[0]
    k_scale, v_scale = r.model.kv_scales[0]
    assert k_scale == pytest.approx(float(k.abs().max()) * 2 / 448, rel=1e-6)
    assert v_scale == pytest.approx(float(v.abs().max()) * 2 / 448, rel=1e-6)
    assert all(k is not None and v is not None for k, v in r.model.kv_scales)
    first = r.model.kv_scales
    prefill(r, [1, 300, 301, 302, 303, 304], rid="b", step=1, first_block=1)
    assert r.model.kv_scales == first  # calibrated once, then fixed


def decode(r, rid, num_tokens, step=100):
    """``num_tokens`` decode steps of request ``rid`` (blocks 0-7 are enough); the sampled ids."""
    from pagedkv.common.protocol import CachedRequestData, StepPlan

    out = []
    for i in range(num_tokens):
        blocks = list(range(1, 8)) if i == 0 else []
        out.append(r.execute(StepPlan(step + i, cached_requests=[CachedRequestData(rid, blocks, 1)])).sampled[0].token_id)
    return out


def test_decode_graphs_wait_for_the_first_prefill_to_fix_the_scales(stories260k):
    """A decode graph bakes k_scale and v_scale in: with scales from the first prefill, the graphs
    are built right after it, never before (warm-up and profiling calibrate nothing)."""
    from pagedkv.worker.model_runner import ModelRunner

    eager = runner(stories260k, kv_cache_dtype="fp8")
    r = ModelRunner(EngineConfig(model=str(stories260k), kv_cache_dtype="fp8"), CPU, torch.float32)
    r.capture_graphs = True  # as on CUDA; on CPU the same padded static-buffer path runs eagerly
    r.warm_up()
    r.init_cache(8, 0)
    assert r.graphs is None and not r.kv_scales_ready and r.model.kv_scales == [(None, None)] * 5
    assert prefill(r, GOLDEN_PROMPT_IDS) == prefill(eager, GOLDEN_PROMPT_IDS)
    assert r.kv_scales_ready and r.graphs is not None and r.model.kv_scales == eager.model.kv_scales
    runs = []
    real_run = r.graphs.run
    r.graphs.run = lambda *a: runs.append(a[0].shape[0]) or real_run(*a)
    assert decode(r, "a", 12) == decode(eager, "a", 12)  # through the graph path, as eagerly
    assert runs == [1] * 12
    given = ModelRunner(EngineConfig(model=str(stories260k), kv_cache_dtype="fp8", k_scale=0.02, v_scale=0.01),
                        CPU, torch.float32)
    given.capture_graphs = True
    given.init_cache(8, 0)
    assert given.graphs is not None  # known scales: built with the pool


def test_given_scales_override_and_checkpoint_scales_load(stories260k, tmp_path):
    r = runner(stories260k, kv_cache_dtype="fp8_e5m2", k_scale=0.02, v_scale=0.01)
    assert r.kv_dtype == torch.float8_e5m2 and r.model.kv_scales == [(0.02, 0.01)] * 5
    prefill(r, GOLDEN_PROMPT_IDS)
    assert r.model.kv_scales == [(0.02, 0.01)] * 5  # given scales are never recalibrated
    # a checkpoint with per-layer scales, in both of vLLM's names
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (stories260k / name).exists():
            (tmp_path / name).write_bytes((stories260k / name).read_bytes())
    tensors = load_file(str(stories260k / "model.safetensors"))
    for i in range(5):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.002 * (i + 1)])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    r = runner(tmp_path, kv_cache_dtype="fp8")
    want = [(pytest.approx(0.01 * (i + 1)), pytest.approx(0.002 * (i + 1))) for i in range(5)]
    assert r.model.kv_scales == want
    prefill(r, GOLDEN_PROMPT_IDS)
    assert r.model.kv_scales == want


# ---- the engine: 4x the blocks of fp32 in the same memory, and still the story --------------------

async def test_fp8_pool_holds_four_times_the_blocks_of_fp32_in_the_same_memory(start):
    fp32 = await start(device="cpu", cpu_kv_cache_space=0.01)
    e4m3 = await start(device="cpu", cpu_kv_cache_space=0.01, kv_cache_dtype="fp8")
    a, b = fp32.kv_cache_snapshot(), e4m3.kv_cache_snapshot()
    assert (a["kv_cache_dtype"], b["kv_cache_dtype"]) == ("float32", "fp8_e4m3")
    # 0.01 GiB / (2 x 5 layers x 16 tokens x 4 heads x 8 dims x 4 or 1 bytes)
    assert (a["kv_bytes_per_block"], b["kv_bytes_per_block"]) == (20480, 5120)
    assert (a["num_gpu_blocks"], b["num_gpu_blocks"]) == (524, 2097)
    assert b["num_gpu_blocks"] / a["num_gpu_blocks"] >= 3.9
    assert e4m3.advisor.settings.kv_cache_dtype == "fp8_e4m3"


async def test_fp8_engine_keeps_the_golden_opening_and_returns_every_block(start):
    # E4M3 only: e5m2 runs the same code with other constants (its writes, copies, swaps and
    # attention are tested above and in tests/test_kernels.py); one engine less in CI
    kv_cache_dtype = "fp8_e4m3"
    engine = await start(device="cpu", num_gpu_blocks=16, kv_cache_dtype=kv_cache_dtype,
                         preemption_mode="swap", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=60)
    outs = [await collect(engine.add_request(GOLDEN_PROMPT_IDS, params))]
    # six more at once on 16 blocks (3 fit): swapped out and back as 8-bit blocks
    outs += await asyncio.gather(*[collect(engine.add_request(GOLDEN_PROMPT_IDS, params))
                                                 for _ in range(6)])
    first = outs[0][0]
    assert all(tokens == first for tokens, _, _ in outs)  # batched, swapped: the same greedy tokens
    agree = next((i for i, (a, b) in enumerate(zip(first, GOLDEN_OUTPUT_IDS)) if a != b), 60)
    assert agree >= 10, (kv_cache_dtype, agree)  # the story opens as the float32 cache's does
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--k-scale", "0.1", "x"], "--k-scale/--v-scale need --kv-cache-dtype fp8"),
    (["serve", "--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice: 'int8'"),
    (["bench", "--kv-cache-dtype", "fp8", "--v-scale", "-1"], "argument --v-scale: must be > 0.0"),
])
def test_bad_kv_cache_flags_are_errors_naming_the_flag(argv, message, capsys):
    from pagedkv.scheduler.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_capacity_plans_fp8_as_four_times_float32_tokens(stories260k):
    from pagedkv.common.capacity import plan
    from pagedkv.common.config import ModelConfig

    model = ModelConfig.load(str(stories260k))
    f32 = plan(model, 1.0, activation_reserve_gib=0, kv_cache_dtype="float32")
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        q = plan(model, 1.0, activation_reserve_gib=0, kv_cache_dtype=name)
        assert q.kv_bytes_per_token * 4 == f32.kv_bytes_per_token == 1280 and q.num_blocks >= 3.9 * f32.num_blocks
