"""Waiting for a server a benchmark started: until its /ready answers 200, while it runs.

The benchmarks that start `colibri serve` (or another server) as a child process call
wait_ready before their first request; it never stops the process, which stays the caller's.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx


def wait_ready(proc: subprocess.Popen[Any], url: str, what: str, timeout: float = 600.0,
               ready_path: str = "/ready", poll_s: float = 0.25) -> None:
    """Return once url + ready_path answers 200; RuntimeError naming what (the server, in
    the caller's words, and where its output went) when proc exits or timeout seconds pass
    first."""
    end = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > end:
            raise RuntimeError(f"{what} was not ready after {timeout:g} s")
        try:
            if httpx.get(url + ready_path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
