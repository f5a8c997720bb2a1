"""Triton implementations of the `kernels` entry points (same signatures as `kernels.reference`).

`paged_attention` lives in `kernels.triton_attention`; `write_kv_cache` and `copy_blocks` in
`kernels.triton_cache`. `swap_blocks`, `rms_norm`, `rotary_embedding` and `silu_and_mul` stay the reference's
PyTorch ops. On CPU these run only under ``TRITON_INTERPRET=1``, which must be set before triton is imported.
"""

from pagedkv.kernels.reference import rms_norm, rotary_embedding, silu_and_mul, swap_blocks
from pagedkv.kernels.triton_attention import paged_attention, warm_up_split_k_reduce
from pagedkv.kernels.triton_cache import copy_blocks, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache", "copy_blocks", "swap_blocks", "rms_norm", "rotary_embedding",
           "silu_and_mul", "warm_up_split_k_reduce"]
