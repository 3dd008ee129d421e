"""Work that may run away, done in child processes that can be stopped.

A `WorkerPool` runs `python -m <module>` children, each answering one JSON request at a time
over its stdin and stdout. Guarantees: a call gets at most `timeout_s` of wall time; its child
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

    def wait_reply(self, deadline: float, cancel: threading.Event | None, what: str) -> Any:
        while not select.select([self.stdout], [], [], _POLL_S)[0]:
            if cancel is not None and cancel.is_set():
                raise WorkerStopped("cancelled", f"{what} stopped: the client left")
            if time.monotonic() > deadline:
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
            w.wait_reply(time.monotonic() + self.start_timeout_s, cancel, "starting a worker")
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
            reply = w.wait_reply(time.monotonic() + timeout_s, cancel, what)
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
