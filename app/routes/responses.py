"""POST /v1/responses: OpenAI's Responses API, stateless.

A request becomes a chat request (instructions -> a system message, input items -> messages,
function tools, text.format -> response_format, reasoning.effort -> reasoning_effort, reasoning
items -> the next assistant message's reasoning) and runs through the chat path; the answer
comes back as a Response object (a thinking model's reasoning as a "reasoning" item first), or
as the Responses stream events (response.created, response.output_item.added,
response.reasoning_text.delta, response.output_text.delta, ..., response.completed). Nothing is
stored: previous_response_id, conversation, background and stored prompts are refused (400).
A `namespace` tool's functions are offered as functions (their calls name the namespace);
tools the server cannot run (hosted ones: web_search, file_search, ...) are dropped, logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, ValidationError

from colibri.app.chat_serving import ChoiceStream, parsed_reply, prepare_chat
from colibri.app.errors import APIError
from colibri.app.protocol import ChatCompletionRequest, Finite, _Model
from colibri.app.replies import Choice, Output, add_output, new_id, now, with_first
from colibri.app.schemas import ResponseObject, error_responses, sse_200
from colibri.app.serving import get_serving
from colibri.app.streaming import sse_response
from colibri.engine import ChatPlan, ParsedReply, ToolCall

router = APIRouter()
log = logging.getLogger("colibri.app")


class ResponsesRequest(_Model):
    """The fields of POST /v1/responses that Colibri reads."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool = True
    stream: bool = False
    temperature: Finite | None = Field(None, ge=0.0, le=2.0)
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_p: Finite | None = Field(None, gt=0.0, le=1.0)
    reasoning: dict[str, Any] | None = None  # effort reaches the template; summary ignored
    # stateful or hosted features: refused when set
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    truncation: str | None = Field(None, json_schema_extra={"enum": ["disabled", None]})
    # accepted and ignored (see the README): store, metadata, service_tier, user,
    # prompt_cache_key, safety_identifier, include


def _refuse_stateful(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: this server stores no "
                       "responses; send the whole conversation in input",
                       "previous_response_id")
    if body.conversation is not None:
        raise APIError(400, "conversations are not supported: this server stores no state; "
                       "send the whole conversation in input", "conversation")
    if body.background:
        raise APIError(400, "background responses are not supported", "background")
    if body.prompt is not None:
        raise APIError(400, "stored prompts are not supported", "prompt")
    if body.truncation not in (None, "disabled"):
        raise APIError(400, "only truncation 'disabled' is supported", "truncation")


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"only text input is supported (got {kind!r})",
                           f"{param}.{j}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"a {kind} part needs a string 'text'"
                           + ("" if text is None else f", not {type(text).__name__}"),
                           f"{param}.{j}.text")
        texts.append(text)
    return "".join(texts)


def _reasoning_text(item: dict[str, Any]) -> str:
    """The text of a reasoning input item: its content, else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [p["text"] for p in parts if isinstance(p, dict)
                     and isinstance(p.get("text"), str)]
            if texts:
                return "\n".join(texts)
    return ""


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*msgs, {"role": "user", "content": body.input}]
    reasoning = ""  # a reasoning item belongs to the assistant message after it
    for i, item in enumerate(body.input):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning += _reasoning_text(item)
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"unsupported role {role!r}", f"{param}.role")
            msgs.append({"role": role, "content": _text_of(item.get("content"), param +
                                                           ".content")})
            if role == "assistant" and reasoning:
                msgs[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning:
                msgs[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "item_reference":
            raise APIError(400, "item references need stored responses, which this server "
                           "does not keep", f"{param}.type")
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported",
                           f"{param}.type")
    return msgs


def _chat_function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tools(tools: list[dict[str, Any]] | None
                ) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """The chat tools of a request, and the namespace of each function offered from one."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    dropped: list[str] = []
    for tool in tools or []:
        kind = tool.get("type")
        if kind == "function":
            out.append(_chat_function(tool))
        elif kind == "namespace" and isinstance(tool.get("tools"), list):
            for fn in tool["tools"]:
                if isinstance(fn, dict) and fn.get("type") == "function":
                    out.append(_chat_function(fn))
                    namespaces[str(fn.get("name"))] = str(tool.get("name"))
                else:
                    dropped.append(str(fn.get("type") if isinstance(fn, dict) else fn))
        else:
            dropped.append(str(kind))
    if dropped:
        log.info("responses: %d tools this server cannot run were dropped (%s)", len(dropped),
                 ", ".join(sorted(set(dropped))))
    return out or None, namespaces


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"tool_choice of type {choice.get('type')!r} is not supported",
                   "tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    kind = fmt.get("type")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, f"text.format type {kind!r} is not supported", "text.format.type")


def to_chat(body: ResponsesRequest) -> tuple[ChatCompletionRequest, dict[str, str]]:
    """The chat request a Responses request stands for, and the namespace of each function
    offered from a namespace tool."""
    _refuse_stateful(body)
    tools, namespaces = _chat_tools(body.tools)
    data: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "tools": tools,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "response_format": _response_format(body.text),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "reasoning_effort": (body.reasoning or {}).get("effort"),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items()
                                                     if v is not None}), namespaces
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        if loc == "reasoning_effort":
            raise APIError(400, f"reasoning.effort: {first.get('msg')}",
                           "reasoning.effort") from None
        param = "tools" if loc.startswith("tools") else "input"
        raise APIError(400, f"{loc}: {first.get('msg')}", param) from None


@router.post("/v1/responses", response_model=None,
             responses={**sse_200(ResponseObject, "The response, or its event stream."),
                        **error_responses(400, 404, 500, 503)})
async def responses(body: ResponsesRequest, request: Request) -> Any:
    """OpenAI's Responses API without stored state."""
    serving = get_serving(request)
    state = serving.state
    model = state.check_model(body.model)
    chat, namespaces = to_chat(body)
    plan, sequences = await prepare_chat(serving, chat, "text.format", prompt_param="input")
    job = serving.submit(sequences, want_token_text=False)
    meta = _meta(body, model)
    if not body.stream:
        choices = await serving.collect(request, job, 1, "input")
        c = choices[0]
        reply, finish = parsed_reply(plan, c.text, c.finish_reason)
        return _final(meta, _items(reply, namespaces, finish), finish, len(plan.prompt),
                      c.n_tokens)
    first, outputs = await serving.first_output(request, job, "input")
    return sse_response(state, _stream(serving.eos_ids, plan, meta, namespaces, first, outputs))


def _meta(body: ResponsesRequest, model: str) -> dict[str, Any]:
    return {
        "id": new_id("resp"), "object": "response", "created_at": now(), "model": model,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
        "text": body.text or {"format": {"type": "text"}},
        "previous_response_id": None, "store": False, "metadata": {}, "truncation": "disabled",
        "reasoning": body.reasoning, "error": None, "user": None,
    }


def _message_item(text: str, status: str = "completed", item_id: str | None = None
                  ) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: ToolCall, namespaces: dict[str, str], status: str = "completed"
               ) -> dict[str, Any]:
    item = {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"),
            "call_id": call.id, "name": call.name, "arguments": call.arguments,
            "status": status}
    if call.name in namespaces:
        item["namespace"] = namespaces[call.name]
    return item


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None
                    ) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "status": status,
            "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _items(reply: ParsedReply, namespaces: dict[str, str], finish: str
           ) -> list[dict[str, Any]]:
    """The output items; the token limit leaves the last call incomplete."""
    items = [_reasoning_item(reply.reasoning)] if reply.reasoning else []
    if reply.content or not reply.calls:
        items.append(_message_item(reply.content))
    items += [_call_item(c, namespaces) for c in reply.calls]
    if reply.calls and finish == "length":
        items[-1]["status"] = "incomplete"
    return items


def _final(meta: dict[str, Any], items: list[dict[str, Any]], finish: str, n_in: int,
           n_out: int) -> dict[str, Any]:
    incomplete = finish == "length"
    return {**meta, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items,
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out}}


async def _stream(eos_ids: frozenset[int], plan: ChatPlan, meta: dict[str, Any],
                  namespaces: dict[str, str], first: Output | None,
                  outputs: AsyncIterator[Output]) -> AsyncIterator[dict[str, str]]:
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, str]:
        nonlocal seq
        seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": seq - 1,
                                                   **fields}, ensure_ascii=False)}

    choice = Choice(0)
    stream = ChoiceStream(plan)
    items: list[dict[str, Any]] = []  # finished output items
    text_item: dict[str, Any] | None = None  # the message being streamed
    call_item: dict[str, Any] | None = None  # the function call being streamed
    think_item: dict[str, Any] | None = None  # the reasoning being streamed

    def open_think() -> list[dict[str, str]]:
        nonlocal think_item
        think_item = _reasoning_item("", "in_progress")
        think_item["content"] = []
        return [event("response.output_item.added", output_index=len(items), item=think_item)]

    def close_think() -> list[dict[str, str]]:
        nonlocal think_item
        if think_item is None:
            return []
        text = think_item.pop("_text", "")
        done = _reasoning_item(text, "completed", think_item["id"])
        idx = len(items)
        items.append(done)
        think_item = None
        return [event("response.reasoning_text.done", item_id=done["id"], output_index=idx,
                      content_index=0, text=text),
                event("response.output_item.done", output_index=idx, item=done)]

    def open_text() -> list[dict[str, str]]:
        nonlocal text_item
        text_item = _message_item("", "in_progress")
        text_item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": []}
        idx = len(items)
        return [event("response.output_item.added", output_index=idx, item=text_item),
                event("response.content_part.added", item_id=text_item["id"],
                      output_index=idx, content_index=0, part=part)]

    def close_text() -> list[dict[str, str]]:
        nonlocal text_item
        if text_item is None:
            return []
        text = text_item.pop("_text", "")
        done = _message_item(text, "completed", text_item["id"])
        idx = len(items)
        items.append(done)
        text_item = None
        return [event("response.output_text.done", item_id=done["id"], output_index=idx,
                      content_index=0, text=text, logprobs=[]),
                event("response.content_part.done", item_id=done["id"], output_index=idx,
                      content_index=0, part=done["content"][0]),
                event("response.output_item.done", output_index=idx, item=done)]

    def close_call(status: str = "completed") -> list[dict[str, str]]:
        nonlocal call_item
        if call_item is None:
            return []
        done = {**call_item, "status": status}
        idx = len(items)
        items.append(done)
        call_item = None
        return [event("response.function_call_arguments.done", item_id=done["id"],
                      output_index=idx, name=done["name"], arguments=done["arguments"]),
                event("response.output_item.done", output_index=idx, item=done)]

    def on_delta(delta: dict[str, Any]) -> list[dict[str, str]]:
        nonlocal call_item
        evs: list[dict[str, str]] = []
        if delta.get("reasoning_content"):
            evs += close_text() + close_call()
            if think_item is None:
                evs += open_think()
            assert think_item is not None
            think_item["_text"] = think_item.get("_text", "") + delta["reasoning_content"]
            evs.append(event("response.reasoning_text.delta", item_id=think_item["id"],
                             output_index=len(items), content_index=0,
                             delta=delta["reasoning_content"]))
        if "content" in delta and delta["content"]:
            evs += close_think() + close_call()
            if text_item is None:
                evs += open_text()
            assert text_item is not None
            text_item["_text"] = text_item.get("_text", "") + delta["content"]
            evs.append(event("response.output_text.delta", item_id=text_item["id"],
                             output_index=len(items), content_index=0,
                             delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if "id" in tc:  # a new call starts
                evs += close_think() + close_text() + close_call()
                call = ToolCall(fn.get("name", ""), "", tc["id"])
                call_item = _call_item(call, namespaces, "in_progress")
                evs.append(event("response.output_item.added", output_index=len(items),
                                 item=call_item))
            elif call_item is not None and fn.get("arguments"):
                call_item["arguments"] += fn["arguments"]
                evs.append(event("response.function_call_arguments.delta",
                                 item_id=call_item["id"], output_index=len(items),
                                 delta=fn["arguments"]))
        return evs

    try:
        yield event("response.created", response={**meta, "status": "in_progress",
                                                  "output": [], "usage": None})
        yield event("response.in_progress", response={**meta, "status": "in_progress",
                                                      "output": [], "usage": None})
        finish = "stop"
        async for out in with_first(first, outputs):
            add_output(choice, out, eos_ids)
            if out.step.text:
                for delta in stream.push(out.step.text):
                    for ev in on_delta(delta):
                        yield ev
            if out.step.finish_reason is not None:
                tail, finish = stream.finish(out.step.finish_reason)
                for delta in tail:
                    for ev in on_delta(delta):
                        yield ev
        for ev in close_think() + close_text() + close_call(
                "incomplete" if finish == "length" else "completed"):
            yield ev
        if not any(i["type"] != "reasoning" for i in items):
            for ev in open_text() + close_text():
                yield ev
        final = _final(meta, items, finish, len(plan.prompt), choice.n_tokens)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield event(kind, response=final)
    finally:
        await outputs.aclose()
