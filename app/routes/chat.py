"""POST /v1/chat/completions, streamed (SSE) and not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from app.errors import APIError
from app.generation import (
    Choice,
    add_output,
    chat_logprob_entries,
    collect,
    first_output,
    is_eos_stop,
    max_tokens_for,
    new_id,
    now,
    submit,
    usage,
)
from app.protocol import ChatCompletionRequest
from app.state import ServerState, get_state
from app.streaming import sse_response
from app.templates import chat_prompt_ids
from app.worker import Output, Sequence

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI's chat completions."""
    state = get_state(request)
    model = state.check_model(body.model)
    llm = state.llm
    body.check(state.settings, int(llm.tokenizer.vocab_size))
    prompt = await state.off_loop(
        chat_prompt_ids, llm, body.template_messages(), body.add_generation_prompt,
        body.chat_template)
    if not prompt:
        raise APIError(400, "the chat prompt is empty", "messages")
    budget = max_tokens_for(state, len(prompt), body.requested_max_tokens(), "messages")
    k = body.engine_logprobs()
    vocab = int(llm.tokenizer.vocab_size)
    sequences = [Sequence(prompt, body.sampling_params(budget, i, vocab, k))
                 for i in range(body.n)]
    job = submit(state, sequences, want_token_text=k is not None)
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": model}
    if not body.stream:
        choices = await collect(state, request, job, body.n, "messages")
        return _response(meta, choices, len(prompt), body.logprobs)
    first, outputs = await first_output(state, request, job, "messages")
    return sse_response(state, _stream(state, body, meta, len(prompt), first, outputs))


def _response(meta: dict[str, Any], choices: list[Choice], n_prompt: int,
              logprobs: bool) -> dict[str, Any]:
    return {
        **meta,
        "object": "chat.completion",
        "system_fingerprint": None,
        "choices": [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": ({"content": chat_logprob_entries(c.logprob_outputs), "refusal": None}
                         if logprobs else None),
            "finish_reason": c.finish_reason or "stop",
        } for c in choices],
        "usage": usage(n_prompt, choices),
    }


async def _stream(state: ServerState, body: ChatCompletionRequest, meta: dict[str, Any],
                  n_prompt: int, first: Output | None,
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
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        pending = [first] if first is not None else []
        while True:
            if pending:
                out = pending.pop()
            else:
                try:
                    out = await outputs.__anext__()
                except StopAsyncIteration:
                    break
            choice = choices[out.index]
            add_output(choice, out, state)
            step = out.step
            lp = None
            if body.logprobs and out.token is not None and not is_eos_stop(out, state):
                lp = {"content": chat_logprob_entries([out]), "refusal": None}
            if step.text or lp is not None:
                yield chunk(out.index, {"content": step.text}, None, lp)
            if step.finish_reason is not None:
                yield chunk(out.index, {}, step.finish_reason)
        if include_usage:
            yield json.dumps({**base, "choices": [],
                              "usage": usage(n_prompt, choices)})
        yield "[DONE]"
    finally:
        await outputs.aclose()
