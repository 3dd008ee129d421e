"""Server-sent events (sse-starlette) for streamed completions.

A stream that fails after its 200 went out ends with one error event in its API's shape
(OpenAI's: an error object and `[DONE]`) instead of a cut connection. A client that stops
reading is dropped after `send_timeout_s`; on SIGTERM a stream may run `drain_timeout_s`
more, then ends with an error event (503, server_shutting_down). Events go out byte for byte
as sse-starlette writes them; the per-event work is kept small (one event per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.event import ensure_bytes
from sse_starlette.sse import SendTimeoutError

from colibri.app.errors import APIError, error_body
from colibri.app.http import DRAIN_GRACE_S, body_writer, drop_connection
from colibri.app.send_deadline import SendDeadline
from colibri.app.serving import engine_error
from colibri.app.state import DrainExpiredError, ServerState, shutting_down

log = logging.getLogger("colibri.app")


async def _next_or_drain(state: ServerState, it: AsyncIterator[str]) -> str:
    """The next event, unless the drain timeout runs out first (DrainExpiredError)."""
    nxt = asyncio.ensure_future(it.__anext__())
    drain = asyncio.ensure_future(state.drain_expired.wait())
    try:
        done, _ = await asyncio.wait({nxt, drain}, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            return nxt.result()
        raise DrainExpiredError()
    finally:
        for task in (nxt, drain):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


Event = str | dict[str, str]  # a `data:` line, or sse-starlette's {"event", "data"}
SEP = EventSourceResponse.DEFAULT_SEPARATOR  # the line separator sse_response's streams use


def encode_event(event: Any, sep: str = SEP) -> bytes:
    """The bytes sse-starlette writes for event, built directly when no line break has to be
    split into several `data:` lines (JSON never holds a raw one)."""
    if type(event) is str:
        if "\n" not in event and "\r" not in event:
            return f"data: {event}{sep}{sep}".encode()
    elif type(event) is dict and len(event) == 2:
        name, data = event.get("event"), event.get("data")
        if (type(name) is str and type(data) is str and "\n" not in name + data
                and "\r" not in name + data):
            return f"event: {name}{sep}data: {data}{sep}{sep}".encode()
    return ensure_bytes(event, sep)


def openai_error_events(err: APIError) -> list[Event]:
    """How an OpenAI stream ends on an error: one error object, then [DONE]."""
    return [json.dumps(error_body(err.status, err.message, err.param, err.code)), "[DONE]"]


async def _guarded(state: ServerState, events: AsyncIterator[Any],
                   error_events: Callable[[APIError], list[Event]]) -> AsyncIterator[bytes]:
    it = events.__aiter__()
    try:
        while True:
            try:
                # racing the drain costs a task per event: only once draining has begun
                event = await (_next_or_drain(state, it) if state.draining
                               else it.__anext__())
            except StopAsyncIteration:
                return
            yield encode_event(event)
    except DrainExpiredError:
        for event in error_events(shutting_down(state)):
            yield encode_event(event)
    except Exception as exc:  # noqa: BLE001 - becomes an error event for this stream only
        for event in error_events(engine_error(exc, "messages")):
            yield encode_event(event)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # already closed by a cancelled __anext__
                await aclose()


class EventStream(EventSourceResponse):
    """sse-starlette's response, its per-event send timeout kept by one `SendDeadline` for
    the whole response instead of an anyio cancel scope (or an `asyncio.timeout`) per event:
    each armed and cancelled a timer per streamed token, the largest part of the event loop's
    work. Where sse-starlette has no such method to override, its own runs: slower, the same
    behaviour (tests/test_reliability_http.py checks that the override is in use and that
    both drop a client that stops reading)."""

    _deadline: SendDeadline | None = None
    _write_body: Callable[[bytes], bool] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self._write_body = body_writer(scope)
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            # the client stopped reading: one line, the connection closed, nothing to raise
            log.warning("dropped a streaming client that read nothing for %g s "
                        "(send_timeout_s); its request was stopped", self.send_timeout or 0)
            if not drop_connection(scope):
                raise
        finally:
            if self._deadline is not None:
                self._deadline.close()

    async def _send_with_timeout(self, send: Any, message: Any) -> None:
        # an event (a body chunk with more to come) is written at once when the transport
        # takes it: that cannot wait, so it needs no deadline, and the send wrappers of the
        # middleware in between only look at the response's start (none changes a body)
        write = self._write_body
        if (write is not None and message["type"] == "http.response.body"
                and message.get("more_body") and write(message["body"])):
            return
        try:
            if self.send_timeout is None:
                await send(message)
            else:
                deadline = self._deadline
                if deadline is None:
                    deadline = self._deadline = SendDeadline(self.send_timeout)
                await deadline.send(send(message))
        except TimeoutError:
            self._send_interrupted = True
            raise SendTimeoutError() from None
        except BaseException:
            self._send_interrupted = True
            raise


def sse_response(state: ServerState, events: AsyncIterator[Any],
                 error_events: Callable[[APIError], list[Event]] = openai_error_events,
                 ping: Callable[[], ServerSentEvent] | None = None) -> EventSourceResponse:
    """An SSE response sending each string of events as one `data:` event (a dict: an
    `event:` line and its data); a failure ends it with error_events. ping: the keep-alive
    sent every 15 s of silence (None: an SSE comment)."""
    settings = state.settings
    return EventStream(
        _guarded(state, events, error_events),
        ping=15,
        ping_message_factory=ping,
        send_timeout=settings.send_timeout_s,
        # our own drain (error event + [DONE]) ends streams at drain_timeout_s; sse-starlette
        # force-cancels only after that has had time to go out
        shutdown_grace_period=settings.drain_timeout_s + DRAIN_GRACE_S / 2,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
