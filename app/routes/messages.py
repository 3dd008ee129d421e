"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes the chat request it stands for (app/protocol_messages.py) and runs through
the chat path: the same plan, sequences, engine and tool-call reading. The answer is a Message
(a thinking model's reasoning as a thinking block, then text and tool_use blocks, stop_reason,
usage), or its stream of named events: message_start, ping, content_block_start /
content_block_delta (thinking_delta and signature_delta, text_delta, input_json_delta) /
content_block_stop, message_delta (stop_reason, usage), message_stop. Errors take Anthropic's
shape on these paths (app/errors.py). A max_tokens larger than the room left in the context is
clamped to it (the answer then stops with max_tokens), as Anthropic's clients expect.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic_core import from_json
from sse_starlette import ServerSentEvent

from colibri.app.chat_serving import ChoiceStream, parsed_reply, plan_request, prepare_chat
from colibri.app.errors import APIError, anthropic_error_body
from colibri.app.protocol_messages import CountTokensRequest, MessagesRequest, to_chat
from colibri.app.replies import Choice, Output, add_output, with_first
from colibri.app.schemas import MessageObject, TokenCount, error_responses, sse_200
from colibri.app.serving import get_serving
from colibri.app.streaming import Event, sse_response
from colibri.engine import ChatPlan, ToolCall

router = APIRouter()
_ERRORS = error_responses(400, 404, 500, 503, anthropic=True)


@router.post("/v1/messages", response_model=None,
             responses={**sse_200(MessageObject, "The message, or its event stream."),
                        **_ERRORS})
async def messages(body: MessagesRequest, request: Request) -> Any:
    """Anthropic's Messages API."""
    serving = get_serving(request)
    state = serving.state
    model = state.check_model(body.model)
    plan, sequences = await prepare_chat(serving, to_chat(body), request=request, clamp=True)
    job = serving.submit(sequences)
    meta = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": model}
    if not body.stream:
        choice = (await serving.collect(request, job, 1, "messages"))[0]
        reply, finish = parsed_reply(plan, choice.text, choice.finish_reason)
        blocks = [_thinking(reply.reasoning if body.thinking_shown else "")
                  ] if reply.reasoning else []
        blocks += [{"type": "text", "text": reply.content}] if reply.content else []
        blocks += [_tool_use(c) for c in reply.calls]
        return {**meta, "content": blocks, **_stop(finish, choice.stop_string),
                "usage": _usage(len(plan.prompt), choice.n_cached, choice.n_tokens)}
    first, outputs = await serving.first_output(request, job, "messages")
    return sse_response(state, _stream(serving.eos_ids, plan, meta, body.thinking_shown,
                                       first, outputs), _error_events, _ping)


@router.post("/v1/messages/count_tokens", response_model=None,
             responses={200: {"model": TokenCount}, **_ERRORS})
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt tokens a Messages request with these messages, system and tools has."""
    serving = get_serving(request)
    serving.state.check_model(body.model)
    plan = await plan_request(serving, to_chat(body), request=request)
    return {"input_tokens": len(plan.prompt)}


def _thinking(text: str) -> dict[str, Any]:
    # no signature: this server keeps no thinking to verify, and ignores those sent back
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    """A tool_use block; a call cut short by max_tokens has what its JSON had so far."""
    try:
        args = from_json(call.arguments or "{}", allow_partial="trailing-strings")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": _tool_id(call.id), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop(finish: str, stop_string: str | None) -> dict[str, Any]:
    if finish == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(n_prompt: int, n_cached: int, n_out: int) -> dict[str, int]:
    """Anthropic counts prompt tokens read from a cache apart from input_tokens."""
    return {"input_tokens": n_prompt - n_cached, "output_tokens": n_out,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": n_cached}


def _event(kind: str, **fields: Any) -> dict[str, str]:
    return {"event": kind, "data": json.dumps({"type": kind, **fields}, ensure_ascii=False)}


def _error_events(err: APIError) -> list[Event]:
    return [{"event": "error",
             "data": json.dumps(anthropic_error_body(err.status, err.message, err.code))}]


def _ping() -> ServerSentEvent:
    return ServerSentEvent(data='{"type": "ping"}', event="ping")


class _Blocks:
    """The content blocks of a streamed message, from its choice's chat deltas."""

    def __init__(self, thinking_shown: bool) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.thinking_shown = thinking_shown

    def _open(self, block: dict[str, Any]) -> list[dict[str, str]]:
        evs = self.close()
        self.index += 1
        self.kind = block["type"]
        return evs + [_event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[dict[str, str]]:
        if self.kind is None:
            return []
        evs = []
        if self.kind == "thinking":
            evs.append(_event("content_block_delta", index=self.index,
                              delta={"type": "signature_delta", "signature": ""}))
        self.kind = None
        return evs + [_event("content_block_stop", index=self.index)]

    def push(self, delta: dict[str, Any]) -> list[dict[str, str]]:
        evs: list[dict[str, str]] = []
        if delta.get("reasoning_content"):
            if self.kind != "thinking":
                evs += self._open({"type": "thinking", "thinking": "", "signature": ""})
            if self.thinking_shown:
                evs.append(_event("content_block_delta", index=self.index, delta={
                    "type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.kind != "text":
                evs += self._open({"type": "text", "text": ""})
            evs.append(_event("content_block_delta", index=self.index,
                              delta={"type": "text_delta", "text": delta["content"]}))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if "id" in tc:  # a new call
                evs += self._open({"type": "tool_use", "id": _tool_id(tc["id"]),
                                   "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments") and self.kind == "tool_use":
                evs.append(_event("content_block_delta", index=self.index, delta={
                    "type": "input_json_delta", "partial_json": fn["arguments"]}))
        return evs


async def _stream(eos_ids: frozenset[int], plan: ChatPlan, meta: dict[str, Any],
                  thinking_shown: bool, first: Output | None,
                  outputs: AsyncIterator[Output]) -> AsyncIterator[dict[str, str]]:
    choice = Choice(0)
    stream = ChoiceStream(plan)
    blocks = _Blocks(thinking_shown)
    n_cached = first.step.n_cached_tokens if first is not None else 0
    try:
        yield _event("message_start", message={
            **meta, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(len(plan.prompt), n_cached, 0)})
        yield _event("ping")
        finish = "stop"
        async for out in with_first(first, outputs):
            add_output(choice, out, eos_ids)
            for delta in stream.push(out.step.text) if out.step.text else []:
                for ev in blocks.push(delta):
                    yield ev
            if out.step.finish_reason is not None:
                tail, finish = stream.finish(out.step.finish_reason)
                for delta in tail:
                    for ev in blocks.push(delta):
                        yield ev
        for ev in blocks.close():
            yield ev
        yield _event("message_delta", delta=_stop(finish, choice.stop_string),
                     usage=_usage(len(plan.prompt), choice.n_cached, choice.n_tokens))
        yield _event("message_stop")
    finally:
        await outputs.aclose()
