"""The wire protocol between the control plane and the workers (ZeroMQ + msgspec MessagePack).

The control plane binds a ROUTER socket; each worker connects a DEALER socket. Start-up:

    worker  -> Register(protocol_version, pid)
    control -> LoadModel(config, rank, world_size)      worker loads weights, profiles memory
    worker  -> WorkerHello(capacity, bandwidth)
    control -> InitCache(num_gpu_blocks, num_cpu_blocks) worker allocates the KV pool + swap pool
    worker  -> WorkerReady
    then one StepPlan -> StepResult per engine step, until Shutdown.

Under tensor parallelism N workers (ranks) connect to the same socket and each says its rank in
`Register`; every message above goes to every rank, a StepPlan encoded once and the same bytes sent
to each. Every rank answers each step; rank 0's StepResult carries the sampled tokens, the others'
only the token ids, which the control plane checks against rank 0's (every rank samples the same
tokens and appends them to its own mirror, see `worker.parallel`).

A `StepPlan` carries deltas, in the style of vLLM V1's SchedulerOutput: a request travels whole
once (`NewRequestData`), afterwards only its new block ids and token count (`CachedRequestData`).
The worker mirrors each request (its token ids and block table) and appends the tokens it samples
itself. A request that is finished, aborted or preempted is listed in ``finished_request_ids`` and
the worker drops its mirror; a preempted request comes back later as a new request (after a
recompute with ``num_computed_tokens`` 0, after a swap-in with its computed tokens already in KV).

Block copies and swaps run before the forward pass, in the order swap-out, swap-in, copy.
No pickles: every message is a tagged msgspec Struct, and a protocol version guards upgrades.
Every frame carries an HMAC-SHA256 under a secret both ends share (`Channel`); a frame without a
valid one is dropped and logged, never decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from pagedkv.common.config import EngineConfig
from pagedkv.common.sampling_params import SamplingParams

PROTOCOL_VERSION = 4  # 2: prompt logprobs; logit_bias, min_tokens; 3: Register carries rank and world_size; 4: frames are HMAC-sealed


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen (first admission, or resumption after a preemption).

    token_ids: every known token (prompt + generated so far); the first ``num_prompt_tokens`` are
    the prompt, so the sampler's output index is ``len(token_ids) - num_prompt_tokens``.
    block_ids: the whole block table (physical device block ids, logical order).
    num_computed_tokens: tokens whose K/V are already in those blocks (prefix-cache hit or swap-in).
    num_scheduled_tokens: tokens to compute this step, starting at ``num_computed_tokens``.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the worker already mirrors: blocks appended to its table and tokens to compute.

    new_token_ids: tokens the control plane appended that the worker did not sample itself
    (beam search chooses tokens centrally); empty in ordinary sampling.
    replaced_block_ids: (logical index, new physical block) pairs, applied before the new blocks
    are appended: a shared block this request writes next was copied (copy-on-write).
    """

    request_id: str
    new_block_ids: list[int]
    num_scheduled_tokens: int
    new_token_ids: list[int] = []
    replaced_block_ids: list[tuple[int, int]] = []


class StepPlan(msgspec.Struct, tag="plan"):
    """One engine step. Block pairs are (src, dst) physical block ids.

    blocks_to_swap_out: (device_block, host_block); blocks_to_swap_in: (host_block, device_block);
    blocks_to_copy: (src_device_block, dst_device_block), for copy-on-write.
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    finished_request_ids: list[str] = []
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_swap_in: list[tuple[int, int]] = []
    blocks_to_copy: list[tuple[int, int]] = []

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.cached_requests)


class SampledToken(msgspec.Struct, array_like=True):
    """A token sampled for one request; logprob is its log-probability (natural log) when asked.

    top_logprobs: the ``logprobs`` most likely (token_id, logprob) pairs, most likely first (equal
    values by token id). rank: the token's 1-based rank in that order, with logprob.
    """

    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of a run of prompt tokens, from the logits of this step's prefill chunk.

    Entry i is about prompt token ``start + i`` (start >= 1: the first token has no context):
    ``logprobs[i]`` its log-probability given the tokens before it, ``ranks[i]`` its 1-based rank
    in that distribution, ``top_logprobs[i]`` the ``prompt_logprobs`` most likely (token_id,
    logprob) pairs, most likely first.
    """

    request_id: str
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]]


class StepResult(msgspec.Struct, tag="result"):
    """The outcome of one StepPlan: a token for every request whose scheduled tokens reached its end.

    prompt_logprobs: for requests that asked (``SamplingParams.prompt_logprobs``), the prompt tokens
    this step's forward covered.
    forward_seconds: wall time of swaps, copies, forward and sampling on the worker (seconds).
    error: set when the step failed; the control plane then fails the requests in flight.
    """

    step_id: int
    sampled: list[SampledToken] = []
    prompt_logprobs: list[PromptLogprobs] = []
    forward_seconds: float = 0.0
    error: str | None = None


class Register(msgspec.Struct, tag="register"):
    """A worker's first message: who it is, and its place in a tensor-parallel group."""

    protocol_version: int
    pid: int
    rank: int = 0
    world_size: int = 1


class LoadModel(msgspec.Struct, tag="load_model"):
    config: EngineConfig
    rank: int = 0
    world_size: int = 1


class WorkerHello(msgspec.Struct, tag="hello"):
    """What a worker can hold, reported after loading the model and profiling one forward pass.

    kv_bytes_per_block: bytes of one block's K and V across all layers, in the pool's dtype
    ``kv_cache_dtype`` (one byte per element for fp8).
    max_num_gpu_blocks: blocks that fit in the device KV budget (CUDA: free memory x
    gpu_memory_utilization after profiling; CPU: cpu_kv_cache_space GiB).
    swap_bandwidth: measured host<->device copy bandwidth in bytes/s (None on CPU: no copy needed
    beyond memcpy, still measured if possible).
    """

    rank: int
    device: str
    dtype: str
    kv_bytes_per_block: int
    max_num_gpu_blocks: int
    swap_bandwidth: float | None = None
    kv_cache_dtype: str = "auto"  # the pool's element type: the model dtype's name, fp8_e4m3 or fp8_e5m2


class InitCache(msgspec.Struct, tag="init_cache"):
    num_gpu_blocks: int
    num_cpu_blocks: int


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int


class WorkerError(msgspec.Struct, tag="error"):
    """A worker failed outside a step (loading, allocation); ``message`` says why."""

    message: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


ToWorker = LoadModel | InitCache | StepPlan | Shutdown
FromWorker = Register | WorkerHello | WorkerReady | StepResult | WorkerError

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: ToWorker | FromWorker) -> bytes:
    """Serialize one message to MessagePack bytes."""
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    """Parse a control-plane message. Raises msgspec.ValidationError/DecodeError on bad input."""
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    """Parse a worker message. Raises msgspec.ValidationError/DecodeError on bad input."""
    return _from_worker.decode(data)


# ZMTP heartbeats (ms) on a link between hosts: a PING every 1 s; a peer that sends nothing for 5 s
# after one is gone (a host that lost power or a partition sends no FIN) and its connection is closed.
# The control plane sets them for external workers, a worker for a tcp:// control plane.
HEARTBEAT_MS = (1000, 5000)

# ---- the authenticated channel ----------------------------------------------------------------

SECRET_ENV = "PAGEDKV_WORKER_SECRET"  # the shared secret, for workers and control planes started apart
MAC_BYTES = 32
_TO_WORKER, _FROM_WORKER = b"pagedkv control->worker\0", b"pagedkv worker->control\0"


class Unauthenticated(ValueError):
    """A frame that does not carry a valid MAC under this channel's secret; it was not decoded."""


class UndecodablePlan(ValueError):
    """An authenticated StepPlan with a field of the wrong type (msgspec checks types when it
    decodes, not when it encodes). The worker answers its ``step_id`` with a failed StepResult, so
    the control plane fails the step's cause as for a step whose forward raised; dropped
    unanswered, the same plan came back after every restart until the engine was out of them."""

    def __init__(self, step_id: int, error: str):
        super().__init__(f"could not decode step plan {step_id}: {error}")
        self.step_id = step_id


class _PlanStepId(msgspec.Struct, tag="plan"):
    step_id: int


_plan_step_id = msgspec.msgpack.Decoder(_PlanStepId)


def load_secret(path: str | None = None) -> bytes | None:
    """The worker-channel secret: the file at ``path`` (stripped), else ``$PAGEDKV_WORKER_SECRET``, else None.

    Raises OSError when the file cannot be read, ValueError when the secret is empty or shorter
    than 16 bytes (too easy to guess).
    """
    if path is not None:
        with open(path, "rb") as f:
            secret = f.read().strip()
        where = path
    elif os.environ.get(SECRET_ENV):
        secret, where = os.environ[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < 16:
        raise ValueError(f"the worker secret in {where} must be at least 16 bytes (e.g. `openssl rand -hex 32`)")
    return secret


class Channel:
    """Both ends of one control-plane <-> worker link seal every message with HMAC-SHA256.

    A frame is ``HMAC-SHA256(key, direction || payload) || payload``: 32 bytes of MAC, then the
    MessagePack payload. The key is derived from the shared secret; the direction label keeps a
    message of one side from being reflected back as the other's. A frame whose MAC does not match
    raises `Unauthenticated` before a byte of it is decoded. (RFC 2104; it authenticates, it does
    not encrypt: run tcp:// links on a private network.)
    """

    def __init__(self, secret: bytes):
        self._key = hashlib.sha256(b"pagedkv worker channel v1\0" + secret).digest()

    def _mac(self, direction: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, direction + payload, hashlib.sha256).digest()

    def _open(self, direction: bytes, frame: bytes) -> bytes:
        if len(frame) < MAC_BYTES or not hmac.compare_digest(frame[:MAC_BYTES], self._mac(direction, frame[MAC_BYTES:])):
            raise Unauthenticated(f"dropped a {len(frame)}-byte frame without a valid MAC")
        return frame[MAC_BYTES:]

    def seal_to_worker(self, msg: ToWorker) -> bytes:
        payload = encode(msg)
        return self._mac(_TO_WORKER, payload) + payload

    def seal_from_worker(self, msg: FromWorker) -> bytes:
        payload = encode(msg)
        return self._mac(_FROM_WORKER, payload) + payload

    def open_to_worker(self, frame: bytes) -> ToWorker:
        """Verify, then decode a control-plane message. Raises Unauthenticated, UndecodablePlan
        (a StepPlan whose step_id could be read), msgspec errors."""
        payload = self._open(_TO_WORKER, frame)
        try:
            return decode_to_worker(payload)
        except msgspec.ValidationError as e:
            try:
                step_id = _plan_step_id.decode(payload).step_id
            except msgspec.ValidationError:
                raise e from None
            raise UndecodablePlan(step_id, str(e)) from e

    def open_from_worker(self, frame: bytes) -> FromWorker:
        """Verify, then decode a worker message. Raises Unauthenticated, msgspec errors."""
        return decode_from_worker(self._open(_FROM_WORKER, frame))
