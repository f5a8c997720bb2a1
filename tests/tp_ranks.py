"""Helpers run inside the rank processes of the tensor-parallel tests (spawned with torch.multiprocessing)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from pagedkv.common.config import EngineConfig, ModelConfig
from pagedkv.worker.cache_engine import CacheEngine
from pagedkv.worker.model import AttentionMetadata
from pagedkv.worker.model_loader import load_model
from pagedkv.worker.parallel import TensorParallel


@torch.inference_mode()
def step_logits(config: ModelConfig, load_format: str, prompt: list[int], next_token: int,
                tp: TensorParallel = TensorParallel(), kv_dtype: torch.dtype = torch.float32,
                scales: list | None = None) -> torch.Tensor:
    """Float32 logits ``[len(prompt) + 1, vocab]`` of two steps on CPU: a prefill of ``prompt`` (every row),
    then a decode of ``next_token`` that reads the prompt back from this rank's paged KV cache (in
    ``kv_dtype``; an fp8 one is calibrated by the prefill, and its per-layer scales appended to ``scales``)."""
    model = load_model(config, EngineConfig(model=config.path, load_format=load_format), torch.device("cpu"),
                       torch.float32, tp)
    bs = 4  # several blocks, so the block table matters
    cache = CacheEngine(config.shard(tp.world_size), 8, 0, bs, kv_dtype, torch.device("cpu"), model.kernels)
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)  # scattered physical blocks
    n = len(prompt)
    pos = torch.arange(n)
    meta = AttentionMetadata(table[0, pos // bs].long() * bs + pos % bs, table, torch.tensor([n], dtype=torch.int32),
                             torch.tensor([0, n], dtype=torch.int32))
    prefill = model(torch.tensor(prompt), pos, meta, cache.k_caches, cache.v_caches, torch.arange(n))
    pos = torch.tensor([n])
    meta = AttentionMetadata(table[0, pos // bs].long() * bs + pos % bs, table,
                             torch.tensor([n + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    decode = model(torch.tensor([next_token]), pos, meta, cache.k_caches, cache.v_caches, torch.tensor([0]))
    if scales is not None:
        scales.extend(model.kv_scales)
    return torch.cat([prefill, decode])


def logits_rank(rank: int, world_size: int, init_method: str, cases: list, out_dir: str) -> None:
    """Rank ``rank`` of a gloo group of ``world_size``: for each case (name, config, load_format, prompt,
    next_token, tp size), ranks below the tp size compute `step_logits` in a sub-group of that size;
    rank 0 saves them to ``out_dir/NAME-tpN.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    groups = {n: dist.new_group(list(range(n))) for n in sorted({c[-1] for c in cases})}  # every rank joins each
    for name, config, load_format, prompt, next_token, n in cases:
        if rank < n:
            logits = step_logits(config, load_format, prompt, next_token, TensorParallel(rank, n, groups[n]))
            if rank == 0:
                torch.save(logits, f"{out_dir}/{name}-tp{n}.pt")
    dist.destroy_process_group()


def fp8_rank(rank: int, world_size: int, init_method: str, config: ModelConfig, prompt: list[int], next_token: int,
             out_dir: str) -> None:
    """Rank ``rank`` of a gloo group of ``world_size``: `step_logits` over an fp8 e4m3 KV cache, saved
    with the calibrated scales to ``out_dir/fp8-rankR.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    scales: list = []
    logits = step_logits(config, "auto", prompt, next_token, TensorParallel(rank, world_size),
                         torch.float8_e4m3fn, scales)
    torch.save((logits, scales), f"{out_dir}/fp8-rank{rank}.pt")
    dist.destroy_process_group()
