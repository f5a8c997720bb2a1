"""FP8 KV cache: per-tensor scaled quantization of K and V (vLLM's ``--kv-cache-dtype fp8``).

A pool in ``torch.float8_e4m3fn`` (OCP FP8 E4M3: 3 mantissa bits, finite range ±448) or
``torch.float8_e5m2`` (2 mantissa bits, ±57344) holds ``x / scale`` rounded to the nearest fp8
value, saturated to the finite range; reading multiplies by ``scale`` again. One scale per layer
for K (``k_scale``) and one for V (``v_scale``): a checkpoint's, given ones, or `scale_for` the
first prefill's K and V. Pools in any other dtype ignore the scales (they are 1.0).
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# The first prefill's largest |x| maps to half the fp8 range: later tokens may be up to twice as
# large before they saturate, and values 1/14,000 of the largest (e4m3) still keep full precision.
HEADROOM = 2.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def scale_for(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The scale that maps ``max |x|`` to ``1 / HEADROOM`` of ``dtype``'s finite range (1.0 for all zeros)."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax * HEADROOM / torch.finfo(dtype).max if amax > 0 else 1.0


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in ``dtype``: round to nearest even, saturated at the finite range (no inf/NaN)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 ``x x scale`` (any dtype; for non-fp8 pools scale is 1.0 and this is a cast)."""
    return x.float() * scale if scale != 1.0 else x.float()
