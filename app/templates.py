"""Chat prompts through the model's tokenizer, on the tokenizer pool (never the loop).

The engine's template rendering keeps every client string plain text (a user cannot forge
role markers with special-token text) and renders in jinja2's sandbox with a size cap.
Every template renders in a separate process with memory and time limits, stopped when its
client disconnects: the model's own template and, when the operator enabled them (checked
in app.protocol before this runs), templates sent by clients. A client template past a
limit is that client's 400; the model's template past a limit is a 500 naming the model's
template, and the server goes on serving.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from colibri.app.errors import APIError
from colibri.engine import ModelTemplateError

log = logging.getLogger("colibri.app")


def render_prompt_ids(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                      client_template: str | None, timeout_s: float,
                      cancel: threading.Event | None = None,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the rendered chat; APIError(400) for what the template refuses or a
    client template past a limit, APIError(500) for the model's template past a limit."""
    kwargs: dict[str, Any] = {"render_timeout_s": timeout_s, "cancel": cancel}
    if client_template is not None:
        kwargs.update(chat_template=client_template, allow_custom_template=True)
    try:
        return list(tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs))
    except ValueError as exc:
        raise APIError(400, str(exc), getattr(exc, "param", None) or "messages") from None
    except ModelTemplateError as exc:
        log.error("%s", exc)
        raise APIError(500, str(exc), code="model_chat_template_failed") from None


def chat_prompt_ids(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    client_template: str | None, timeout_s: float = 2.0,
                    cancel: threading.Event | None = None) -> list[int]:
    """Token ids of the chat prompt (see render_prompt_ids)."""
    return render_prompt_ids(tok, messages, add_generation_prompt, client_template,
                             timeout_s, cancel)
