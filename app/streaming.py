"""Server-sent events (sse-starlette) for streamed completions.

A stream that fails after its 200 went out ends with one OpenAI-shaped error event and
`[DONE]` instead of a cut connection. A client that stops reading is dropped after
`send_timeout_s`; on SIGTERM a stream may run `drain_timeout_s` more before it is cut.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse

from app.errors import error_body
from app.generation import engine_error
from app.state import ServerState


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - becomes an error event for this stream only
        err = engine_error(exc, "messages")
        yield json.dumps(error_body(err.status, err.message, err.param, err.code))
        yield "[DONE]"
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(state: ServerState, events: AsyncIterator[str]) -> EventSourceResponse:
    """An SSE response sending each string of events as one `data:` event."""
    settings = state.settings
    return EventSourceResponse(
        _guarded(events),
        ping=15,
        send_timeout=settings.send_timeout_s,
        shutdown_grace_period=settings.drain_timeout_s,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
