"""From a chat request's messages, tools and formats to a prompt and an output plan.

Decides, per request, what the model sees and how its reply is read:
- `text`: plain content (no tools, tool_choice "none", or tools the template cannot render
  with tool_choice absent / "auto": those are dropped, and the log says so);
- `auto`: the tools are rendered by the model's template and the reply is parsed for calls
  in the template family's format (engine.ToolCallParser);
- `forced` (tool_choice "required" or a named function): the reply is constrained to the
  calls' JSON Schema; a template that cannot render tools gets them in a generic preamble.
response_format json_object / json_schema constrains the content (tool_choice auto is then
read as "none": a reply cannot both match the schema and be a tool call).
Runs on the tokenizer pool, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri.app.errors import APIError
from colibri.app.protocol_tools import ResponseFormat, Tool, ToolChoice, named_choice
from colibri.app.templates import render_prompt_ids
from colibri.engine import (
    ConstraintCompiler,
    ConstraintError,
    ConstraintSpec,
    ToolCall,
    ToolCallParser,
    forced_calls,
    forced_calls_schema,
    generic_preamble,
    history_call_text,
    template_tools,
)

log = logging.getLogger("colibri.app")


@dataclass
class ChatPlan:
    """The prompt and how to read the reply."""

    prompt: list[int]
    mode: Literal["text", "auto", "forced"] = "text"
    forced_name: str | None = None  # tool_choice named a function
    spec: ConstraintSpec | None = None
    family: str = "generic"
    tool_names: set[str] = field(default_factory=set)
    n_tools_rendered: int = 0

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.family, self.tool_names) if self.mode == "auto" else None

    def calls_of_forced(self, text: str) -> list[ToolCall] | None:
        """The calls of a forced reply; None when it was cut short and does not parse."""
        try:
            return forced_calls(text, self.forced_name)
        except (ValueError, KeyError, TypeError):
            return None


def _messages(messages: list[dict[str, Any]], template_tools_ok: bool) -> list[dict[str, Any]]:
    """OpenAI messages as templates want them. Tool-call arguments become objects (templates
    serialise them themselves); without a tool-capable template, earlier calls are written as
    generic JSON text and tool results become user messages."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if template_tools_ok:
                m["tool_calls"] = [_template_call(c) for c in calls]
            else:
                del m["tool_calls"]
                text = m.get("content") or ""
                m["content"] = (text + "\n" if text else "") + history_call_text(calls)
        elif m["role"] == "tool" and not template_tools_ok:
            who = m.pop("name", None) or m.pop("tool_call_id", None) or "tool"
            m.pop("tool_call_id", None)
            m = {"role": "user", "content": f"Result of {who}:\n{m.get('content', '')}"}
        out.append(m)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # left as the string the client sent
    return {"id": call.get("id"), "type": "function", "function": fn}


def plan_chat(
    tok: Any,
    messages: list[dict[str, Any]],
    tools: list[Tool] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    response_format: ResponseFormat | None,
    add_generation_prompt: bool = True,
    client_template: str | None = None,
    format_param: str = "response_format",
    template_timeout_s: float = 2.0,
    cancel: threading.Event | None = None,
) -> ChatPlan:
    """Render the prompt (tok: the model's tokenizer) and choose the output mode;
    APIError(400) for what cannot be done."""
    template = client_template if client_template is not None else tok.chat_template
    info = template_tools(template)
    spec = response_format.spec(format_param) if response_format is not None else None
    name = named_choice(tool_choice)
    forced = bool(tools) and (tool_choice == "required" or name is not None)
    plan = ChatPlan(prompt=[], spec=spec, family=info.family)
    tool_dicts = [t.template_dict() for t in tools or []]
    render_tools: list[dict[str, Any]] | None = None
    msgs = _messages(messages, info.renders_tools)
    if forced:
        plan.mode, plan.forced_name = "forced", name
        plan.spec = ConstraintSpec("json_schema",
                                   forced_calls_schema(tool_dicts, name, parallel_tool_calls),
                                   "tools")
        if info.renders_tools:
            render_tools = tool_dicts
        else:
            msgs = _with_system(msgs, generic_preamble(tool_dicts, name))
    elif tools and tool_choice != "none" and spec is None:
        if info.renders_tools:
            plan.mode, render_tools = "auto", tool_dicts
        else:
            log.info("the chat template cannot render tools: %d tools ignored for this "
                     "request (tool_choice %s)", len(tools), tool_choice or "absent")
    plan.tool_names = {t.function.name for t in tools or []}
    plan.prompt = render_prompt_ids(tok, msgs, add_generation_prompt, client_template,
                                    template_timeout_s, cancel, render_tools)
    if render_tools or (forced and not info.renders_tools):
        plan.n_tools_rendered = len(tool_dicts)
    return plan


def _with_system(msgs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if msgs and msgs[0]["role"] == "system":
        first = dict(msgs[0])
        first["content"] = f"{first.get('content', '')}\n\n{text}".strip()
        return [first, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]


def compile_constraints(tok: Any, vocab_size: int, spec: ConstraintSpec | None,
                        budgets: list[int]) -> list[Any]:
    """One fresh constraint per sequence (None without a spec); 400 naming what the grammar
    engine cannot enforce. Runs on the tokenizer pool (a first compile can take a while)."""
    if spec is None:
        return [None] * len(budgets)
    try:
        compiler = ConstraintCompiler.for_tokenizer(tok, vocab_size)
        return [compiler.compile(spec, max_tokens=b) for b in budgets]
    except ConstraintError as exc:
        raise APIError(400, exc.message, exc.param) from None


def context_note(plan: ChatPlan) -> str:
    """Added to a context-length error when tool definitions are part of the prompt."""
    if not plan.n_tools_rendered:
        return ""
    return (f" The prompt includes the definitions of {plan.n_tools_rendered} tools, which "
            "count against the context like any other prompt text.")
