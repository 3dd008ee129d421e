"""POST /v1/completions (text completions), streamed (SSE) and not."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from colibri.app.errors import APIError
from colibri.app.protocol import CompletionRequest
from colibri.app.replies import (
    Choice,
    ChunkJSON,
    Output,
    add_output,
    completion_logprobs,
    new_id,
    now,
    usage,
    with_first,
)
from colibri.app.schemas import Completion, error_responses, sse_200
from colibri.app.serving import Sequence, get_serving
from colibri.app.streaming import sse_response

router = APIRouter()


def _tokenize_prompts(tok: Any, prompts: list[str | list[int]],
                      echo: bool) -> list[tuple[list[int], str]]:
    """(ids, echo text) per prompt; runs on the tokenizer pool."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = list(tok.encode(p, add_special_tokens=True))
            out.append((ids, p))
        else:
            text = tok.decode(p, skip_special_tokens=False) if echo else ""
            out.append((list(p), text))
    return out


@router.post("/v1/completions", response_model=None,
             responses={**sse_200(Completion, "The completion, or its event stream."),
                        **error_responses(400, 404, 500, 503)})
async def completions(body: CompletionRequest, request: Request) -> Any:
    """OpenAI's (legacy) text completions."""
    serving = get_serving(request)
    state = serving.state
    model = state.check_model(body.model)
    tok = state.tokenizer
    vocab = int(tok.vocab_size)
    body.check(state.settings, vocab)
    prompts = await state.off_loop(_tokenize_prompts, tok, body.prompt_list(), body.echo)
    sequences = []
    # echo with logprobs scores the prompt too; max_tokens 0 only scores it
    prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
    if body.max_tokens == 0 and prompt_lp is None:
        prompt_lp = 0
    spec = body.response_format.spec() if body.response_format is not None else None
    for ids, _ in prompts:
        if not ids:
            raise APIError(400, "prompt must not be empty", "prompt")
        budget = serving.budget(len(ids), body.max_tokens, "prompt")
        constraints = await serving.constraints(spec, [budget] * body.n, request)
        for j in range(body.n):
            params = body.sampling_params(budget, j, vocab, body.logprobs, prompt_lp)
            params.constraint = constraints[j]
            sequences.append(Sequence(ids, params))
    job = serving.submit(sequences, want_token_text=body.logprobs is not None)
    echoes = [text for _, text in prompts for _ in range(body.n)] if body.echo else None
    n_prompt = sum(len(ids) for ids, _ in prompts)
    meta = {"id": new_id("cmpl"), "created": now(), "model": model}
    if not body.stream:
        choices = await serving.collect(request, job, len(sequences), "prompt", body.echo)
        return _response(meta, choices, n_prompt, body, echoes)
    first, outputs = await serving.first_output(request, job, "prompt")
    return sse_response(state, _stream(serving.eos_ids, body, meta, n_prompt, len(sequences),
                                       echoes, first, outputs))


def _response(meta: dict[str, Any], choices: list[Choice], n_prompt: int,
              body: CompletionRequest, echoes: list[str] | None) -> dict[str, Any]:
    out = []
    for c in choices:
        prefix = echoes[c.index] if echoes else ""
        logprobs = None
        if body.logprobs is not None:
            offset = 0 if c.prompt is not None else len(prefix)
            logprobs = completion_logprobs(c.logprob_outputs, body.logprobs, offset, c.prompt)
        out.append({"index": c.index, "text": prefix + c.text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason or "stop"})
    return {**meta, "object": "text_completion", "system_fingerprint": None, "choices": out,
            "usage": usage(n_prompt, choices)}


async def _stream(eos_ids: frozenset[int], body: CompletionRequest, meta: dict[str, Any],
                  n_prompt: int, n_choices: int, echoes: list[str] | None,
                  first: Output | None, outputs: AsyncIterator[Output]) -> AsyncIterator[str]:
    base = {**meta, "object": "text_completion", "system_fingerprint": None}
    if body.include_usage:
        base["usage"] = None
    with_choices = ChunkJSON(base, "choices")

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return with_choices([{
            "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
        }])

    choices = [Choice(i) for i in range(n_choices)]
    offsets = [len(e) for e in echoes] if echoes else [0] * n_choices
    # with logprobs, a choice's echo goes out with its prompt's logprobs (its first output)
    echo_late = bool(echoes) and body.logprobs is not None
    try:
        if echoes and not echo_late:
            for i, text in enumerate(echoes):
                yield chunk(i, text)
        async for out in with_first(first, outputs):
            choice = choices[out.index]
            before = len(choice.logprob_outputs)
            add_output(choice, out, eos_ids, body.echo)
            if echo_late and echoes and out.prompt is not None:
                assert body.logprobs is not None
                lp_prompt = completion_logprobs([], body.logprobs, 0, out.prompt)
                offsets[out.index] = sum(len(t) for t in lp_prompt["tokens"])
                yield chunk(out.index, echoes[out.index], None, lp_prompt)
            lp = None
            if body.logprobs is not None and len(choice.logprob_outputs) > before:
                lp = completion_logprobs(choice.logprob_outputs[before:], body.logprobs,
                                         offsets[out.index])
                offsets[out.index] += sum(len(t) for t in lp["tokens"])
            step = out.step
            if step.text or lp is not None:
                yield chunk(out.index, step.text, None, lp)
            if step.finish_reason is not None:
                yield chunk(out.index, "", step.finish_reason)
        if body.include_usage:
            yield json.dumps({**base, "choices": [],
                              "usage": usage(n_prompt, choices)})
        yield "[DONE]"
    finally:
        await outputs.aclose()
