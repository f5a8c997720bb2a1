"""The authenticated worker channel (issue 12): junk and forged messages on the control plane's worker
port change nothing; the engine keeps serving the golden on stories260K.

Before the channel was sealed, one ZMTP frame of junk, a forged ``Register`` or random bytes on
``--worker-address tcp://...`` killed the engine at its next step.
"""

from __future__ import annotations

import asyncio
import os
import socket

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
