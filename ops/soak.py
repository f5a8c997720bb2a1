"""Soak test: many requests against a real `pagedkv serve`, with client aborts, mixed n, beam search,
streaming, swap pressure and worker kills; then check that every KV block came back.

    python ops/soak.py --model ../shared/models/stories260K --requests 10000 --kill-interval 180
    python ops/soak.py --model ../shared/models/stories260K --requests 1000 --kill-every 400   # CI size

The server runs as its own process (`pagedkv serve`, a small KV pool so swaps and preemptions
happen); this script is the clients. Each request picks, from a seeded RNG: a prompt (text or token
ids), ``max_tokens`` in [2, --max-tokens], ``n`` in {1, 2, 4} or beam search (n = 2), streamed or
not, and with probability --abort-rate a moment to walk away (a streamed client after a few chunks,
a blocking one after a short delay). The worker process is killed with SIGKILL every --kill-every
requests and/or every --kill-interval seconds; the server must recover and the streams go on.

Prints and writes (--out) a JSON report: completed, aborted, walkaways (clients drawn to walk
away; one whose answer came first counts as completed), errors by type, p50/p99 end-to-end
latency of completed requests (seconds), worker kills (SIGKILLs that hit a live worker) beside the
server's `pagedkv:worker_restarts_total` and `pagedkv:worker_restart_failures_total` (every kill
forces one worker start: a kill landing on a replacement while it starts fails that start, and the
next one follows, so kills == restarts), blocks leaked (device and host, must be 0), and the control
plane's RSS at start and at the end (MiB). Exit status 1 when any block leaked, any request failed,
the restarts counted differ from the kills, or the worker killer failed (`killer_errors`: a /health
check that got no answer, or the error that ended the killer).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a big red ball",
           "Tom wanted to", "The sun was hot and", "She looked at the sky and"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))
    return round(kb / 1024, 1)


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid``: a killed worker not yet reaped (a zombie) is not one."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return [c for c in out if _alive(c)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:  # reaped meanwhile
        return False


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q of them at or below it (int(q * n) was one
    rank high whenever q * n is whole: the p50 of two values was the larger, p99 of 100 the maximum)."""
    if not values:
        return None
    values = sorted(values)
    return round(values[max(0, min(len(values) - 1, math.ceil(q * len(values)) - 1))], 4)


def _request_body(rng: random.Random, max_tokens: int) -> dict:
    body: dict = {"max_tokens": rng.randint(2, max_tokens), "ignore_eos": rng.random() < 0.5}
    body["prompt"] = rng.choice(PROMPTS) if rng.random() < 0.7 else \
        [1] + [rng.randrange(3, 512) for _ in range(rng.randint(4, 60))]
    kind = rng.random()
    if kind < 0.1:
        body.update(use_beam_search=True, n=2, temperature=0)
    else:
        body["n"] = rng.choice([1, 1, 1, 2, 4])
        body["temperature"] = rng.choice([0, 0.8])
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
    body["stream"] = not body.get("use_beam_search") and rng.random() < 0.5
    return body


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.outcomes: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.latencies: list[float] = []
        self.walkaways = 0  # clients drawn to walk away; those whose answer came first count as completed
        self.done = 0
        self.kills = 0
        # what stopped or skipped kills: the killer task's failure (else lost when it is cancelled, and
        # the soak passed with restarts == kills == 0) and /health checks that got no answer
        self.killer_errors: collections.Counter = collections.Counter()

    async def one(self, session: aiohttp.ClientSession, url: str, body: dict, abort_after: float | None,
                  abort_chunks: int | None) -> None:
        start = time.monotonic()
        try:
            async with asyncio.timeout(abort_after):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        self.errors[f"http_{resp.status}"] += 1
                        return
                    if not body["stream"]:
                        data = await resp.json()
                        if len(data["choices"]) != body["n"]:
                            self.errors["wrong_number_of_choices"] += 1
                            return
                    else:
                        chunks = 0
                        async for line in resp.content:
                            if not line.startswith(b"data: "):
                                continue
                            if line.startswith(b"data: [DONE]"):
                                break
                            event = json.loads(line[len(b"data: "):])
                            if "error" in event:
                                self.errors["stream_error:" + event["error"]["message"][:60]] += 1
                                return
                            chunks += 1
                            if abort_chunks is not None and chunks >= abort_chunks:
                                self.outcomes["aborted"] += 1
                                return  # leaving the context closes the connection: the server aborts
                        else:
                            self.errors["stream_without_done"] += 1
                            return
            self.outcomes["completed"] += 1
            self.latencies.append(time.monotonic() - start)
        except TimeoutError:
            if abort_after is None:  # the session's own timeout: a request that hung, not a walkaway
                self.errors["timeout"] += 1
            else:
                self.outcomes["aborted"] += 1
        except aiohttp.ClientError as e:
            self.errors[type(e).__name__] += 1
        finally:
            self.done += 1

    async def killer(self, url: str, server_pid: int) -> None:
        """SIGKILL the serving worker every --kill-every requests and/or --kill-interval seconds.

        A kill that falls due while the server recovers waits for /health 200: killing each
        replacement as it starts would only test the restart limit (past a backoff longer than
        --kill-interval, every start would be killed).
        """
        a, next_at, next_time = self.args, self.args.kill_every, time.monotonic() + (self.args.kill_interval or 0)
        async with aiohttp.ClientSession() as session:  # its own: the clients' pool may be full
            while self.done < a.requests:
                await asyncio.sleep(0.05)
                due = (a.kill_every and self.done >= next_at) or (a.kill_interval and time.monotonic() >= next_time)
                if not due:
                    continue
                try:
                    async with session.get(url + "/health") as r:
                        if r.status != 200:
                            continue
                except aiohttp.ClientError as e:  # the server must stay reachable: reported, and tried again
                    self.killer_errors[f"/health: {type(e).__name__}"] += 1
                    continue
                self._kill(server_pid)
                next_at += a.kill_every or 0
                next_time = time.monotonic() + (a.kill_interval or 0)

    def _kill(self, server_pid: int) -> None:
        """SIGKILL every live worker of the server; counts one kill when any was there."""
        killed = False  # a kill that finds no live worker (one is being replaced) forces no restart
        for pid in _children(server_pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed = True
            except ProcessLookupError:  # exited and reaped since it was listed
                pass
        self.kills += killed

    async def run(self, url: str, server_pid: int) -> None:
        a = self.args
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(a.requests):
            body = _request_body(self.rng, a.max_tokens)
            abort = self.rng.random() < a.abort_rate
            self.walkaways += abort
            abort_chunks = self.rng.randint(1, 3) if abort and body["stream"] else None
            abort_after = self.rng.uniform(0.01, 0.3) if abort and not body["stream"] else None
            queue.put_nowait((body, abort_after, abort_chunks))
        connector = aiohttp.TCPConnector(limit=a.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def client() -> None:
                while not queue.empty():
                    await self.one(session, url, *queue.get_nowait())

            killer = asyncio.create_task(self.killer(url, server_pid))
            await asyncio.gather(*(client() for _ in range(a.concurrency)))
            killer.cancel()
            try:
                await killer
            except asyncio.CancelledError:
                pass
            except Exception as e:  # noqa: BLE001 - kills stopped there: the soak must not pass as if they went on
                self.killer_errors[f"{type(e).__name__}: {e}"] += 1


async def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server did not become healthy")


async def _final_state(url: str) -> tuple[dict, dict]:
    """The pool once every request has ended (waits for aborts to land) and the worker serves (a restart
    under way is finished), and the fault and pressure counters."""
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 60
        while True:
            async with s.get(url + "/kv_cache") as r:
                snap = await r.json()
            async with s.get(url + "/health") as r:
                serving = r.status == 200
            if serving and not snap["requests"] and not snap["swapped_requests"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    def total(name: str, label: str = "") -> float:
        return sum(float(v) for v in re.findall(rf"^pagedkv:{name}_total\{{[^}}]*{label}[^}}]*\}} (\S+)$", text, re.M))

    return snap, {"worker_restarts": total("worker_restarts"),
                  "worker_restart_failures": total("worker_restart_failures"),
                  "preemptions_recompute": total("num_preemptions", 'mode="recompute"'),
                  "preemptions_swap": total("num_preemptions", 'mode="swap"'),
                  "blocks_swapped_out": total("num_blocks_swapped_out")}


async def main_async(args: argparse.Namespace) -> dict:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedkv.scheduler.cli", "serve", "--port", str(port), "--device", "cpu",
           "--num-gpu-blocks", str(args.num_gpu_blocks), "--swap-space", str(args.swap_space),
           "--preemption-mode", "auto", "--max-worker-restarts", "1000", "--max-model-len", "256",
           "--log-level", "warning", "--log-format", "json"]
    if args.model:
        cmd += ["--model", args.model]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL)
    try:
        await _wait_healthy(url, proc, 300)
        soak = Soak(args)
        # warm-up (not counted), then the control plane's RSS at start
        warm = Soak(argparse.Namespace(**{**vars(args), "requests": 50, "kill_every": 0, "kill_interval": 0,
                                          "abort_rate": 0.3}))
        await warm.run(url, proc.pid)
        rss_start = _rss_mib(proc.pid)
        started = time.monotonic()
        await soak.run(url, proc.pid)
        seconds = time.monotonic() - started
        snap, counters = await _final_state(url)
        report = {
            "requests": args.requests,
            "completed": soak.outcomes["completed"],
            "aborted": soak.outcomes["aborted"],
            "walkaways": soak.walkaways,
            "errors": dict(soak.errors),
            "p50_latency_s": _percentile(soak.latencies, 0.50),
            "p99_latency_s": _percentile(soak.latencies, 0.99),
            "worker_kills": soak.kills,
            "killer_errors": dict(soak.killer_errors),
            **counters,
            "blocks_leaked": snap["num_gpu_blocks"] - snap["num_free_blocks"],
            "host_blocks_leaked": snap["num_cpu_blocks"] - snap["num_free_cpu_blocks"],
            "live_requests_left": len(snap["requests"]) + len(snap["swapped_requests"]),
            "rss_mib_start": rss_start,
            "rss_mib_end": _rss_mib(proc.pid),
            "seconds": round(seconds, 1),
            "server_alive": proc.poll() is None,
        }
        return report
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded random model)")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32, help="clients at once")
    p.add_argument("--abort-rate", type=float, default=0.3, help="share of clients that walk away")
    p.add_argument("--max-tokens", type=int, default=12, help="max_tokens is drawn from [2, this]")
    p.add_argument("--num-gpu-blocks", type=int, default=48, help="a small pool: preemptions and swaps happen")
    p.add_argument("--swap-space", type=float, default=0.002, help="GiB of host swap pool")
    p.add_argument("--kill-every", type=int, default=0, metavar="N", help="SIGKILL the worker every N requests")
    p.add_argument("--kill-interval", type=float, default=0, metavar="SECONDS",
                   help="SIGKILL the worker every SECONDS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--server-log", default=None, help="write the server's log here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if passed(report) else 1


def passed(report: dict) -> bool:
    return (report["blocks_leaked"] == 0 and report["host_blocks_leaked"] == 0 and not report["errors"]
            and report["live_requests_left"] == 0 and report["server_alive"] and not report["killer_errors"]
            and report["worker_restarts"] == report["worker_kills"])


if __name__ == "__main__":
    sys.exit(main())
