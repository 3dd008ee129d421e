"""What the routes share: settings, metrics, the engine (an EngineClient) and a tokenizer
pool.

Tokenizing, chat-template rendering and detokenizing run on `tok_pool` threads, constraint
compiles on `constraint_pool`, never on the event loop; generation runs only on the engine's
own thread.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from colibri.app.errors import APIError
from colibri.app.metrics import Metrics
from colibri.app.settings import Settings
from colibri.engine import EngineClient, ModelInfo

T = TypeVar("T")


@dataclass
class ServerState:
    """One per app; reachable from a request as request.app.state.colibri."""

    settings: Settings
    metrics: Metrics
    engine: EngineClient
    tok_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="colibri-tok"))
    # constraint compiles wait here (up to constraint_timeout_s each), never on tok_pool
    constraint_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="colibri-grammar"))
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    # set drain_timeout_s after draining began: what is still queued gets 503, what still
    # streams ends with an error event and [DONE] (see app.server's drain watch)
    drain_expired: asyncio.Event = field(default_factory=asyncio.Event)
    exit_code: int = 0
    request_exit: Callable[[int], None] | None = None

    @property
    def model(self) -> ModelInfo:
        """The served model; 503 while loading, draining, failed or faulty."""
        if self.engine.health() != "ready":
            raise unavailable(self)
        return self.engine.info

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer; 503 like `model`."""
        self.model  # noqa: B018 - the 503 when not ready
        return self.engine.tokenizer

    def model_names(self) -> list[str]:
        return self.settings.model_names(self.model.name)

    def served_name(self) -> str:
        return self.model_names()[0]

    def check_model(self, requested: str | None) -> str:
        """The served name; 404 (param model) when the request names another model, unless
        the server accepts any name (settings.accept_any_model)."""
        names = self.model_names()
        if requested is not None and requested not in names \
                and not self.settings.accept_any_model:
            raise APIError(404, f"The model `{requested}` does not exist.", "model",
                           "model_not_found")
        return names[0]

    async def off_loop(self, fn: Callable[..., T], *args: Any,
                       pool: ThreadPoolExecutor | None = None, **kwargs: Any) -> T:
        """Run fn on pool (default: the tokenizer pool)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool or self.tok_pool,
                                          functools.partial(fn, *args, **kwargs))


class DrainExpiredError(Exception):
    """The drain timeout ran out while this request was still waiting or running."""


def shutting_down(state: ServerState) -> APIError:
    """503 + Retry-After for a request the drain timeout cut off."""
    return APIError(503, "Service unavailable: the server is shutting down.",
                    code="server_shutting_down",
                    headers={"Retry-After": str(state.settings.retry_after_s)})


def unavailable(state: ServerState) -> APIError:
    """503 while loading, draining, after a failed load or once the model is faulty."""
    health = state.engine.health()
    if health == "failed":
        why = "the model failed to load"
    elif health == "faulty":
        why = "the model's weights changed or went bad; the server needs a restart"
    elif state.draining or health == "stopping":
        why = "the server is shutting down"
    else:
        why = "the model is still loading"
    return APIError(503, f"Service unavailable: {why}.",
                    headers={"Retry-After": str(state.settings.retry_after_s)})


def get_state(request: Request) -> ServerState:
    """The ServerState of the app serving request."""
    return request.app.state.colibri  # type: ignore[no-any-return]
