"""The control plane's side of the ZeroMQ link to the worker processes (one per tensor-parallel rank).

The control plane binds a ROUTER socket (``ipc://`` in a temp dir by default, or ``tcp://``) and
either spawns the ranks itself (``python -m pagedkv.worker --connect ADDR --rank R --world-size N
--dist-init-method tcp://127.0.0.1:PORT``) or waits for ranks started on their own (``pagedkv worker
--connect ADDR --rank R ...``, on any host). Each message is encoded once and the same bytes go to
every rank. Every reply has a deadline: a rank that dies, stops answering or fails a step in a group
raises `WorkerFailed` instead of being waited on forever, and failed spawned ranks are killed
(SIGKILL), never left holding their pools.

Every frame is sealed with an HMAC under a secret shared with the workers (`common.protocol.Channel`):
a fresh random one per start for spawned ranks (handed over in their environment), the operator's
(``--worker-secret-file`` or ``$PAGEDKV_WORKER_SECRET``) for external ones. Frames without a valid
MAC, or from any peer but the registered ranks, are dropped and logged, never decoded. The one
exception is an authenticated Register from a new peer to a lone external worker's socket: its
supervisor restarted it, so the old one is gone; the client fails (`WorkerFailed`) and
`forget_worker` lets the engine take the new one on the same socket.

An external worker that dies (kill -9, a crash) is noticed within `_POLL_SECONDS`, idle or not: a
socket monitor reports the end of its connection, the one its authenticated Register came on
(matched by file descriptor, so another peer's disconnect counts for nothing), and ZMTP heartbeats
close the connection of a host that vanished without one (`protocol.HEARTBEAT_MS`).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedkv.common import protocol
from pagedkv.common.config import EngineConfig
from pagedkv.common.log import current_format, get_logger

log = get_logger("pagedkv.worker_client")

_POLL_SECONDS = 0.5  # how often a waiting call checks that a spawned worker is still alive
_START_SECONDS = 600.0  # loading a large checkpoint and profiling may take minutes; steps may not


class WorkerFailed(RuntimeError):
    """The worker died, missed its deadline, or reported an error it cannot recover from."""


def default_worker_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/pagedkv-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


def remove_stale_sockets() -> list[str]:
    """Unlink the default ipc socket files of control planes that are gone (killed with -9, say).

    Returns the paths removed. A file whose pid is alive is left alone.
    """
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "pagedkv-*-*.sock")):
        m = re.fullmatch(r"pagedkv-(\d+)-[0-9a-f]{8}\.sock", os.path.basename(path))
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    if removed:
        log.info("removed stale ipc socket files", paths=removed)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the spawned ranks' rendezvous (rank 0 listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _reap(process: subprocess.Popen, timeout: float | None = None) -> bool:
    """Wait for a spawned rank to exit, polling; returns False if ``timeout`` seconds pass first.

    No executor thread: `LLM.shutdown` runs this from ``atexit``, when a new thread pool can no
    longer be created.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while process.poll() is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class WorkerClient:
    """The worker ranks (``config.tensor_parallel_size`` of them, one process each) behind a ROUTER socket.

    timeout: seconds a step may take before the group is declared failed (``--worker-timeout``);
    each start-up phase (load, profile, allocate) may take up to the larger of it and 600 s.
    """

    def __init__(self, config: EngineConfig, address: str | None = None, spawn: bool = True,
                 secret: bytes | None = None):
        self.config = config
        if address is None:
            remove_stale_sockets()
        self.address = address or default_worker_address()
        self.spawn = spawn
        self.timeout = config.worker_timeout
        self.world_size = config.tensor_parallel_size
        self.processes: list[subprocess.Popen] = []  # spawned ranks, in rank order
        if secret is None:
            if not spawn:
                raise ValueError(f"an external worker needs the shared worker secret: --worker-secret-file "
                                 f"or {protocol.SECRET_ENV}")
            secret = secrets.token_hex(32).encode()  # per start: spawned ranks get it in their environment
        self._secret = secret
        self._channel = protocol.Channel(secret)
        self._dropped = 0  # frames dropped since the last log line
        self._bad_macs = 0  # frames with a wrong MAC before the group formed: a worker with another secret
        self._dropped_logged_at = 0.0
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = None  # external ranks: their connections' ends (spawned ones are watched by pid)
        if not spawn:
            self._sock.setsockopt(zmq.HEARTBEAT_IVL, protocol.HEARTBEAT_MS[0])
            self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, protocol.HEARTBEAT_MS[1])
            self._monitor_owner = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitor = zmq.Socket.shadow(self._monitor_owner.underlying)  # read without awaiting
        self._sock.bind(self.address)
        self._identities: list[bytes] = []  # ZeroMQ identity of each rank, in rank order
        self._registered: dict[bytes, protocol.Register] = {}  # identity -> its Register (external ranks)
        self._fds: dict[bytes, int | None] = {}  # identity -> the fd of the connection its Register came on
        self._gone: dict[bytes, None] = {}  # registered identities whose connection ended, in that order
        self._last_fd: int | None = None  # the connection the last delivery came on
        self._registering: set[bytes] = set()  # peers whose authenticated Register was taken by `start`
        self._successor: tuple[bytes, protocol.Register] | None = None  # a new external worker's Register
        self._early: dict[int, dict[int, object]] = {}  # step id -> rank -> a result that came before its turn
        self.failed: str | None = None

    @property
    def process(self) -> subprocess.Popen | None:
        """Rank 0's process, when spawned."""
        return self.processes[0] if self.processes else None

    async def start(self, register_timeout: float = 300.0) -> protocol.WorkerHello:
        """Spawn (or wait for) every rank, send them the config, return the group's capacity report.

        The report is rank 0's with ``max_num_gpu_blocks`` and ``swap_bandwidth`` the minimum over
        ranks (every rank holds every block, of its own heads). register_timeout: seconds to wait for
        external ranks to connect. Raises WorkerFailed on a protocol-version mismatch, ranks that do not
        form 0..N-1 of this world size, a load error or a missed deadline.
        """
        n = self.world_size
        if self.spawn:
            env = dict(os.environ, PAGEDKV_PARENT_PID=str(os.getpid()))
            env[protocol.SECRET_ENV] = self._secret.decode()
            rendezvous = f"tcp://127.0.0.1:{_free_loopback_port()}"
            # the ranks log at the control plane's level (debug: tracebacks of their failures), in its format
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
            for rank in range(n):
                # a group's ranks all run on this host: a LOCAL_RANK / LOCAL_WORLD_SIZE inherited from the
                # control plane's environment (torchrun, a job launcher) put every rank on one GPU
                local = {"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n)} if n > 1 else {}
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "pagedkv.worker", "--connect", self.address, "--rank", str(rank),
                     "--world-size", str(n), "--dist-init-method", rendezvous, "--log-level", level,
                     "--log-format", current_format()], env={**env, **local}))
                log.info("worker process started", rank=rank, pid=self.processes[-1].pid, address=self.address)
        else:
            log.info("waiting for a worker to connect" if n == 1 else f"waiting for {n} worker ranks to connect",
                     address=self.address)
        start_timeout = max(self.timeout, _START_SECONDS)
        started = time.monotonic()
        by_rank: dict[int, bytes] = {}
        deadline = time.monotonic() + (register_timeout if not self.spawn else start_timeout)
        while len(by_rank) < n:
            missing = [r for r in range(n) if r not in by_rank]
            if self._successor is not None:  # it registered while its predecessor was still ours
                (identity, msg), self._successor = self._successor, None
            else:
                identity, msg = await self._recv_any(deadline, register_timeout if not self.spawn else start_timeout,
                                                     f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}")
            if not isinstance(msg, protocol.Register):
                raise WorkerFailed(f"expected Register from the worker, got {type(msg).__name__}")
            if msg.protocol_version != protocol.PROTOCOL_VERSION:
                raise WorkerFailed(f"worker speaks protocol version {msg.protocol_version}, "
                                   f"control plane {protocol.PROTOCOL_VERSION}: upgrade both together")
            if msg.world_size != n or not 0 <= msg.rank < n or msg.rank in by_rank:
                raise WorkerFailed(f"a worker registered as rank {msg.rank} of {msg.world_size}; this control "
                                   f"plane needs ranks 0..{n - 1} of {n} once each (--tensor-parallel-size {n})")
            by_rank[msg.rank] = identity
            self._registering.add(identity)
        self._identities = [by_rank[r] for r in range(n)]
        self._registering = set()
        log.info("loading the model and profiling memory", model=self.config.model or "embedded",
                 load_format=self.config.load_format, world_size=n)
        for rank in range(n):
            await self._send_to(rank, self._channel.seal_to_worker(protocol.LoadModel(self.config, rank, n)))
        hellos = await self._gather(protocol.WorkerHello, start_timeout)
        if len({(h.dtype, h.kv_bytes_per_block) for h in hellos}) > 1:
            raise WorkerFailed("ranks disagree on dtype or KV block size: "
                               + ", ".join(f"rank {h.rank} {h.device} {h.dtype} {h.kv_bytes_per_block} B" for h in hellos)
                               + " (give every host the same --dtype and device kind)")
        hello = msgspec.structs.replace(
            hellos[0], max_num_gpu_blocks=min(h.max_num_gpu_blocks for h in hellos),
            swap_bandwidth=min((h.swap_bandwidth for h in hellos if h.swap_bandwidth), default=None))
        log.info("model loaded", device=hello.device, dtype=hello.dtype, max_num_gpu_blocks=hello.max_num_gpu_blocks,
                 kv_bytes_per_block=hello.kv_bytes_per_block, seconds=round(time.monotonic() - started, 2))
        return hello

    async def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        await self._broadcast(protocol.InitCache(num_gpu_blocks, num_cpu_blocks))
        await self._gather(protocol.WorkerReady, max(self.timeout, _START_SECONDS))

    async def step(self, plan: protocol.StepPlan) -> protocol.StepResult:
        """`submit` one plan and wait for its `result`."""
        await self.submit(plan)
        return await self.result(plan.step_id)

    async def submit(self, plan: protocol.StepPlan) -> None:
        """Send one plan to every rank without waiting for it: each rank computes plans in the order sent.

        Raises what encoding raises (OverflowError, UnicodeEncodeError, ValueError, TypeError) when the
        plan cannot be sent; nothing is sent then.
        """
        await self._broadcast(plan)

    async def result(self, step_id: int) -> protocol.StepResult:
        """Wait for every rank's result of step ``step_id``; return rank 0's (the tokens).

        Results must be asked for in the order the plans were sent. Raises WorkerFailed on a death
        or a missed deadline (``--worker-timeout``, counted from this call), when a rank of a group
        reports an error (the group cannot run another step: see `worker.worker`), and when a rank
        sampled other token ids than rank 0 (every rank samples; their mirrors must agree). A single
        worker's step error is returned in the result, as the worker keeps serving.
        """
        results = await self._gather(protocol.StepResult, self.timeout, step_id)
        tokens = [[(t.request_id, t.token_id) for t in r.sampled] for r in results]
        if bad := next((rank for rank, ids in enumerate(tokens) if ids != tokens[0]), None):
            self.failed = (f"worker rank {bad} sampled other tokens than rank 0 in step {step_id}: the ranks' "
                           "request mirrors no longer agree")
            raise WorkerFailed(self.failed)
        return results[0]

    async def _broadcast(self, msg) -> None:
        payload = self._channel.seal_to_worker(msg)  # encoded and sealed once; the same bytes go to every rank
        for rank in range(len(self._identities)):
            await self._send_to(rank, payload)

    async def _send_to(self, rank: int, payload: bytes) -> None:
        await self._sock.send_multipart([self._identities[rank], payload], copy=False)

    async def _gather(self, kind: type, timeout: float, step_id: int | None = None) -> list:
        """One message of type ``kind`` from every rank (for ``step_id`` when given), in rank order.

        In a group, the first failed StepResult raises WorkerFailed at once: its peers may wait in a
        collective until their timeout, and the group is lost anyway.
        """
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        ranks = {identity: rank for rank, identity in enumerate(self._identities)}
        early = self._early.pop(step_id, {}) if step_id is not None else {}
        while len(replies) < len(self._identities):
            missing = [r for r in range(len(self._identities)) if r not in replies]
            if missing[0] in early:
                rank = missing[0]
                msg = early.pop(rank)
            else:
                identity, msg = await self._recv_any(deadline, timeout,
                                                     f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}")
                rank = ranks.get(identity)
            if (rank is not None and step_id is not None and isinstance(msg, kind) and msg.step_id > step_id
                    and rank not in self._early.get(msg.step_id, {})):
                self._early.setdefault(msg.step_id, {})[rank] = msg  # a fast rank is a step ahead of a slow one
                continue
            if rank is None or not isinstance(msg, kind) or (step_id is not None and msg.step_id != step_id):
                what = f"the result of step {step_id}" if step_id is not None else kind.__name__
                self.failed = f"expected {what} from every rank, got {msg!r:.200} from rank {rank}"
                raise WorkerFailed(self.failed)
            if self.world_size > 1 and getattr(msg, "error", None) is not None:
                # a dead rank is the cause its peer's error only hints at; its exit may take a moment
                for _ in range(10 if self.processes or self._monitor is not None else 0):
                    self._check_processes()
                    self._check_connections()
                    if self.failed is not None:
                        raise WorkerFailed(self.failed)
                    await asyncio.sleep(0.1)
                self.failed = f"worker group failed step {step_id}: {msg.error}"
                raise WorkerFailed(self.failed)
            replies[rank] = msg
        return [replies[r] for r in range(len(self._identities))]

    async def _recv_any(self, deadline: float, timeout: float, waiting_for: str) -> tuple[bytes, object]:
        """The next message from any rank before ``deadline`` (time.monotonic): (its identity, the message).

        timeout (the deadline's length) and waiting_for (who is late) word the error.
        """
        while True:
            self._check_processes()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                who = "worker" if self.world_size == 1 else f"worker {waiting_for}"
                self.failed = f"{who} did not answer within {timeout:g} s (--worker-timeout)"
                if self._bad_macs and not self._identities:  # the likely cause, said where it is read
                    self.failed += (f"; {self._bad_macs} frames with a wrong MAC arrived meanwhile: does the worker "
                                    f"have this control plane's secret ({protocol.SECRET_ENV}, --worker-secret-file)?")
                raise WorkerFailed(self.failed)
            # A result already waiting is read at once: awaiting poll() costs several event-loop passes,
            # each as long as everything else ready on the loop (a burst of arriving requests, streaming)
            ready = self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN
            if not ready and not await self._sock.poll(timeout=int(min(_POLL_SECONDS, remaining) * 1000)):
                self._check_connections()
                if self.failed is not None:
                    raise WorkerFailed(self.failed)
            else:
                frames = await self._recv()
                msg = self._open(frames)
                if self.failed is not None:  # a new worker registered in this one's place
                    raise WorkerFailed(self.failed)
                if msg is None:
                    continue
                if isinstance(msg, protocol.WorkerError):
                    self.failed = f"worker error: {msg.message}"
                    raise WorkerFailed(self.failed)
                return frames[0], msg

    async def _recv(self) -> list[bytes]:
        """One ROUTER delivery as bytes; the connection each authenticated Register came on is noted
        (for an external rank) so that its end can be told from another peer's (`_check_connections`)."""
        frames = await self._sock.recv_multipart(copy=False)
        if self._monitor is not None and len(frames) == 2:
            self._check_connections()  # events of earlier connections first: their fd may be reused by this one
            try:
                self._last_fd = frames[1].get(zmq.SRCFD)
            except zmq.ZMQError:  # a ZMTP 1.0 peer's frames carry none (libzmq); never a worker's
                self._last_fd = None
        return [f.bytes for f in frames]

    def _check_connections(self) -> None:
        """Read the monitor's pending events; the end of the connection of a rank of the group (or of
        one registering for it) fails the client. Other peers' disconnects count for nothing."""
        if self._monitor is None:
            return
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            fd = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["value"]
            for identity in [i for i, known in self._fds.items() if known == fd]:
                del self._fds[identity]  # the fd may serve a new connection next
                self._gone[identity] = None
        group = {*self._identities, *self._registering, *self._successors()}
        # the first to go is the cause: in a group, a rank whose peer died fails its step and exits too
        if self.failed is None and (gone := next((i for i in self._gone if i in group), None)) is not None:
            reg = self._registered[gone]
            who = "external worker" if self.world_size == 1 else f"external worker rank {reg.rank}"
            self.failed = f"{who} (pid {reg.pid}) disconnected"
            log.warning("worker disconnected", rank=reg.rank, pid=reg.pid, address=self.address)

    def _successors(self) -> tuple[bytes, ...]:
        return (self._successor[0],) if self._successor is not None else ()

    def _open(self, frames: list[bytes]):
        """The verified message of a ROUTER delivery, or None when it was dropped (and counted).

        Before the group is complete, an authenticated Register from a new peer is taken (`start`
        checks its rank); after, only the registered ranks are heard.
        """
        why = None
        registered = bool(self._identities)
        if len(frames) != 2:
            why = f"{len(frames)} frames"
        else:
            try:  # verified before decoded, like every frame
                msg = self._channel.open_from_worker(frames[1])
            except protocol.Unauthenticated as e:
                why = str(e)
                self._bad_macs += not registered
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                why = f"an authenticated but malformed message: {e}"
            else:
                known = frames[0] in self._identities or frames[0] in self._registering
                if registered and not known:
                    why = "a peer other than the registered workers"
                    if isinstance(msg, protocol.Register) and not self.spawn and self.world_size == 1:
                        self._note_register(frames[0], msg)
                        self._successor = (frames[0], msg)
                        self.failed = f"a new worker (pid {msg.pid}) registered: the previous one is gone"
                        return None
                elif not registered and not known and not isinstance(msg, protocol.Register):
                    why = f"{type(msg).__name__} before Register"
                else:
                    if isinstance(msg, protocol.Register):
                        self._note_register(frames[0], msg)
                    return msg
        self._dropped += 1
        now = time.monotonic()
        if now - self._dropped_logged_at >= 1.0:  # a flood of junk must not flood the log
            log.warning("dropped worker-channel messages", address=self.address, count=self._dropped, last=why)
            self._dropped, self._dropped_logged_at = 0, now
        return None

    def _note_register(self, identity: bytes, msg: protocol.Register) -> None:
        if self._monitor is not None:  # external: watch the connection it came on
            self._registered[identity], self._fds[identity] = msg, self._last_fd

    def _check_processes(self) -> None:
        """Raise WorkerFailed naming the first spawned rank that has exited."""
        for rank, process in enumerate(self.processes):
            if (code := process.poll()) is not None:
                who = "worker" if self.world_size == 1 else f"worker rank {rank} (pid {process.pid})"
                self.failed = f"{who} process exited with code {code}"
                raise WorkerFailed(self.failed)

    async def check_alive(self) -> None:
        """Raise WorkerFailed when the worker is known to be gone: a spawned rank that exited, an
        external rank whose connection ended, or an external worker whose successor registered.
        Never waits; for an idle engine."""
        if self.failed is None:
            try:
                self._check_processes()
            except WorkerFailed:
                pass  # self.failed says why
        while self.failed is None and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            if (msg := self._open(await self._recv())) is not None:
                log.warning("dropped an unexpected message from an idle worker", type=type(msg).__name__)
        self._check_connections()
        if self.failed is not None:
            raise WorkerFailed(self.failed)

    async def forget_worker(self) -> None:
        """External workers failed: keep the bound socket for the ones their supervisor starts next.

        The old ranks, should they still run, are told to shut down and their frames are dropped
        from now on; the next workers to register (perhaps already, `_successor`) are taken by `start`.
        """
        if self._identities or self._registering:
            payload = self._channel.seal_to_worker(protocol.Shutdown())
            for identity in (*self._identities, *self._registering):
                try:
                    await self._sock.send_multipart([identity, payload], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for identity in (*self._identities, *self._registering):  # a successor that registered stays watched
            self._registered.pop(identity, None)
            self._fds.pop(identity, None)
            self._gone.pop(identity, None)
        self._identities, self._registering, self.failed = [], set(), None
        self._early.clear()

    async def kill(self) -> None:
        """Kill every spawned rank for certain (SIGKILL) and reap it: a failed worker must not hold its pool.

        External ranks cannot be killed from here: they see the control plane's socket close (or
        get Shutdown) and exit; their supervisor restarts them.
        """
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            await _reap(process)

    async def close(self) -> None:
        """Ask every rank to exit, then make sure the spawned ones did; release the socket. Idempotent."""
        if self._sock.closed:
            return
        if self._identities and self.failed is None:
            try:
                await self._broadcast(protocol.Shutdown())
            except zmq.ZMQError:
                pass
        if self.failed is not None:
            await self.kill()  # died or missed a deadline: do not wait for a rank stuck in a collective to notice
        for process in self.processes:
            if not await _reap(process, timeout=10):
                process.kill()
                process.wait()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor_owner.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except OSError:
                pass
