"""From a chat's messages, tools and output format to a prompt and a plan for its reply.

Decides what the model sees and how its reply is read:
- `text`: plain content (no tools, tool_choice "none", or tools the template cannot render
  with tool_choice absent / "auto": those are dropped, and the log says so);
- `auto`: the tools are rendered by the model's template and the reply is parsed for calls
  in the template family's format (ToolCallParser);
- `forced` (tool_choice "required" or a named function): the reply is constrained to the
  calls' JSON Schema; a template that cannot render tools gets them in a generic preamble.
A content format (a ConstraintSpec) turns tool_choice "auto" into "none": a reply cannot
both match the format and be a tool call. Knows nothing of HTTP; messages and tools come as
the chat-template dicts (OpenAI's shape). Renders through the tokenizer's chat template:
run it off any event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri.engine.sample.constraints import ConstraintSpec
from colibri.engine.text.toolcalls import (
    ToolCall,
    ToolCallParser,
    forced_calls,
    forced_calls_schema,
    generic_preamble,
    history_call_text,
    template_tools,
)

log = logging.getLogger("colibri.engine")


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
        """A fresh parser of the calls in a reply; None unless the mode is `auto`."""
        return ToolCallParser(self.family, self.tool_names) if self.mode == "auto" else None

    def calls_of_forced(self, text: str, cut: bool = False) -> list[ToolCall] | None:
        """The calls of a forced reply; None when it does not parse. cut: the reply ended at
        the token limit, and the call being written stays a call, its arguments incomplete."""
        try:
            return forced_calls(text, self.forced_name, cut, self.tool_names)
        except (ValueError, KeyError, TypeError):
            return None


def plan_chat(
    tok: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | None = None,
    forced_name: str | None = None,
    parallel_tool_calls: bool = True,
    spec: ConstraintSpec | None = None,
    add_generation_prompt: bool = True,
    client_template: str | None = None,
    template_timeout_s: float = 2.0,
    cancel: threading.Event | None = None,
) -> ChatPlan:
    """Render the prompt with tok (the model's Tokenizer) and choose the reply's mode.

    tool_choice: "none", "auto", "required" or None (absent); forced_name: the function a
    request named (tool_choice is then ignored). Raises what the tokenizer's chat rendering
    raises: ValueError for what the template refuses or a client template past a limit,
    ModelTemplateError for the model's own template past a limit.
    """
    template = client_template if client_template is not None else tok.chat_template
    info = template_tools(template)
    forced = bool(tools) and (tool_choice == "required" or forced_name is not None)
    plan = ChatPlan(prompt=[], spec=spec, family=info.family)
    tool_dicts = list(tools or [])
    render_tools: list[dict[str, Any]] | None = None
    msgs = _messages(messages, info.renders_tools)
    if forced:
        plan.mode, plan.forced_name = "forced", forced_name
        plan.spec = ConstraintSpec(
            "json_schema", forced_calls_schema(tool_dicts, forced_name, parallel_tool_calls),
            "tools")
        if info.renders_tools:
            render_tools = tool_dicts
        else:
            msgs = _with_system(msgs, generic_preamble(tool_dicts, forced_name))
    elif tools and tool_choice != "none" and spec is None:
        if info.renders_tools:
            plan.mode, render_tools = "auto", tool_dicts
        else:
            log.info("the chat template cannot render tools: %d tools ignored for this "
                     "request (tool_choice %s)", len(tools), tool_choice or "absent")
    plan.tool_names = {t["function"]["name"] for t in tool_dicts}
    plan.prompt = render_chat(tok, msgs, add_generation_prompt, client_template,
                              template_timeout_s, cancel, render_tools)
    if render_tools or (forced and not info.renders_tools):
        plan.n_tools_rendered = len(tool_dicts)
    return plan


def render_chat(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                client_template: str | None, timeout_s: float,
                cancel: threading.Event | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a chat rendered by the model's template, or by client_template (a
    template a client sent, which the tokenizer renders in its sandbox)."""
    kwargs: dict[str, Any] = {"render_timeout_s": timeout_s, "cancel": cancel}
    if client_template is not None:
        kwargs.update(chat_template=client_template, allow_custom_template=True)
    return list(tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs))


def _messages(messages: list[dict[str, Any]], template_tools_ok: bool) -> list[dict[str, Any]]:
    """Messages as templates want them. Tool-call arguments become objects (templates
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


def _with_system(msgs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if msgs and msgs[0]["role"] == "system":
        first = dict(msgs[0])
        first["content"] = f"{first.get('content', '')}\n\n{text}".strip()
        return [first, *msgs[1:]]
    return [{"role": "system", "content": text}, *msgs]
