"""Work that may run away, done in child processes that can be stopped.

A `WorkerPool` runs `python -m <module>` children, each answering one JSON request at a time
over its stdin and stdout. Guarantees: a call gets at most `timeout_s` of its child's CPU time
(where /proc tells it; else of wall time) and at most WALL_FACTOR times that of wall time, so a
busy machine slows a call down without failing it, while a runaway one is stopped; its child
gets at most `memory_bytes` of address space beyond what it holds once set up; the child is
killed (and replaced on the next call) when it runs out of either, when `cancel` is set (the
client left) or when the server process dies. Requests and replies cross the pipe as JSON,
never pickle, so even a compromised child could not hand the server code to run. The server
never holds what the child built along the way.

The child side is `serve(handle, setup)`: `setup` receives the pool's `hello` once (large
shared inputs, such as a tokenizer), then `handle` maps each request to its reply.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO, Literal

_POLL_S = 0.02
# a call's wall-time cap, in multiples of its CPU-time budget: a child that gets less than
# this share of a core, or that waits on something, is stopped all the same
WALL_FACTOR = 10
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX_MESSAGE = 256 << 20
_MEMORY_ENV = "COLIBRI_WORKER_MEMORY"
_PR_SET_PDEATHSIG = 1

StopReason = Literal["timeout", "memory", "cancelled"]


class WorkerStopped(Exception):
    """A call was stopped: out of time (`timeout`), its child died, most likely at its memory
    limit (`memory`), or its client left (`cancelled`)."""

    def __init__(self, reason: StopReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def send(f: BinaryIO, obj: Any) -> None:
    """Write one message: its length, then its JSON."""
    body = json.dumps(obj).encode("utf-8", "surrogatepass")
    data = memoryview(struct.pack("<I", len(body)) + body)
    while data:  # an unbuffered pipe may take part of it per write
        data = data[f.write(data) or 0:]
    f.flush()


def _read_exactly(f: BinaryIO, n: int) -> bytes:
    """n bytes from f; an unbuffered pipe hands out at most what it holds per read."""
    parts: list[bytes] = []
    while n > 0:
        part = f.read(n)
        if not part:
            raise EOFError
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def recv(f: BinaryIO) -> Any:
    """Read one message written by send; EOFError when the other side is gone."""
    (n,) = struct.unpack("<I", _read_exactly(f, 4))
    if n > _MAX_MESSAGE:
        raise EOFError
    return json.loads(_read_exactly(f, n).decode("utf-8", "surrogatepass"))


class _Worker:
    """One child process."""

    def __init__(self, module: str, memory_bytes: int) -> None:
        env = dict(os.environ, **{_MEMORY_ENV: str(memory_bytes)})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, bufsize=0, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: BinaryIO = self.proc.stdin
        self.stdout: BinaryIO = self.proc.stdout
        os.set_blocking(self.stdout.fileno(), True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float | None:
        """CPU time the child has used so far (user and system), None where /proc is not
        there to say."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
        except (OSError, IndexError, ValueError):
            return None

    def wait_reply(self, timeout_s: float, cancel: threading.Event | None, what: str) -> Any:
        """The child's next reply; WorkerStopped once it has used timeout_s of CPU time
        (or of wall time where that cannot be read) or WALL_FACTOR * timeout_s of wall
        time, or when cancel is set."""
        start, cpu0 = time.monotonic(), self.cpu_seconds()
        while not select.select([self.stdout], [], [], _POLL_S)[0]:
            if cancel is not None and cancel.is_set():
                raise WorkerStopped("cancelled", f"{what} stopped: the client left")
            wall = time.monotonic() - start
            if wall > timeout_s:
                cpu = self.cpu_seconds()
                used = wall if cpu is None or cpu0 is None else cpu - cpu0
                if used > timeout_s or wall > WALL_FACTOR * timeout_s:
                    raise WorkerStopped("timeout", f"{what} ran out of time")
        try:
            return recv(self.stdout)
        except EOFError:
            raise WorkerStopped("memory", f"{what} failed (out of memory?)") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.stdin, self.stdout):
            f.close()


class WorkerPool:
    """Up to `keep` idle children of `module`, started on first use; `hello` (JSON) is what
    each child's setup receives, within `start_timeout_s`."""

    def __init__(self, module: str, memory_bytes: int, keep: int = 2,
                 hello: Any = None, start_timeout_s: float = 60.0) -> None:
        self.module = module
        self.memory_bytes = int(memory_bytes)
        self.keep = keep
        self.hello = hello
        self.start_timeout_s = start_timeout_s
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def _start(self, cancel: threading.Event | None) -> _Worker:
        w = _Worker(self.module, self.memory_bytes)
        try:
            send(w.stdin, {"hello": self.hello})
            w.wait_reply(self.start_timeout_s, cancel, "starting a worker")
        except BaseException:
            w.kill()
            raise
        return w

    def call(self, request: Any, timeout_s: float, cancel: threading.Event | None = None,
             what: str = "the work") -> Any:
        """The child's reply to request; WorkerStopped (its message starts with `what`)
        when the call ran out of time or memory or was cancelled."""
        with self._lock:
            w = self._idle.pop() if self._idle else None
        if w is None or not w.alive():
            w = self._start(cancel)
        try:
            send(w.stdin, request)
            reply = w.wait_reply(timeout_s, cancel, what)
        except BaseException:
            w.kill()  # stopped mid-call: the child and whatever it built go away
            raise
        with self._lock:
            keep = len(self._idle) < self.keep
            if keep:
                self._idle.append(w)
        if not keep:
            w.kill()
        return reply

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when the thread that started it ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _limit_memory(extra: int) -> None:
    """Cap the address space at what is in use now plus extra (Linux)."""
    import resource

    if os.path.exists("/proc/self/statm"):
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


def serve(handle: Callable[[Any], Any], setup: Callable[[Any], None] | None = None) -> None:
    """The child's loop: set up from the hello, limit memory, then answer requests until
    stdin closes. A MemoryError while answering ends the child (the caller sees `memory`)."""
    _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        first = recv(stdin)
    except EOFError:
        return
    if setup is not None:
        setup(first.get("hello"))
    _limit_memory(int(os.environ.get(_MEMORY_ENV, 256 << 20)))
    send(stdout, {"ready": True})
    while True:
        try:
            req = recv(stdin)
        except EOFError:
            return
        send(stdout, handle(req))
