"""A headless Chromium driven over the Chrome DevTools Protocol, for the tests of /kv_cache/ui.

Chromium comes from the system packages (Debian ``chromium``; `.ci/run` installs it). The test
starts it with ``--remote-debugging-port=0``, reads the DevTools address it prints, and talks to
one page target over a WebSocket (aiohttp): commands are ``{"id", "method", "params"}`` messages
answered by id, events arrive as ``{"method", "params"}`` (CDP, https://chromedevtools.github.io/devtools-protocol/).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest


def require_binary(name: str) -> str:
    """The path of a system program the test needs. Missing: the test fails in CI (``CI`` set to a
    true value, as `.ci/run` does), and is skipped elsewhere with the install command."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt-get install {name}; .ci/run installs it)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return path


class Page:
    """One page target: `send` a CDP command, `evaluate` JavaScript, collect events by method."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self.events.append(data)

    async def send(self, method: str, **params) -> dict:
        """Run one CDP command; returns its ``result``. Raises RuntimeError with the protocol's error."""
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self.ws.send_json({"id": i, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression (promises awaited); raises on a JS exception."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0, interval: float = 0.1):
        """Poll a JavaScript expression until it is truthy (a JS error, e.g. while the page loads,
        counts as not yet); returns its value. Raises TimeoutError."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                value, error = await self.evaluate(expression), None
            except RuntimeError as e:
                value, error = None, e
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"waited {timeout} s for: {expression}" + (f" (last: {error})" if error else ""))
            await asyncio.sleep(interval)

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        await self.ws.close()


class Chromium:
    """``async with Chromium(tmp_path) as browser: page = await browser.page(url)``; the process is
    killed on exit. The window is ``width`` x ``height`` CSS pixels at device scale factor 1."""

    def __init__(self, profile_dir: Path, width: int = 1280, height: int = 900):
        self.binary = require_binary("chromium")
        self.profile_dir, self.width, self.height = profile_dir, width, height
        self.process: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.http: str | None = None

    async def __aenter__(self) -> "Chromium":
        self.process = subprocess.Popen(
            [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             # no calls home: the CI machine's network is closed and each refused call costs time
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--force-device-scale-factor=1", f"--window-size={self.width},{self.height}",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--user-data-dir={self.profile_dir}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        loop = asyncio.get_running_loop()
        lines = []
        while True:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
            line = await asyncio.wait_for(loop.run_in_executor(None, self.process.stderr.readline), 60)
            lines.append(line)
            if not line:
                raise RuntimeError("chromium exited before DevTools listened:\n" + "".join(lines))
            if m := re.search(r"DevTools listening on ws://([\d.:]+)/", line):
                self.http = f"http://{m.group(1)}"
                break
        # keep draining stderr so chromium never blocks on a full pipe
        loop.run_in_executor(None, self.process.stderr.read)
        self.session = aiohttp.ClientSession()
        return self

    async def page(self, url: str) -> Page:
        """The first page target, with Page, Runtime and Network events on, navigated to ``url``."""
        async with self.session.get(f"{self.http}/json/list") as resp:
            targets = [t for t in await resp.json() if t["type"] == "page"]
        ws = await self.session.ws_connect(targets[0]["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        # large buffers: the tests read back /kv_cache bodies of 100K-block pools
        await page.send("Network.enable", maxTotalBufferSize=200 * 2**20, maxResourceBufferSize=50 * 2**20)
        await page.send("Page.navigate", url=url)
        return page

    async def __aexit__(self, *exc) -> None:
        if self.session is not None:
            await self.session.close()
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
