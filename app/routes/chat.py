"""POST /v1/chat/completions, streamed (SSE) and not, with tools and structured output."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from colibri.app.chat_serving import ChoiceStream, call_dict, parsed_reply, prepare_chat
from colibri.app.protocol import ChatCompletionRequest
from colibri.app.replies import (
    Choice,
    ChunkJSON,
    Output,
    add_output,
    chat_logprob_entries,
    is_eos_stop,
    new_id,
    now,
    usage,
    with_first,
)
from colibri.app.schemas import ChatCompletion, error_responses, sse_200
from colibri.app.serving import get_serving
from colibri.app.streaming import sse_response
from colibri.engine import ChatPlan

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None,
             responses={**sse_200(ChatCompletion, "The completion, or its event stream."),
                        **error_responses(400, 404, 500, 503)})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI's chat completions."""
    serving = get_serving(request)
    state = serving.state
    model = state.check_model(body.model)
    plan, sequences = await prepare_chat(serving, body, request=request)
    k = body.engine_logprobs()
    job = serving.submit(sequences, want_token_text=k is not None)
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": model}
    if not body.stream:
        choices = await serving.collect(request, job, body.n, "messages")
        return _response(meta, plan, choices, len(plan.prompt), body.logprobs)
    first, outputs = await serving.first_output(request, job, "messages")
    return sse_response(state, _stream(serving.eos_ids, body, plan, meta, first, outputs))


def _response(meta: dict[str, Any], plan: ChatPlan, choices: list[Choice], n_prompt: int,
              logprobs: bool) -> dict[str, Any]:
    out = []
    for c in choices:
        reply, finish = parsed_reply(plan, c.text, c.finish_reason)
        content = (reply.content or None) if reply.calls else reply.content
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if plan.reasoning is not None:  # a model that thinks: its reasoning, apart
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [call_dict(t) for t in reply.calls]
        out.append({
            "index": c.index,
            "message": message,
            "logprobs": ({"content": chat_logprob_entries(c.logprob_outputs), "refusal": None}
                         if logprobs else None),
            "finish_reason": finish,
        })
    return {**meta, "object": "chat.completion", "system_fingerprint": None, "choices": out,
            "usage": usage(n_prompt, choices)}


async def _stream(eos_ids: frozenset[int], body: ChatCompletionRequest, plan: ChatPlan,
                  meta: dict[str, Any], first: Output | None,
                  outputs: AsyncIterator[Output]) -> AsyncIterator[str]:
    include_usage = body.include_usage
    base = {**meta, "object": "chat.completion.chunk", "system_fingerprint": None}
    if include_usage:
        base["usage"] = None
    with_choices = ChunkJSON(base, "choices")

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: Any = None) -> str:
        return with_choices([{
            "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
        }])

    choices = [Choice(i) for i in range(body.n)]
    streams = [ChoiceStream(plan) for _ in range(body.n)]
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for out in with_first(first, outputs):
            choice = choices[out.index]
            add_output(choice, out, eos_ids)
            step = out.step
            lp = None
            if body.logprobs and out.token is not None and not is_eos_stop(out, eos_ids):
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
