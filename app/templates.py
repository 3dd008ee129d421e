"""Chat prompts through the model's tokenizer, on the tokenizer pool (never the loop).

The engine's template rendering keeps every client string plain text (a user cannot forge
role markers with special-token text) and renders in jinja2's sandbox with a size cap.
A client-sent template reaches it only when the operator enabled them (checked in
app.protocol before this runs); it renders in a separate process with memory and time
limits, stopped when its client disconnects.
"""

from __future__ import annotations

import threading
from typing import Any

from app.errors import APIError


def chat_prompt_ids(llm: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    client_template: str | None, timeout_s: float = 2.0,
                    cancel: threading.Event | None = None) -> list[int]:
    """Token ids of the chat prompt; APIError(400) for messages the template refuses."""
    kwargs: dict[str, Any] = {}
    if client_template is not None:
        kwargs = {"chat_template": client_template, "allow_custom_template": True,
                  "render_timeout_s": timeout_s, "cancel": cancel}
    try:
        return list(llm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs))
    except ValueError as exc:
        raise APIError(400, str(exc), getattr(exc, "param", None) or "messages") from None

