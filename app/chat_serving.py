"""What chat completions, responses and messages share: a chat request's plan and engine
sequences, and reading a finished or streaming reply back as reasoning, content and calls.

`parsed_reply` reads a whole reply (a ParsedReply and its finish reason); `ChoiceStream`
turns a streamed one into chat deltas: `{"reasoning_content": ...}`, `{"content": ...}` and
`{"tool_calls": [...]}`, which the other routes map onto their own events.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import Request

from colibri.app.chat_plan import context_note, request_plan
from colibri.app.errors import APIError
from colibri.app.protocol import ChatCompletionRequest
from colibri.app.serving import ClientGoneError, Sequence, Serving
from colibri.engine import ChatPlan, ParsedReply, ReplyDelta, ToolCall, parse_reply


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
        body.chat_template, format_param, _template_timeout_s(state, body), cancel,
        body.reasoning_effort, body.chat_template_kwargs)
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
    constraints = await serving.constraints(plan.spec, [budget] * body.n, request)
    sequences = []
    for i in range(body.n):
        params = body.sampling_params(budget, i, vocab, k)
        params.constraint = constraints[i]
        params.skip_special_tokens = not plan.keeps_special_tokens
        sequences.append(Sequence(plan.prompt, params))
    return plan, sequences


def call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def parsed_reply(plan: ChatPlan, text: str, finish: str | None) -> tuple[ParsedReply, str]:
    """One finished choice read back: its reasoning, content and calls, and finish_reason."""
    finish = finish or "stop"
    if plan.mode == "forced":
        calls = plan.calls_of_forced(text, cut=finish == "length")
        if calls is None:  # not a call after all (never with a constraint): as text
            return ParsedReply(None, text, []), finish
        return ParsedReply(None, "", calls), "tool_calls" if finish == "stop" else finish
    reply = parse_reply(plan.reply_parser(), text)
    if reply.calls and finish == "stop":
        finish = "tool_calls"
    return reply, finish


def reply_of(plan: ChatPlan, text: str, finish: str | None) -> tuple[str | None,
                                                                   list[ToolCall], str]:
    """(content, tool calls, finish_reason) of one finished choice."""
    reply, finish = parsed_reply(plan, text, finish)
    if reply.calls:
        return reply.content or None, reply.calls, finish
    return reply.content, [], finish


class ChoiceStream:
    """Turns one choice's text deltas into chat deltas for its output mode."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.parser = plan.reply_parser() if plan.mode != "forced" else None
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
            if self.plan.forced_name is None or self.plan.forced_markup:
                self.held += text  # the whole reply, read when it ends
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
        assert self.parser is not None
        return self._deltas(self.parser.push(text))

    def _deltas(self, step: ReplyDelta) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if step.reasoning:
            deltas.append({"reasoning_content": step.reasoning})
        if step.content:
            deltas.append({"content": step.content})
        return deltas + self._call_deltas(step.calls)

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        if self.plan.mode == "forced":
            if self.plan.forced_name is not None and not self.plan.forced_markup:
                return [], "tool_calls" if reason == "stop" and self.named else reason
            calls = self.plan.calls_of_forced(self.held, cut=reason == "length")
            if calls is None:
                return ([{"content": self.held}] if self.held else []), reason
            return self._call_deltas(calls), "tool_calls" if reason == "stop" else reason
        assert self.parser is not None
        deltas = self._deltas(self.parser.finish())
        if self.n_calls and reason == "stop":
            reason = "tool_calls"
        return deltas, reason
