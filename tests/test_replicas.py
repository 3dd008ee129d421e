"""`colibri serve --replicas 2` on Ray Serve, on loopback with the bundled demo model: many
streams over both replicas give what one replica gives alone, a client that leaves mid-stream
is aborted on its replica, a replica killed under load fails only its own requests and comes
back, SIGTERM drains and exits 0.

One server (a local Ray cluster) serves the module, in its own session and Ray folder, so
whatever happens its processes are ended afterwards. The tests run in file order: the last
one stops the server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from colibri.app.replicas.launch import port_outside_ray
from tests.server_helpers import SubprocessServer, parse_metrics, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-replicas"
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA_HEADER = "x-colibri-replica"
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo", "HAMLET.\nTo be", "KING LEAR.\nNothing"]


class ReplicaServer(SubprocessServer):
    """`python -m colibri.app serve --replicas 2` in a new session with its own Ray folder."""

    poll_s = 0.5  # each check asks Ray Serve's controller

    def __init__(self, workdir: Path) -> None:
        # short: Ray puts Unix sockets under it
        self.ray_dir = tempfile.mkdtemp(prefix="clbray", dir="/tmp")
        super().__init__(None, workdir, "--replicas", "2", "--threads", "1", "--api-key", KEY,
                         env={"RAY_TMPDIR": self.ray_dir, "RAY_DEDUP_LOGS": "0"},
                         port=port_outside_ray(), new_session=True)

    def log(self) -> str:
        return super().log()[-6000:]

    def ready(self) -> bool:
        try:
            return len(self.replicas()) == 2
        except (ValueError, KeyError):
            return False

    def replicas(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/v1/replicas", headers=AUTH, timeout=30.0)
        r.raise_for_status()
        return list(r.json()["data"])

    def leftovers(self) -> list[int]:
        """Processes still running that this server started (Ray's included)."""
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes()
                env_ok = self.ray_dir.encode() in cmd
                if not env_ok:
                    env_ok = os.getpgid(int(p.name)) == self.proc.pid
            except (OSError, ProcessLookupError):
                continue
            if env_ok and int(p.name) != os.getpid():
                out.append(int(p.name))
        return out

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.leftovers()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaServer]:
    pytest.importorskip("ray.serve")  # here, not at collection: importing Ray takes seconds
    s = ReplicaServer(tmp_path_factory.mktemp("replicas"))
    try:
        s.wait_ready(240.0)
        yield s
    finally:
        s.kill_all()


def _body(prompt: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": "demo_model", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}


def _stream(url: str, body: dict[str, Any], on_header: Any = None,
            timeout: float = 120.0, pin: str | None = None,
            on_token: Any = None) -> dict[str, Any]:
    """One streamed completion (pinned to replica `pin` when given): its replica, text,
    finish reason and any error event. on_header(replica) runs when the reply starts,
    on_token(replica) when its first text arrives."""
    out: dict[str, Any] = {"text": "", "finish": None, "error": None}
    headers = AUTH if pin is None else {**AUTH, "x-colibri-replica": pin}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=timeout) as r:
        out["status"] = r.status_code
        out["replica"] = r.headers.get("x-colibri-replica")
        if on_header is not None:
            on_header(out["replica"])
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            for choice in event["choices"]:
                if on_token is not None and not out["text"] and choice["text"]:
                    on_token(out["replica"])
                out["text"] += choice["text"]
                out["finish"] = choice["finish_reason"] or out["finish"]
    return out


def _nothing_routed(server: ReplicaServer, why: str) -> None:
    """Wait until the endpoint's router counts no request in flight on any replica (the
    `routed` of /v1/replicas)."""
    end = time.monotonic() + 30
    while True:
        counts = {r["id"]: r["routed"] for r in server.replicas()}
        if not any(counts.values()):
            return
        assert time.monotonic() < end, f"the router counts {counts} in flight {why}"
        time.sleep(0.3)


def _run_all(fn: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    results: list[Any] = [None] * len(args)

    def run(i: int) -> None:
        try:
            results[i] = fn(*args[i])
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def test_sixteen_streams_over_two_replicas_equal_one_replica(server: ReplicaServer) -> None:
    replicas = server.replicas()
    assert len({r["id"] for r in replicas}) == 2 and len({r["pid"] for r in replicas}) == 2
    one = replicas[0]["id"]
    reference = {}
    for prompt in PROMPTS:  # each prompt, greedy, served by one replica alone
        r = httpx.post(server.url + "/v1/completions", json=_body(prompt, 24, False),
                       headers={**AUTH, "x-colibri-replica": one}, timeout=60)
        assert r.status_code == 200 and r.headers["x-colibri-replica"] == one
        reference[prompt] = r.json()["choices"][0]["text"]
    jobs = [(server.url, _body(PROMPTS[i % len(PROMPTS)], 24, True)) for i in range(16)]
    results = _run_all(_stream, jobs)
    for (_, body), res in zip(jobs, results, strict=True):
        assert not isinstance(res, Exception), res
        assert res["status"] == 200 and res["error"] is None
        assert res["text"] == reference[body["prompt"]]
        assert res["finish"] in ("length", "stop")
    assert {res["replica"] for res in results} == {r["id"] for r in replicas}
    _nothing_routed(server, "once the streams have ended")
    # the other routes answer through the endpoint too, naming their replica
    msg = httpx.post(server.url + "/v1/messages", headers=AUTH, timeout=60, json={
        "model": "demo_model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert msg.status_code == 200 and msg.json()["type"] == "message"
    assert msg.headers["x-colibri-replica"] in {r["id"] for r in replicas}
    bad = httpx.post(server.url + "/v1/chat/completions", json={"model": "demo_model"},
                     headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    gone = httpx.get(server.url + "/metrics", headers={"x-colibri-replica": "nosuchone"},
                     timeout=30)
    assert gone.status_code == 404
    # the key guards the endpoint's own route as it guards the replicas' routes
    assert httpx.get(server.url + "/v1/replicas", timeout=30).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json=_body("x", 1, False),
                      timeout=30).status_code == 401


def _replica_metrics(server: ReplicaServer, replica: str) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", headers={**AUTH, REPLICA_HEADER: replica},
                  timeout=30)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica
    return parse_metrics(r.text)


def test_a_client_gone_mid_stream_is_aborted_on_its_replica(server: ReplicaServer) -> None:
    """A streaming client that disconnects mid-stream through the ingress: the replica
    serving it aborts the request and its KV blocks go back to the pool."""
    data = json.dumps(_body("JULIET.\n", 1500, True, ignore_eos=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(data)).encode()
                     + b"\r\n\r\n" + data)
        reply = b""
        while reply.count(b"data: {") < 3:  # the reply has begun and tokens are flowing
            chunk = sock.recv(65536)
            assert chunk, f"the stream ended early: {reply[-2000:]!r}"
            reply += chunk
        head = reply.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
        assert head.startswith("http/1.1 200"), head
        replica = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                       if line.startswith(REPLICA_HEADER + ":"))
        busy = _replica_metrics(server, replica)
        assert busy["colibri_requests_running"] == 1
        assert busy["colibri_kv_cache_blocks_free"] < busy["colibri_kv_cache_blocks_total"]
    finally:
        sock.close()  # gone mid-stream: 1500 tokens asked for, a few read

    def freed() -> bool:
        m = _replica_metrics(server, replica)
        return (m["colibri_requests_running"] == m["colibri_requests_waiting"] == 0
                and m["colibri_kv_cache_blocks_free"] == m["colibri_kv_cache_blocks_total"])

    wait_for(freed, 30, f"replica {replica} to abort the stream and free its blocks")
    after = _replica_metrics(server, replica)
    # stopped, not finished: the replica counts it aborted
    assert after["colibri_requests_aborted_total"] == busy["colibri_requests_aborted_total"] + 1
    # and the endpoint's router no longer counts it, so new requests go there again
    _nothing_routed(server, "after the cut stream")


def test_a_killed_replica_fails_only_its_requests_and_comes_back(server: ReplicaServer) -> None:
    before = {r["id"]: r["pid"] for r in server.replicas()}
    started: list[str | None] = []  # the replica of each stream, as its reply starts
    all_started = threading.Event()
    lock = threading.Lock()

    def header(replica: str | None) -> None:
        with lock:
            started.append(replica)
            if len(started) == 16:
                all_started.set()

    long_body = _body("ROMEO.\n", 1500, True, ignore_eos=True)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(
        _run_all(_stream, [(server.url, long_body, None, 120.0, None, header)] * 16)))
    runner.start()
    assert all_started.wait(120), f"only {len(started)} of 16 streams started"
    # the burst, sent right after the previous test cut a stream on one replica, spread
    # over both: the cut stream is no longer counted, and requests routed together count
    # each other
    spread = {replica: started.count(replica) for replica in before}
    assert min(spread.values()) >= 4, f"the burst went {spread}"
    # the victim is the replica of the stream that started last: that one is under way
    victim_id = started[-1]
    assert victim_id in before, started
    victim_pid = before[victim_id]
    os.kill(victim_pid, signal.SIGKILL)  # a stream there is under way: it must be cut
    runner.join(200)
    assert not runner.is_alive() and len(results) == 16, "streams hung after the kill"
    for res in results:
        assert not isinstance(res, Exception), res
        assert res["status"] == 200
        if res["replica"] == victim_id and res["finish"] != "length":
            # cut by the kill: a clean error event in OpenAI's shape, then the end
            assert res["error"]["type"] == "service_unavailable", res
        else:
            assert res["error"] is None and res["finish"] == "length", res
    assert any(r["replica"] == victim_id and r["error"] for r in results), (
        f"no stream on {victim_id} (pid {victim_pid}) was cut: "
        f"{[(r['replica'], r['finish'], len(r['text'])) for r in results]}\n{server.log()}")
    # every request after the kill is served (by the survivor, or by the new replica)
    for prompt in PROMPTS * 2:
        r = httpx.post(server.url + "/v1/completions", json=_body(prompt, 4, False),
                       headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    end = time.monotonic() + 60
    while time.monotonic() < end:
        now = {r["id"]: r["pid"] for r in server.replicas()}
        if len(now) == 2 and victim_id not in now:
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the killed replica was not replaced within 60 s:\n"
                             f"{server.log()}")
    assert victim_pid not in now.values()
    # the streams the killed replica was serving are no longer counted anywhere
    _nothing_routed(server, "after the kill")


def test_sigterm_drains_both_replicas_and_exits_0(server: ReplicaServer) -> None:
    # both idle first (the router counts a finished request once Ray reports it done; a
    # replica too busy to answer within 5 s is listed as pending)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        listed = [(x["health"], x.get("running")) for x in server.replicas()]
        if listed == [("ready", 0), ("ready", 0)]:
            break
        time.sleep(0.5)
    print("replicas before the drain test:", listed)
    time.sleep(3)
    started: list[str | None] = []
    body = _body("HAMLET.\n", 1500, True, ignore_eos=True)
    results: list[Any] = []
    # two streams pinned to each replica: both have work to drain, whatever the router's
    # counts learned from the replica killed before
    ids = sorted(r["id"] for r in server.replicas())
    assert len(ids) == 2, ids
    runner = threading.Thread(target=lambda: results.extend(
        _run_all(_stream, [(server.url, body, started.append, 120.0, ids[i % 2])
                           for i in range(4)])))
    runner.start()
    end = time.monotonic() + 120
    while len(started) < 4 and time.monotonic() < end:
        time.sleep(0.05)
    assert len(set(started)) == 2, \
        f"the streams did not reach both replicas: {started}\n{server.log()}"
    server.proc.send_signal(signal.SIGTERM)
    runner.join(200)
    for res in results:  # each finished in full: drained, not cut
        assert not isinstance(res, Exception), res
        assert res["error"] is None and res["finish"] == "length", res
        assert len(res["text"]) > 1000
    assert server.proc.wait(120) == 0, server.log()
    end = time.monotonic() + 30
    while server.leftovers() and time.monotonic() < end:
        time.sleep(0.5)
    assert not server.leftovers(), "Ray processes outlived the server"
