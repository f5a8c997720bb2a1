"""GET /kv_cache/ui in a real headless Chromium (system package), against a real engine under load.

What the page draws is read back from its canvas, block by block, and compared with the very
/kv_cache response the page rendered (captured from Chromium's network log, so it is the server's
answer, not the page's own account of it).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from browser import Chromium

from pagedkv.common.config import EngineConfig
from pagedkv.scheduler.api import build_app
from pagedkv.scheduler.api_keys import APIKeys
from pagedkv.scheduler.engine import Engine

# The page's colours (kv_cache_ui.html): free, cached and evictable, referenced once, shared, host used.
COLOURS = {(222, 226, 233): "free", (142, 202, 230): "cached", (42, 157, 143): "ref1", (231, 111, 81): "shared"}
HOST_COLOURS = {(222, 226, 233): "free", (155, 93, 229): "used"}

# Reads the pixel at the top-left corner of every block's cell from the canvas backing store.
READ_CANVAS = """(() => {
  const out = {};
  for (const which of ["device", "host"]) {
    const pool = kvui.state[which], L = pool.layout, c = document.getElementById(which);
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data, px = [];
    if (L.blocksPerCell === 1)
      for (let i = 0; i < pool.states.length; i++) {
        const o = (Math.floor(i / L.cols) * L.cell * c.width + (i % L.cols) * L.cell) * 4;
        px.push([d[o], d[o + 1], d[o + 2]]);
      }
    out[which] = {layout: L, pixels: px};
  }
  out.snapshot = kvui.state.snapshot;
  out.legend = Object.fromEntries(["free", "cached", "ref1", "shared", "host-free", "host-used"].map(
      (k) => [k, Number(document.getElementById("c-" + k).textContent.replace(/,/g, ""))]));
  out.rows = [...document.querySelectorAll("#requests tr[data-id]")].map(
      (tr) => [...tr.children].map((td) => td.textContent));
  return out;
})()"""


def expected_counts(snap: dict) -> dict:
    refs = snap["block_ref_counts"].values()
    return {"free": snap["num_free_blocks"] - snap["num_cached_free_blocks"], "cached": snap["num_cached_free_blocks"],
            "ref1": sum(r == 1 for r in refs), "shared": sum(r > 1 for r in refs)}


def ranges(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(f"{ids[i]}–{ids[j]}" if j > i else str(ids[i]))
        i = j + 1
    return " ".join(out)


async def kv_cache_bodies(page) -> list[dict]:
    """Every /kv_cache response body the page received so far (Chromium's network log)."""
    bodies = []
    ids = [e["params"]["requestId"] for e in page.events
           if e["method"] == "Network.responseReceived" and e["params"]["response"]["url"].endswith("/kv_cache")]
    for rid in ids:
        try:
            bodies.append(json.loads((await page.send("Network.getResponseBody", requestId=rid))["body"]))
        except RuntimeError:  # still loading, or evicted from the buffer
            pass
    return bodies


async def observe(page) -> dict:
    """Pause the page, read what it drew, check it against the /kv_cache response it drew, resume."""
    await page.evaluate("kvui.pause()")
    await asyncio.sleep(0.5)  # a poll in flight lands (and is not drawn)
    seen = await page.evaluate(READ_CANVAS)
    snap = seen["snapshot"]
    assert snap in await kv_cache_bodies(page), "the page drew something /kv_cache never sent"
    drawn = [COLOURS[tuple(p)] for p in seen["device"]["pixels"]]
    assert len(drawn) == snap["num_gpu_blocks"]
    counts = {k: drawn.count(k) for k in ("free", "cached", "ref1", "shared")}
    assert counts == expected_counts(snap)
    for b, ref in snap["block_ref_counts"].items():  # block by block, not only the totals
        assert drawn[int(b)] == ("shared" if ref > 1 else "ref1")
    for b in snap["cached_free_block_ids"]:
        assert drawn[b] == "cached"
    host = [HOST_COLOURS[tuple(p)] for p in seen["host"]["pixels"]]
    used = {b for r in snap["swapped_requests"] for b in r["host_block_table"]}
    assert len(host) == snap["num_cpu_blocks"] and {i for i, h in enumerate(host) if h == "used"} == used
    assert seen["legend"] == {**counts, "host-free": snap["num_cpu_blocks"] - len(used), "host-used": len(used)}
    # one row per live request, with its block table (host blocks for a swapped one)
    host_tables = {r["id"]: r["host_block_table"] for r in snap["swapped_requests"]}
    rows = {r[0]: r for r in seen["rows"]}
    assert set(rows) == {r["id"] for r in snap["requests"]}
    for r in snap["requests"]:
        table = host_tables[r["id"]] if r["status"] == "swapped" else r["block_table"]
        assert rows[r["id"]][1:] == [r["status"], f"{r['num_computed_tokens']} / {r['num_tokens']}", str(len(table)),
                                     ("host " if r["status"] == "swapped" else "") + ranges(table)]
    await page.evaluate("kvui.resume()")
    return {"snapshot": snap, "counts": counts, "layout": seen["device"]["layout"]}


async def hover_block(page, block: int) -> str:
    """Move the mouse over a device block's cell; returns the tooltip's text."""
    box = await page.evaluate("""(() => { const c = document.getElementById("device"), r = c.getBoundingClientRect();
        return {x: r.left + c.clientLeft, y: r.top + c.clientTop}; })()""")
    layout = await page.evaluate("kvui.state.device.layout")
    x = box["x"] + (block % layout["cols"] + 0.5) * layout["cell"]
    y = box["y"] + (block // layout["cols"] + 0.5) * layout["cell"]
    await page.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
    return await page.wait_for("document.getElementById('tip').style.display === 'block' && "
                               "document.getElementById('tip').textContent")


@pytest.fixture
async def served(stories260k):
    engines, servers = [], []

    async def serve(api_keys: APIKeys | None = None, **kw) -> tuple[Engine, str]:
        engine = await Engine.start(EngineConfig(model=str(stories260k), device="cpu", worker_timeout=60, **kw))
        engines.append(engine)
        server = TestServer(build_app(engine, api_keys=api_keys), host="127.0.0.1", port=0)
        await server.start_server()
        servers.append(server)
        return engine, str(server.make_url("")).rstrip("/")

    yield serve
    for s in servers:
        await s.close()
    for e in engines:
        await e.shutdown()


async def test_page_draws_every_block_as_kv_cache_reports_it_and_follows_requests(served, tmp_path):
    # 24 blocks of 8 tokens: 3 pairs (n = 2) sharing a 17-token prompt's 2 full blocks, long outputs
    # that overflow the pool, so the page sees sharing, swapping and requests coming and going.
    engine, base = await served(num_gpu_blocks=24, block_size=8, max_num_seqs=8, preemption_mode="swap",
                                swap_space=0.0005)  # 25 host blocks of 20 KiB
    prompt = list(range(300, 317))
    async with aiohttp.ClientSession(base) as http, Chromium(tmp_path / "profile") as browser:
        page = await browser.page(f"{base}/kv_cache/ui?interval=150")
        await page.wait_for("document.body.dataset.renders >= 1")
        idle = await observe(page)
        assert idle["counts"] == {"free": 24, "cached": 0, "ref1": 0, "shared": 0}

        async def complete(max_tokens: int) -> dict:
            body = {"prompt": prompt, "max_tokens": max_tokens, "n": 2, "temperature": 1.0, "ignore_eos": True}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                return await resp.json()

        load = [asyncio.create_task(complete(40 + 15 * i)) for i in range(3)]
        await page.wait_for("kvui.state.snapshot.block_ref_counts && "
                            "Object.values(kvui.state.snapshot.block_ref_counts).some((r) => r > 1)")
        busy = await observe(page)
        assert busy["counts"]["shared"] >= 1 and busy["snapshot"]["requests"]
        await page.evaluate("kvui.pause()")
        await asyncio.sleep(0.5)
        snap = await page.evaluate("kvui.state.snapshot")
        shared = next(int(b) for b, r in snap["block_ref_counts"].items() if r > 1)
        tip = await hover_block(page, shared)
        assert tip.startswith(f"block {shared} · shared · ref {snap['block_ref_counts'][str(shared)]}\n")
        if shot := os.environ.get("PAGEDKV_UI_SCREENSHOT"):  # docs/kv-cache-ui.png comes from here
            await page.screenshot(Path(shot))
        await page.evaluate("kvui.resume()")

        await asyncio.gather(*load)
        # every request ended: the page follows, and now agrees with a /kv_cache fetched directly
        await page.wait_for("kvui.state.snapshot.requests.length === 0 && kvui.state.snapshot.usage === 0")
        done = await observe(page)
        async with http.get("/kv_cache") as resp:
            now = await resp.json()
        assert done["snapshot"] == now and done["counts"] == expected_counts(now)
        assert done["counts"]["ref1"] == done["counts"]["shared"] == 0 and done["counts"]["cached"] >= 2
        assert engine.scheduler.num_preemptions > 0
        await page.close()


async def test_with_api_keys_the_page_asks_for_the_key_keeps_it_for_the_tab_and_sends_it(served, tmp_path):
    """Keys on: the page loads without a key (it holds no data), says why /kv_cache refused it, takes
    the key from its form (a wrong one is refused with the server's reason), keeps it in the tab's
    sessionStorage across a reload, sends it as a bearer token, and draws the pool exactly."""
    engine, base = await served(num_gpu_blocks=16, swap_space=0.0005, api_keys=APIKeys(["sk-alice"], ["sk-admin"]))
    status = "document.getElementById('status').textContent"
    form_shown = "!document.getElementById('auth').hidden"

    async def enter_key(page, key: str) -> None:
        await page.evaluate("document.getElementById('key').focus()")
        await page.send("Input.insertText", text=key)
        await page.evaluate("document.querySelector('#auth button').click()")

    def kv_cache_auth(page) -> list:
        """The Authorization header of every /kv_cache request the page sent, in order (None: none)."""
        return [e["params"]["request"]["headers"].get("Authorization") for e in page.events
                if e["method"] == "Network.requestWillBeSent" and e["params"]["request"]["url"].endswith("/kv_cache")]

    async with aiohttp.ClientSession(base) as http, Chromium(tmp_path / "profile") as browser:
        async with http.get("/kv_cache/ui") as resp:
            assert resp.status == 200 and resp.content_type == "text/html"
        async with http.get("/kv_cache/advice") as resp:
            assert resp.status == 401
        page = await browser.page(f"{base}/kv_cache/ui?interval=150")
        await page.wait_for(f"{form_shown} && {status}.includes('401')")
        assert await page.evaluate(status) == (
            "this server needs an API key (/kv_cache: HTTP 401: You didn't provide an API key. You need to provide "
            "your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).); "
            "enter it to watch the pool")
        assert await page.evaluate("document.getElementById('status').className") == "error"
        assert await page.evaluate("kvui.state.renders") == 0

        await enter_key(page, "sk-alice")  # a key, but not the admin key /kv_cache takes
        await page.wait_for(f"{form_shown} && {status}.startsWith('the API key was refused')")
        assert await page.evaluate(status) == ("the API key was refused (/kv_cache: HTTP 401: Incorrect API key "
                                               "provided: /kv_cache takes an admin key (--admin-api-key).); "
                                               "enter it to watch the pool")
        assert await page.evaluate("sessionStorage.getItem('pagedkv-api-key')") is None

        await enter_key(page, "sk-admin")
        await page.wait_for("kvui.state.renders >= 1")
        assert not await page.evaluate(form_shown)
        assert await page.evaluate("document.getElementById('status').className") == ""
        assert await page.evaluate("sessionStorage.getItem('pagedkv-api-key')") == "sk-admin"
        sent = kv_cache_auth(page)
        assert sent[:2] == [None, "Bearer sk-alice"] and set(sent[2:]) == {"Bearer sk-admin"}
        idle = await observe(page)
        assert idle["counts"] == {"free": 16, "cached": 0, "ref1": 0, "shared": 0}

        await page.send("Page.reload")  # the same tab: the key is kept, not asked for again
        await page.wait_for("kvui.state.renders >= 1")
        assert not await page.evaluate(form_shown)
        await page.evaluate("document.getElementById('forget').click()")
        assert await page.evaluate("sessionStorage.getItem('pagedkv-api-key')") is None
        await page.wait_for(f"{form_shown} && {status}.startsWith('this server needs an API key')")  # asked again

        page.events.clear()
        await page.send("Page.navigate", url=f"{base}/kv_cache/ui?interval=200#key=sk-admin")
        await page.wait_for("kvui.state.renders >= 1")
        assert await page.evaluate("location.hash") == ""  # out of the address bar and the history
        assert await page.evaluate("sessionStorage.getItem('pagedkv-api-key')") == "sk-admin"
        assert set(kv_cache_auth(page)) == {"Bearer sk-admin"}
        await page.close()


async def test_page_stays_exact_at_100k_device_blocks_and_summarises_a_million_host_blocks(tmp_path):
    """The page alone (its real HTML) against a synthetic /kv_cache of 100,000 device blocks in every
    state and 1,000,000 host blocks: every device block gets its own cell with the right colour, and
    the host pool, too large for its canvas, is drawn k blocks per pixel in their mean colour."""
    from aiohttp import web

    from pagedkv.scheduler.api import _KV_CACHE_UI

    n, n_host = 100_000, 1_000_000
    refs = {str(b): 1 + (b // 7) % 4 for b in range(0, n, 2)}  # every other block held, 1 to 4 times
    cached = list(range(1, n, 6))  # a third of the free ones still hold a cached prefix
    swapped = [{"id": f"swapped-{i}", "num_computed_tokens": 64, "host_block_table": list(range(i * 5000, i * 5000 + 3000))}
               for i in range(100)]
    snap = {"block_size": 16, "num_gpu_blocks": n, "num_free_blocks": n - len(refs), "num_cached_free_blocks": len(cached),
            "usage": len(refs) / n, "prefix_caching": True, "block_ref_counts": refs, "cached_free_block_ids": cached,
            "num_cpu_blocks": n_host, "num_free_cpu_blocks": n_host - 300_000, "cpu_usage": 0.3,
            "num_requests_swapped": 100, "swapped_requests": swapped, "num_requests_running": 1,
            "num_requests_waiting": 0,
            "requests": [{"id": "r0", "status": "running", "num_tokens": 32, "num_computed_tokens": 31,
                          "block_table": [0, 2], "num_prompt_tokens": 8, "max_tokens": 64}]
                       + [{"id": s["id"], "status": "swapped", "num_tokens": 64, "num_computed_tokens": 64,
                           "block_table": [], "num_prompt_tokens": 8, "max_tokens": 64} for s in swapped]}
    async def ui(request):
        return web.Response(body=_KV_CACHE_UI, content_type="text/html")

    async def kv_cache(request):
        return web.json_response(snap)

    async def metrics(request):
        return web.Response(text="")

    async def advice(request):
        return web.json_response({"advice": [], "observed": {}})

    app = web.Application()
    for path, handler in (("/kv_cache/ui", ui), ("/kv_cache", kv_cache), ("/metrics", metrics),
                          ("/kv_cache/advice", advice)):
        app.router.add_get(path, handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        async with Chromium(tmp_path / "profile") as browser:
            page = await browser.page(str(server.make_url("/kv_cache/ui?interval=2000")))
            await page.wait_for("document.body.dataset.renders >= 1")
            seen = await page.evaluate(READ_CANVAS.replace("out.snapshot = kvui.state.snapshot;", ""))
            draw_ms = await page.evaluate("kvui.state.lastDrawMs")
            summary = await page.evaluate("""(() => { const c = document.getElementById("host");
                const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
                return {layout: kvui.state.host.layout, first: Array.from(d.slice(0, 4 * 4000))}; })()""")
            tip = await hover_block(page, 14)
            await page.close()
    finally:
        await server.close()
    drawn = [COLOURS[tuple(p)] for p in seen["device"]["pixels"]]
    cached_set = set(cached)
    want = ["ref1" if refs.get(str(b)) == 1 else "shared" if str(b) in refs else "cached" if b in cached_set else "free"
            for b in range(n)]
    assert drawn == want and seen["device"]["layout"]["blocksPerCell"] == 1
    assert seen["legend"] == {"free": want.count("free"), "cached": len(cached), "ref1": want.count("ref1"),
                              "shared": want.count("shared"), "host-free": 700_000, "host-used": 300_000}
    assert refs["14"] == 3 and tip == "block 14 · shared · ref 3"  # no live request holds it: no names
    # the host pool: k blocks per pixel, each pixel the rounded mean colour of its k blocks
    layout = summary["layout"]
    k = layout["blocksPerCell"]
    assert k > 1 and layout["cols"] * layout["rows"] * k >= n_host
    used = {b for s in swapped for b in s["host_block_table"]}
    free_c, used_c = (222, 226, 233), (155, 93, 229)
    for p in range(1000):
        blocks = range(p * k, min(n_host, (p + 1) * k))
        m = sum(b in used for b in blocks)
        mean = [round((m * u + (len(blocks) - m) * f) / len(blocks)) for u, f in zip(used_c, free_c)]
        assert summary["first"][4 * p:4 * p + 3] == mean, p
    print(f"100K device blocks + 1M host blocks drawn in {draw_ms:.1f} ms")
