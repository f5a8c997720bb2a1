"""The authenticated worker channel (issue 12): junk and forged messages on the control plane's worker
port change nothing; the engine keeps serving the golden on stories260K.

Before the channel was sealed, one ZMTP frame of junk, a forged ``Register`` or random bytes on
``--worker-address tcp://...`` killed the engine at its next step.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import threading

import pytest
import zmq
import zmq.asyncio
from conftest import GOLDEN_OUTPUT_IDS, GOLDEN_PROMPT_IDS, collect

from pagedkv.common.config import EngineConfig
from pagedkv.common.protocol import (PROTOCOL_VERSION, Channel, Register, Shutdown, StepResult, Unauthenticated,
                                     encode)
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.engine import Engine

GREEDY_60 = SamplingParams(temperature=0, max_tokens=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _attack(address: str) -> None:
    """Everything an unauthenticated peer can send: raw bytes, junk frames, forged and foreign-sealed messages."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(os.urandom(4096))  # not even a ZMTP greeting
    await writer.drain()
    writer.close()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    forged_register = encode(Register(protocol_version=PROTOCOL_VERSION, pid=1))
    await dealer.send(os.urandom(64))
    await dealer.send(forged_register)  # well-formed, unsealed
    await dealer.send(Channel(b"guessed-secret-0123456789").seal_from_worker(Register(PROTOCOL_VERSION, 1)))
    await dealer.send(b"\x00" * 32 + encode(StepResult(step_id=0)))  # a MAC of zeros
    await dealer.send_multipart([b"two", b"frames"])
    await asyncio.sleep(0.3)
    dealer.close(0)
    ctx.term()


async def test_junk_and_forged_messages_on_the_worker_port_change_nothing(stories260k):
    address = f"tcp://127.0.0.1:{_free_port()}"
    engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=32,
                                             swap_space=0.001), worker_address=address)
    try:
        await _attack(address)  # while idle
        assert engine.healthy
        stream = engine.add_request(GOLDEN_PROMPT_IDS, GREEDY_60)
        attack = asyncio.create_task(_attack(address))  # and while steps run
        tokens, _, last = await collect(stream)
        await attack
        assert tokens == GOLDEN_OUTPUT_IDS and last.finish_reason == "length"
        tokens, _, _ = await collect(engine.add_request(GOLDEN_PROMPT_IDS, GREEDY_60))
        assert tokens == GOLDEN_OUTPUT_IDS
        assert engine.healthy
    finally:
        await engine.shutdown()


def test_external_worker_needs_a_secret():
    from pagedkv.scheduler.worker_client import WorkerClient

    with pytest.raises(ValueError, match="PAGEDKV_WORKER_SECRET"):
        WorkerClient(EngineConfig(), "ipc:///tmp/pagedkv-test-never.sock", spawn=False)


def test_a_frame_is_verified_before_it_is_decoded():
    channel = Channel(b"s" * 32)
    frame = channel.seal_to_worker(Shutdown())
    assert isinstance(channel.open_to_worker(frame), Shutdown)
    for bad in (frame[:-1], b"x" + frame[1:], frame[:31], b""):
        with pytest.raises(Unauthenticated):
            channel.open_to_worker(bad)
    with pytest.raises(Unauthenticated):  # a worker's message cannot be reflected back as a control one
        channel.open_to_worker(channel.seal_from_worker(StepResult(step_id=1)))


class _FakeRank:
    """A DEALER that registers with the shared secret like `pagedkv worker --connect` (no model)."""

    def __init__(self, ctx, address: str, secret: bytes, pid: int, rank: int = 0, world_size: int = 1):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.frame = Channel(secret).seal_from_worker(Register(PROTOCOL_VERSION, pid, rank, world_size))

    async def register(self) -> None:
        await self.sock.send(self.frame)


async def _wait_failed(client, timeout: float = 30.0) -> str:
    from pagedkv.scheduler.worker_client import WorkerFailed

    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        try:
            await client.check_alive()
        except WorkerFailed as e:
            return str(e)
        await asyncio.sleep(0.05)
    raise AssertionError("the end of the worker's connection was not noticed")


async def test_the_end_of_an_external_workers_connection_fails_the_client_and_no_other_peers_does():
    """A registered external worker's connection is watched (matched by fd to its Register): junk peers
    that come and go change nothing, the worker's own disconnect fails `check_alive` without a step."""
    from pagedkv.scheduler.worker_client import WorkerClient

    secret, address = b"k" * 64, f"tcp://127.0.0.1:{_free_port()}"
    client = WorkerClient(EngineConfig(), address, spawn=False, secret=secret)
    ctx = zmq.asyncio.Context()
    try:
        worker = _FakeRank(ctx, address, secret, pid=4242)
        await worker.register()
        identity, msg = await client._recv_any(asyncio.get_running_loop().time() + 30, 30, "rank 0")
        assert isinstance(msg, Register) and msg.pid == 4242
        client._identities = [identity]  # as `start` leaves it, without a model to load

        await _attack(address)
        other = _FakeRank(ctx, address, b"not-the-secret" * 4, pid=1)  # registers with the wrong secret
        await other.register()
        await asyncio.sleep(0.3)
        other.sock.close(0)
        await asyncio.sleep(1.0)
        await client.check_alive()  # nothing of theirs counts

        worker.sock.close(0)
        assert await _wait_failed(client) == "external worker (pid 4242) disconnected"
    finally:
        client.failed = client.failed or "test over"
        await client.close()
        ctx.term()


async def test_a_worker_with_another_secret_fails_the_start_naming_the_secret():
    """Its Register is dropped (wrong MAC); the start's timeout says why instead of only 'did not answer'."""
    from pagedkv.scheduler.worker_client import WorkerClient, WorkerFailed

    address = f"tcp://127.0.0.1:{_free_port()}"
    client = WorkerClient(EngineConfig(), address, spawn=False, secret=b"k" * 64)
    ctx = zmq.asyncio.Context()
    try:
        other = _FakeRank(ctx, address, b"not-the-secret" * 4, pid=1)  # kept: its socket lives till the end
        await other.register()
        with pytest.raises(WorkerFailed) as e:
            await client.start(register_timeout=1.0)
        assert str(e.value) == ("worker did not answer within 1 s (--worker-timeout); 1 frames with a wrong MAC "
                                "arrived meanwhile: does the worker have this control plane's secret "
                                "(PAGEDKV_WORKER_SECRET, --worker-secret-file)?")
    finally:
        other.sock.close(0)  # before term(), which waits for every socket
        await client.close()
        ctx.term()


async def test_a_rank_that_disconnects_while_its_group_forms_fails_the_start_at_once():
    """-tp 2 by hand: rank 0 registers, then dies before rank 1 comes; `start` says so instead of
    waiting out the registration timeout, and `forget_worker` leaves nothing of it to trip the next start."""
    from pagedkv.scheduler.worker_client import WorkerClient, WorkerFailed

    secret, address = b"k" * 64, f"tcp://127.0.0.1:{_free_port()}"
    client = WorkerClient(EngineConfig(tensor_parallel_size=2), address, spawn=False, secret=secret)
    ctx = zmq.asyncio.Context()
    try:
        rank0 = _FakeRank(ctx, address, secret, pid=5000, rank=0, world_size=2)
        await rank0.register()
        starting = asyncio.create_task(client.start(register_timeout=300))
        await asyncio.sleep(0.5)
        rank0.sock.close(0)
        with pytest.raises(WorkerFailed, match=r"^external worker rank 0 \(pid 5000\) disconnected$"):
            await asyncio.wait_for(starting, 30)
        await client.forget_worker()
        assert client._registering == set() and not client._gone and client.failed is None
        await client.check_alive()
    finally:
        client.failed = client.failed or "test over"
        await client.close()
        ctx.term()


def test_a_worker_the_control_plane_never_answers_says_why_and_logs_its_shutdown(monkeypatch, caplog):
    """A worker with another secret than its control plane's used to wait silently forever: the control
    plane drops its frames and cannot seal a word back. Now it says what to check; and a worker told
    to shut down (another worker took its rank) says so before it exits."""
    import threading

    from pagedkv.worker import worker as worker_mod
    monkeypatch.setattr(worker_mod, "UNANSWERED_SECONDS", 0.3)
    monkeypatch.setattr(worker_mod, "POLL_MS", 50)
    secret = b"the-workers-secret-0123456789"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{_free_port()}"
    router.bind(address)
    caplog.set_level("INFO", logger="pagedkv.worker")
    thread = threading.Thread(target=worker_mod.run, args=(address, secret))
    thread.start()
    try:
        identity, frame = router.recv_multipart()  # its Register, which a control plane of another secret drops
        assert router.poll(2000) == 0  # nothing more: the worker waits
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warnings == [f"the control plane at {address} has not answered this worker's Register in 0 s: does "
                            "it have the same worker secret (PAGEDKV_WORKER_SECRET, --secret-file)? (it also waits "
                            "for every rank of a group, and takes one worker per rank)"]
        router.send_multipart([identity, Channel(secret).seal_to_worker(Shutdown())])
        thread.join(5)
        assert not thread.is_alive()
        assert caplog.records[-1].getMessage() == (f"the control plane at {address} told this worker to shut "
                                                   "down; exiting")
    finally:
        router.close(0)
        ctx.term()


class _SilentRelay:
    """A TCP relay between a worker and its control plane that can fall silent without closing, as the
    link to a host that lost power or was cut off by a partition does: no FIN, no RST, nothing."""

    def __init__(self, upstream_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        self.silent = threading.Event()
        self.sockets = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:  # closed
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [down, up]
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self.silent.is_set():
            if select.select([src], [], [], 0.05)[0] and not self.silent.is_set():
                try:
                    data = src.recv(65536)
                    dst.sendall(data)
                except OSError:
                    return
                if not data:
                    return

    def close(self) -> None:
        self.silent.set()
        for s in self.sockets:
            s.close()


def test_an_idle_worker_whose_control_plane_falls_silent_over_tcp_exits(caplog):
    """A control plane whose host vanishes sends no FIN: an idle external worker used to wait for ever,
    holding its device memory. Its ZMTP heartbeats (`protocol.HEARTBEAT_MS`: a PING every 1 s, 5 s
    without an answer) now close the silent connection, and the worker exits as on a disconnect."""
    from pagedkv.worker import worker as worker_mod

    secret = b"the-shared-secret-0123456789"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = _free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    relay = _SilentRelay(port)
    address = f"tcp://127.0.0.1:{relay.port}"
    caplog.set_level("INFO", logger="pagedkv.worker")
    thread = threading.Thread(target=worker_mod.run, args=(address, secret), daemon=True)
    thread.start()
    try:
        assert router.poll(30_000)
        assert isinstance(Channel(secret).open_from_worker(router.recv_multipart()[1]), Register)
        relay.silent.set()
        thread.join(30)  # a bound far above the heartbeat's 5 s; without heartbeats it waited for ever
        assert not thread.is_alive()
        assert caplog.records[-1].getMessage() == f"control plane at {address} disconnected; exiting"
    finally:
        relay.close()  # a worker still waiting sees the connection end now
        thread.join(30)
        router.close(0)
        ctx.term()


async def test_a_worker_whose_host_falls_silent_fails_the_client_over_tcp():
    """The other way round: the control plane's heartbeats close the connection of an external worker
    whose host went silent (no FIN), and the client fails as on a disconnect."""
    from pagedkv.scheduler.worker_client import WorkerClient

    secret, port = b"k" * 64, _free_port()
    client = WorkerClient(EngineConfig(), f"tcp://127.0.0.1:{port}", spawn=False, secret=secret)
    relay = _SilentRelay(port)
    ctx = zmq.asyncio.Context()
    try:
        worker = _FakeRank(ctx, f"tcp://127.0.0.1:{relay.port}", secret, pid=4343)
        await worker.register()
        identity, msg = await client._recv_any(asyncio.get_running_loop().time() + 30, 30, "rank 0")
        assert isinstance(msg, Register) and msg.pid == 4343
        client._identities = [identity]  # as `start` leaves it, without a model to load
        relay.silent.set()
        assert await _wait_failed(client) == "external worker (pid 4343) disconnected"
    finally:
        relay.close()
        worker.sock.close(0)
        client.failed = client.failed or "test over"
        await client.close()
        ctx.term()
