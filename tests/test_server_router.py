"""Several `colibri serve` processes behind an existing router (vllm-router, from PyPI): the
streams a client sends through the router all complete with the text one server alone gives,
both servers take requests, and once one of them is killed the router sends everything to
the other.

Everything started here (two servers, the router) is stopped at the end, failed test or not.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import SubprocessServer, free_port, wait_for

pytestmark = pytest.mark.slow

MODEL = "tiny-routed"
PROMPTS = ["Hello!", "Count to five.", "Name a colour.", "What is a router?"]
CHAT = '/v1/chat/completions'


class Router:
    """`python -m vllm_router.launch_router` in front of worker_urls, on a free port (the
    router comes with the test extras)."""

    def __init__(self, worker_urls: list[str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "router.log"
        cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--worker-urls", *worker_urls,
               # round robin makes "both servers take requests" certain; cache_aware (the
               # default) works the same way but picks by prompt
               "--policy", "round_robin",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--health-check-interval-secs", "2", "--worker-startup-check-interval", "1",
               "--log-level", "warning"]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=workdir, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
        try:
            r = httpx.get(self.url + "/readiness", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json().get("healthy_workers") == 2

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, list[Any]]]:
    tmp = tmp_path_factory.mktemp("router")
    workers: list[SubprocessServer] = []
    router: Router | None = None
    try:
        # the bundled demo model, converted once into the session's cache (the second server
        # waits for the first one's conversion and reuses it)
        for name in ("w1", "w2"):
            workers.append(SubprocessServer(None, tmp / name, "--served-model-name", MODEL,
                                            "--threads", "1"))
        for w in workers:
            w.wait_ready()
        router = Router([w.url for w in workers], tmp)
        wait_for(router.ready, 60, "the router to see both servers healthy")
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def _served(worker: SubprocessServer) -> float:
    """Chat completions the worker answered with 200."""
    m = worker.metrics()
    return m.get(f'colibri_requests_total{{endpoint="{CHAT}",status="200"}}', 0.0)


def _stream(client: openai.OpenAI, prompt: str) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12,
            temperature=0, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def _reference(worker: SubprocessServer, prompt: str) -> str:
    """The same greedy request answered by one server alone, without the router."""
    r = httpx.post(worker.url + CHAT, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
        "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_router_spreads_streams_and_survives_a_killed_server(
        stack: tuple[Router, list[SubprocessServer]]) -> None:
    router, workers = stack
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    expected = {p: _reference(workers[0], p) for p in PROMPTS}
    before = [_served(w) for w in workers]

    # the router reads each server's /get_load (a parse failure would show as -1)
    loads = httpx.get(router.url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(w.url for w in workers)
    assert all(w["load"] == 0 for w in loads), loads

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _stream(client, p), prompts))
    for p, (text, finish) in zip(prompts, results, strict=True):
        assert finish in ("stop", "length") and text, (p, text, finish)
        assert text == expected[p]  # the router passes each stream through unchanged
    served = [_served(w) - b for w, b in zip(workers, before, strict=True)]
    assert sum(served) == 16 and min(served) >= 1, served  # both servers took requests

    # the router's own /v1/models is a server's
    assert [m.id for m in client.models.list().data] == [MODEL]

    workers[1].proc.send_signal(signal.SIGKILL)
    workers[1].proc.wait(10)
    survivor = _served(workers[0])
    after = [_stream(client, p) for p in PROMPTS * 2]
    for p, (text, finish) in zip(PROMPTS * 2, after, strict=True):
        assert finish in ("stop", "length") and text == expected[p], (p, text, finish)
    assert _served(workers[0]) - survivor == len(after)  # all of them on the one left
