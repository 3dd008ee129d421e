"""What chat completions, responses and messages share: a chat request's plan and engine
sequences, and reading a finished or streaming reply back as content and tool calls.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import Request

from colibri.app.chat_plan import context_note, request_constraints, request_plan
from colibri.app.errors import APIError
from colibri.app.protocol import ChatCompletionRequest
from colibri.app.serving import ClientGoneError, Sequence, Serving
from colibri.engine import ChatPlan, ToolCall


def _template_timeout_s(state: Any, body: ChatCompletionRequest) -> float:
    s = state.settings
    return s.model_template_timeout_s if body.chat_template is None else s.client_template_timeout_s


async def plan_request(serving: Serving, body: ChatCompletionRequest,
                       format_param: str = "response_format", request: Request | None = None
                       ) -> ChatPlan:
    """The plan of a chat request (its prompt and how to read the reply). With request, a
    client template's render stops as soon as that client disconnects."""
    state = serving.state
    tok = state.tokenizer
    body.check(state.settings, int(tok.vocab_size))
    cancel = threading.Event()
    planning = state.off_loop(
        request_plan, tok, body.template_messages(), body.tools, body.tool_choice,
        body.parallel_tool_calls, body.response_format, body.add_generation_prompt,
        body.chat_template, format_param, _template_timeout_s(state, body), cancel)
    try:
        return await (planning if request is None
                      else serving.race_disconnect(request, planning))
    except ClientGoneError:
        raise APIError(499, "client closed the request") from None
    finally:
        cancel.set()  # a render still running in the pool stops now


async def prepare_chat(serving: Serving, body: ChatCompletionRequest,
                       format_param: str = "response_format", request: Request | None = None,
                       prompt_param: str = "messages", clamp: bool = False
                       ) -> tuple[ChatPlan, list[Sequence]]:
    """The plan and the engine's sequences of a chat request (see plan_request).
    prompt_param: the field that errors about the prompt name; clamp: see Serving.budget."""
    state = serving.state
    tok = state.tokenizer
    vocab = int(tok.vocab_size)
    plan = await plan_request(serving, body, format_param, request)
    if not plan.prompt:
        raise APIError(400, "the chat prompt is empty", prompt_param)
    budget = serving.budget(len(plan.prompt), body.requested_max_tokens(), prompt_param,
                            context_note(plan), clamp)
    k = body.engine_logprobs()
    constraints = await state.off_loop(request_constraints, tok, vocab, plan.spec,
                                       [budget] * body.n)
    sequences = []
    for i in range(body.n):
        params = body.sampling_params(budget, i, vocab, k)
        params.constraint = constraints[i]
        sequences.append(Sequence(plan.prompt, params))
    return plan, sequences


def call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def reply_of(plan: ChatPlan, text: str, finish: str | None) -> tuple[str | None,
                                                                   list[ToolCall], str]:
    """(content, tool calls, finish_reason) of one finished choice."""
    finish = finish or "stop"
    if plan.mode == "forced":
        calls = plan.calls_of_forced(text, cut=finish == "length")
        if calls is None:  # not a call after all (never with a constraint): as text
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


class ChoiceStream:
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
            calls = self.plan.calls_of_forced(self.held, cut=reason == "length")
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
