"""GET /v1/expert_cache and the /experts page, against the real app and the bundled demo
model (4 MoE layers, 64 experts, top-8) in this process.

With 12 slots per layer the answer has every expert's state and heat, counters that add up
and a history; with every expert resident the cache is off and only the history is kept.
The JSON needs the API key when one is set (the page itself does not), and is a 503 in
OpenAI's error shape while the model loads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from colibri.app.schemas import ExpertCacheInfo
from tests.server_helpers import InProcessServer, wait_for

KEY = "sk-experts"
N_CTX = 256
CHAT = {"messages": [{"role": "user", "content": "Tell me about the river."}],
        "max_tokens": 24, "seed": 3}


def _llm(slots: int, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    from colibri.engine import LLM, EngineConfig
    from colibri.engine.core.options import ExpertCacheConfig

    os.environ.setdefault("COLIBRI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return LLM(None, n_ctx=N_CTX, config=EngineConfig(
        expert_cache=ExpertCacheConfig(expert_cache_size=slots, expert_pin=False)))


@pytest.fixture(scope="module")
def cached_llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _llm(12, tmp_path_factory)


def _app(loader: Any, **settings: Any) -> Any:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    # the app takes a loader of the engine core; these tests hand it an LLM's
    return create_app(Settings(_env_file=None, **settings),  # type: ignore[call-arg]
                      loader=lambda: loader().core)


@pytest.fixture(scope="module")
def server(cached_llm: Any) -> Iterator[InProcessServer]:
    srv = InProcessServer(_app(lambda: cached_llm, api_key=KEY)).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
    yield srv
    srv.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _chat_twice(url: str, headers: dict[str, str]) -> None:
    """Two chats more than a second apart: the second's steps add a history point."""
    for _ in range(2):
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        time.sleep(1.05)
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert r.status_code == 200, r.text


def test_needs_the_api_key_but_the_page_does_not(server: InProcessServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/expert_cache", headers=headers)
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "invalid_api_key"
    page = httpx.get(server.url + "/experts")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<canvas id="grid"' in page.text and "/static/experts.js" in page.text
    for name in ("experts.js", "experts.css"):
        assert httpx.get(server.url + "/static/" + name).status_code == 200
    chat_page = httpx.get(server.url + "/").text
    assert 'href="/experts"' in chat_page


@pytest.mark.slow  # seconds: left out of the quick pass, run by the whole suite
def test_shape_and_counters_with_12_slots(server: InProcessServer) -> None:
    _chat_twice(server.url, _auth())
    r = httpx.get(server.url + "/v1/expert_cache", headers=_auth())
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    info = ExpertCacheInfo.model_validate(body)  # the published schema holds
    assert info.enabled and info.reason == "--expert-cache-size 12"
    assert (info.n_layer, info.n_expert, info.slots_per_layer) == (4, 64, 12)
    assert info.budget_bytes == 4 * 12 * info.expert_bytes
    assert info.state is not None and info.heat is not None and info.layers is not None
    assert len(info.state) == len(info.heat) == len(info.layers) == 4
    for row, heat in zip(info.state, info.heat, strict=True):
        assert len(row) == len(heat) == 64
        assert set(row) <= {0, 1, 2, 3}
        # at most the slots hold experts, and after three chats they are all filled
        assert sum(s >= 1 for s in row) == 12
        assert all(h >= 0 for h in heat) and max(heat) > 0
    t = info.totals
    assert t["hits"] + t["misses"] > 0
    assert t["hit_rate"] == pytest.approx(t["hits"] / (t["hits"] + t["misses"]))
    assert t["hits"] == sum(layer["hits"] for layer in info.layers)
    assert t["bytes_read"] == sum(layer["bytes_read"] for layer in info.layers) > 0
    assert t["resident_bytes"] == sum(s >= 1 for row in info.state for s in row) \
        * info.expert_bytes
    assert t["budget_bytes"] == info.budget_bytes
    assert info.history, body
    point = info.history[-1]
    assert point.tok_s > 0 and point.batch >= 1
    assert point.hit_rate is None or 0 <= point.hit_rate <= 1
    assert all(a.t < b.t for a, b in zip(info.history, info.history[1:], strict=False))
    # the counters only grow
    _chat_twice(server.url, _auth())
    later = httpx.get(server.url + "/v1/expert_cache", headers=_auth()).json()["totals"]
    assert later["hits"] + later["misses"] > t["hits"] + t["misses"]
    assert later["bytes_read"] >= t["bytes_read"]
    # /metrics exports the same counters per layer, the prefetches' fate included
    from colibri.app.metrics import parse_metrics

    samples = parse_metrics(httpx.get(server.url + "/metrics", headers=_auth()).text)
    for key in ("prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_cancelled",
                "reader_loads", "misses", "prefetch_busy", "prefetch_aborted",
                "prefetch_spared", "predicted", "predicted_right"):
        per_layer = [v for k, v in samples.items()
                     if k.startswith(f"colibri_expert_cache_{key}_total{{layer=")]
        assert len(per_layer) == 4 and sum(per_layer) == later[key], key
    assert (later["prefetch_used"] + later["prefetch_wasted"] + later["prefetch_aborted"]
            <= later["prefetch_issued"])
    assert later["predicted_right"] <= later["predicted"]


def test_in_openapi_schema(server: InProcessServer) -> None:
    schema = httpx.get(server.url + "/openapi.json", headers=_auth()).json()
    op = schema["paths"]["/v1/expert_cache"]["get"]
    ref = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ExpertCacheInfo"
    assert {"401", "503"} <= set(op["responses"])
    assert "/experts" not in schema["paths"]


def test_503_while_loading(cached_llm: Any) -> None:
    gate = threading.Event()

    def slow_loader() -> Any:
        gate.wait(30)
        return cached_llm

    srv = InProcessServer(_app(slow_loader, retry_after_s=3)).start()
    try:
        r = httpx.get(srv.url + "/v1/expert_cache")
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "loading" in err["message"]
        gate.set()
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 30, "ready")
        assert httpx.get(srv.url + "/v1/expert_cache").status_code == 200
    finally:
        gate.set()
        srv.stop()


@pytest.mark.slow  # seconds: left out of the quick pass, run by the whole suite
def test_cache_off_keeps_the_history(tmp_path_factory: pytest.TempPathFactory) -> None:
    llm = _llm(64, tmp_path_factory)  # every expert asked for: the cache is off
    srv = InProcessServer(_app(lambda: llm)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
        _chat_twice(srv.url, {})
        body = httpx.get(srv.url + "/v1/expert_cache").json()
        info = ExpertCacheInfo.model_validate(body)
        assert not info.enabled and info.slots_per_layer == info.n_expert == 64
        assert info.reason == "every expert resident (asked)"
        assert info.budget_bytes == 4 * 64 * info.expert_bytes
        assert "state" not in body and "heat" not in body and "layers" not in body
        assert info.totals == {}
        assert info.history and info.history[-1].tok_s > 0
        assert all(p.hit_rate is None for p in info.history)
    finally:
        srv.stop()
