"""The worker's persistent batch: one preallocated row per live request, updated from plan deltas.

Every live request owns a row of fixed-size host arrays: its known tokens, block table, computed
and known token counts and sampling knobs, plus (on the device) its penalty statistics. Rows are
kept dense, ``0 .. num_rows - 1``: removing a request moves the last row into its place, so the
batch a step runs is always the prefix of the arrays and its block table a view, not a copy. A
step then costs O(rows + new tokens + new blocks) on the host, whatever the context lengths (the
design of vLLM V1's persistent batch, ``InputBatch``, written from its description).

Host arrays are numpy views of torch CPU tensors (cheap scalar updates from Python, zero-copy
tensor ops). On CUDA the block table and penalty statistics also live on the device and receive
only the step's changes, staged in pinned memory and copied without blocking.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.common.protocol import NewRequestData
from pagedkv.common.sampling_params import MIN_TEMPERATURE, SamplingParams
from pagedkv.worker.sampler import SamplingBatch, all_truncated, bias_and_bans

# (name, dtype, neutral value) of the per-row sampling knobs kept on the host.
_KNOBS = (("temperature", np.float32, 1.0), ("top_k", np.int64, -1), ("top_p", np.float32, 1.0),
          ("min_p", np.float32, 0.0), ("repetition_penalty", np.float32, 1.0),
          ("presence_penalty", np.float32, 0.0), ("frequency_penalty", np.float32, 0.0))


def _host(shape, dtype, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    t = torch.zeros(shape, dtype=dtype, pin_memory=pin)
    return t, t.numpy()


class InputBatch:
    """Rows of live requests. ``row_of[request_id]`` is a request's row; ``request_ids[row]`` the reverse.

    capacity: rows preallocated (grows by doubling if ever exceeded). max_model_len bounds the
    token buffer; block tables hold ``ceil(max_model_len / block_size)`` columns. eos_token_ids:
    masked, with a row's stop token ids, before its ``min_tokens``. Raises ValueError for a request
    longer than max_model_len.
    """

    def __init__(self, capacity: int, max_model_len: int, block_size: int, vocab_size: int, device: torch.device,
                 eos_token_ids: list[int] = ()):
        self.max_model_len, self.block_size, self.vocab_size, self.device = max_model_len, block_size, vocab_size, device
        self.eos_token_ids = list(eos_token_ids)
        self.max_blocks = -(-max_model_len // block_size)
        self.on_cpu = device.type == "cpu"
        self.num_rows = 0
        self.request_ids: list[str | None] = []
        self.row_of: dict[str, int] = {}
        self.params: list[SamplingParams | None] = []
        self.capacity = 0
        # the device table's writes since its last flush: (row, column) -> block, so the last write to a cell wins
        self._pending: dict[tuple[int, int], int] = {}
        self._allocate(capacity)

    # ---- storage -------------------------------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate every array with ``capacity`` rows, keeping the live rows."""
        old, n = self.capacity, self.num_rows
        keep = {}
        if old:
            keep = {name: getattr(self, name) for name in self._array_names()}
        self.capacity = capacity
        # one spare column: a request at max_model_len still samples (and drops) one more token
        self.token_ids_t, self.token_ids = _host((capacity, self.max_model_len + 1), torch.int32, False)
        self.block_table_t, self.block_table = _host((capacity, self.max_blocks), torch.int32, False)
        for name in ("num_tokens", "num_prompt", "num_computed", "num_blocks", "q_len", "seed", "num_logprobs",
                     "num_prompt_logprobs", "min_tokens"):
            setattr(self, name, np.zeros(capacity, dtype=np.int64))
        for name, dtype, _ in _KNOBS:
            setattr(self, name, np.zeros(capacity, dtype=dtype))
        self.seeded = np.zeros(capacity, dtype=bool)
        self.beam = np.zeros(capacity, dtype=bool)
        self.biased = np.zeros(capacity, dtype=bool)  # has a logit_bias
        self.penalized = np.zeros(capacity, dtype=bool)  # only these rows' penalty statistics are kept
        dev = self.device
        self.prompt_mask = torch.zeros(capacity, self.vocab_size, dtype=torch.bool, device=dev)
        self.output_counts = torch.zeros(capacity, self.vocab_size, dtype=torch.int32, device=dev)
        self.block_table_dev = self.block_table_t if self.on_cpu else torch.zeros(
            capacity, self.max_blocks, dtype=torch.int32, device=dev)
        self.request_ids += [None] * (capacity - old)
        self.params += [None] * (capacity - old)
        for name, arr in keep.items():
            getattr(self, name)[:n] = arr[:n]  # the device table's copy lacks the step's pending writes: they stay

    def _array_names(self):
        yield from ("token_ids", "block_table", "num_tokens", "num_prompt", "num_computed", "num_blocks", "q_len",
                    "seed", "num_logprobs", "num_prompt_logprobs", "min_tokens", "seeded", "beam", "biased",
                    "penalized", "prompt_mask", "output_counts")
        yield from (name for name, _, _ in _KNOBS)
        if not self.on_cpu:
            yield "block_table_dev"

    # ---- deltas --------------------------------------------------------------------------------

    def add(self, new: NewRequestData) -> int:
        """Give a new (or resumed) request a row filled from its NewRequestData; returns the row."""
        if new.request_id in self.row_of:  # resumed without an explicit finish: start afresh
            self.remove(new.request_id)
        n_tok, n_blk = len(new.token_ids), len(new.block_ids)
        if n_tok > self.max_model_len or n_blk > self.max_blocks:
            raise ValueError(f"request {new.request_id!r}: {n_tok} tokens / {n_blk} blocks exceed max_model_len "
                             f"{self.max_model_len} (block_size {self.block_size})")
        if self.num_rows == self.capacity:
            self._allocate(2 * self.capacity)
        row = self.num_rows
        self.num_rows += 1
        self.request_ids[row] = new.request_id
        self.row_of[new.request_id] = row
        self.token_ids[row, :n_tok] = new.token_ids
        self.num_tokens[row], self.num_prompt[row] = n_tok, new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, :n_blk] = new.block_ids
        self.num_blocks[row] = n_blk
        if not self.on_cpu:
            self._pending.update(((row, col), b) for col, b in enumerate(new.block_ids))
        p = new.sampling
        self.params[row] = p
        for name, _, _ in _KNOBS:
            getattr(self, name)[row] = getattr(p, name)
        self.seeded[row], self.seed[row] = p.seed is not None, p.seed or 0
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.min_tokens[row], self.biased[row] = p.min_tokens, bool(p.logit_bias)
        self.beam[row] = p.use_beam_search
        self.penalized[row] = p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
        if self.penalized[row]:
            tokens = torch.from_numpy(self.token_ids[row, :n_tok].astype(np.int64)).to(self.device)
            self.prompt_mask[row] = False
            self.prompt_mask[row, tokens[:new.num_prompt_tokens]] = True
            self.output_counts[row] = torch.bincount(tokens[new.num_prompt_tokens:],
                                                     minlength=self.vocab_size).to(torch.int32)
        self.q_len[row] = new.num_scheduled_tokens
        return row

    def remove(self, request_id: str) -> None:
        """Drop a request's row (unknown ids are ignored); the last row moves into its place."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        last = self.num_rows - 1
        if row != last:
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]  # only the known tokens
            nb = int(self.num_blocks[last])
            self.block_table[row, :nb] = self.block_table[last, :nb]
            for name in self._array_names():
                if name in ("token_ids", "block_table"):
                    continue
                getattr(self, name)[row] = getattr(self, name)[last]  # device rows: device-side copies
            self.request_ids[row], self.params[row] = self.request_ids[last], self.params[last]
            self.row_of[self.request_ids[row]] = row
            if not self.on_cpu:  # pending writes to the moved row follow it
                self._pending = {(row if r == last else r, c): b for (r, c), b in self._pending.items() if r != row}
        elif not self.on_cpu:
            self._pending = {cell: b for cell, b in self._pending.items() if cell[0] != row}
        self.request_ids[last], self.params[last] = None, None
        self.num_rows = last

    def append_blocks(self, row: int, block_ids: list[int], replaced: list[tuple[int, int]]) -> None:
        """Apply copy-on-write replacements (logical index, new block), then append ``block_ids``."""
        for index, block in replaced:
            self.block_table[row, index] = block
            if not self.on_cpu:
                self._pending[row, index] = block
        if block_ids:
            nb = int(self.num_blocks[row])
            if nb + len(block_ids) > self.max_blocks:
                raise ValueError(f"request {self.request_ids[row]!r}: {nb + len(block_ids)} blocks exceed "
                                 f"max_model_len {self.max_model_len}")
            self.block_table[row, nb:nb + len(block_ids)] = block_ids
            self.num_blocks[row] = nb + len(block_ids)
            if not self.on_cpu:
                self._pending.update(((row, nb + i), b) for i, b in enumerate(block_ids))

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Append tokens the control plane chose (beam search) to a row."""
        n = int(self.num_tokens[row])
        if n + len(token_ids) > self.max_model_len:
            raise ValueError(f"request {self.request_ids[row]!r}: {n + len(token_ids)} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        self.token_ids[row, n:n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)
        if not self.penalized[row]:
            return
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.output_counts[row].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def flush_block_table(self) -> None:
        """Send the step's block-table writes to the device copy (no-op on CPU, where they are one)."""
        if self.on_cpu or not self._pending:
            self._pending = {}
            return
        # one write per cell (index_put_ with a repeated index keeps an undefined one of its values on CUDA):
        # writes left from a step that computed nothing may meet a copy-on-write of that column.
        # Pageable memory: the copy has read it when `to` returns.
        writes = torch.tensor([(r, c, b) for (r, c), b in self._pending.items()], dtype=torch.int64)
        writes = writes.T.contiguous().to(self.device, non_blocking=True)
        self.block_table_dev[writes[0], writes[1]] = writes[2].to(torch.int32)
        self._pending = {}

    # ---- sampling ------------------------------------------------------------------------------

    def sampling_batch(self, rows: np.ndarray) -> SamplingBatch:
        """The sampling knobs of ``rows`` (host row indices, int64) as a `SamplingBatch` on the device.

        All-greedy rows without penalties (the common decode case) get a batch without knob tensors.
        Python runs per row only for rows with a logit bias or a pending ``min_tokens``.
        """
        dev = self.device
        temperature = self.temperature[rows]
        greedy = temperature < MIN_TEMPERATURE  # 1e-45 divides logits into inf: greedy, as SamplingParams.greedy says
        penalties = bool(self.penalized[rows].any())
        num_logprobs = self.num_logprobs[rows]
        logprobs = [None] * rows.size if (num_logprobs < 0).all() else [None if k < 0 else k for k in num_logprobs.tolist()]
        output_index = self.num_tokens[rows] - self.num_prompt[rows]
        edits = (None, None)
        edited = np.flatnonzero(self.biased[rows] | (output_index < self.min_tokens[rows]))
        if edited.size:
            edits = bias_and_bans(edited.tolist(), [self.params[r] for r in rows[edited].tolist()],
                                  output_index[edited].tolist(), self.eos_token_ids, dev)
        if greedy.all() and not penalties:
            return SamplingBatch.greedy(logprobs, *edits)
        seeded = self.seeded[rows]
        floats = torch.from_numpy(np.stack([temperature, *(getattr(self, name)[rows] for name in
                                   ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                                    "frequency_penalty"))]))
        ints = torch.from_numpy(np.stack([self.top_k[rows], self.seed[rows], output_index]))
        floats, ints = floats.to(dev, non_blocking=True), ints.to(dev, non_blocking=True)
        rows_dev = torch.from_numpy(rows).to(dev, non_blocking=True) if penalties else None
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        return SamplingBatch(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], repetition_penalty=floats[3],
            presence_penalty=floats[4], frequency_penalty=floats[5], top_k=ints[0], seeds=ints[1],
            output_index=ints[2], seeded=torch.from_numpy(seeded).to(dev, non_blocking=True),
            prompt_mask=self.prompt_mask[rows_dev] if penalties else None,
            output_counts=self.output_counts[rows_dev] if penalties else None,
            num_logprobs=logprobs, all_greedy=bool(greedy.all()), any_seeded=bool((seeded & ~greedy).any()),
            any_unseeded=bool((~seeded & ~greedy).any()),
            any_top_k_top_p=bool((((top_k > 0) | (top_p < 1)) & ~greedy).any()),
            any_min_p=bool(((self.min_p[rows] > 0) & ~greedy).any()),
            all_truncated=all_truncated(greedy, top_k, top_p, self.min_p[rows]),
            bias=edits[0], banned=edits[1])

    def record_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append each row's sampled token (beam-search rows excepted: the control plane chooses theirs)."""
        keep = ~self.beam[rows]
        rows, tokens = rows[keep], tokens[keep]
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
        keep = self.penalized[rows]
        if keep.any():
            rows, tokens = rows[keep], tokens[keep]
            both = torch.from_numpy(np.stack([rows, tokens.astype(np.int64)])).to(self.device, non_blocking=True)
            self.output_counts.index_put_((both[0], both[1]), torch.ones(rows.size, dtype=torch.int32,
                                                                         device=self.device), accumulate=True)
