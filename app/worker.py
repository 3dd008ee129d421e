"""The server's side of the engine: one HTTP request's prompts and choices become engine
requests (a prompt with its n choices is one engine request, so the choices share the
prompt's prefill), and their outputs are merged into one ordered stream of `Output`s.

Everything about generation itself (admission, queueing, batching, abort, token bytes) lives
behind engine.AsyncEngine's submit/abort; this module only maps indices and records metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from colibri.app.metrics import Metrics
from colibri.engine import (
    LLM,
    AsyncEngine,
    AsyncEngineConfig,
    EngineUnavailableError,
    QueueFullError,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger("colibri.app")

__all__ = ["EngineUnavailableError", "EngineWorker", "Job", "Output", "PromptToken",
           "QueueFullError", "Sequence"]


@dataclass
class Sequence:
    """One sequence to generate: a choice of a request."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class PromptToken:
    """A prompt token's text forms with its logprob (None for the first) and the top
    alternatives (TokenInfo, logprob)."""

    token: Any
    logprob: float | None
    top: list[tuple[Any, float]]


@dataclass
class Output:
    """One engine step of one sequence, as the routes receive it."""

    index: int
    step: RequestOutput
    prompt: list[PromptToken] | None = None  # with prompt logprobs and token text: the first

    @property
    def token(self) -> Any:
        return self.step.token

    @property
    def top(self) -> Any:
        return self.step.top


@dataclass(eq=False)
class Job:
    """One HTTP request's engine requests and the queue their outputs arrive on."""

    streams: list[Any] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)  # engine request id -> first index
    prompts: dict[str, list[int]] = field(default_factory=dict)  # engine request id -> prompt
    want_token_text: bool = False
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last: dict[int, float] = field(default_factory=dict)  # index -> time of its last token
    ended: bool = False


class EngineWorker:
    """Owns the AsyncEngine; the LLM the loader builds provides the model and its core."""

    def __init__(self, loader: Callable[[], LLM], max_queue: int, metrics: Metrics,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self._metrics = metrics
        self.llm: LLM | None = None

        def load() -> Any:
            self.llm = loader()
            core = self.llm.core
            core.on_step = metrics.observe_step
            metrics.engine_stats = core.snapshot
            metrics.expert_cache = core.expert_cache
            metrics.model_name = str(self.llm.model_name)
            metrics.model_loaded = 1
            log.info("model %s loaded (context %d tokens)", self.llm.model_name,
                     self.llm.n_ctx)
            return self.llm.core

        def fatal(exc: BaseException) -> None:
            metrics.model_loaded = 0
            if on_fatal is not None:
                on_fatal(exc)

        self.engine = AsyncEngine(load, AsyncEngineConfig(max_queue=max_queue), fatal)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    @property
    def stopping(self) -> bool:
        return self.engine.stopping

    @property
    def loaded(self) -> Any:
        return self.engine.loaded

    @property
    def n_running(self) -> int:
        return self.engine.n_running

    @property
    def n_waiting(self) -> int:
        return self.engine.n_waiting

    def stop(self, timeout: float) -> None:
        self.engine.stop(timeout)

    # -- requests --------------------------------------------------------------------------
    def submit(self, sequences: list[Sequence], want_token_text: bool = False) -> Job:
        """Queue the request's sequences; raises QueueFullError, EngineUnavailableError or
        the engine's validation errors before anything runs. Consecutive sequences with the
        same prompt are one engine request."""
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
        except BaseException:
            self.cancel(job)
            raise
        return job

    async def outputs(self, job: Job) -> AsyncIterator[Output]:
        """The job's outputs in arrival order; raises what the engine raised. Cancels on
        exit."""
        open_streams = len(job.streams)
        try:
            while open_streams:
                stream, item = await job.queue.get()
                if isinstance(item, BaseException):
                    stream.closed = True
                    stream.engine.release(stream, ended=True)
                    raise item
                if not isinstance(item, list):  # the end of one engine request
                    stream.closed = True
                    stream.engine.release(stream, ended=True)
                    open_streams -= 1
                    continue
                base = job.offsets[stream.request_id]
                for out in item:
                    o = Output(base + out.index, out)
                    if job.want_token_text and out.prompt_logprobs is not None:
                        o.prompt = await asyncio.to_thread(  # token texts: off the loop
                            self._prompt_tokens, job.prompts[stream.request_id],
                            out.prompt_logprobs)
                    yield self._record(job, o)
            job.ended = True
            self._metrics.add_e2e(time.perf_counter() - job.arrival)
        finally:
            self.cancel(job)

    def _prompt_tokens(self, prompt: list[int], entries: list[Any]) -> list[PromptToken]:
        tt = self.engine.token_text
        assert tt is not None
        return [PromptToken(tt(t), None if e is None else e[0],
                            [] if e is None else [(tt(a), lp) for a, lp in e[1]])
                for t, e in zip(prompt, entries, strict=True)]

    def _record(self, job: Job, out: Output) -> Output:
        if out.step.token_id >= 0:
            now = time.perf_counter()
            prev = job.last.get(out.index)
            self._metrics.add_token(None if prev is None else now - prev,
                                    now - job.arrival if not job.last else None)
            job.last[out.index] = now
        return out

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
