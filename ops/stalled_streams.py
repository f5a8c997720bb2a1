"""What clients that stop reading cost the server: the control plane's RSS with stalled streams.

    python ops/stalled_streams.py --model ../shared/models/stories260K            # 20 streams, n 16 x 490
    python ops/stalled_streams.py --model ../shared/models/stories260K --streams 5 --n 4

Starts `pagedkv serve` on the CPU, sends one request to warm it up and reads the control plane's RSS
(the serve process, not its worker), then opens --streams streamed completions (n, max_tokens,
--logprobs, ignore_eos) on raw sockets with a 4 KiB receive buffer and reads nothing: each server
write soon waits on a full TCP window while the engine runs the requests to their end. Once no
request is left running it samples the RSS (the stall), then reads every stream to its end, checks
that each choice got all its tokens and counts the SSE events, and samples the RSS again.

Prints a JSON report: rss_mib at start, while stalled (after every request finished) and after the
reads, the peak (VmHWM), the tokens and events received, and the seconds the requests took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import subprocess
import sys
import time

import aiohttp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status_mib(pid: int, field: str) -> float:
    """VmRSS or VmHWM of process ``pid`` in MiB."""
    with open(f"/proc/{pid}/status") as f:
        kb = int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))
    return round(kb / 1024, 1)


async def _wait(url: str, proc: subprocess.Popen, ready, timeout: float) -> None:
    """Poll ``url`` until ``ready(status, body)``; raise RuntimeError when the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(url) as r:
                    if ready(r.status, await r.read()):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}: not ready within {timeout} s")


async def _open_stalled(port: int, body: bytes) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small TCP window, soon full
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def _read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    raw = b""
    while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 2**20), 60)
        if not chunk:
            raise RuntimeError(f"stream ended early: {raw[-200:]!r}")
        raw += chunk
    sock.close()
    return raw


def _count(raw: bytes, n: int) -> tuple[list[int], int]:
    """Tokens per choice (from the logprobs, else the usage chunk's total split evenly, once every choice
    has its finish reason) and the number of delta events of one stream."""
    events = [json.loads(e) for e in re.findall(rb"data: (\{.*?\})\r?\n\r?\n", raw)]
    deltas = [e for e in events if e["choices"]]
    choices = [c for e in deltas for c in e["choices"]]
    if choices[0]["logprobs"] is None:
        finished = sorted(c["index"] for c in choices if c["finish_reason"])
        total = events[-1]["usage"]["completion_tokens"] if finished == list(range(n)) else 0
        return [total // n] * n, len(deltas)
    tokens = [0] * n
    for c in choices:
        tokens[c["index"]] += len(c["logprobs"]["tokens"])
    return tokens, len(deltas)


async def main_async(args: argparse.Namespace) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedkv.scheduler.cli", "serve", "--port", str(port), "--device", "cpu",
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    if args.num_gpu_blocks:
        cmd += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        await _wait(url + "/health", proc, lambda status, _: status == 200, 300)
        async with aiohttp.ClientSession() as s:  # warm-up: every code path a stream takes, once
            async with s.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16,
                                                             "n": 2, "logprobs": 5, "stream": True}) as r:
                await r.read()
        await asyncio.sleep(1)
        rss_start = _status_mib(proc.pid, "VmRSS")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": args.max_tokens, "n": args.n,
                           "logprobs": None if args.logprobs < 0 else args.logprobs, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        started = time.monotonic()
        socks = [await _open_stalled(port, body) for _ in range(args.streams)]
        await asyncio.sleep(1)  # the requests arrive
        await _wait(url + "/kv_cache", proc, lambda _, b: not json.loads(b)["requests"], 1800)
        seconds = time.monotonic() - started
        rss_stalled = [_status_mib(proc.pid, "VmRSS")]
        for _ in range(3):  # flat while stalled?
            await asyncio.sleep(1)
            rss_stalled.append(_status_mib(proc.pid, "VmRSS"))
        raws = await asyncio.gather(*(_read_all(s) for s in socks))
        await asyncio.sleep(1)
        counts = [_count(raw, args.n) for raw in raws]
        return {"streams": args.streams, "n": args.n, "max_tokens": args.max_tokens, "logprobs": args.logprobs,
                "requests_seconds": round(seconds, 1),
                "rss_mib_start": rss_start, "rss_mib_stalled": rss_stalled,
                "rss_mib_after_reads": _status_mib(proc.pid, "VmRSS"), "rss_mib_peak": _status_mib(proc.pid, "VmHWM"),
                "all_tokens_received": all(tokens == [args.max_tokens] * args.n for tokens, _ in counts),
                "tokens_received": sum(sum(tokens) for tokens, _ in counts),
                "delta_events_received": sum(events for _, events in counts),
                "bytes_received": sum(len(raw) for raw in raws)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded random-weights model)")
    p.add_argument("--streams", type=int, default=20, help="stalled streams, opened at once")
    p.add_argument("--n", type=int, default=16, help="choices per stream")
    p.add_argument("--max-tokens", type=int, default=490, help="tokens per choice (ignore_eos)")
    p.add_argument("--logprobs", type=int, default=5, help="top alternatives per token; -1: no logprobs")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV pool size (default: profiled)")
    print(json.dumps(asyncio.run(main_async(p.parse_args())), indent=1))


if __name__ == "__main__":
    main()
