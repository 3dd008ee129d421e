"""EngineClient: everything a server sees of the engine, and nothing more.

A server submits prompts and reads their outputs, aborts them, tokenizes through the model's
tokenizer, asks the context budget of a request, and watches health, counters and the expert
cache. `AsyncEngine` implements it; a different engine (another process, a remote replica)
would implement the same protocol and the HTTP layer would not change.

`ModelInfo` is what a loaded engine says about its model; `context_budget` is the one place
the completion budget of a request is computed (the server maps its ContextLengthError to
OpenAI's 400 `context_length_exceeded`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from colibri.engine.core.request import RequestOutput
from colibri.engine.sample.sampler import SamplingParams

Health = Literal["loading", "ready", "failed", "faulty", "stopping"]


@dataclass(frozen=True)
class ModelInfo:
    """The served model, as a loaded engine reports it."""

    name: str  # the repo id or folder name it was loaded from
    path: Path  # the converted Colibri folder
    n_ctx: int  # positions per sequence
    max_request_tokens: int  # prompt + completion one request may hold (<= n_ctx)
    vocab_size: int
    eos_token_ids: frozenset[int]


@runtime_checkable
class EngineStream(Protocol):
    """One submitted request: its outputs arrive on the queue given at submit."""

    request_id: str
    closed: bool

    def close(self) -> None:
        """Stop listening; aborts the request unless it already ended."""

    def finish(self) -> None:
        """The consumer saw the request's end (or its error): forget it without aborting."""


@runtime_checkable
class EngineClient(Protocol):
    """The engine as a server drives it (see the module docstring)."""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start loading the model in the background."""

    def stop(self, timeout: float) -> None:
        """Abort what is left and stop (blocking)."""

    def health(self) -> Health:
        """loading, ready, failed (the load or the engine loop), faulty (the model can no
        longer serve) or stopping."""

    @property
    def error(self) -> BaseException | None:
        """Why loading or the engine failed."""

    @property
    def fault(self) -> str | None:
        """Why the loaded model can no longer serve (weights changed, non-finite values)."""

    # -- the model ---------------------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        """The loaded model; EngineUnavailableError before it is loaded."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (thread-safe for encode, decode and templates)."""

    def context_budget(self, n_prompt: int, requested: int | None) -> int:
        """Completion tokens a prompt of n_prompt tokens may have: requested, or what is left
        of the context when None; requested 0 scores the prompt only. ContextLengthError
        when it does not fit."""

    # -- requests ----------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str: ...

    def submit(self, request_id: str, prompt_ids: list[int],
               params: SamplingParams | list[SamplingParams], want_token_text: bool = False,
               sink: asyncio.Queue[Any] | None = None) -> EngineStream:
        """Validate and queue one prompt (one SamplingParams per choice). Outputs arrive as
        (stream, item) pairs on sink: item is a list of RequestOutput, an exception, or
        anything else for the end. Raises before queueing anything."""

    def generate(self, request_id: str, prompt_ids: list[int],
                 params: SamplingParams | list[SamplingParams],
                 want_token_text: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs in order; aborts it on exit."""

    def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix; the number of cached KV blocks forgotten.
        EngineUnavailableError when the model is not ready."""

    def token_texts(self, token_ids: list[int]) -> list[Any]:
        """TokenInfo (text and bytes) of each id."""

    # -- observation -------------------------------------------------------------------------
    def observe_steps(self, fn: Callable[[int, int], None]) -> None:
        """Call fn(sequences, tokens) after every step (on the engine thread)."""

    def stats(self) -> dict[str, float]:
        """Counters of the scheduler and the KV cache (empty before the model is loaded)."""

    def expert_cache(self) -> Any:
        """The expert cache's monitor (None before the model is loaded)."""
