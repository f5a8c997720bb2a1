"""The Grafana dashboard (ops/grafana) evaluated by a real Prometheus scraping a real engine under load.

Prometheus (the Debian package; `.ci/run` installs it) scrapes the engine every second while
requests overflow a small pool (preemptions by swap). Every PromQL query of every panel is then
run through Prometheus' HTTP API as Grafana runs it (a range query over the load, with
``$__rate_interval`` expanded as Grafana does) and must return data. With the worker stopped
(SIGSTOP), the engine's state cannot move: the usage panel's value must then equal /kv_cache's.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
from aiohttp.test_utils import TestServer
from browser import require_binary

from pagedkv.common.config import EngineConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.engine import Engine

DASHBOARD = Path(__file__).resolve().parents[1] / "ops" / "grafana" / "dashboards" / "pagedkv.json"
SCRAPE_S = 1
# Grafana: $__rate_interval = max($__interval + scrape interval, 4 x scrape interval); a panel a
# few minutes wide on a 1 s scrape has $__interval = 1 s.
RATE_INTERVAL = f"{max(1 + SCRAPE_S, 4 * SCRAPE_S)}s"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panels += [p for row in panels for p in row.get("panels", [])]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def promql(http: aiohttp.ClientSession, path: str, **params) -> list[dict]:
    async with http.get(path, params=params) as resp:
        body = await resp.json()
    assert resp.status == 200 and body["status"] == "success", (params, body)
    return body["data"]["result"]


async def test_every_dashboard_query_returns_data_and_usage_equals_kv_cache(stories260k, tmp_path):
    prometheus = require_binary("prometheus")
    engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", num_gpu_blocks=16,
                                             max_num_seqs=8, preemption_mode="swap", swap_space=0.001,
                                             worker_timeout=60))
    server = TestServer(build_app(engine), host="127.0.0.1", port=0)
    await server.start_server()
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_S}s, evaluation_interval: {SCRAPE_S}s}}\n"
        f"scrape_configs:\n  - job_name: pagedkv\n    metrics_path: /metrics\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]\n")
    prom = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    stop = asyncio.Event()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as prom_http, \
                aiohttp.ClientSession(str(server.make_url(""))) as api:
            deadline = time.monotonic() + 60
            while True:  # ready, and scraping the engine
                try:
                    up = await promql(prom_http, "/api/v1/query", query="up")
                    if up and up[0]["value"][1] == "1":
                        break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
                await asyncio.sleep(0.5)

            async def client(i: int) -> None:
                n = 0
                while not stop.is_set():  # short and long requests, so every latency histogram moves
                    body = {"prompt": [1, 300 + i, 400 + n % 50], "max_tokens": 8 + 40 * ((i + n) % 3),
                            "ignore_eos": True, "temperature": 1.0}
                    async with api.post("/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    n += 1

            start = time.time()
            clients = [asyncio.create_task(client(i)) for i in range(8)]
            # 6 s of load: every rate() window (4 s) then holds several scrapes
            while engine.scheduler.num_preemptions < 5 or time.time() - start < 6:
                await asyncio.sleep(0.5)
            await asyncio.sleep(2 * SCRAPE_S)  # the scrapes after the load's last events
            end = time.time()

            queries = dashboard_queries()
            assert len(queries) >= 15
            for title, expr in queries:
                query = expr.replace("$__rate_interval", RATE_INTERVAL)
                series = await promql(prom_http, "/api/v1/query_range", query=query, start=start, end=end,
                                       step=SCRAPE_S)
                values = [float(v) for s in series for _, v in s["values"]]
                assert any(math.isfinite(v) for v in values), f"{title}: {query} returned no data"
            swapped = await promql(prom_http, "/api/v1/query", query="sum(pagedkv:num_blocks_swapped_out_total)")
            assert float(swapped[0]["value"][1]) > 0

            # Freeze the engine mid-load: the worker stops, so no step ends and no block moves.
            os.kill(engine.client.process.pid, signal.SIGSTOP)
            try:
                frozen_at = time.time()
                await asyncio.sleep(0.3)
                async with api.get("/kv_cache") as resp:
                    snap = await resp.json()
                await asyncio.sleep(3 * SCRAPE_S)
                usage_expr = next(e for t, e in queries if t == "KV cache usage")
                (usage,) = await promql(prom_http, "/api/v1/query", query=usage_expr)
                (scraped_at,) = await promql(prom_http, "/api/v1/query",
                                             query="timestamp(pagedkv:kv_cache_usage_perc)")
                running = await promql(prom_http, "/api/v1/query", query="sum(pagedkv:num_requests_running)")
                async with api.get("/kv_cache") as resp:
                    assert await resp.json() == snap  # nothing moved while frozen
            finally:
                os.kill(engine.client.process.pid, signal.SIGCONT)
            assert float(scraped_at["value"][1]) > frozen_at + 0.3
            assert snap["usage"] > 0 and float(usage["value"][1]) == snap["usage"]
            assert int(float(running[0]["value"][1])) == snap["num_requests_running"]
            stop.set()
            await asyncio.gather(*clients)
    finally:
        stop.set()
        prom.terminate()
        prom.wait(10)
        await server.close()
        await engine.shutdown()
