"""Load, queue, disconnect, failure and shutdown behaviour of the server.

Most tests run the real app and the real LLM in this process, with `PacedLLM` deciding when
each token may come, so that "a request is running", "one is queued" and "the client left
after 3 tokens" are exact states rather than races. Process-level behaviour (SIGTERM drain,
exit code after a failed load) runs `python -m colibri.app serve` in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_helpers import (
    ROOT,
    ExplodingConstraint,
    InProcessServer,
    PacedLLM,
    SubprocessServer,
    free_port,
    tiny_model,
    wait_for,
)

N_CTX = 256
MSG = [{"role": "user", "content": "Hello!"}]
LONG = {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "seed": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the engines below convert into a cache of this run's own
    os.environ.setdefault("COLIBRI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    return tiny_model(tmp_path_factory.mktemp("lifecycle") / "model",
                      max_position_embeddings=N_CTX)


@pytest.fixture(scope="module")
def real_llm(model_dir: Path) -> Any:
    from colibri.engine import LLM, EngineConfig

    # one sequence at a time, so that one running and one waiting request fill the queue
    return LLM(str(model_dir), n_ctx=N_CTX, config=EngineConfig(max_num_seqs=1))


def _app(loader: Any, **settings: Any) -> Any:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    # the app takes a loader of the engine core; these tests hand it an LLM's
    return create_app(Settings(_env_file=None, **settings),  # type: ignore[call-arg]
                      loader=lambda: loader().core)


@pytest.fixture(scope="module")
def paced(real_llm: Any) -> Iterator[tuple[InProcessServer, PacedLLM]]:
    llm = PacedLLM(real_llm)
    srv = InProcessServer(_app(lambda: llm, max_queue=1, retry_after_s=2,
                               cors_origins=["http://ok.example"])).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 30, "ready")
    yield srv, llm
    llm.release(10_000)
    srv.stop()


@pytest.fixture(scope="module")
def paced_pair(model_dir: Path) -> Iterator[tuple[InProcessServer, PacedLLM]]:
    """Two seats and prompt chunks of at most 16 tokens: a long prompt takes several steps,
    and a second request shares the running batch."""
    from colibri.engine import LLM, EngineConfig

    real = LLM(str(model_dir), n_ctx=N_CTX,
               config=EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))
    llm = PacedLLM(real)
    srv = InProcessServer(_app(lambda: llm)).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 30, "ready")
    yield srv, llm
    llm.release(10_000)
    srv.stop()


def _idle(srv: InProcessServer) -> bool:
    m = srv.metrics()
    return m["colibri_requests_running"] == 0 and m["colibri_requests_waiting"] == 0


def _quiet(pair: tuple[InProcessServer, PacedLLM]) -> tuple[InProcessServer, PacedLLM,
                                                             dict[str, float]]:
    """Wait for an idle server, take back unused permits; the metrics at that point."""
    srv, llm = pair
    wait_for(lambda: _idle(srv), 10, "idle")
    llm.drain()
    return srv, llm, srv.metrics()


def _raw_request(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a request on a raw socket and return the socket (close it to disconnect)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_readiness_503_while_loading(real_llm: Any) -> None:
    gate = threading.Event()

    def slow_loader() -> Any:
        gate.wait(30)
        return real_llm

    srv = InProcessServer(_app(slow_loader)).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200  # alive while loading
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert r.headers["retry-after"] == "1"
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert srv.metrics()["colibri_model_loaded"] == 0
        gate.set()
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 10, "ready")
        assert srv.metrics()["colibri_model_loaded"] == 1
    finally:
        gate.set()
        srv.stop()


def test_failed_load_marks_health_503() -> None:
    def broken_loader() -> Any:
        raise FileNotFoundError("no model here")

    srv = InProcessServer(_app(broken_loader)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503, 10, "health 503")
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 503 and "no model here" not in r.text
    finally:
        srv.stop()


def test_health_and_models_answer_during_generation(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    got: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json={**LONG, "stream": True}, timeout=60) as r:
            got.extend(r.iter_lines())

    t = threading.Thread(target=stream)
    t.start()
    try:
        llm.release(2)
        wait_for(lambda: srv.metrics()["colibri_requests_running"] == 1, 10, "running")
        for path in ("/health", "/v1/models", "/ready", "/metrics"):
            t0 = time.perf_counter()
            r = httpx.get(srv.url + path, timeout=5)
            assert r.status_code == 200
            assert time.perf_counter() - t0 < 0.5, path
    finally:
        llm.release(200)
        t.join(60)
    assert [x for x in got if x][-1] == "data: [DONE]"
    wait_for(lambda: _idle(srv), 10, "idle")


def test_queue_full_is_503_with_retry_after(paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    wait_for(lambda: _idle(srv), 10, "idle")
    llm.drain()
    before = srv.metrics()["colibri_requests_aborted_total"]
    running = _raw_request(srv.port, "/v1/chat/completions", {**LONG, "stream": True})
    llm.release(1)
    wait_for(lambda: srv.metrics()["colibri_requests_running"] == 1, 10, "running")
    queued = _raw_request(srv.port, "/v1/chat/completions", LONG)
    wait_for(lambda: srv.metrics()["colibri_requests_waiting"] == 1, 10, "waiting")
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json=LONG, timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "queue_full"
        # the queued client goes away: its slot is freed without running it
        queued.close()
        wait_for(lambda: srv.metrics()["colibri_requests_waiting"] == 0, 10, "queue empty")
        assert srv.metrics()["colibri_requests_aborted_total"] == before + 1
    finally:
        running.close()
        queued.close()
    wait_for(lambda: _idle(srv), 10, "idle")


def test_messages_queue_full_and_failure_mid_stream_in_anthropic_shape(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    """The Messages API: a full queue is a 503 overloaded_error (the SDKs retry it), and a
    stream whose generation fails after its 200 ends with an `error` event."""
    srv, llm = paced
    wait_for(lambda: _idle(srv), 10, "idle")
    llm.drain()
    body = {"messages": MSG, "max_tokens": 200, "temperature": 0}
    running = _raw_request(srv.port, "/v1/chat/completions", {**LONG, "stream": True})
    llm.release(1)
    wait_for(lambda: srv.metrics()["colibri_requests_running"] == 1, 10, "running")
    queued = _raw_request(srv.port, "/v1/chat/completions", LONG)
    wait_for(lambda: srv.metrics()["colibri_requests_waiting"] == 1, 10, "waiting")
    try:
        r = httpx.post(srv.url + "/v1/messages", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "overloaded_error"
    finally:
        running.close()
        queued.close()
    wait_for(lambda: _idle(srv), 10, "idle")
    llm.drain()
    lines: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", srv.url + "/v1/messages", json={**body, "stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            lines.extend(r.iter_lines())

    t = threading.Thread(target=stream)
    t.start()
    try:
        tokens0 = srv.metrics()["colibri_generation_tokens_total"]
        llm.release(3)
        wait_for(lambda: srv.metrics()["colibri_generation_tokens_total"] == tokens0 + 3,
                 10, "3 tokens")
        llm.fail_next = True
        llm.release(1)
    finally:
        t.join(60)
    events = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert events[0] == "message_start" and events[-1] == "error", events
    assert "message_stop" not in events
    assert data[-1] == {"type": "error", "error": {"type": "api_error",
                                                   "message": data[-1]["error"]["message"]}}
    assert "kernel.c" not in data[-1]["error"]["message"]
    wait_for(lambda: _idle(srv), 10, "idle")


def test_disconnect_mid_stream_stops_within_one_token(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm, before = _quiet(paced)
    produced0 = llm.produced
    client = httpx.Client(timeout=30)
    llm.release(3)
    with client.stream("POST", srv.url + "/v1/chat/completions",
                       json={**LONG, "stream": True}) as r:
        # next() rather than a for/break: leaving httpx's line iterator closes the response
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass  # the stream is open (the role chunk comes with the first token)
        tokens0 = before["colibri_generation_tokens_total"]
        wait_for(lambda: srv.metrics()["colibri_generation_tokens_total"] == tokens0 + 3,
                 10, "3 tokens")
        assert srv.metrics()["colibri_requests_running"] == 1
    client.close()  # disconnect mid-stream; the engine is waiting for its next permit
    wait_for(lambda: _idle(srv), 10, "request freed")
    after = srv.metrics()
    assert after["colibri_requests_aborted_total"] == before["colibri_requests_aborted_total"] + 1
    assert llm.produced - produced0 <= 4
    # its KV blocks went back to the pool with it
    assert after["colibri_kv_cache_blocks_free"] == after["colibri_kv_cache_blocks_total"]
    assert (after["colibri_generation_tokens_total"]
            - before["colibri_generation_tokens_total"]) <= 4
    # the engine is free again: the next request runs to the end
    llm.release(5)
    r = httpx.post(srv.url + "/v1/chat/completions",
                   json={**LONG, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_disconnect_while_waiting_for_non_streamed(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    s = _raw_request(srv.port, "/v1/completions", {"prompt": "Water", "max_tokens": 100,
                                                   "ignore_eos": True})
    llm.release(2)
    wait_for(lambda: srv.metrics()["colibri_requests_running"] == 1, 10, "running")
    s.close()
    wait_for(lambda: _idle(srv), 10, "request freed")


def test_one_failure_is_a_500_for_that_request_only(
        paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm = paced
    wait_for(lambda: _idle(srv), 10, "idle")
    llm.drain()
    llm.fail_next = True
    llm.release(1)  # the failing step
    r = httpx.post(srv.url + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "secret" not in r.text and "kernel.c" not in r.text and "Traceback" not in r.text
    assert httpx.get(srv.url + "/health").status_code == 200
    llm.release(3)
    r = httpx.post(srv.url + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200
    # a stream whose generation fails before its first token gets the 500 status too
    llm.fail_next = True
    llm.release(1)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                      json={"prompt": "a", "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 500


def test_disconnect_during_prefill_frees_its_blocks_without_another_step(
        paced_pair: tuple[InProcessServer, PacedLLM]) -> None:
    srv, llm, before = _quiet(paced_pair)
    steps0, produced0 = llm.steps, llm.produced
    body = {"prompt": "Tell me everything about the river. " * 4, "max_tokens": 5,
            "stream": True}  # 88 prompt tokens: six chunks of at most 16
    s = _raw_request(srv.port, "/v1/completions", body)
    try:
        llm.release(2)  # two chunks of the prompt, nothing sampled yet
        wait_for(lambda: llm.steps == steps0 + 2, 10, "two prefill steps")
        mid = srv.metrics()
        assert mid["colibri_requests_running"] == 1
        assert mid["colibri_kv_cache_blocks_free"] < mid["colibri_kv_cache_blocks_total"]
        assert llm.produced == produced0
    finally:
        s.close()
    # no step is allowed to run: the engine frees the request between steps
    wait_for(lambda: _idle(srv), 10, "request freed")
    after = srv.metrics()
    assert after["colibri_kv_cache_blocks_free"] == after["colibri_kv_cache_blocks_total"]
    assert after["colibri_requests_aborted_total"] == before["colibri_requests_aborted_total"] + 1
    assert llm.steps == steps0 + 2 and llm.produced == produced0


def test_a_failing_request_is_a_500_while_its_batch_neighbour_finishes(
        paced_pair: tuple[InProcessServer, PacedLLM], monkeypatch: pytest.MonkeyPatch) -> None:
    import colibri.app.serving as serving

    srv, llm, before = _quiet(paced_pair)
    monkeypatch.setattr(serving, "request_constraints", lambda _tok, _v, spec, budgets, *_: [
        None if spec is None else ExplodingConstraint() for _ in budgets])
    results: dict[str, httpx.Response] = {}

    def post(name: str, body: dict[str, Any]) -> None:
        results[name] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)

    steps0 = llm.steps
    good = threading.Thread(target=post, args=("good", {**LONG, "max_tokens": 12}))
    good.start()
    llm.release(2)  # the good request's prompt and first token, then a second token
    wait_for(lambda: llm.steps == steps0 + 2, 10, "the good request decoding")
    bad = threading.Thread(target=post, args=("bad", {
        **LONG, "max_tokens": 12, "response_format": {"type": "json_object"}}))
    bad.start()
    # queued until the next step, which takes it into the good request's batch
    wait_for(lambda: srv.metrics()["colibri_requests_waiting"] == 1, 10, "the bad one queued")
    llm.release(40)
    good.join(60)
    bad.join(60)
    assert not good.is_alive() and not bad.is_alive()
    assert results["bad"].status_code == 500, results["bad"].text
    err = results["bad"].json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "exploded" not in results["bad"].text and "kernel.c" not in results["bad"].text
    ok = results["good"]
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 12
    assert ok.json()["choices"][0]["finish_reason"] == "length"
    # and it is the text the same request gets alone
    llm.release(40)
    post("alone", {**LONG, "max_tokens": 12})
    assert results["alone"].json()["choices"][0]["message"]["content"] == \
        ok.json()["choices"][0]["message"]["content"]
    after = srv.metrics()
    # a step really carried both requests
    two = 'colibri_batch_size_sequences_bucket{le="2"}'
    one = 'colibri_batch_size_sequences_bucket{le="1"}'
    assert (after[two] - after[one]) - (before[two] - before[one]) >= 1
    assert after["colibri_kv_cache_blocks_free"] == after["colibri_kv_cache_blocks_total"]
    assert httpx.get(srv.url + "/health").status_code == 200


def test_cors_when_configured(paced: tuple[InProcessServer, PacedLLM]) -> None:
    srv, _ = paced
    pre = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(srv.url + "/v1/chat/completions",
                       headers={"Origin": "http://ok.example", **pre})
    assert ok.headers.get("access-control-allow-origin") == "http://ok.example"
    assert "access-control-allow-credentials" not in ok.headers
    bad = httpx.options(srv.url + "/v1/chat/completions",
                        headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers


def test_client_chat_template_when_enabled(real_llm: Any) -> None:
    from colibri.engine.text.bpe import CHATML_TEMPLATE

    srv = InProcessServer(_app(lambda: real_llm, allow_client_chat_template=True)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 30, "ready")
        body = {"messages": MSG, "max_tokens": 4, "seed": 3, "ignore_eos": True}
        a = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30).json()
        b = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       json={**body, "chat_template": CHATML_TEMPLATE}).json()
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["usage"] == b["usage"]
        bad = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                         json={**body, "chat_template": "{{ ''.__class__.__mro__ }}"})
        assert bad.status_code == 400
    finally:
        srv.stop()


def test_sigterm_drains_running_request_then_exits_0(model_dir: Path, tmp_path: Path) -> None:
    srv = SubprocessServer(model_dir, tmp_path, "--n-ctx", str(N_CTX),
                           "--max-n", "4").wait_ready()
    lines: list[str] = []
    signalled = threading.Event()

    def stream() -> None:
        # 4 sequences of 200 tokens: SIGTERM goes out from this reader as soon as the first
        # event arrives, while the request is running (no hand-off to another thread first)
        body = {"prompt": ["Once", "The"], "n": 2, "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not signalled.is_set() and line.startswith("data: {"):
                    srv.proc.send_signal(signal.SIGTERM)
                    signalled.set()
                lines.append(line)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert signalled.wait(60), "no streamed event before the timeout"
        # new connections are refused while the running stream finishes
        wait_for(lambda: _refused(srv.port), 10, "listener closed")
        rc = srv.wait_exit()  # no second signal: it would cut the drain short
        t.join(60)
        assert not t.is_alive()
    finally:
        srv.stop()  # only acts if the server is still running (a failed step above)
    assert rc == 0, srv.log()
    assert [x for x in lines if x][-1] == "data: [DONE]"
    finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines
              if x.startswith("data: {") and '"finish_reason": "' in x]
    assert finals == ["length"] * 4


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_failed_load_exits_1(tmp_path: Path) -> None:
    # a missing folder or a damaged weight file is refused before start (exit 2,
    # tests/test_cli_models.py); a config.json whose sizes disagree with the weights passes
    # those checks (they read headers, not shapes against the config) and fails to load
    from colibri.engine.format.convert import convert

    model = convert(tiny_model(tmp_path / "hf"), tmp_path / "broken", progress=False)
    config = json.loads((model / "config.json").read_text())
    config["n_ff"] += 32
    (model / "config.json").write_text(json.dumps(config))
    srv = SubprocessServer(model, tmp_path)
    assert srv.proc.wait(60) == 1
    srv.stop()
    log = srv.log()
    assert "could not load the model" in log and "the config wants" in log, log


def test_disk_full_during_serves_own_conversion_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`serve` on a checkpoint converts it into the cache first; a disk that fills up on the
    way (a real one: a 64 KiB tmpfs over the cache folder, in a mount namespace of its own)
    stops the server with one line, exit status 2, and no half-written entry."""
    model = tiny_model(tmp_path / "hf")
    cache = tmp_path / "cache"
    cache.mkdir()
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "-rm"]
    server = (f"mount -t tmpfs -o size=64k tmpfs {cache} && exec {sys.executable} -m "
              f"colibri.app serve --model {model} --port {free_port()}")
    env = dict(os.environ, COLIBRI_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT))
                                          if p))
    run = subprocess.run([*namespace, "sh", "-c", server], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out
    assert "ran out of disk space" in errors[0] and "COLIBRI_CACHE_DIR" in errors[0], out
    assert "Traceback" not in out, out
