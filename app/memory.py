"""Giving freed memory back to the system.

glibc's malloc keeps what a thread frees in that thread's arena, for the next allocation of
that thread; with the event loop, the tokenizer pool, the constraint pool and the engine each
growing arenas of their own, a few large requests (a body near max_body_bytes that ends in a
400, say) left a few hundred MB resident that no later request reused, growing round after
round. The server therefore caps the arenas at start (`limit_arenas`), and `MemoryReturner`
trims the heap (malloc_trim) once the resident size has grown by TRIM_STEP_BYTES since the last
trim, and again once memory a trim found in use has been freed, checked once a second, off the
event loop. Without glibc both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("colibri.app")

ARENAS = 2
TRIM_STEP_BYTES = 32 << 20
CHECK_EVERY_S = 1.0
EAGER_TRIES = 8
MAX_RETRY_S = 64.0
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc has it, other C libraries do not
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def limit_arenas(n: int = ARENAS) -> bool:
    """At most n malloc arenas from now on (call before threads start); False without glibc."""
    return _LIBC is not None and bool(_LIBC.mallopt(_M_ARENA_MAX, int(n)))


def trim() -> None:
    """Return the heap's free pages to the system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident set (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryReturner:
    """Trims after growth, and again after memory that was in use at a trim is freed:
    `await run()` until cancelled.

    A trim while a burst of requests still holds its memory gives little back, and the burst
    frees it afterwards without the resident size growing again; so while the resident size
    stays TRIM_STEP_BYTES above the least it fell to after a trim, trims are tried again: each
    second for EAGER_TRIES trims that returned less than a step, then twice as long after each
    (at most MAX_RETRY_S): a process that really needs more memory pays one trim a minute."""

    def __init__(self, step_bytes: int = TRIM_STEP_BYTES) -> None:
        self.step_bytes = step_bytes
        self.trims = 0

    async def run(self) -> None:
        if _LIBC is None:
            return
        base = low = resident_bytes()  # after the last trim; the least after any trim
        retry_s = due_s = CHECK_EVERY_S
        misses = 0  # trims in a row that returned less than a step
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            now = resident_bytes()
            due_s -= CHECK_EVERY_S
            if now <= base + self.step_bytes and (now <= low + self.step_bytes or due_s > 0):
                continue
            if now > base + self.step_bytes:
                misses = 0  # it grew: a new burst, whose memory a second from now may be free
            await asyncio.to_thread(trim)
            self.trims += 1
            base = resident_bytes()
            low = min(low, base)
            misses = 0 if now - base >= self.step_bytes else misses + 1
            retry_s = CHECK_EVERY_S if misses < EAGER_TRIES else min(retry_s * 2, MAX_RETRY_S)
            due_s = retry_s
