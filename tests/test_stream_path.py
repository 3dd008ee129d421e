"""The per-token path of a streamed reply: each piece kept lean against the reference it stands
in for. Events encoded as sse-starlette does, chunks as json.dumps does, histogram buckets as
Prometheus counts them, the send timeout as a per-send asyncio.timeout would cut, and the
server's immediate body writes byte for byte what uvicorn's own send writes."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sse_starlette.event import ensure_bytes

from colibri.app.http import chunk_bytes, event_loop
from colibri.app.mailbox import Mailbox
from colibri.app.metrics import _LATENCY_BUCKETS, Histogram
from colibri.app.replies import ChunkJSON
from colibri.app.send_deadline import SendDeadline
from colibri.app.streaming import encode_event
from tests.server_helpers import free_port, tiny_model, wait_for

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
line_breaks = st.sampled_from(["", "\n", "\r", "\r\n", "\u2028", "\x85"])


@given(st.lists(st.one_of(text, line_breaks), max_size=6).map("".join), line_breaks)
@settings(max_examples=300, deadline=None)
def test_events_are_encoded_as_sse_starlette_encodes_them(data: str, name_break: str) -> None:
    assert encode_event(data) == ensure_bytes(data, "\r\n")
    event = {"event": f"response.delta{name_break}", "data": data}
    assert encode_event(event) == ensure_bytes(event, "\r\n")
    for other in ({"data": data}, {"event": "e", "data": data, "id": "1"}):
        assert encode_event(other) == ensure_bytes(other, "\r\n")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=12)


@given(st.dictionaries(text.filter(lambda k: k != "choices"), json_values, max_size=5),
       json_values)
@settings(max_examples=300, deadline=None)
def test_chunks_are_the_json_of_base_and_value(base: dict[str, Any], value: Any) -> None:
    assert ChunkJSON(base, "choices")(value) == json.dumps({**base, "choices": value},
                                                           ensure_ascii=False)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True)
                | st.sampled_from(_LATENCY_BUCKETS), max_size=60))
def test_histogram_buckets_count_what_they_hold(values: list[float]) -> None:
    h = Histogram()
    for v in values:
        h.observe(v)
    assert h.cumulative() == [sum(1 for v in values if v <= b) for b in _LATENCY_BUCKETS]
    assert h.total == len(values)
    lines = h.render("x")
    assert lines[-1] == f"x_count {len(values)}" and f'x_bucket{{le="+Inf"}} {len(values)}' in lines


def test_mailbox_hands_items_over_in_order_to_a_waiting_reader() -> None:
    async def main() -> list[int]:
        box: Mailbox[int] = Mailbox()
        got: list[int] = []

        async def reader() -> None:
            for _ in range(5):
                got.append(await box.get())

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader waits on an empty box
        box.put_nowait(0)
        for i in range(1, 5):
            asyncio.get_running_loop().call_soon(box.put_nowait, i)
        await asyncio.wait_for(task, 5)
        assert box.qsize() == 0
        return got

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_send_deadline_cuts_only_the_send_that_waits_too_long() -> None:
    async def main() -> None:
        deadline = SendDeadline(0.2)
        never = asyncio.Event()
        loop = asyncio.get_running_loop()
        quick_sends = 0

        async def quick() -> None:
            nonlocal quick_sends
            for _ in range(20):
                await deadline.send(asyncio.sleep(0.02))
                quick_sends += 1

        began = loop.time()
        stalled = asyncio.create_task(deadline.send(never.wait()))
        steady = asyncio.create_task(quick())
        with pytest.raises(TimeoutError):
            await stalled
        assert loop.time() - began >= 0.2
        await steady  # the other task's sends, each short, all went through
        assert quick_sends == 20
        assert not stalled.cancelled() and stalled.cancelling() == 0
        # a cancellation from elsewhere is not a timeout
        other = asyncio.create_task(deadline.send(never.wait()))
        await asyncio.sleep(0.01)
        other.cancel()
        with pytest.raises(asyncio.CancelledError):
            await other
        deadline.close()

    asyncio.run(main())


def _responding(version: bytes = b"1.1", method: bytes = b"POST") -> h11.Connection:
    """A server connection that has answered a request's head with 200 and no length."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"%s / HTTP/%s\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
                      % (method, version))
    while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED):
        pass
    conn.send(h11.Response(status_code=200, headers=[]))
    return conn


@given(st.lists(st.binary(max_size=300), max_size=8))
@settings(max_examples=200, deadline=None)
def test_chunks_are_framed_as_h11_frames_them(bodies: list[bytes]) -> None:
    """chunk_bytes makes what h11's own send makes for each body chunk, and leaves the
    connection where h11's send leaves it (the end of the message is the same bytes)."""
    ours, theirs = _responding(), _responding()
    for body in bodies:
        chunk = chunk_bytes(ours, body)
        if body:
            assert chunk is not None, "a chunked body's chunks take the direct framing"
        out = chunk if chunk is not None else ours.send(h11.Data(data=body))
        assert out == theirs.send(h11.Data(data=body))
        assert ours.our_state is theirs.our_state is h11.SEND_BODY
    assert ours.send(h11.EndOfMessage()) == theirs.send(h11.EndOfMessage())
    assert chunk_bytes(ours, b"late") is None  # past the body: h11 refuses it itself


def test_chunks_of_other_framings_go_through_h11() -> None:
    old = _responding(version=b"1.0")  # HTTP/1.0: the body is delimited by the close
    assert chunk_bytes(old, b"data") is None
    assert old.send(h11.Data(data=b"data")) == b"data"


# -- the server's immediate body writes -------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("stream-path") / "model")


class _Served:
    """The real app on a uvicorn thread, with Colibri's HTTP protocol or uvicorn's own, on
    the event loop `serve` picks (event_loop()) or asyncio's."""

    def __init__(self, model: Path, guarded: bool, loop: str = "asyncio") -> None:
        import uvicorn

        from colibri.app.http import uvicorn_options
        from colibri.app.server import create_app
        from colibri.app.settings import Settings

        settings = Settings(_env_file=None, model=str(model), n_ctx=256)  # type: ignore[call-arg]
        self.port = free_port()
        options: dict[str, Any] = uvicorn_options(settings) if guarded else {"http": "h11"}
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port,
                                log_level="warning", loop=loop, lifespan="on", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(self._ready, 120.0, "the model to load")

    def _ready(self) -> bool:
        try:
            return self.raw("GET", "/ready", b"").startswith(b"HTTP/1.1 200")
        except OSError:
            return False

    def raw(self, method: str, path: str, body: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as s:
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\nConnection: "
                      f"close\r\n\r\n".encode() + body)
            out = b""
            while data := s.recv(1 << 16):
                out += data
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)


def _streams(served: _Served) -> list[bytes]:
    requests = [
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 24, "n": 2,
                             "logprobs": 2, "temperature": 0.8, "seed": 7, "stream": True,
                             "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}],
                                  "max_tokens": 16, "logprobs": True, "top_logprobs": 1,
                                  "temperature": 0.8, "seed": 3, "stream": True}),
    ]
    out = []
    for path, body in requests:
        reply = served.raw("POST", path, json.dumps(body).encode())
        head, _, rest = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
        out.append(rest)
    return out


def _without_ids(body: bytes) -> bytes:
    """body with each reply's id and creation time blanked (the chunk sizes stay right: ids
    and times have fixed widths)."""
    body = re.sub(rb'"id": "([a-z]+)-[0-9a-f]+"', rb'"id": "\1-' + b"0" * 32 + b'"', body)
    return re.sub(rb'"created": \d{10}', b'"created": 1000000000', body)


@pytest.fixture(scope="module")
def streams(model: Path) -> Iterator[dict[str, list[bytes]]]:
    got = {}
    for name, guarded, loop in (("guarded", True, event_loop()),
                                ("guarded-asyncio", True, "asyncio"),
                                ("uvicorn", False, "asyncio")):
        served = _Served(model, guarded, loop)
        try:
            got[name] = _streams(served)
        finally:
            served.stop()
    yield got


def test_immediate_body_writes_are_what_uvicorns_send_writes(
        streams: dict[str, list[bytes]]) -> None:
    """The same seeded streams through Colibri's protocol (events written at once, on the loop
    `serve` runs and on asyncio's) and uvicorn's plain one (each event through the ASGI send):
    the same chunked bytes."""
    want = [_without_ids(b) for b in streams["uvicorn"]]
    assert [_without_ids(b) for b in streams["guarded"]] == want
    assert [_without_ids(b) for b in streams["guarded-asyncio"]] == want


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not a dependency on Windows")
def test_serve_runs_on_uvloop() -> None:
    """uvloop is a dependency where it builds, and `serve` picks it."""
    assert event_loop() == "uvloop"


def test_each_event_is_one_chunk_of_the_body(streams: dict[str, list[bytes]]) -> None:
    for body in streams["guarded"]:
        events = []
        rest = body
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            chunk, rest = rest[:size], rest[size:]
            assert rest.startswith(b"\r\n")
            rest = rest[2:]
            assert chunk.startswith(b"data: ") and chunk.endswith(b"\r\n\r\n")
            events.append(chunk[6:-4])
        assert rest == b"\r\n" and events[-1] == b"[DONE]"
        for event in events[:-1]:
            assert "choices" in json.loads(event)
