"""Request models of Anthropic's Messages API and their translation into a chat request.

A Messages request becomes the chat request it stands for (`to_chat`) and runs through the
chat path: `system` and `role: "system"` messages -> system messages, text blocks -> content
(joined as sent), `tool_use` blocks -> an assistant's tool_calls, `tool_result` blocks -> tool
messages, `tools` -> function tools, `tool_choice` auto/any/tool/none -> auto/required/named/
none, `stop_sequences` -> stop, `thinking` (with `output_config.effort`) -> reasoning_effort,
earlier thinking blocks -> the assistant message's reasoning_content. Accepted and ignored:
`cache_control` on any block, `metadata`, `service_tier`, `context_management`, a tool's
`defer_loading`, redacted thinking. Tools the server cannot run (Anthropic's server tools such
as web_search) are dropped, and the log says so. Refused (400): image, document and other
non-text blocks.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import Field, ValidationError

from colibri.app.errors import APIError
from colibri.app.protocol import NON_EMPTY, ChatCompletionRequest, Finite, Text, _Model
from colibri.engine import join_text_parts

log = logging.getLogger("colibri.app")

# Anthropic's effort levels as the chat path's reasoning_effort
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


class MessageParam(_Model):
    role: Literal["user", "assistant", "system"]
    content: Text | list[dict[str, Any]]


class ToolParam(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # absent or "custom": a client tool; else one of Anthropic's


class ToolChoiceParam(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)
    display: str | None = None  # "omitted": thinking blocks come back without their text


class OutputConfig(_Model):
    effort: str | None = None


class CountTokensRequest(_Model):
    """POST /v1/messages/count_tokens: what decides the prompt."""

    model: Text | None = None
    messages: list[MessageParam] = Field(json_schema_extra=NON_EMPTY)
    system: Text | list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None

    def reasoning_effort(self) -> str | None:
        """The chat path's reasoning_effort (its switch of the template's thinking): none for
        `disabled`; `output_config.effort`, or for `enabled` the budget's size, otherwise
        (None: the model's default). A budget is not enforced as a token count."""
        if self.thinking is None:
            return None
        if self.thinking.type == "disabled":
            return "none"
        effort = self.output_config.effort if self.output_config else None
        if effort in _EFFORTS:
            return _EFFORTS[effort]
        if self.thinking.type == "enabled":
            budget = self.thinking.budget_tokens or 0
            return "low" if budget < 4096 else "medium" if budget < 16384 else "high"
        return None

    @property
    def thinking_shown(self) -> bool:
        """Whether thinking blocks carry their text (`display: "omitted"`: empty)."""
        return self.thinking is None or self.thinking.display != "omitted"


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (fields in the order of Anthropic's reference)."""

    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: Finite | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    top_p: Finite | None = Field(None, gt=0.0, le=1.0)


def _text(blocks: Any, param: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(400, "content must be a string or a list of text blocks", param)
    texts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise APIError(400, f"only text blocks are supported here (got {kind!r})",
                           f"{param}.{j}.type")
        text = block.get("text")
        if not isinstance(text, str):
            raise APIError(400, "a text block needs a string 'text'", f"{param}.{j}.text")
        texts.append(text)
    return join_text_parts(texts)


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise APIError(400, "a tool_use block's input must be an object", f"{param}.input")
    return {"id": block.get("id"), "type": "function",
            "function": {"name": block.get("name"),
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def _message(m: MessageParam, param: str) -> list[dict[str, Any]]:
    """The chat messages of one Messages message, in the order of its blocks."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "system":
        return [{"role": "system", "content": _text(m.content, param)}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []

    def flush() -> None:
        if texts or calls or thoughts:
            msg: dict[str, Any] = {"role": m.role, "content": join_text_parts(texts)}
            if calls:
                msg["tool_calls"] = list(calls)
                msg["content"] = msg["content"] or None
            if thoughts:
                msg["reasoning_content"] = join_text_parts(thoughts)
            out.append(msg)
        texts.clear()
        calls.clear()
        thoughts.clear()

    for j, block in enumerate(m.content):
        where = f"{param}.{j}"
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise APIError(400, "a text block needs a string 'text'", f"{where}.text")
            texts.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result" and m.role == "user":
            flush()
            content = block.get("content")
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": _text(content if content is not None else "",
                                         f"{where}.content")})
        elif kind == "thinking" and m.role == "assistant":
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue
        else:
            raise APIError(400, f"content blocks of type {kind!r} are not supported in "
                           f"{m.role} messages", f"{where}.type")
    flush()
    return out


def _tools(tools: list[ToolParam] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out, dropped = [], []
    for tool in tools:
        if tool.type not in (None, "custom"):
            dropped.append(tool.type)
            continue
        fn: dict[str, Any] = {"name": tool.name,
                              "parameters": tool.input_schema or {"type": "object"}}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    if dropped:
        log.info("messages: %d tools this server cannot run were dropped (%s)", len(dropped),
                 ", ".join(sorted(set(dropped))))
    return out or None


def _tool_choice(choice: ToolChoiceParam | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs the tool's name",
                           "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request stands for."""
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages")
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    for i, m in enumerate(body.messages):
        messages += _message(m, f"messages.{i}.content")
    data: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body.tools),
        "tool_choice": _tool_choice(body.tool_choice),
        "reasoning_effort": body.reasoning_effort(),
    }
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        data["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        data.update(max_tokens=body.max_tokens, stop=body.stop_sequences,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items()
                                                     if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        param = loc.split(".")[0] if loc.startswith(("tools", "tool_choice")) else "messages"
        raise APIError(400, f"{loc}: {first.get('msg')}", param) from None
