"""uvicorn's h11 protocol with the guards a public HTTP/1.1 server needs.

- the request line and headers must arrive within `header_timeout_s` of the connection (or
  of the previous response): else 408 and close, so a client trickling a header line every
  few seconds cannot hold a connection forever;
- at most `max_connections` open connections: one more is answered 503 + Retry-After;
- malformed HTTP (negative Content-Length, bad chunk sizes, NUL in a header) gets a 400 and
  a head too large for the parser a 431, both in OpenAI's JSON error shape, not plain text.
The body deadline (`body_timeout_s`, 408) is enforced by the guard middleware that reads it.
A response may also end its connection on purpose (a streaming client that stopped reading):
`drop_connection(scope)` closes it, and the server logs nothing more about it. A streamed
response may write its next body chunk at once with `body_writer(scope)` (no await through
the middleware's send wrappers, which act on the response's start only).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from colibri.app.errors import error_bytes
from colibri.app.settings import Settings

try:
    from h11._writers import ChunkedWriter as _ChunkedWriter
except ImportError:  # an h11 laid out otherwise: every chunk goes through h11's send
    _ChunkedWriter = None  # type: ignore[assignment,misc]

# Room above max_header_bytes so the guard middleware (not the parser) answers ordinary
# oversized heads; heads past this are refused by the parser itself, as 431.
PARSER_HEAD_SLACK = 64 << 10
# After SIGTERM, how long uvicorn waits beyond drain_timeout_s before it cancels what is
# left: the app's own drain answers (503s, error events + [DONE]) go out in this window.
DRAIN_GRACE_S = 5.0

_DROP = "colibri.drop_connection"
_WRITE = "colibri.write_body"
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}


def _raw_response(status: int, message: str, extra: list[tuple[bytes, bytes]] = ()) -> bytes:
    """A complete HTTP/1.1 response that closes the connection (written without h11)."""
    body = error_bytes(status, message)
    head = [b"HTTP/1.1 %d %s" % (status, _REASONS[status]),
            b"content-type: application/json", b"content-length: %d" % len(body),
            b"connection: close", *(k + b": " + v for k, v in extra)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus head deadline, connection cap and JSON protocol errors."""

    header_timeout_s = 10.0
    max_connections = 256
    retry_after_s = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.logger.warning("refused a connection: %d open (max_connections)",
                                len(self.connections) - 1)
            transport.write(_raw_response(
                503, "The server has too many open connections. Retry later.",
                [(b"retry-after", str(self.retry_after_s).encode())]))
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in: the body has its own deadline
            self._disarm_head_timer()
        cycle = self.cycle
        if cycle is not None:  # its app has not run yet: it finds the drop in its scope
            extensions = cycle.scope.setdefault("extensions", {})  # type: ignore[typeddict-item]
            if _DROP not in extensions:
                extensions[_DROP] = functools.partial(self._drop, cycle)
                extensions[_WRITE] = functools.partial(_write_body, cycle)

    def _drop(self, cycle: Any) -> None:
        """End the connection of cycle's response on purpose: marked as gone, uvicorn does not
        report the response as incomplete."""
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the next request's head has the same deadline

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still going out (pipelining): its end re-arms the timer
        received, _ = self.conn.trailing_data
        if received:  # a client that sent nothing at all just loses the connection
            self.transport.write(_raw_response(
                408, f"The request head did not arrive within {self.header_timeout_s:g} s."))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Called by uvicorn when h11 refuses what the client sent."""
        self._disarm_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            # the head was fine, the body is not (a bad chunk): the app sees a disconnect
            # and, unless it has begun its own answer, the client gets the 400
            started = self.cycle.response_started
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if not started:
                self.transport.write(_raw_response(400, "The request is not valid HTTP/1.1."))
            self.transport.close()
            return
        received, _ = self.conn.trailing_data
        limit = getattr(self.conn, "_max_incomplete_event_size", None)
        if limit is not None and len(received) > limit:  # the head outgrew the parser
            out = _raw_response(431, "Request header fields too large.")
        else:
            out = _raw_response(400, "The request is not valid HTTP/1.1.")
        self.transport.write(out)
        self.transport.close()


def drop_connection(scope: Any) -> bool:
    """Close the connection of the request of scope on purpose (False: not served by
    GuardedH11Protocol, nothing was done)."""
    drop = scope.get("extensions", {}).get(_DROP)
    if drop is None:
        return False
    drop()
    return True


def _write_body(cycle: Any, body: bytes) -> bool:
    """Write body as the next chunk of cycle's started response, exactly as its ASGI send
    would for a message with more_body, without awaiting anything; False where that send
    would do something else (wait for a paused transport, report a gone client, refuse a
    response not started or already complete, drop a HEAD response's body)."""
    if (cycle.disconnected or cycle.flow.write_paused or not cycle.response_started
            or cycle.response_complete or cycle.scope["method"] == "HEAD"):
        return False
    conn = cycle.conn
    chunk = chunk_bytes(conn, body)
    cycle.transport.write(chunk if chunk is not None else conn.send(event=h11.Data(data=body)))
    return True


def chunk_bytes(conn: h11.Connection, body: bytes) -> bytes | None:
    """What h11's send of Data(body) returns on conn while its response body is chunked:
    the chunk's framing, made here without an event object or a pass through h11's state
    machine (a body chunk changes none of its state); None where h11 must send it itself
    (another framing, an empty body, a connection past the body)."""
    if (body and conn.our_state is h11.SEND_BODY and _ChunkedWriter is not None
            and type(getattr(conn, "_writer", None)) is _ChunkedWriter):
        return b"%x\r\n%b\r\n" % (len(body), body)
    return None


def body_writer(scope: Any) -> Callable[[bytes], bool] | None:
    """The immediate writer of the response body chunks of scope's request (see
    `_write_body`), where it is served by GuardedH11Protocol; None elsewhere."""
    return scope.get("extensions", {}).get(_WRITE)  # type: ignore[no-any-return]


def protocol_for(settings: Settings) -> type[GuardedH11Protocol]:
    """The protocol class with settings' limits (uvicorn instantiates it per connection)."""
    return type("ColibriH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": settings.header_timeout_s,
        "max_connections": settings.max_connections,
        "retry_after_s": settings.retry_after_s,
    })


def event_loop() -> str:
    """The event loop `serve` runs on: uvloop where it is installed (its loop, selector and
    transports are compiled: the loop's own CPU per streamed token is about a third less than
    asyncio's), else asyncio's."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn.Config arguments that carry Colibri's HTTP limits."""
    return {
        "http": protocol_for(settings),
        "h11_max_incomplete_event_size": settings.max_header_bytes + PARSER_HEAD_SLACK,
        "timeout_graceful_shutdown": settings.drain_timeout_s + DRAIN_GRACE_S,
    }
