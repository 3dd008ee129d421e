"""POST /v1/chat/completions, streamed (SSE) and not, with tools and structured output."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from colibri.app.chat_plan import ChatPlan, compile_constraints, context_note, plan_chat
from colibri.app.errors import APIError
from colibri.app.generation import (
    Choice,
    ClientGoneError,
    add_output,
    chat_logprob_entries,
    collect,
    first_output,
    is_eos_stop,
    max_tokens_for,
    new_id,
    now,
    race_disconnect,
    submit,
    usage,
    with_first,
)
from colibri.app.protocol import ChatCompletionRequest
from colibri.app.schemas import ChatCompletion, error_responses, sse_200
from colibri.app.state import ServerState, get_state
from colibri.app.streaming import sse_response
from colibri.app.worker import Output, Sequence
from colibri.engine import ToolCall

router = APIRouter()


def _template_timeout_s(state: ServerState, body: ChatCompletionRequest) -> float:
    s = state.settings
    return s.model_template_timeout_s if body.chat_template is None else s.client_template_timeout_s


async def prepare_chat(state: ServerState, body: ChatCompletionRequest,
                       format_param: str = "response_format", request: Request | None = None
                       ) -> tuple[ChatPlan, list[Sequence]]:
    """The plan and the engine's sequences of a chat request (shared with /v1/responses).
    With request, a client template's render stops as soon as that client disconnects."""
    llm = state.llm
    vocab = int(llm.tokenizer.vocab_size)
    body.check(state.settings, vocab)
    cancel = threading.Event()
    planning = state.off_loop(
        plan_chat, llm, body.template_messages(), body.tools, body.tool_choice,
        body.parallel_tool_calls, body.response_format, body.add_generation_prompt,
        body.chat_template, format_param, _template_timeout_s(state, body), cancel)
    try:
        plan = await (planning if request is None else race_disconnect(request, planning))
    except ClientGoneError:
        raise APIError(499, "client closed the request") from None
    finally:
        cancel.set()  # a render still running in the pool stops now
    if not plan.prompt:
        raise APIError(400, "the chat prompt is empty", "messages")
    budget = max_tokens_for(state, len(plan.prompt), body.requested_max_tokens(), "messages",
                            context_note(plan))
    k = body.engine_logprobs()
    constraints = await state.off_loop(compile_constraints, llm, plan.spec, [budget] * body.n)
    sequences = []
    for i in range(body.n):
        params = body.sampling_params(budget, i, vocab, k)
        params.constraint = constraints[i]
        sequences.append(Sequence(plan.prompt, params))
    return plan, sequences


@router.post("/v1/chat/completions", response_model=None,
             responses={**sse_200(ChatCompletion, "The completion, or its event stream."),
                        **error_responses(400, 404, 500, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI's chat completions."""
    state = get_state(request)
    model = state.check_model(body.model)
    plan, sequences = await prepare_chat(state, body, request=request)
    k = body.engine_logprobs()
    job = submit(state, sequences, want_token_text=k is not None)
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": model}
    if not body.stream:
        choices = await collect(state, request, job, body.n, "messages")
        return _response(meta, plan, choices, len(plan.prompt), body.logprobs)
    first, outputs = await first_output(state, request, job, "messages")
    return sse_response(state, _stream(state, body, plan, meta, first, outputs))


def call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def reply_of(plan: ChatPlan, text: str, finish: str | None) -> tuple[str | None,
                                                                   list[ToolCall], str]:
    """(content, tool calls, finish_reason) of one finished choice."""
    finish = finish or "stop"
    if plan.mode == "forced":
        calls = plan.calls_of_forced(text)
        if calls is None:  # cut short by max_tokens: what there is, as text
            return text, [], finish
        return None, calls, "tool_calls" if finish == "stop" else finish
    parser = plan.parser()
    if parser is None:
        return text, [], finish
    content, calls = parser.push(text)
    tail, more = parser.finish()
    calls = calls + more
    content += tail
    if calls:
        return content or None, calls, "tool_calls" if finish == "stop" else finish
    return content, [], finish


def _response(meta: dict[str, Any], plan: ChatPlan, choices: list[Choice], n_prompt: int,
              logprobs: bool) -> dict[str, Any]:
    out = []
    for c in choices:
        content, calls, finish = reply_of(plan, c.text, c.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [call_dict(t) for t in calls]
        out.append({
            "index": c.index,
            "message": message,
            "logprobs": ({"content": chat_logprob_entries(c.logprob_outputs), "refusal": None}
                         if logprobs else None),
            "finish_reason": finish,
        })
    return {**meta, "object": "chat.completion", "system_fingerprint": None, "choices": out,
            "usage": usage(n_prompt, choices)}


class _ChoiceStream:
    """Turns one choice's text deltas into chat deltas for its output mode."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.parser = plan.parser()
        self.n_calls = 0
        self.held = ""  # forced calls without a name: the whole list, parsed at the end
        self.named: ToolCall | None = None

    def _call_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append({"tool_calls": [{"index": self.n_calls, "id": call.id,
                                           "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": self.n_calls,
                                           "function": {"arguments": call.arguments}}]})
            self.n_calls += 1
        return deltas

    def push(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "forced":
            if self.plan.forced_name is None:
                self.held += text
                return []
            deltas = []
            if self.named is None:  # a named call streams its arguments as they come
                self.named = ToolCall(self.plan.forced_name, "")
                deltas.append({"tool_calls": [{
                    "index": 0, "id": self.named.id, "type": "function",
                    "function": {"name": self.named.name, "arguments": ""}}]})
                self.n_calls = 1
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        if self.parser is None:
            return [{"content": text}] if text else []
        content, calls = self.parser.push(text)
        deltas = [{"content": content}] if content else []
        return deltas + self._call_deltas(calls)

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        if self.plan.mode == "forced":
            if self.plan.forced_name is not None:
                return [], "tool_calls" if reason == "stop" and self.named else reason
            calls = self.plan.calls_of_forced(self.held)
            if calls is None:
                return ([{"content": self.held}] if self.held else []), reason
            return self._call_deltas(calls), "tool_calls" if reason == "stop" else reason
        if self.parser is None:
            return [], reason
        content, calls = self.parser.finish()
        deltas = ([{"content": content}] if content else []) + self._call_deltas(calls)
        if self.n_calls and reason == "stop":
            reason = "tool_calls"
        return deltas, reason


async def _stream(state: ServerState, body: ChatCompletionRequest, plan: ChatPlan,
                  meta: dict[str, Any], first: Output | None,
                  outputs: AsyncIterator[Output]) -> AsyncIterator[str]:
    include_usage = body.include_usage
    base = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None) -> str:
        return json.dumps({**base, "choices": [{
            "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
        }]}, ensure_ascii=False)

    choices = [Choice(i) for i in range(body.n)]
    streams = [_ChoiceStream(plan) for _ in range(body.n)]
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for out in with_first(first, outputs):
            choice = choices[out.index]
            add_output(choice, out, state)
            step = out.step
            lp = None
            if body.logprobs and out.token is not None and not is_eos_stop(out, state):
                lp = {"content": chat_logprob_entries([out]), "refusal": None}
            deltas = streams[out.index].push(step.text) if step.text else []
            if lp is not None and not deltas:
                deltas = [{"content": ""}]
            for j, delta in enumerate(deltas):
                yield chunk(out.index, delta, None, lp if j == 0 else None)
            if step.finish_reason is not None:
                tail, reason = streams[out.index].finish(step.finish_reason)
                for delta in tail:
                    yield chunk(out.index, delta)
                yield chunk(out.index, {}, reason)
        if include_usage:
            yield json.dumps({**base, "choices": [],
                              "usage": usage(len(plan.prompt), choices)})
        yield "[DONE]"
    finally:
        await outputs.aclose()
