"""What chat and text completions share: prompt budgets, submitting work, collecting it,
racing client disconnects, mapping engine errors, and the logprobs formats.

A request's sequences (prompts x n) run one after another on the engine thread as one job,
so one request holds one queue slot however many choices it asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from colibri.app.errors import APIError
from colibri.app.state import DrainExpiredError, ServerState, get_state, shutting_down, unavailable
from colibri.app.worker import (
    EngineUnavailableError,
    Job,
    Output,
    PromptToken,
    QueueFullError,
    Sequence,
)
from colibri.engine import ContextLengthError, ModelFaultError, SamplingParamError, TokenIdError

log = logging.getLogger("colibri.app")
T = TypeVar("T")


class ClientGoneError(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class Choice:
    """One choice being accumulated from engine outputs."""

    index: int
    parts: list[str] = field(default_factory=list)
    n_tokens: int = 0
    n_cached: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None
    logprob_outputs: list[Output] = field(default_factory=list)
    prompt: list[PromptToken] | None = None  # echo with logprobs: the prompt's tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def max_tokens_for(state: ServerState, n_prompt: int, requested: int | None, param: str,
                   note: str = "") -> int:
    """The completion budget: requested, or what is left of the context; 400 if it cannot fit.
    A KV cache smaller than the context caps a request at the cache's size. note: appended to
    the error (e.g. that tool definitions are part of the prompt)."""
    n_ctx = int(state.llm.n_ctx)
    cap = int(state.llm.core.max_request_tokens)
    if cap < n_ctx:
        limit = (f"This server's KV cache holds {cap} tokens per request (the model's context "
                 f"is {n_ctx})")
    else:
        limit = f"This model's maximum context length is {n_ctx} tokens"
    if requested == 0 and n_prompt < cap:
        return 0  # scoring the prompt only
    if n_prompt >= cap:
        raise APIError(400, f"{limit}, and the prompt has {n_prompt} tokens.{note}", param,
                       "context_length_exceeded")
    if requested is None:
        return cap - n_prompt
    if n_prompt + requested > cap:
        raise APIError(400, f"{limit}. However, you requested {n_prompt + requested} tokens "
                       f"({n_prompt} in the prompt, {requested} for the completion). Please "
                       f"reduce the prompt or max_tokens.{note}", param, "context_length_exceeded")
    return requested


def submit(state: ServerState, sequences: list[Sequence], want_token_text: bool) -> Job:
    """Queue the job; 503 + Retry-After when the queue is full or the model is not ready."""
    if state.draining:
        raise unavailable(state)
    try:
        return state.worker.submit(sequences, want_token_text)
    except QueueFullError:
        raise APIError(503, "The server is busy: the request queue is full. Retry later.",
                       code="queue_full",
                       headers={"Retry-After": str(state.settings.retry_after_s)}) from None
    except EngineUnavailableError:
        raise unavailable(state) from None


def engine_error(exc: BaseException, param: str) -> APIError:
    """The client-facing error for what the engine raised (500s keep internals in the log)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), param, "context_length_exceeded")
    if isinstance(exc, (SamplingParamError, TokenIdError)):
        return APIError(400, str(exc), getattr(exc, "param", None))
    if isinstance(exc, ModelFaultError):  # the engine logged which file or why, once
        return APIError(500, "The model can no longer serve requests (its weight files "
                        "changed or it produced non-finite values); the server needs a restart.",
                        code="model_fault")
    log.error("generation failed: %s", exc, exc_info=exc)
    return APIError(500, "The server had an error while processing the request.")


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await awaitable unless the client disconnects first (then ClientGoneError) or the
    drain timeout runs out (then DrainExpiredError)."""
    main = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    drain = asyncio.ensure_future(get_state(request).drain_expired.wait())
    try:
        done, _ = await asyncio.wait({main, watch, drain}, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        if drain in done:
            raise DrainExpiredError()
        raise ClientGoneError()
    finally:
        for task in (main, watch, drain):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task


async def collect(state: ServerState, request: Request, job: Job, n_choices: int,
                  param: str, keep_eos: bool = False) -> list[Choice]:
    """Run the job to the end (non-streaming); the job is cancelled if the client leaves."""
    choices = [Choice(i) for i in range(n_choices)]

    async def consume() -> None:
        outputs = state.worker.outputs(job)
        try:
            async for out in outputs:
                add_output(choices[out.index], out, state, keep_eos)
        finally:
            await outputs.aclose()

    try:
        await race_disconnect(request, consume())
    except ClientGoneError:
        raise APIError(499, "client closed the request") from None
    except DrainExpiredError:
        raise shutting_down(state) from None
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error
        raise engine_error(exc, param) from None
    finally:
        state.worker.cancel(job)
    return choices


def add_output(choice: Choice, out: Output, state: ServerState, keep_eos: bool = False) -> None:
    """Fold one engine step into its choice. keep_eos: the end-of-sequence token that ended
    it gets a logprobs entry too (echoed completions: scorers count one entry per token)."""
    step = out.step
    choice.parts.append(step.text)
    if step.token_id >= 0:
        choice.n_tokens += 1
    choice.n_cached = max(choice.n_cached, step.n_cached_tokens)
    if out.prompt is not None:
        choice.prompt = out.prompt
    if step.finish_reason is not None:
        choice.finish_reason = step.finish_reason
    if out.token is not None and step.token_id >= 0 and (keep_eos or not is_eos_stop(out, state)):
        choice.logprob_outputs.append(out)


def is_eos_stop(out: Output, state: ServerState) -> bool:
    """The end-of-sequence token that ended a choice (no text, no logprobs entry)."""
    return (out.step.finish_reason == "stop"
            and out.step.token_id in state.llm.tokenizer.eos_token_ids)


def usage(n_prompt: int, choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache (the
    first choice's: later choices of a prompt share its prefill)."""
    n_completion = sum(c.n_tokens for c in choices)
    cached = choices[0].n_cached if choices else 0
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs formats ------------------------------------------------------------------------
def chat_logprob_entries(outputs: list[Output]) -> list[dict[str, Any]]:
    """Chat format: `{"token", "logprob", "bytes", "top_logprobs": [...]}` per token."""
    entries = []
    for out in outputs:
        assert out.token is not None
        top = [{"token": t.text, "logprob": lp, "bytes": t.bytes} for t, lp in out.top or []]
        entries.append({"token": out.token.text, "logprob": out.step.logprob,
                        "bytes": out.token.bytes, "top_logprobs": top})
    return entries


def completion_logprobs(outputs: list[Output], k: int, offset: int,
                        prompt: list[PromptToken] | None = None) -> dict[str, Any]:
    """Legacy completions format: parallel lists tokens / token_logprobs / top / offsets;
    with prompt (echo), the prompt's tokens come first (the first has no logprob)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for p in prompt or []:
        tokens.append(p.token.text)
        lps.append(p.logprob)
        offsets.append(offset)
        offset += len(p.token.text)
        if p.logprob is None:
            tops.append(None)
        else:
            tops.append({t.text: lp for t, lp in p.top} if k > 0 else None)
    for out in outputs:
        assert out.token is not None
        tokens.append(out.token.text)
        lps.append(out.step.logprob)
        offsets.append(offset)
        offset += len(out.token.text)
        tops.append({t.text: lp for t, lp in (out.top or [])} if k > 0 else None)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": tops if k > 0 else None, "text_offset": offsets}


async def with_first(first: Output | None,
                     outputs: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """The output first_output already took (if any), then the rest of the stream."""
    if first is not None:
        yield first
    async for out in outputs:
        yield out


async def first_output(state: ServerState, request: Request, job: Job,
                       param: str) -> tuple[Output | None, AsyncIterator[Output]]:
    """Wait for a stream's first output before answering 200, so that early failures
    (queue, context, engine errors) still get their own status; None if it ended empty."""
    outputs = state.worker.outputs(job)
    try:
        first = await race_disconnect(request, outputs.__anext__())
    except StopAsyncIteration:
        return None, outputs
    except ClientGoneError:
        await outputs.aclose()
        state.worker.cancel(job)
        raise APIError(499, "client closed the request") from None
    except DrainExpiredError:
        await outputs.aclose()
        state.worker.cancel(job)
        raise shutting_down(state) from None
    except BaseException as exc:
        await outputs.aclose()
        state.worker.cancel(job)
        if isinstance(exc, Exception):
            raise engine_error(exc, param) from None
        raise
    return first, outputs
