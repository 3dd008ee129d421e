"""The endpoints routers read from a server (/get_load, /health_generate, /flush_cache,
/get_model_info, /get_server_info), over raw HTTP against the real app and the real engine.

`PacedLLM` decides when each engine step runs, so "one request running and two waiting" is an
exact state when /get_load is read, not a race.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_helpers import InProcessServer, PacedLLM, parse_metrics, tiny_model, wait_for

N_CTX = 256
MODEL = "tiny-worker"
KEY = "sk-worker-test"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 40,
        "ignore_eos": True, "seed": 1}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessServer, PacedLLM]]:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings
    from colibri.engine import LLM, EngineConfig

    os.environ.setdefault("COLIBRI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    model = tiny_model(tmp_path_factory.mktemp("workers") / "model",
                       max_position_embeddings=N_CTX)
    # one sequence at a time: a second and third request wait
    llm = PacedLLM(LLM(str(model), n_ctx=N_CTX, config=EngineConfig(max_num_seqs=1)))
    settings = Settings(_env_file=None, served_model_name=MODEL, api_key=KEY,  # type: ignore[call-arg]
                        max_queue=4, max_num_seqs=1)
    srv = InProcessServer(create_app(settings, loader=lambda: llm.core)).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
    yield srv, llm
    llm.release(10_000)
    srv.stop()


def _load(srv: InProcessServer) -> dict[str, Any]:
    r = httpx.get(srv.url + "/get_load", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_get_load_counts_the_schedulers_running_and_waiting(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    llm.drain()
    assert _load(srv) == {"load": 0, "running": 0, "waiting": 0, "kv_cache_usage": 0.0}
    results: list[int] = []

    def send() -> None:
        r = httpx.post(srv.url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=120)
        results.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    # queued, no step yet: all three wait
    wait_for(lambda: _load(srv)["waiting"] == 3, 30, "three waiting requests")
    llm.release(1)  # one step: the scheduler takes one (max_num_seqs=1), two still wait
    wait_for(lambda: _load(srv)["running"] == 1, 30, "one running request")
    load = _load(srv)
    assert (load["load"], load["running"], load["waiting"]) == (3, 1, 2)
    assert 0.0 < load["kv_cache_usage"] <= 1.0
    # the same numbers /metrics exports under vLLM's names
    m = parse_metrics(httpx.get(srv.url + "/metrics", timeout=10).text)
    running = [v for k, v in m.items() if k.startswith("vllm:num_requests_running")]
    waiting = [v for k, v in m.items() if k.startswith("vllm:num_requests_waiting")]
    assert running == [1.0] and waiting == [2.0]
    llm.release(10_000)
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]
    wait_for(lambda: _load(srv)["load"] == 0, 30, "an idle scheduler")


def test_flush_cache_forgets_cached_prefixes(paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    llm.release(10_000)
    # a prompt of several full KV blocks (16 tokens each)
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3}]}

    def hits() -> float:
        m = parse_metrics(httpx.get(srv.url + "/metrics", timeout=10).text)
        return sum(v for k, v in m.items() if k.startswith("vllm:prefix_cache_hits_total"))

    def chat() -> None:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text

    chat()
    before = hits()
    chat()  # the same prompt again: its full blocks come from the prefix cache
    assert hits() - before >= 32
    assert httpx.post(srv.url + "/flush_cache", timeout=10).status_code == 401  # key needed
    r = httpx.post(srv.url + "/flush_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "flushed" and r.json()["blocks"] >= 2
    before = hits()
    chat()  # nothing cached any more: every block is computed again
    assert hits() == before
    chat()  # and cached again afterwards
    assert hits() - before >= 32
    # a second flush right away forgets what the last two requests cached, and nothing more
    r2 = httpx.post(srv.url + "/flush_cache", headers=AUTH, timeout=30)
    assert r2.json()["blocks"] >= 2
    assert httpx.post(srv.url + "/flush_cache", headers=AUTH, timeout=30).json()["blocks"] == 0


def test_health_generate_generates_a_token(paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    llm.release(10_000)
    steps = llm.steps
    assert httpx.get(srv.url + "/health_generate", timeout=10).status_code == 401
    r = httpx.get(srv.url + "/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert llm.steps > steps  # the engine ran for it


def test_health_generate_fails_when_the_engine_cannot_generate(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    llm.release(10_000)
    llm.fail_next = True  # the next step's forward pass raises: the probe's request fails
    r = httpx.get(srv.url + "/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["code"] == "generation_failed"  # OpenAI's error shape
    r = httpx.get(srv.url + "/health_generate", headers=AUTH, timeout=60)
    assert r.status_code == 200  # one failed step fails that request only


def test_model_and_server_info(paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, _ = paced
    for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
        assert httpx.get(srv.url + path, timeout=10).status_code == 401, path
    info = httpx.get(srv.url + "/get_model_info", headers=AUTH, timeout=10).json()
    assert info == httpx.get(srv.url + "/model_info", headers=AUTH, timeout=10).json()
    assert info["served_model_name"] == MODEL and info["is_generation"] is True
    assert info["max_model_len"] == N_CTX and info["model_path"] == "model"
    assert not Path(info["model_path"]).is_absolute()  # no file system path is disclosed
    models = httpx.get(srv.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["max_model_len"] == info["max_model_len"]
    server = httpx.get(srv.url + "/get_server_info", headers=AUTH, timeout=10).json()
    assert server == httpx.get(srv.url + "/server_info", headers=AUTH, timeout=10).json()
    assert server["served_model_name"] == MODEL and server["context_length"] == N_CTX
    assert server["max_num_seqs"] == 1 and server["max_queue"] == 4
    assert server["prefix_cache"] is True


def test_worker_endpoints_answer_503_before_the_model_is_loaded(tmp_path: Path) -> None:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    gate = threading.Event()

    def loader() -> Any:  # never finishes loading while the test runs
        gate.wait(60)
        raise RuntimeError("not loaded in this test")

    srv = InProcessServer(create_app(Settings(_env_file=None), loader=loader)).start()  # type: ignore[call-arg]
    try:
        assert httpx.get(srv.url + "/get_load", timeout=10).status_code == 503
        assert httpx.get(srv.url + "/health_generate", timeout=10).status_code == 503
        assert httpx.post(srv.url + "/flush_cache", timeout=10).status_code == 503
        assert httpx.get(srv.url + "/get_model_info", timeout=10).status_code == 503
    finally:
        gate.set()
        srv.stop()
