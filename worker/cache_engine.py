"""The KV pool on the device and the swap pool on the host (PagedAttention, Kwon et al., SOSP 2023, §4).

Each layer has one K and one V tensor ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
device pool, and the same layout with ``num_cpu_blocks`` blocks in the host pool (pinned on CUDA so
swaps are asynchronous DMA). Which block holds what is decided by the control plane; this class
only moves bytes when told.
"""

from __future__ import annotations

import math
import time
from types import ModuleType

import torch

from pagedkv.common.config import ModelConfig
from pagedkv.kernels import reference


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's K and V over all layers: 2 x layers x block_size x kv_heads x head_dim x itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * itemsize


class CacheEngine:
    """Per-layer device and host KV tensors, with block swaps and copies.

    kernels: the attention backend (`kernels.select_backend`) whose ``copy_blocks`` runs copy-on-write
    copies; swaps are plain torch copies on every backend (`kernels.reference.swap_blocks`).

    Raises torch.OutOfMemoryError (or RuntimeError) when the pools do not fit.
    """

    def __init__(self, config: ModelConfig, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kernels: ModuleType = reference):
        shape = (block_size, config.num_key_value_heads, config.head_dim)
        pin = device.type == "cuda"

        def pool(n: int, dev: torch.device, pin_memory: bool = False, zero: bool = True) -> list[torch.Tensor]:
            # device pool zeroed (a kernel may read a stale slot past seq_len and mask it; 0 * NaN
            # would poison it); host pool left uninitialised: a block is always swapped out before in
            alloc = torch.zeros if zero else torch.empty
            return [alloc((n, *shape), dtype=dtype, device=dev, pin_memory=pin_memory)
                    for _ in range(config.num_hidden_layers)]

        self.block_size = block_size
        self.kernels = kernels
        self.num_gpu_blocks, self.num_cpu_blocks = num_gpu_blocks, num_cpu_blocks
        self.k_caches, self.v_caches = pool(num_gpu_blocks, device), pool(num_gpu_blocks, device)
        cpu = torch.device("cpu")
        self.cpu_k_caches = pool(num_cpu_blocks, cpu, pin, zero=False)
        self.cpu_v_caches = pool(num_cpu_blocks, cpu, pin, zero=False)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device_block, host_block) pairs from the device pool to the host pool."""
        self._swap(self.k_caches + self.v_caches, self.cpu_k_caches + self.cpu_v_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (host_block, device_block) pairs from the host pool to the device pool."""
        self._swap(self.cpu_k_caches + self.cpu_v_caches, self.k_caches + self.v_caches, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (src_block, dst_block) pairs within the device pool, all layers (copy-on-write)."""
        if pairs:
            self.kernels.copy_blocks(self.k_caches, self.v_caches, torch.tensor(pairs, dtype=torch.int64))

    @staticmethod
    def _swap(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for s, d in zip(src, dst):
            reference.swap_blocks(s, d, mapping)


def measure_swap_bandwidth(device: torch.device, block_shape: tuple[int, ...], dtype: torch.dtype,
                           num_bytes: int = 32 << 20, repeats: int = 3) -> float:
    """Effective host<->device swap bandwidth in bytes/s for blocks of ``block_shape`` and ``dtype``.

    Times the real swap path (`kernels.reference.swap_blocks`, one copy per block, as a swap does) out to the
    host and back for up to ``num_bytes`` (at most 1,024 blocks), best of ``repeats``. Small blocks pay a per-copy
    overhead that a single large copy would hide (PagedAttention §7.3), so the figure depends on the
    block size. On CUDA the host buffer is pinned, as the swap pool is; on CPU both are host memory.
    """
    block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
    n = min(max(1, num_bytes // block_bytes), 1024)  # enough blocks to see the per-copy cost, quickly
    dev = torch.zeros((n, *block_shape), dtype=dtype, device=device)
    host = torch.empty((n, *block_shape), dtype=dtype, pin_memory=device.type == "cuda")
    mapping = torch.stack([torch.arange(n), torch.arange(n)], dim=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reference.swap_blocks(dev, host, mapping)  # warm-up (page faults, lazy CUDA init)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reference.swap_blocks(dev, host, mapping)
        reference.swap_blocks(host, dev, mapping)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n * block_bytes / best
