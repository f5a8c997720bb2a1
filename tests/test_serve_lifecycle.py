"""`pagedkv serve` start and stop under faults (issue 12): SIGTERM drains (503 for new work, in-flight
requests finish), an engine that cannot serve makes the process exit non-zero, stale ipc socket
files of dead control planes are removed, the open-files limit is raised."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from conftest import GOLDEN_PROMPT, GOLDEN_PROMPT_IDS, assert_all_blocks_free, collect
from test_cli import REPO, SMALL_POOL, Server

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.worker_client import remove_stale_sockets


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sigterm_refuses_new_work_lets_streams_finish_then_exits_0(stories260k):
    server = Server("--model", str(stories260k), *SMALL_POOL, "--shutdown-timeout", "300")
    terminated = False
    try:
        req = urllib.request.Request(server.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": GOLDEN_PROMPT, "max_tokens": 300, "ignore_eos": True,
                                                      "temperature": 0, "stream": True}).encode())
        stream = urllib.request.urlopen(req, timeout=300)
        first = stream.readline()
        assert first.startswith(b"data: ")
        server.proc.send_signal(signal.SIGTERM)
        terminated = True
        deadline = time.monotonic() + 60
        while (health := _get(server.url + "/health"))[0] == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert health == (503, {"status": "draining", "reason": None})
        status, body = _post(server.url + "/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 4})
        assert status == 503 and "draining" in body["error"]["message"]
        events = [first] + stream.read().split(b"\n\n")
        chunks = [json.loads(e[len(b"data: "):]) for e in events if e.strip().startswith(b"data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the stream ran to its end
        assert events[-2].strip() == b"data: [DONE]"
    finally:
        if terminated:  # it exits on its own once the stream is done: a second SIGTERM would race its teardown
            server.proc.stderr.read()
            code = server.proc.wait(timeout=120)
        else:
            code, _ = server.stop(signal.SIGTERM)
    assert code == 0


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_serve_exits_nonzero_when_the_engine_cannot_go_on(stories260k):
    server = Server("--model", str(stories260k), *SMALL_POOL, "--max-worker-restarts", "0")
    [worker] = _children(server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    rest = server.proc.stderr.read()
    assert server.proc.wait(timeout=120) == 1
    events = [json.loads(x) for x in rest.splitlines() if x.startswith("{")]
    failed = next(e for e in events if e["event"] == "engine failed; exiting")
    assert failed["error"].startswith("failed: worker process exited with code -9")


async def test_drain_deadline_aborts_what_is_left_and_frees_every_block(start):
    engine = await start(device="cpu", num_gpu_blocks=32)
    stream = engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    await stream.__anext__()
    await engine.drain(0.2)
    _, _, last = await collect(stream)
    assert last.finish_reason == "abort"
    assert engine.health() == (False, "draining")
    with pytest.raises(RuntimeError, match="draining"):
        engine.add_request(GOLDEN_PROMPT_IDS, SamplingParams(temperature=0, max_tokens=4))
    await asyncio.sleep(0)
    assert_all_blocks_free(engine)


def test_stale_ipc_socket_files_of_dead_control_planes_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = tempfile.gettempdir()
    stale = os.path.join(tmp, f"pagedkv-{dead.pid}-0badcafe.sock")
    live = os.path.join(tmp, f"pagedkv-{os.getpid()}-0badcafe.sock")
    for path in (stale, live):
        open(path, "w").close()
    try:
        assert stale in remove_stale_sockets()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_serve_raises_the_open_files_soft_limit_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = ("import resource; from pagedkv.scheduler.cli import raise_open_files_limit; "
            "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    low = min(256, hard)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard)))
    assert out.returncode == 0, out.stderr
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert out.stdout.strip() == f"({low}, {want}) ({want}, {hard})"




def test_connections_beyond_the_open_files_limit_are_logged(stories260k, tmp_path):
    """At the hard limit the event loop sheds connections (clients see resets); the server says so."""
    import socket

    log = open(tmp_path / "serve.log", "w+")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.scheduler.cli", "serve", "--port", str(port), "--model",
                             str(stories260k), *SMALL_POOL, "--log-format", "json"], stderr=log, cwd=REPO,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96)))
    socks = []
    try:
        deadline = time.monotonic() + 300
        while '"serving"' not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        for _ in range(150):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            socks.append(c)
        while "open files near the limit" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        for c in socks:
            c.close()
        proc.terminate()
        proc.wait(timeout=60)
    event = next(json.loads(x) for x in (tmp_path / "serve.log").read_text().splitlines()
                 if "open files near the limit" in x)
    assert event["level"] == "error" and event["limit"] == 96


def test_serve_logs_served_name_debug_steps_and_absorbs_signals_while_tearing_down(stories260k):
    """The "serving" line names --served-model-name; --log-level debug adds a line per request and per
    step; an echo with max_tokens 0 logs no completion tokens; SIGTERMs sent throughout the drain and
    the teardown leave the exit status 0 (a second one once killed the server with -15)."""
    import threading

    server = Server("--model", str(stories260k), *SMALL_POOL, "--served-model-name", "tiny-stories",
                    "--log-level", "debug")
    assert server.events[-1]["event"] == "serving" and server.events[-1]["model"] == "tiny-stories"
    golden = server.post("/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 60, "temperature": 0})
    echo = server.post("/v1/completions", {"prompt": GOLDEN_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert golden["usage"]["completion_tokens"] == 60 and echo["usage"]["completion_tokens"] == 0

    def keep_signalling() -> None:
        while server.proc.poll() is None:
            try:
                server.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                return
            time.sleep(0.005)

    signaller = threading.Thread(target=keep_signalling)
    signaller.start()
    rest = server.proc.stderr.read()
    code = server.proc.wait(timeout=120)
    signaller.join()
    assert code == 0
    events = server.events + [json.loads(x) for x in rest.splitlines() if x.startswith("{")]
    finished = {e["request_id"]: e["completion_tokens"] for e in events if e["event"] == "request finished"}
    assert finished == {golden["id"]: 60, echo["id"]: 0}
    added = [(e["request_id"], e["prompt_tokens"], e["max_tokens"], e["level"]) for e in events
             if e["event"] == "request added"]
    assert added == [(golden["id"], 5, 60, "debug"), (echo["id"], 5, 1, "debug")]
    steps = [e for e in events if e["event"] == "step"]
    # the golden: a 5-token prefill, then 59 one-token decodes; the echo: its 5-token prefill
    assert [s["num_scheduled_tokens"] for s in steps] == [5] + [1] * 59 + [5]
    assert [s["num_new_requests"] for s in steps] == [1] + [0] * 59 + [1]
    assert {s["level"] for s in steps} == {"debug"} and steps[-1]["running"] == 0
    assert [e["event"] for e in events].count("shutting down") == 1
    assert [e["event"] for e in events].count("second signal: aborting the requests in flight") == 1
