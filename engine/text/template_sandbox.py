"""Chat templates render in a separate process that can be stopped: the model's own
template and those sent by clients alike.

Guarantees: a template gets at most `timeout_s` of wall time and RENDER_MEMORY_BYTES of
address space beyond what the render process needs to start; it is killed (and replaced)
when it runs out of either or when `cancel` is set (its client left). The server process
never holds the template's intermediate values. Requests and results cross the pipe as JSON,
never pickle, so even an escaped sandbox could not hand the server code to run.
Refuses: nothing itself; the jinja2 sandbox and output cap of engine.text.template_env still
apply inside the render process.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from colibri.engine.text.errors import ChatTemplateError, TemplateFaultError, TemplateLimitError
from colibri.engine.text.template_env import render_template

RENDER_MEMORY_BYTES = 192 << 20
RENDER_TIMEOUT_S = 2.0
_POLL_S = 0.02
_MAX_MESSAGE = 64 << 20


class TemplateStoppedError(ChatTemplateError):
    """The render was stopped: out of time or memory, or its client went away."""


class TemplateBudgetError(TemplateStoppedError, TemplateLimitError):
    """The render was stopped because it ran out of time or memory."""


def _send(f: Any, obj: Any) -> None:
    body = json.dumps(obj).encode("utf-8", "surrogatepass")
    data = memoryview(struct.pack("<I", len(body)) + body)
    while data:  # an unbuffered pipe may take part of it per write
        data = data[f.write(data):]
    f.flush()


def _read_exactly(f: Any, n: int) -> bytes:
    """n bytes from f; an unbuffered pipe hands out at most what it holds per read."""
    parts: list[bytes] = []
    while n > 0:
        part = f.read(n)
        if not part:
            raise EOFError
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _recv(f: Any) -> Any:
    (n,) = struct.unpack("<I", _read_exactly(f, 4))
    if n > _MAX_MESSAGE:
        raise EOFError
    return json.loads(_read_exactly(f, n).decode("utf-8", "surrogatepass"))


class _Renderer:
    """One render process (python -m colibri.engine.text.template_sandbox)."""

    def __init__(self) -> None:
        env = dict(os.environ, COLIBRI_RENDER_MEMORY=str(RENDER_MEMORY_BYTES))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colibri.engine.text.template_sandbox"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0,
            start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        os.set_blocking(self.stdout.fileno(), True)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.stdin, self.stdout):
            f.close()


class TemplateSandbox:
    """A small pool of render processes, started on first use."""

    def __init__(self) -> None:
        self._idle: list[_Renderer] = []
        self._lock = threading.Lock()

    def render(self, template: str, context: dict[str, Any], cap: int,
               timeout_s: float = RENDER_TIMEOUT_S,
               cancel: threading.Event | None = None) -> str:
        """What engine.text.template_env's render_template returns, or ChatTemplateError."""
        with self._lock:
            r = self._idle.pop() if self._idle else None
        if r is None or r.proc.poll() is not None:
            r = _Renderer()
        try:
            _send(r.stdin, {"template": template, "context": context, "cap": cap})
            deadline = time.monotonic() + timeout_s
            while not select.select([r.stdout], [], [], _POLL_S)[0]:
                if cancel is not None and cancel.is_set():
                    raise TemplateStoppedError("chat template render stopped: the client left",
                                               "chat_template")
                if time.monotonic() > deadline:
                    raise TemplateBudgetError(
                        f"chat template did not render within {timeout_s:g} s", "chat_template")
            try:
                reply = _recv(r.stdout)
            except EOFError:
                raise TemplateBudgetError("chat template render failed (out of memory?)",
                                           "chat_template") from None
        except BaseException:
            r.kill()  # stopped mid-render: the process and whatever it built go away
            raise
        with self._lock:
            keep = len(self._idle) < 2
            if keep:
                self._idle.append(r)
        if not keep:
            r.kill()
        if reply.get("error") is not None:
            error = (TemplateLimitError if reply.get("limit") else TemplateFaultError
                     if reply.get("fault") else ChatTemplateError)
            raise error(reply["error"], reply.get("param") or "messages")
        return str(reply["text"])

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for r in idle:
            r.kill()


SANDBOX = TemplateSandbox()


def _child() -> None:
    """The render process: limit memory, then render requests until stdin closes."""
    import resource

    extra = int(os.environ.get("COLIBRI_RENDER_MEMORY", RENDER_MEMORY_BYTES))
    if os.path.exists("/proc/self/statm"):  # Linux: the address space in use now
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            req = _recv(stdin)
        except EOFError:
            return
        try:
            reply: dict[str, Any] = {
                "text": render_template(req["template"], req["context"], req["cap"])}
        except ChatTemplateError as e:
            reply = {"error": str(e), "param": e.param,
                     "limit": isinstance(e, TemplateLimitError),
                     "fault": isinstance(e, TemplateFaultError)}
            if isinstance(e.__cause__, MemoryError):
                reply = {"error": "chat template needs too much memory to render",
                         "param": "chat_template", "limit": True}
        except MemoryError:
            reply = {"error": "chat template needs too much memory to render",
                     "param": "chat_template", "limit": True}
        except Exception as e:  # noqa: BLE001 - a template is data: any failure is a 400
            reply = {"error": f"chat template failed to render: {e}", "param": "messages"}
        try:
            _send(stdout, reply)
        except MemoryError:
            _send(stdout, {"error": "chat template output too large", "param": "chat_template",
                           "limit": True})


if __name__ == "__main__":
    _child()
