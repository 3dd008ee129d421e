"""Where one HTTP request's engine outputs wait for its handler: a first-in, first-out box on
the event loop, filled by the engine's step deliveries and read by one consumer.

What `asyncio.Queue` does for a single reader without a bound, with less work per item
(no size checks, task counting or `join` event): a streamed request takes one item per
token. Not thread-safe: put from the loop only (the engine hands items over with
`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """An unbounded FIFO with one reader."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> T:
        """The oldest item, waiting for one if the box is empty."""
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self._items.popleft()

    def qsize(self) -> int:
        return len(self._items)
