"""The send timeout of one streamed response, without a timer per event.

`asyncio.timeout` around each send arms and cancels a timer handle per event (a heap push
and its comparisons, then a cancelled entry left in the loop's heap): on a stream of one
event per token that was the largest part of the event loop's work. Here a send only notes
when it began; one timer, armed by the first send and re-armed only when it fires, cancels
a send that has waited `timeout` seconds. Guarantees what a per-send `asyncio.timeout`
does: such a send raises TimeoutError in its task (and only there), no earlier than
`timeout` after it began; a cancellation from elsewhere passes through unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


class SendDeadline:
    """Cuts sends that wait longer than timeout seconds (one per task at a time)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._loop = asyncio.get_running_loop()
        self._began: dict[asyncio.Task[object], float] = {}  # sends in flight: start time
        self._expired: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    async def send(self, awaitable: Awaitable[None]) -> None:
        """Await awaitable (one send) in the current task; TimeoutError once it has waited
        timeout seconds."""
        task = asyncio.current_task()
        assert task is not None, "sends run in a task"
        self._began[task] = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_later(self.timeout, self._check)
        try:
            await awaitable
        except asyncio.CancelledError:
            if task not in self._expired:
                raise
            self._expired.discard(task)
            task.uncancel()
            raise TimeoutError() from None
        finally:
            del self._began[task]
        if task in self._expired:  # it completed, swallowing the cut: the data went out
            self._expired.discard(task)
            task.uncancel()

    def close(self) -> None:
        """The response is over: drop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        next_due: float | None = None
        for task, began in self._began.items():
            due = began + self.timeout
            if due <= now:
                if task not in self._expired:
                    self._expired.add(task)
                    task.cancel()
            elif next_due is None or due < next_due:
                next_due = due
        if next_due is not None:
            self._timer = self._loop.call_at(next_due, self._check)
        # with no send in flight, the next send arms the timer again
