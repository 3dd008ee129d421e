"""A chat request's prompt and reply plan, through the engine's chat planning, with its
errors as API errors.

Every template renders in a separate process with memory and time limits, stopped when its
client disconnects: the model's own template and, when the operator enabled them (checked
in app.protocol before this runs), templates sent by clients. A client template past a
limit is that client's 400; the model's template past a limit is a 500 naming the model's
template, and the server goes on serving. Runs on the tokenizer pool, never on the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from colibri.app.errors import APIError
from colibri.app.protocol_tools import ResponseFormat, Tool, ToolChoice, named_choice
from colibri.engine import (
    ChatPlan,
    ConstraintError,
    ConstraintSpec,
    ModelTemplateError,
    compile_constraints,
    plan_chat,
    render_chat,
)

log = logging.getLogger("colibri.app")
T = TypeVar("T")


def _api_errors(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) with the template's and the grammar engine's refusals as API errors."""
    try:
        return fn(*args)
    except ConstraintError as exc:
        raise APIError(400, exc.message, exc.param) from None
    except ModelTemplateError as exc:
        log.error("%s", exc)
        raise APIError(500, str(exc), code="model_chat_template_failed") from None
    except ValueError as exc:
        raise APIError(400, str(exc), getattr(exc, "param", None) or "messages") from None


def request_plan(tok: Any, messages: list[dict[str, Any]], tools: list[Tool] | None,
                 tool_choice: ToolChoice | None, parallel_tool_calls: bool,
                 response_format: ResponseFormat | None, add_generation_prompt: bool = True,
                 client_template: str | None = None, format_param: str = "response_format",
                 template_timeout_s: float = 2.0,
                 cancel: threading.Event | None = None, reasoning_effort: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> ChatPlan:
    """The engine's plan of a chat request (tok: the model's tokenizer); APIError for what
    cannot be done. reasoning_effort and template_kwargs reach the template (plan_chat)."""
    spec = response_format.spec(format_param) if response_format is not None else None
    name = named_choice(tool_choice)
    choice = tool_choice if isinstance(tool_choice, str) else None
    tool_dicts = [t.template_dict() for t in tools] if tools else None
    return _api_errors(plan_chat, tok, messages, tool_dicts, choice, name,
                       parallel_tool_calls, spec, add_generation_prompt, client_template,
                       template_timeout_s, cancel, reasoning_effort, template_kwargs)


def chat_prompt_ids(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    client_template: str | None, timeout_s: float = 2.0,
                    cancel: threading.Event | None = None) -> list[int]:
    """Token ids of a chat prompt without tools; APIError as request_plan."""
    return _api_errors(render_chat, tok, messages, add_generation_prompt, client_template,
                       timeout_s, cancel)


def request_constraints(tok: Any, vocab_size: int, spec: ConstraintSpec | None,
                        budgets: list[int], timeout_s: float,
                        cancel: threading.Event | None = None) -> list[Any]:
    """One fresh constraint per sequence (None without a spec); 400 naming what the grammar
    engine cannot enforce or could not compile within timeout_s."""
    return _api_errors(compile_constraints, tok, vocab_size, spec, budgets, timeout_s, cancel)


def context_note(plan: ChatPlan) -> str:
    """Added to a context-length error when tool definitions are part of the prompt."""
    if not plan.n_tools_rendered:
        return ""
    return (f" The prompt includes the definitions of {plan.n_tools_rendered} tools, which "
            "count against the context like any other prompt text.")
