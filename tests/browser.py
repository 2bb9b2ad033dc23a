"""A real headless Chromium for tests, driven over the DevTools protocol.

Tests load a page as a user's browser does (JavaScript, websockets), run
JavaScript in it and take screenshots. Chromium comes from Debian's
``chromium`` package (``.ci/run`` installs it); without it, tests skip.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tornado.websocket import WebSocketClientConnection, websocket_connect


def chromium_path() -> str:
    """The Chromium executable; skips the test when there is none."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("chromium is not installed (Debian: apt-get install chromium)")


class Page:
    """One browser tab, spoken to over its DevTools websocket."""

    def __init__(self, conn: WebSocketClientConnection):
        self._conn = conn
        self._next_id = 0
        #: Exceptions the page's JavaScript threw (``Runtime.exceptionThrown``).
        self.errors: list[str] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send a DevTools command; its ``result``, or RuntimeError
        (TimeoutError after 60 s: a browser that stopped answering)."""
        return await asyncio.wait_for(self._call(method, params), 60)

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self._next_id += 1
        call_id = self._next_id
        await self._conn.write_message(
            json.dumps({"id": call_id, "method": method, "params": params})
        )
        while True:
            raw = await self._conn.read_message()
            if raw is None:
                raise RuntimeError(f"the browser closed the connection during {method}")
            msg = json.loads(raw)
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(msg["params"]["exceptionDetails"])[:2000])
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited), or
        RuntimeError with the exception it threw."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(json.dumps(result["exceptionDetails"])[:2000])
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float) -> Any:
        """Evaluate ``expression`` until it is truthy; its value. A last
        exception (e.g. a model not there yet) is in the TimeoutError."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                value = await self.evaluate(expression)
            except RuntimeError as e:
                last = e
            else:
                if value:
                    return value
                last = value
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{expression!r} still not truthy after {timeout} s: {last}")

    async def screenshot(self) -> Any:
        """The viewport as a ``PIL.Image`` in RGB."""
        from PIL import Image

        data = (await self.call("Page.captureScreenshot", format="png"))["data"]
        return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


@contextlib.asynccontextmanager
async def open_page(url: str, *, width: int = 1400, height: int = 1200) -> AsyncIterator[Page]:
    """A fresh headless Chromium (own profile) showing ``url`` in a
    ``width`` x ``height`` viewport; killed on exit."""
    profile = tempfile.mkdtemp(prefix="dask-shm-chromium-")
    proc = subprocess.Popen(
        [
            chromium_path(),
            "--headless",
            "--no-sandbox",  # we run as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = await asyncio.wait_for(asyncio.to_thread(_devtools_port, proc), 60)
        targets = json.loads(
            await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10).read()
            )
        )
        tab = next(t for t in targets if t["type"] == "page")
        conn = await websocket_connect(tab["webSocketDebuggerUrl"], max_message_size=256 * 2**20)
        try:
            page = Page(conn)
            await page.call("Runtime.enable")
            await page.call("Page.enable")
            await page.call(
                "Emulation.setDeviceMetricsOverride",
                width=width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            await page.call("Page.navigate", url=url)
            yield page
        finally:
            conn.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(proc: subprocess.Popen[str]) -> int:
    """The DevTools port Chromium prints on stderr as it starts."""
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if found:
            # Keep reading stderr so that Chromium never blocks on a full pipe.
            stream = proc.stderr
            threading.Thread(target=stream.read, daemon=True).start()
            return int(found.group(1))
    raise RuntimeError(f"chromium exited ({proc.wait()}) without a DevTools port")
