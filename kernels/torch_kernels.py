"""The PyTorch backend (``--attention-backend torch``): `kernels.reference`'s batched attention and cache ops.

`paged_attention` is `reference.batched_paged_attention` (the whole batch in a few tensor ops);
`write_kv_cache`, `copy_blocks`, `swap_blocks`, `rms_norm`, `rotary_embedding` and `silu_and_mul` are the
reference's. Same signatures as `kernels.triton_kernels`.
"""

from pagedkv.kernels.reference import batched_paged_attention as paged_attention
from pagedkv.kernels.reference import (copy_blocks, rms_norm, rotary_embedding, silu_and_mul, swap_blocks,
                                       write_kv_cache)

__all__ = ["paged_attention", "write_kv_cache", "copy_blocks", "swap_blocks", "rms_norm", "rotary_embedding",
           "silu_and_mul"]
