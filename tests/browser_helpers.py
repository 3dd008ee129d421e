"""Headless Chromium (Debian `chromium`) driven over the DevTools protocol, for the page tests
(not a test file)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from tests.server_helpers import wait_for


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return dict(msg["result"])

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")


def _devtools_port(port_file: Path) -> int:
    """The port Chromium writes to `port_file` once it listens. The file appears before its
    text is whole, so wait for the port line and the browser path line after it."""
    lines: list[str] = []

    def written() -> bool:
        lines[:] = port_file.read_text().splitlines() if port_file.exists() else []
        return len(lines) >= 2 and lines[0].strip().isdigit()

    wait_for(written, 60, "chromium's DevTools port")
    return int(lines[0])


@contextmanager
def chromium_page(profile: Path) -> Iterator[DevTools]:
    """Headless Chromium with a fresh profile in `profile`; yields its first page."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe is not None, "Debian's chromium is needed (.ci/run installs it)"
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port = _devtools_port(Path(profile) / "DevToolsActivePort")
        targets: list[dict[str, Any]] = []

        def has_page() -> bool:
            targets[:] = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
            return any(t["type"] == "page" for t in targets)

        wait_for(has_page, 30, "a page target")
        target = next(t for t in targets if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            yield DevTools(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
