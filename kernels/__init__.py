"""Paged-attention kernels: Triton on CUDA, a fused C kernel on CPU, batched PyTorch anywhere.

A backend is a module exporting `paged_attention`, `write_kv_cache`, `copy_blocks`, `swap_blocks`,
`rms_norm`, `rotary_embedding` and `silu_and_mul` (signatures and layouts in `kernels.reference`):
`kernels.triton_kernels`, `kernels.cpu_kernels` (fused in C up to 2,048 new tokens a sequence, longer
prefill batched) or `kernels.torch_kernels` (the batched PyTorch attention alone;
`kernels.reference.paged_attention`, the per-sequence loop, is the oracle tests compare every backend
against). The worker picks one once, at model load, with `select_backend` (from
``--attention-backend``, else by device) and passes it down to the model and the cache engine;
nothing is decided per call. On CPU, Triton kernels run
only under ``TRITON_INTERPRET=1`` (how CI tests them).
"""

from __future__ import annotations

from types import ModuleType

import torch

from pagedkv.kernels import cpu_kernels, reference, torch_kernels

BACKENDS = ("triton", "cpu", "torch")


def select_backend(requested: str | None, device: torch.device) -> ModuleType:
    """The kernel module for ``requested`` ("triton" | "cpu" | "torch"), or by device when None.

    None picks Triton on CUDA and "cpu" elsewhere. Returns `kernels.triton_kernels` (imported here,
    lazily: triton is optional on CPU), `kernels.cpu_kernels` or `kernels.torch_kernels`.
    Raises ValueError for an unknown name.
    """
    name = requested or ("triton" if device.type == "cuda" else "cpu")
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "triton":
        from pagedkv.kernels import triton_kernels

        return triton_kernels
    return cpu_kernels if name == "cpu" else torch_kernels


__all__ = ["BACKENDS", "select_backend", "reference", "cpu_kernels", "torch_kernels"]
