"""From a chat's messages, tools and output format to a prompt and a plan for its reply.

Decides what the model sees and how its reply is read:
- `text`: plain content (no tools, tool_choice "none", or tools the template cannot render
  with tool_choice absent / "auto": those are dropped, and the log says so);
- `auto`: the tools are rendered by the model's template and the reply is parsed for calls
  in the template family's format (ToolCallParser);
- `forced` (tool_choice "required" or a named function): the reply is constrained to the
  calls, in the family's own markup when it has one (Hermes / Qwen3, DeepSeek-V3.1, Kimi K2,
  gpt-oss; Qwen3-Coder, GLM-4.5 and MiniMax-M2 XML), else to the generic JSON shape; a
  template that cannot render tools gets them in a generic preamble.
A content format (a ConstraintSpec) turns tool_choice "auto" into "none": a reply cannot
both match the format and be a tool call.
Models that think (a template with `<think>` or gpt-oss's channels) have their reasoning
split from the answer (ReplyParser). The request's reasoning switch and template variables
reach the template; a constrained reply (a format or a forced call) is rendered with
thinking switched off, since the constraint leaves no room for it. Knows nothing of HTTP;
messages and tools come as the chat-template dicts (OpenAI's shape). Renders through the
tokenizer's chat template: run it off any event loop.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri.engine.sample.constraints import ConstraintSpec
from colibri.engine.text.reasoning import (
    ReasoningStyle,
    opens_reasoning,
    reasoning_style,
    thinking_switches,
)
from colibri.engine.text.reply import ReplyParser
from colibri.engine.text.toolcalls import (
    ToolCall,
    ToolCallParser,
    forced_calls,
    forced_calls_schema,
    generic_preamble,
    history_call_text,
    markup_calls,
    template_tools,
)
from colibri.engine.text.toolformats.forced_json import forced_calls_markup
from colibri.engine.text.toolformats.forced_xml import forced_xml_grammar

log = logging.getLogger("colibri.engine")


@dataclass
class ChatPlan:
    """The prompt and how to read the reply."""

    prompt: list[int]
    mode: Literal["text", "auto", "forced"] = "text"
    forced_name: str | None = None  # tool_choice named a function
    forced_markup: bool = False  # forced calls are written in the family's own markup
    spec: ConstraintSpec | None = None
    family: str = "generic"
    tool_names: set[str] = field(default_factory=set)
    tools: list[dict[str, Any]] = field(default_factory=list)
    n_tools_rendered: int = 0
    reasoning: ReasoningStyle | None = None  # how the model thinks; None: it does not
    in_reasoning: bool = False  # the prompt opened the reasoning: the reply starts in it

    def parser(self) -> ToolCallParser | None:
        """A fresh parser of the calls in a reply; None unless the mode is `auto`."""
        if self.mode != "auto":
            return None
        return ToolCallParser(self.family, self.tool_names, self.tools)

    def reply_parser(self) -> ReplyParser:
        """A fresh parser of a reply into reasoning, answer and calls (not for `forced`)."""
        return ReplyParser(self.reasoning, self.in_reasoning, self.parser())

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the reply must be decoded with special-token text: the markers this plan
        reads (reasoning tags, call markup, harmony channels) are special tokens in some
        vocabularies."""
        return (self.reasoning is not None or self.forced_markup
                or (self.mode == "auto" and self.family != "generic"))

    def calls_of_forced(self, text: str, cut: bool = False) -> list[ToolCall] | None:
        """The calls of a forced reply; None when it does not parse. cut: the reply ended at
        the token limit, and the call being written stays a call, its arguments incomplete
        (nothing of a call whose name was not complete)."""
        if self.forced_markup:
            calls = markup_calls(text, self.family, self.tool_names, self.tools, cut)
            return calls if calls or cut else None
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
    reasoning_effort: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatPlan:
    """Render the prompt with tok (the model's Tokenizer) and choose the reply's mode.

    tool_choice: "none", "auto", "required" or None (absent); forced_name: the function a
    request named (tool_choice is then ignored). reasoning_effort ("none" switches thinking
    off) and template_kwargs (a client's variables, which win) reach the template as
    variables. Raises what the tokenizer's chat rendering
    raises: ValueError for what the template refuses or a client template past a limit,
    ModelTemplateError for the model's own template past a limit.
    """
    template = client_template if client_template is not None else tok.chat_template
    info = template_tools(template)
    forced = bool(tools) and (tool_choice == "required" or forced_name is not None)
    plan = ChatPlan(prompt=[], spec=spec, family=info.family)
    tool_dicts = list(tools or [])
    render_tools: list[dict[str, Any]] | None = None
    msgs = _messages(messages, info.renders_tools, info.family in _ARGS_AS_TEXT)
    if forced:
        plan.mode, plan.forced_name = "forced", forced_name
        markup = _forced_markup(tool_dicts, forced_name, parallel_tool_calls, info.family,
                                getattr(tok, "split_special", None))
        if markup is not None and info.renders_tools:
            plan.spec, plan.forced_markup = markup, True
        else:
            plan.spec = ConstraintSpec(
                "json_schema", forced_calls_schema(tool_dicts, forced_name,
                                                   parallel_tool_calls), "tools")
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
    plan.tools = tool_dicts
    style = reasoning_style(template)
    constrained = plan.spec is not None
    effort = "none" if constrained and style is not None else reasoning_effort
    variables = {**thinking_switches(effort), **(template_kwargs or {})}
    plan.prompt = render_chat(tok, msgs, add_generation_prompt, client_template,
                              template_timeout_s, cancel, render_tools, variables)
    if render_tools or (forced and not info.renders_tools):
        plan.n_tools_rendered = len(tool_dicts)
    if not constrained:  # a constrained reply is all format: nothing to split off
        plan.reasoning = style
        if plan.reasoning == "think" and add_generation_prompt:
            tail = tok.decode(plan.prompt[-8:], skip_special_tokens=False)
            plan.in_reasoning = opens_reasoning(tail)
    return plan


def _forced_markup(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                   family: str, split: Any) -> ConstraintSpec | None:
    """The constraint of forced calls in the family's own markup, None when it has none.
    split: the tokenizer's split_special (markers that are special tokens in its vocabulary
    are allowed as those tokens, never spelled out)."""
    value = (forced_calls_markup(tools, name, parallel, family, split)
             or forced_xml_grammar(tools, name, parallel, family, split))
    return ConstraintSpec("lark_json", value, "tools") if value is not None else None


def render_chat(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                client_template: str | None, timeout_s: float,
                cancel: threading.Event | None = None,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a chat rendered by the model's template, or by client_template (a
    template a client sent, which the tokenizer renders in its sandbox); template_kwargs are
    extra variables the template sees."""
    kwargs: dict[str, Any] = {"render_timeout_s": timeout_s, "cancel": cancel,
                              "template_kwargs": template_kwargs or None}
    if client_template is not None:
        kwargs.update(chat_template=client_template, allow_custom_template=True)
    return list(tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs))


# families whose templates write a call's arguments as the JSON text they are given
# (DeepSeek's concatenate them into the markup)
_ARGS_AS_TEXT = frozenset({"deepseek"})


def _messages(messages: list[dict[str, Any]], template_tools_ok: bool,
              args_as_text: bool = False) -> list[dict[str, Any]]:
    """Messages as templates want them. Tool-call arguments become objects (templates
    serialise them themselves) unless args_as_text; without a tool-capable template, earlier
    calls are written as generic JSON text and tool results become user messages."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and calls:
            if template_tools_ok:
                m["tool_calls"] = [_template_call(c, args_as_text) for c in calls]
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


def _template_call(call: dict[str, Any], args_as_text: bool = False) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if args_as_text:
        if not isinstance(args, str):
            fn["arguments"] = json.dumps(args if args is not None else {}, ensure_ascii=False)
    elif isinstance(args, str):
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
