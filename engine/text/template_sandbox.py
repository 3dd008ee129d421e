"""Chat templates render in a separate process that can be stopped: the model's own
template and those sent by clients alike.

Guarantees: a template gets at most `timeout_s` of CPU time (a busy machine stretches the wall
time, up to engine.isolate.pool's WALL_FACTOR times) and RENDER_MEMORY_BYTES of address space
beyond what the render process needs to start; it is killed (and replaced)
when it runs out of either or when `cancel` is set (its client left). The server process
never holds the template's intermediate values. Requests and results cross the pipe as JSON,
never pickle, so even an escaped sandbox could not hand the server code to run.
Refuses: nothing itself; the jinja2 sandbox and output cap of engine.text.template_env still
apply inside the render process.
"""

from __future__ import annotations

import threading
from typing import Any

from colibri.engine.isolate.pool import WorkerPool, WorkerStopped, serve
from colibri.engine.text.errors import ChatTemplateError, TemplateFaultError, TemplateLimitError
from colibri.engine.text.template_env import render_template

RENDER_MEMORY_BYTES = 192 << 20
RENDER_TIMEOUT_S = 2.0


class TemplateStoppedError(ChatTemplateError):
    """The render was stopped: out of time or memory, or its client went away."""


class TemplateBudgetError(TemplateStoppedError, TemplateLimitError):
    """The render was stopped because it ran out of time or memory."""


class TemplateSandbox:
    """A small pool of render processes, started on first use."""

    def __init__(self) -> None:
        self._pool = WorkerPool("colibri.engine.text.template_sandbox", RENDER_MEMORY_BYTES)

    def render(self, template: str, context: dict[str, Any], cap: int,
               timeout_s: float = RENDER_TIMEOUT_S,
               cancel: threading.Event | None = None) -> str:
        """What engine.text.template_env's render_template returns, or ChatTemplateError."""
        try:
            reply = self._pool.call({"template": template, "context": context, "cap": cap},
                                    timeout_s, cancel, "chat template render")
        except WorkerStopped as e:
            if e.reason == "cancelled":
                raise TemplateStoppedError(f"{e}", "chat_template") from None
            if e.reason == "timeout":
                raise TemplateBudgetError(
                    f"chat template did not render within {timeout_s:g} s", "chat_template"
                ) from None
            raise TemplateBudgetError(f"{e}", "chat_template") from None
        if reply.get("error") is not None:
            error = (TemplateLimitError if reply.get("limit") else TemplateFaultError
                     if reply.get("fault") else ChatTemplateError)
            raise error(reply["error"], reply.get("param") or "messages")
        return str(reply["text"])

    def close(self) -> None:
        self._pool.close()


SANDBOX = TemplateSandbox()


def _render(req: dict[str, Any]) -> dict[str, Any]:
    """One render in the child: its text, or what went wrong."""
    too_big = {"error": "chat template needs too much memory to render",
               "param": "chat_template", "limit": True}
    try:
        reply: dict[str, Any] = {
            "text": render_template(req["template"], req["context"], req["cap"])}
    except ChatTemplateError as e:
        reply = {"error": str(e), "param": e.param,
                 "limit": isinstance(e, TemplateLimitError),
                 "fault": isinstance(e, TemplateFaultError)}
        if isinstance(e.__cause__, MemoryError):
            reply = too_big
    except MemoryError:
        reply = too_big
    except Exception as e:  # noqa: BLE001 - a template is data: any failure is a 400
        reply = {"error": f"chat template failed to render: {e}", "param": "messages"}
    return reply


if __name__ == "__main__":
    serve(_render)
