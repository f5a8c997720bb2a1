"""Paged-attention kernels: Triton on CUDA, the PyTorch reference on CPU.

Exports `paged_attention`, `write_kv_cache`, `copy_blocks`, `swap_blocks` (signatures and layouts
in `kernels.reference`). Which implementation runs is decided per call from the tensors' device,
unless ``PAGEDKV_ATTENTION_BACKEND`` is ``triton`` or ``torch``. On CPU, Triton kernels run only
under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

import os

import torch

from pagedkv.kernels import reference

BACKENDS = ("triton", "torch")


def backend_for(device: torch.device) -> str:
    """The backend used for tensors on ``device``: the env override, else triton on CUDA, torch on CPU.

    Raises ValueError for an unknown ``PAGEDKV_ATTENTION_BACKEND`` value.
    """
    forced = os.environ.get("PAGEDKV_ATTENTION_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"PAGEDKV_ATTENTION_BACKEND must be one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def _impl(name: str, device: torch.device):
    if backend_for(device) == "triton":
        from pagedkv.kernels import triton_kernels  # imported lazily: triton is optional on CPU

        return getattr(triton_kernels, name)
    return getattr(reference, name)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None):
    """See `kernels.reference.paged_attention`."""
    return _impl("paged_attention", q.device)(q, k_cache, v_cache, block_tables, seq_lens,
                                               query_start_loc, scale, out)


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    """See `kernels.reference.write_kv_cache`."""
    return _impl("write_kv_cache", key.device)(key, value, k_cache, v_cache, slot_mapping)


def copy_blocks(k_caches, v_caches, block_mapping):
    """See `kernels.reference.copy_blocks`."""
    return _impl("copy_blocks", k_caches[0].device)(k_caches, v_caches, block_mapping)


def swap_blocks(src, dst, block_mapping):
    """See `kernels.reference.swap_blocks` (plain torch copies on every backend)."""
    return reference.swap_blocks(src, dst, block_mapping)


__all__ = ["paged_attention", "write_kv_cache", "copy_blocks", "swap_blocks", "backend_for"]
