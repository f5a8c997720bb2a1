"""Request state in the control plane.

A request carries its own token ids, its block table and one progress counter,
``num_computed_tokens`` (tokens whose K/V are in the cache). Prefill, chunked prefill, decode,
prefix-cache hits and recompute preemption all follow from that one counter (as in vLLM V1):
the tokens to compute next are ``token_ids[num_computed_tokens:]``.
"""

from __future__ import annotations

import enum
import time

from pagedkv.common.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted by recompute and requeued
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: its blocks live in the host pool
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # client went away or asked
    FINISHED_ERROR = "finished_error"  # the worker failed

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {"finished_stopped": "stop", "finished_length": "length",
                "finished_aborted": "abort", "finished_error": "error"}.get(self.value)


class Request:
    """One sequence being generated.

    block_table: physical device block ids in logical order; ``len(block_table)`` blocks hold
    ``num_tokens`` token slots at most. num_preemptions counts how often it was preempted.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                 group: list[Request] | None = None, index: int = 0, group_width: int | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.sampling = sampling
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of its full blocks (kept across preemptions)
        self.num_named_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.in_worker = False  # does the worker mirror this request right now?
        self.num_preemptions = 0
        # Sharing (n > 1, beam search): the sibling sequences of one user request share this list,
        # are preempted together, and fork from a leader. ``index`` is the choice index.
        self.group: list[Request] = group if group is not None else []
        self.group.append(self)
        self.index = index
        self._group_width = group_width  # beam search: the beam width (its group grows by forks)
        self.pending_forks: list[Request] = []  # siblings forked once the prompt minus 1 is computed
        self.unsent_token_ids: list[int] = []  # tokens the control plane chose (beam search)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def group_width(self) -> int:
        """Sequences of its group that run at once: the beam width, else every sibling (n)."""
        return self._group_width or len(self.group)

    @property
    def fork_point(self) -> int:
        """Tokens computed once before siblings fork: all but the prompt's last token."""
        return self.num_prompt_tokens - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
