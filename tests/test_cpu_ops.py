"""The CPU backend's C layer ops (`kernels/cpu_kernels.py`, `kernels/cpu_ops.c`) against the PyTorch reference.

RoPE and the KV write must be bit-identical to `kernels.reference` (the C file is built without
fast-math flags and without contraction for that), in float32 and bfloat16, but for NaN's bit
pattern; RMSNorm sums its squares in another order and silu_and_mul (float32 only) takes e^x from a
polynomial, so those are held to float rounding: in float32 a relative 1e-5; RMSNorm in bfloat16 to
two units in the last place, where nearly every element is equal (over 40 seeds, 1 to 7 in 100,000
differed: a sum one float32 ulp apart can move x / rms by one bfloat16 ulp, and the weight's
product by two).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedkv.kernels import cpu_kernels, reference


@pytest.fixture(autouse=True, scope="module")
def _ops_build():
    """On CI the C file must build: a missing compiler would silently test the reference against itself."""
    assert cpu_kernels._library("cpu_ops.c") is not None, "cpu_ops.c did not build (is a C compiler installed?)"


def qkv(num_tokens, num_heads=8, num_kv_heads=4, head_dim=8, seed=0, dtype=torch.float32):
    """q, k, v as slices of one fused projection's output (rows wider than each), as the model makes them."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def angles(num_tokens, head_dim, seed=1):
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(seed)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def ulps(got, want):
    """Per element, how many representable values apart two bfloat16 tensors of one sign are."""
    return (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()


def assert_bf16_close(got, want):
    """At most two units in the last place apart, and equal but for at most 1 in 1,000 elements."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    assert (torch.sign(got) == torch.sign(want)).all()
    assert ulps(got, want).max() <= 2
    assert (got != want).float().mean() <= 1e-3


def refuse(name):
    """A stand-in for a reference op that fails the test if called: the C path must take the case."""
    def fail(*args, **kwargs):
        raise AssertionError(f"reference.{name} ran where cpu_ops.c should have")
    return fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 4, 8), (32, 8, 128), (6, 2, 6), (16, 4, 64)])
def test_rotary_embedding_is_bit_identical_to_the_reference_on_slices_of_a_fused_projection(
        num_heads, num_kv_heads, head_dim, dtype):
    q, k, _ = qkv(37, num_heads, num_kv_heads, head_dim, dtype=dtype)
    cos, sin = angles(37, head_dim)
    want_q, want_k = reference.rotary_embedding(q.clone(), k.clone(), cos, sin)
    got_q, got_k = cpu_kernels.rotary_embedding(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place, in the fused rows
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_embedding_of_other_dtypes_takes_the_reference():
    q, k, _ = qkv(5)
    cos, sin = angles(5, 8)
    q16, k16 = q.to(torch.float16), k.to(torch.float16)
    got_q, got_k = cpu_kernels.rotary_embedding(q16, k16, cos, sin)
    want_q, want_k = reference.rotary_embedding(q16, k16, cos, sin)
    assert got_q.data_ptr() != q16.data_ptr()  # the reference's new tensors: C does not take float16
    assert got_q.dtype == torch.float16 and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    for q_mixed, k_mixed in ((q.to(torch.bfloat16), k), (q, k.to(torch.bfloat16))):  # mixed: the reference too
        want_q, want_k = reference.rotary_embedding(q_mixed, k_mixed, cos, sin)
        got_q, got_k = cpu_kernels.rotary_embedding(q_mixed, k_mixed, cos, sin)
        assert got_q.data_ptr() != q_mixed.data_ptr() and got_k.data_ptr() != k_mixed.data_ptr()
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    q_odd, k_odd, _ = qkv(3, 2, 1, 7)  # an odd head_dim has no rotate_half pairing: the reference's error
    with pytest.raises(RuntimeError):
        reference.rotary_embedding(q_odd, k_odd, *angles(3, 7))
    with pytest.raises(RuntimeError):
        cpu_kernels.rotary_embedding(q_odd, k_odd, *angles(3, 7))


@pytest.mark.parametrize("hidden_size", [64, 4096, 13])  # stories260K, Llama-3.1-8B, not a multiple of 8
def test_rms_norm_equals_the_reference_to_float_rounding(hidden_size):
    gen = torch.Generator().manual_seed(hidden_size)
    x = torch.randn(19, hidden_size, generator=gen) * 3
    weight = torch.randn(hidden_size, generator=gen)
    got = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    assert got.data_ptr() != x.data_ptr()  # a new tensor, like the reference's
    rows = torch.randn(19, 2 * hidden_size, generator=gen)[:, :hidden_size]  # rows of a wider tensor
    torch.testing.assert_close(cpu_kernels.rms_norm(rows, weight, 1e-5), reference.rms_norm(rows, weight, 1e-5),
                               atol=1e-6, rtol=1e-5)
    assert cpu_kernels.rms_norm(x[:0], weight, 1e-5).shape == (0, hidden_size)  # a step that samples no row


@pytest.mark.parametrize("hidden_size", [64, 1024, 4096, 13])
def test_rms_norm_in_bfloat16_equals_the_reference_to_its_last_places(hidden_size, monkeypatch):
    gen = torch.Generator().manual_seed(hidden_size)
    x = (torch.randn(64, 2 * hidden_size, generator=gen) * 3).to(torch.bfloat16)[:, :hidden_size]  # wider rows
    weight = torch.randn(hidden_size, generator=gen).to(torch.bfloat16)
    want = reference.rms_norm(x, weight, 1e-5)
    with monkeypatch.context() as m:
        m.setattr(reference, "rms_norm", refuse("rms_norm"))
        got = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert_bf16_close(got, want)
    # x / rms is rounded to bfloat16 before the weight multiplies it, as HF's LlamaRMSNorm does: one
    # rounding instead of two would differ from the reference in about a tenth of the elements
    rms = x.float().pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
    once = (weight.float() * (x.float() * rms)).to(torch.bfloat16)
    assert (got != once).float().mean() > 0.01
    mixed = cpu_kernels.rms_norm(x, weight.float(), 1e-5)  # a float32 weight promotes, as in the reference
    assert mixed.dtype == torch.float32 and torch.equal(mixed, reference.rms_norm(x, weight.float(), 1e-5))


def pools(dtype, num_blocks=6, block_size=4, num_kv_heads=4, head_dim=8):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.full(shape, 7.0).to(dtype), torch.full(shape, -7.0).to(dtype)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_write_kv_cache_is_bit_identical_to_the_reference(dtype, kv_dtype, monkeypatch):
    """dtype: the pool's; kv_dtype: the model's K and V (float32 into a bfloat16 pool rounds). NaNs
    stay NaN, whatever their payload, but their bits may differ (PyTorch's vector rounding writes 0xffff)."""
    _, k, v = qkv(6)
    k[0, 0, 0], k[1, 0, 0], v[2, 1, 3] = float("nan"), float("inf"), 1.00390625  # NaN, inf, a bf16 tie (1 + 2^-8)
    k[3, 2, 1] = 1.01171875  # a tie that rounds up to even (1 + 3 x 2^-8)
    payloads = torch.tensor([0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32).view(torch.float32)  # NaNs: 0xffffffff
    k[4, 3, :3], v[5, 0, :3] = payloads, payloads  # a payload that plain rounding would turn into inf, 0 or -0
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    slots = torch.tensor([3, -1, 0, 23, 12, 5])  # -1: padding, skipped; 23: the pool's last slot
    want_k, want_v = pools(dtype)
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    got_k, got_v = pools(dtype)
    with monkeypatch.context() as m:
        m.setattr(reference, "write_kv_cache", refuse("write_kv_cache"))
        cpu_kernels.write_kv_cache(k, v, got_k, got_v, slots)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0, equal_nan=True)  # exact, NaN where NaN
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0, equal_nan=True)
    assert got_k.view(-1, 4, 8)[12, 3, :3].isnan().all() and got_v.view(-1, 4, 8)[5, 0, :3].isnan().all()
    assert torch.equal(got_k.view(-1, 4, 8)[1], torch.full((4, 8), 7.0).to(dtype))  # untouched slot


@pytest.mark.parametrize("key_dtype, value_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_write_kv_cache_of_mixed_key_and_value_dtypes_takes_the_reference(key_dtype, value_dtype):
    _, k, v = qkv(4)
    k, v = k.to(key_dtype), v.to(value_dtype)
    slots = torch.tensor([0, 9, -1, 2])
    want_k, want_v = pools(torch.bfloat16)
    reference.write_kv_cache(k, v, want_k, want_v, slots)
    got_k, got_v = pools(torch.bfloat16)
    cpu_kernels.write_kv_cache(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_loading_the_c_kernels_leaves_float32_denormals_as_they_are():
    """-ffast-math as a flag links crtfastmath.o, whose constructor switches on flush-to-zero in the
    thread that loads the library: every later PyTorch op there would turn denormals into 0."""
    probe = ("import torch; from pagedkv.kernels import cpu_kernels; "
             "assert cpu_kernels._library() and cpu_kernels._library('cpu_ops.c'); "
             "print((torch.tensor([1e-40]) * 0.5).item())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout) == pytest.approx(5e-41, rel=1e-3)


def test_write_kv_cache_refuses_a_slot_outside_the_pool_and_writes_nothing():
    _, k, v = qkv(3)
    k_cache, v_cache = pools(torch.float32)
    with pytest.raises(IndexError, match="outside the pool's 24"):
        cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 24]))
    with pytest.raises(IndexError):
        cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, -2, 1]))
    assert torch.equal(k_cache, pools(torch.float32)[0]) and torch.equal(v_cache, pools(torch.float32)[1])


def test_write_kv_cache_into_an_fp8_pool_quantizes_like_the_reference():
    _, k, v = qkv(4)
    slots = torch.tensor([0, 9, -1, 2])
    want_k, want_v = pools(torch.float8_e4m3fn)
    reference.write_kv_cache(k, v, want_k, want_v, slots, 0.5, 0.25)
    got_k, got_v = pools(torch.float8_e4m3fn)
    cpu_kernels.write_kv_cache(k, v, got_k, got_v, slots, 0.5, 0.25)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_mismatched_shapes_fail_as_in_the_reference_without_reading_past_a_tensor():
    _, k, v = qkv(3)
    k_cache, v_cache = pools(torch.float32)
    with pytest.raises(IndexError, match="shape of the mask"):  # two slots for three tokens: the reference refuses
        cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1]))
    x, weight = torch.randn(4, 64), torch.randn(32)
    with pytest.raises(RuntimeError):  # a weight of another size: the reference's broadcast fails
        cpu_kernels.rms_norm(x, weight, 1e-5)


def test_without_a_c_compiler_the_layer_ops_take_the_reference(monkeypatch, tmp_path):
    q, k, v = qkv(4)
    cos, sin = angles(4, 8)
    x, weight = torch.randn(4, 64), torch.randn(64)
    with monkeypatch.context() as m:
        m.setenv("CC", str(tmp_path / "no-such-compiler"))
        m.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
        cpu_kernels._library.cache_clear()
        assert cpu_kernels._library("cpu_ops.c") is None
        assert torch.equal(cpu_kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
        assert torch.equal(cpu_kernels.silu_and_mul(x), reference.silu_and_mul(x))
        got_q, got_k = cpu_kernels.rotary_embedding(q, k, cos, sin)
        want_q, want_k = reference.rotary_embedding(q, k, cos, sin)
        assert got_q.data_ptr() != q.data_ptr()  # the reference's new tensors, not C's in-place rotation
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        got_k_cache, got_v_cache = pools(torch.float32)
        cpu_kernels.write_kv_cache(k, v, got_k_cache, got_v_cache, torch.tensor([0, 5, -1, 9]))
        assert torch.equal(got_k_cache.view(-1, 4, 8)[5], k[1]) and torch.equal(got_v_cache.view(-1, 4, 8)[9], v[3])
    cpu_kernels._library.cache_clear()
    assert cpu_kernels._library("cpu_ops.c") is not None  # the real compiler builds (or finds) it again


# stories260K; no multiple of 8; one 8- or 16-lane vector; 40 = two 16-lane vectors and a tail of 8
@pytest.mark.parametrize("intermediate_size", [172, 13, 8, 16, 40])
def test_silu_and_mul_equals_the_reference_to_float_rounding(intermediate_size):
    gen = torch.Generator().manual_seed(intermediate_size)
    x = torch.randn(23, 2 * intermediate_size, generator=gen) * 4
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0])  # zero, and past e^x's clamp both ways
    got = cpu_kernels.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.shape == (23, intermediate_size)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[0, 2] == 100.0 * x[0, intermediate_size + 2]  # silu(100) = 100
    assert abs(got[0, 3]) < 1e-30  # silu(-100) ~ -4e-42
    rows = torch.randn(23, 4 * intermediate_size, generator=gen)[:, :2 * intermediate_size]  # rows of a wider tensor
    torch.testing.assert_close(cpu_kernels.silu_and_mul(rows), reference.silu_and_mul(rows), atol=1e-6, rtol=1e-5)
    assert cpu_kernels.silu_and_mul(x[:0]).shape == (0, intermediate_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_of_other_dtypes_takes_the_reference(dtype):
    x = torch.randn(5, 16).to(dtype)
    got = cpu_kernels.silu_and_mul(x)
    assert got.dtype == dtype and torch.equal(got, reference.silu_and_mul(x))


def test_a_missing_c_source_means_the_reference_not_a_crash(caplog):
    # an installation without the sources (the wheel once shipped cpu_attention.c alone)
    assert cpu_kernels._library("no_such_kernel.c") is None
    assert "cannot read no_such_kernel.c" in caplog.text
