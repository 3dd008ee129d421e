"""Serving: what every endpoint does with a request once it has prompts and sampling
parameters: the completion budget, submitting to the engine, reading the outputs back,
racing client disconnects and the drain timeout, and turning engine errors into OpenAI's.

Chat, text completions and responses all go through one `Serving` (per app), over the
engine's `EngineClient`; the routes only parse requests and shape answers.

A request's prompts and choices become engine requests (a prompt with its n choices is one
engine request, so the choices share the prompt's prefill), and their outputs are merged
into one ordered stream of `Output`s; one HTTP request holds one queue slot per prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from colibri.app.chat_plan import request_constraints
from colibri.app.errors import APIError
from colibri.app.mailbox import Mailbox
from colibri.app.replies import Choice, Output, PromptToken, add_output
from colibri.app.state import DrainExpiredError, ServerState, shutting_down, unavailable
from colibri.engine import (
    ConstraintSpec,
    ContextLengthError,
    EngineClient,
    EngineUnavailableError,
    ModelFaultError,
    QueueFullError,
    SamplingParamError,
    SamplingParams,
    TokenIdError,
)

log = logging.getLogger("colibri.app")
T = TypeVar("T")


class ClientGoneError(Exception):
    """The client disconnected before its answer was ready."""


@dataclass
class Sequence:
    """One sequence to generate: a choice of a request."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass(eq=False)
class Job:
    """One HTTP request's engine requests and the queue their outputs arrive on."""

    streams: list[Any] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # engine request id -> first index
    prompts: dict[str, list[int]] = field(default_factory=dict)  # engine request id -> prompt
    want_token_text: bool = False
    queue: Mailbox[tuple[Any, Any]] = field(default_factory=Mailbox)
    arrival: float = field(default_factory=time.perf_counter)
    last: dict[int, float] = field(default_factory=dict)  # index -> time of its last token
    ended: bool = False


class Serving:
    """The serving logic of a request, shared by every generating endpoint."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine: EngineClient = state.engine
        self._metrics = state.metrics

    # -- budget ----------------------------------------------------------------------------
    def budget(self, n_prompt: int, requested: int | None, param: str, note: str = "",
               clamp: bool = False) -> int:
        """The completion budget (the engine's); 400 context_length_exceeded when it cannot
        fit. note: appended to the error (e.g. that tool definitions are in the prompt).
        clamp: a request for more than the context has room for gets what there is."""
        try:
            room = self.engine.context_budget(n_prompt, None if clamp else requested)
        except ContextLengthError as exc:
            raise APIError(400, f"{exc}{note}", param, "context_length_exceeded") from None
        except EngineUnavailableError:
            raise unavailable(self.state) from None
        return min(room, requested) if clamp and requested is not None else room

    # -- submitting ------------------------------------------------------------------------
    def submit(self, sequences: list[Sequence], want_token_text: bool = False) -> Job:
        """Queue the request's sequences: 503 + Retry-After when the queue is full or the
        model is not ready; the engine's validation errors as 400s. Consecutive sequences
        with the same prompt are one engine request."""
        state = self.state
        if state.draining:
            raise unavailable(state)
        job = Job(want_token_text=want_token_text)
        groups: list[tuple[int, list[int], list[SamplingParams]]] = []
        for i, seq in enumerate(sequences):
            if groups and groups[-1][1] == seq.prompt_ids:
                groups[-1][2].append(seq.params)
            else:
                groups.append((i, seq.prompt_ids, [seq.params]))
        try:
            for first, prompt, params in groups:
                rid = self.engine.new_request_id("http")
                job.offsets[rid] = first
                job.prompts[rid] = prompt
                job.streams.append(self.engine.submit(rid, prompt, params, want_token_text,
                                                      sink=job.queue))
                self._metrics.add_prompt_tokens(len(prompt))
        except QueueFullError:
            self.cancel(job)
            raise APIError(503, "The server is busy: the request queue is full. Retry later.",
                           code="queue_full",
                           headers={"Retry-After": str(state.settings.retry_after_s)}) from None
        except EngineUnavailableError:
            self.cancel(job)
            raise unavailable(state) from None
        except BaseException:
            self.cancel(job)
            raise
        return job

    # -- reading ---------------------------------------------------------------------------
    async def outputs(self, job: Job) -> AsyncIterator[Output]:
        """The job's outputs in arrival order; raises what the engine raised. Cancels on
        exit."""
        open_streams = len(job.streams)
        try:
            while open_streams:
                stream, item = await job.queue.get()
                if isinstance(item, BaseException):
                    stream.finish()
                    raise item
                if not isinstance(item, list):  # the end of one engine request
                    stream.finish()
                    open_streams -= 1
                    continue
                base = job.offsets[stream.request_id]
                for out in item:
                    o = Output(base + out.index, out)
                    if job.want_token_text and out.prompt_logprobs is not None:
                        o.prompt = await asyncio.to_thread(  # token texts: off the loop
                            self._prompt_tokens, job.prompts[stream.request_id],
                            out.prompt_logprobs)
                    if out.token_id >= 0:
                        self._record(job, o.index)
                    yield o
            job.ended = True
            self._metrics.add_e2e(time.perf_counter() - job.arrival)
        finally:
            self.cancel(job)

    def _prompt_tokens(self, prompt: list[int], entries: list[Any]) -> list[PromptToken]:
        texts = self.engine.token_texts(prompt)
        return [PromptToken(t, None if e is None else e[0],
                            [] if e is None else list(zip(self.engine.token_texts(
                                [a for a, _ in e[1]]), [lp for _, lp in e[1]], strict=True)))
                for t, e in zip(texts, entries, strict=True)]

    def _record(self, job: Job, index: int) -> None:
        now = time.perf_counter()
        prev = job.last.get(index)
        self._metrics.add_token(None if prev is None else now - prev,
                                now - job.arrival if not job.last else None)
        job.last[index] = now

    def cancel(self, job: Job) -> None:
        """Abort whatever of the job is still live (waiting: dropped; running: within a
        step)."""
        if job.ended:
            return
        job.ended = True
        if any(not s.closed for s in job.streams):
            self._metrics.add_aborted()
        for s in job.streams:
            s.close()

    async def collect(self, request: Request, job: Job, n_choices: int, param: str,
                      keep_eos: bool = False) -> list[Choice]:
        """Run the job to the end (non-streaming); the job is cancelled if the client
        leaves."""
        choices = [Choice(i) for i in range(n_choices)]
        eos = self.eos_ids

        async def consume() -> None:
            outputs = self.outputs(job)
            try:
                async for out in outputs:
                    add_output(choices[out.index], out, eos, keep_eos)
            finally:
                await outputs.aclose()

        try:
            await self.race_disconnect(request, consume())
        except ClientGoneError:
            raise APIError(499, "client closed the request") from None
        except DrainExpiredError:
            raise shutting_down(self.state) from None
        except Exception as exc:  # noqa: BLE001 - mapped to the client's error
            raise engine_error(exc, param) from None
        finally:
            self.cancel(job)
        return choices

    async def first_output(self, request: Request, job: Job,
                           param: str) -> tuple[Output | None, AsyncIterator[Output]]:
        """Wait for a stream's first output before answering 200, so that early failures
        (queue, context, engine errors) still get their own status; None if it ended
        empty."""
        outputs = self.outputs(job)
        try:
            first = await self.race_disconnect(request, outputs.__anext__())
        except StopAsyncIteration:
            return None, outputs
        except BaseException as exc:
            await outputs.aclose()
            self.cancel(job)
            if isinstance(exc, ClientGoneError):
                raise APIError(499, "client closed the request") from None
            if isinstance(exc, DrainExpiredError):
                raise shutting_down(self.state) from None
            if isinstance(exc, Exception):
                raise engine_error(exc, param) from None
            raise
        return first, outputs

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.engine.info.eos_token_ids

    async def constraints(self, spec: ConstraintSpec | None, budgets: list[int],
                          request: Request | None = None) -> list[Any]:
        """One compiled constraint per sequence (None each without a spec). Compiles wait on
        the constraint pool, never on the threads other requests tokenize on; one stops when
        its client disconnects (with request) and is a 400 past constraint_timeout_s."""
        if spec is None:
            return [None] * len(budgets)
        state = self.state
        tok = state.tokenizer
        cancel = threading.Event()
        work = state.off_loop(request_constraints, tok, int(tok.vocab_size), spec, budgets,
                              state.settings.constraint_timeout_s, cancel,
                              pool=state.constraint_pool)
        try:
            return await (work if request is None else self.race_disconnect(request, work))
        except ClientGoneError:
            raise APIError(499, "client closed the request") from None
        except DrainExpiredError:
            raise shutting_down(state) from None
        finally:
            cancel.set()  # a compile still running in its process stops now

    # -- waiting ---------------------------------------------------------------------------
    async def race_disconnect(self, request: Request, awaitable: Awaitable[T]) -> T:
        """Await awaitable unless the client disconnects first (then ClientGoneError) or the
        drain timeout runs out (then DrainExpiredError)."""
        main = asyncio.ensure_future(awaitable)
        watch = asyncio.ensure_future(_wait_disconnect(request))
        drain = asyncio.ensure_future(self.state.drain_expired.wait())
        try:
            done, _ = await asyncio.wait({main, watch, drain},
                                         return_when=asyncio.FIRST_COMPLETED)
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


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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


def get_serving(request: Request) -> Serving:
    """The Serving of the app answering request."""
    return request.app.state.serving  # type: ignore[no-any-return]
