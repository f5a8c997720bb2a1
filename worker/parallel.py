"""Tensor parallelism: this rank's place in the group, the slices of the model it holds, its all-reduce.

Megatron-LM's layout (Shoeybi et al. 2019, §3): in each layer the Q/K/V and gate/up projections are
column-parallel (each rank computes its heads and its part of the intermediate activations from the
full hidden state) and the output and down projections are row-parallel (each rank multiplies its
part; one all-reduce sums the partial outputs), so a layer costs two all-reduces of
``[num_tokens, hidden_size]``. KV heads are split like the query heads, or replicated when there are
fewer KV heads than ranks. The embedding and the LM head are replicated: every rank then ends a step
with the same hidden state and the same logits, samples the same tokens from the same seeded
generators, and keeps its request mirror in step with no extra collective (only rank 0 reports them).
Collectives go through torch.distributed: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedkv.common.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world_size``; ``world_size`` 1 is the single-device model (no collectives).

    group: the torch.distributed process group of the ranks (None: the default group).
    """

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def q_heads(self, config: ModelConfig) -> range:
        """The global query-head indices this rank holds (``config``: the full model)."""
        n = config.num_attention_heads // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, config: ModelConfig) -> range:
        """The global KV-head indices this rank holds: its share, or the one it replicates.

        With fewer KV heads than ranks, ``world_size / num_key_value_heads`` consecutive ranks hold
        the same head: exactly the ranks whose query heads read it (GQA groups are consecutive).
        """
        kv = config.num_key_value_heads
        if kv >= self.world_size:
            n = kv // self.world_size
            return range(self.rank * n, (self.rank + 1) * n)
        first = self.rank // (self.world_size // kv)
        return range(first, first + 1)

    def intermediate(self, config: ModelConfig) -> range:
        """The MLP intermediate channels this rank holds."""
        n = config.intermediate_size // self.world_size
        return range(self.rank * n, (self.rank + 1) * n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (the row-parallel projections' partial outputs); returns ``x``.

        Raises RuntimeError (gloo) when a peer died or the group's timeout passed; NCCL's watchdog
        aborts the process instead.
        """
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``x`` over the ranks, in place; returns ``x``."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x


def init_group(rank: int, world_size: int, init_method: str, device: torch.device,
               timeout_s: float) -> TensorParallel:
    """Join the process group of ``world_size`` ranks at ``init_method`` (``tcp://HOST:PORT``; rank 0 listens).

    Backend: NCCL on CUDA, gloo on CPU. ``timeout_s`` bounds the rendezvous and every collective, so a
    rank whose peer died or stalled fails instead of waiting forever. Raises ValueError for a bad
    rank, RuntimeError/DistStoreError when the rendezvous times out.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside [0, --world-size {world_size})")
    if world_size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(rank, world_size)


def destroy_group() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
