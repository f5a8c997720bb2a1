"""CUDA graphs for decode-only steps: one captured forward per padded batch size, replayed.

A decode step launches a few kernels per layer for very little work each; on a GPU the CPU's
launch cost then exceeds the GPU time. Capturing the whole forward once per batch size and
replaying it costs one launch (CUDA Graphs; vLLM captures decode batches the same way).

Replay needs fixed shapes and addresses, so inputs are copied into static buffers of the padded
batch size: padding rows have slot -1 (their K/V is not written) and seq_len 0 (attention does
nothing for them); their outputs are never read. Block tables keep their full width and split-K
is sized for ``max_model_len``, so a graph holds for every context length. Only steps where every
row decodes exactly one token use a graph; the rest run eagerly.

``capture=False`` runs the same padded static-buffer path eagerly: how CPU tests check the padding.
"""

from __future__ import annotations

import torch

from pagedkv.worker.model import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captured (or, with ``capture=False``, emulated) decode forwards for ``capture_sizes(max_num_seqs)``.

    model: the `LlamaForCausalLM`; k_caches, v_caches: the live KV pool (their addresses are baked in).
    max_blocks: block-table width; max_model_len: the context bound split-K is sized for.
    """

    def __init__(self, model, k_caches, v_caches, max_num_seqs: int, max_blocks: int, max_model_len: int,
                 device: torch.device, capture: bool = True):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.capture = capture
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                self._forward(size)  # warm-up outside the graph (lazy buffers, kernel compilation)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size)
                self.graphs[size] = (graph, out)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 self.query_start_loc[:size + 1], max_query_len=1, max_seq_len=self.max_model_len)
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.k_caches, self.v_caches,
                          self.rows[:size])

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size a batch of ``num_rows`` decodes runs at, None when it is too big."""
        return next((s for s in self.sizes if s >= num_rows), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits ``[num_rows, vocab]`` of a decode-only step (one token per row, row i = token i).

        Raises ValueError when the batch exceeds the largest captured size.
        """
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if size is None:
            raise ValueError(f"decode batch of {n} rows exceeds the largest captured size {self.sizes[-1]}")
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(0)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if self.capture:
            graph, out = self.graphs[size]
            graph.replay()
        else:
            out = self._forward(size)
        return out[:n]
