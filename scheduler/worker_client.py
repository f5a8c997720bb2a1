"""The control plane's side of the ZeroMQ link to the worker process.

The control plane binds a ROUTER socket (``ipc://`` in a temp dir by default, or ``tcp://``) and
either spawns the worker itself (``python -m pagedkv.worker --connect ADDR``) or waits for one started on
its own (``pagedkv worker --connect ADDR``). Every reply has a deadline: a worker that dies or stops
answering raises `WorkerFailed` instead of being waited on forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid

import zmq
import zmq.asyncio

from pagedkv.common import protocol
from pagedkv.common.config import EngineConfig
from pagedkv.common.log import get_logger

log = get_logger("pagedkv.worker_client")

_POLL_SECONDS = 0.5  # how often a waiting call checks that a spawned worker is still alive
_START_SECONDS = 600.0  # loading a large checkpoint and profiling may take minutes; steps may not


class WorkerFailed(RuntimeError):
    """The worker died, missed its deadline, or reported an error it cannot recover from."""


def default_worker_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/pagedkv-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"


class WorkerClient:
    """One worker process (rank 0) behind a ROUTER socket.

    timeout: seconds a step may take before the worker is declared failed (``--worker-timeout``);
    each start-up phase (load, profile, allocate) may take up to the larger of it and 600 s.
    """

    def __init__(self, config: EngineConfig, address: str | None = None, spawn: bool = True):
        self.config = config
        self.address = address or default_worker_address()
        self.spawn = spawn
        self.timeout = config.worker_timeout
        self.process: subprocess.Popen | None = None
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._identity: bytes | None = None
        self.failed: str | None = None

    async def start(self, register_timeout: float = 300.0) -> protocol.WorkerHello:
        """Spawn (or wait for) the worker, send it the config, return its capacity report.

        register_timeout: seconds to wait for an external worker to connect.
        Raises WorkerFailed on a protocol-version mismatch, a load error or a missed deadline.
        """
        if self.spawn:
            env = dict(os.environ, PAGEDKV_PARENT_PID=str(os.getpid()))
            # the worker logs at the control plane's level (debug: tracebacks of its failures)
            level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
            self.process = subprocess.Popen([sys.executable, "-m", "pagedkv.worker", "--connect", self.address,
                                             "--log-level", level], env=env)
            log.info("worker process started", pid=self.process.pid, address=self.address)
        else:
            log.info("waiting for a worker to connect", address=self.address)
        start_timeout = max(self.timeout, _START_SECONDS)
        started = time.monotonic()
        msg = await self._recv(timeout=register_timeout if not self.spawn else start_timeout)
        if not isinstance(msg, protocol.Register):
            raise WorkerFailed(f"expected Register from the worker, got {type(msg).__name__}")
        if msg.protocol_version != protocol.PROTOCOL_VERSION:
            raise WorkerFailed(f"worker speaks protocol version {msg.protocol_version}, "
                               f"control plane {protocol.PROTOCOL_VERSION}: upgrade both together")
        log.info("loading the model and profiling memory", model=self.config.model or "embedded",
                 load_format=self.config.load_format, pid=msg.pid)
        await self._send(protocol.LoadModel(self.config))
        hello = await self._recv(start_timeout)
        if not isinstance(hello, protocol.WorkerHello):
            raise WorkerFailed(f"expected WorkerHello, got {type(hello).__name__}")
        log.info("model loaded", device=hello.device, dtype=hello.dtype, max_num_gpu_blocks=hello.max_num_gpu_blocks,
                 kv_bytes_per_block=hello.kv_bytes_per_block, seconds=round(time.monotonic() - started, 2))
        return hello

    async def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        await self._send(protocol.InitCache(num_gpu_blocks, num_cpu_blocks))
        ready = await self._recv(max(self.timeout, _START_SECONDS))
        if not isinstance(ready, protocol.WorkerReady):
            raise WorkerFailed(f"expected WorkerReady, got {type(ready).__name__}")

    async def step(self, plan: protocol.StepPlan) -> protocol.StepResult:
        """Send one plan and wait for its result. Raises WorkerFailed on death or deadline."""
        await self._send(plan)
        result = await self._recv(self.timeout)
        if not isinstance(result, protocol.StepResult) or result.step_id != plan.step_id:
            raise WorkerFailed(f"expected the result of step {plan.step_id}, got {result!r:.200}")
        return result

    async def _send(self, msg) -> None:
        await self._sock.send_multipart([self._identity or b"", protocol.encode(msg)])

    async def _recv(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and (code := self.process.poll()) is not None:
                self.failed = f"worker process exited with code {code}"
                raise WorkerFailed(self.failed)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.failed = f"worker did not answer within {timeout:g} s (--worker-timeout)"
                raise WorkerFailed(self.failed)
            if await self._sock.poll(timeout=int(min(_POLL_SECONDS, remaining) * 1000)):
                identity, payload = await self._sock.recv_multipart()
                self._identity = identity
                msg = protocol.decode_from_worker(payload)
                if isinstance(msg, protocol.WorkerError):
                    self.failed = f"worker error: {msg.message}"
                    raise WorkerFailed(self.failed)
                return msg

    async def close(self) -> None:
        """Ask the worker to exit, then make sure it did; release the socket."""
        if self._identity is not None and self.failed is None:
            try:
                await self._send(protocol.Shutdown())
            except zmq.ZMQError:
                pass
        if self.process is not None:
            if self.failed is not None and self.process.poll() is None:
                self.process.terminate()  # it missed a deadline: do not wait for it to notice
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.process.wait, 10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._sock.close(linger=0)
        self._ctx.term()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except OSError:
                pass
