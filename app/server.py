"""The FastAPI application: routes, error shapes, the guard middleware, CORS, lifespan.

The model loads on the engine thread after the server is up, so /health answers at once
and /ready says 503 until the model is loaded. Shutdown (after uvicorn has drained the
connections) aborts what is left and joins the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from colibri.app.errors import install_error_handlers
from colibri.app.memory import MemoryReturner
from colibri.app.metrics import Metrics
from colibri.app.middleware import PROTECTED, GuardMiddleware
from colibri.app.routes import (
    chat,
    completions,
    experts,
    health,
    messages,
    models,
    responses,
    tokenize,
    workers,
)
from colibri.app.schemas import install_schema
from colibri.app.serving import Serving
from colibri.app.settings import Settings
from colibri.app.state import ServerState
from colibri.engine import (
    AsyncEngine,
    AsyncEngineConfig,
    EngineConfig,
    EngineCore,
    ModelError,
    __version__,
    engine_loader,
)

log = logging.getLogger("colibri.app")


def default_loader(settings: Settings) -> Callable[[], EngineCore]:
    """Load settings.model (a folder, a Hugging Face repo id, or None for the bundled demo
    model) the way `colibri serve` does."""
    return engine_loader(settings.model, EngineConfig.from_options(settings))


def create_app(settings: Settings, loader: Callable[[], EngineCore] | None = None) -> FastAPI:
    """The app for settings; loader builds the engine core on the engine's thread."""
    metrics = Metrics()
    holder: list[ServerState] = []

    def on_fatal(exc: BaseException) -> None:
        state = holder[0]
        # a model that cannot load (its files, the disk it converts to) exits 2 with one line,
        # as the checks before binding do; the engine failing later exits 1
        load_failed = not engine.loaded.is_set()
        code = 2 if load_failed and isinstance(exc, (ModelError, OSError)) else 1
        state.exit_code = code
        if state.request_exit is not None:
            state.request_exit(code)

    engine = AsyncEngine(loader or default_loader(settings),
                         AsyncEngineConfig(max_queue=settings.max_queue), on_fatal)
    metrics.attach(engine)
    state = ServerState(settings, metrics, engine)
    holder.append(state)

    async def drain_watch() -> None:
        # `draining` is set by the signal handler (app.cli); polling it keeps that handler
        # trivial. Once drain_timeout_s has passed, waiting and streaming requests are
        # answered by the app itself, before uvicorn's own (later) deadline cancels them.
        while not state.draining:
            await asyncio.sleep(0.1)
        await asyncio.sleep(settings.drain_timeout_s)
        log.warning("drain timeout (%gs) reached: refusing what is still waiting",
                    settings.drain_timeout_s)
        state.drain_expired.set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watch = asyncio.create_task(drain_watch())
        returner = asyncio.create_task(MemoryReturner().run())
        try:
            yield
        finally:
            watch.cancel()
            returner.cancel()
            state.draining = True
            await asyncio.to_thread(engine.stop, settings.drain_timeout_s)
            state.tok_pool.shutdown(wait=False, cancel_futures=True)
            state.constraint_pool.shutdown(wait=False, cancel_futures=True)

    docs = settings.docs
    app = FastAPI(title="Colibri", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    install_schema(app, settings, PROTECTED)
    app.state.colibri = state
    app.state.serving = Serving(state)
    install_error_handlers(app)
    paths: set[str] = set()
    for module in (models, chat, completions, responses, messages, tokenize, experts, health,
                   workers):
        app.include_router(module.router)
        paths |= {getattr(r, "path", "") for r in module.router.routes}
    app.add_middleware(GuardMiddleware, settings=settings, metrics=metrics,
                       known_paths=lambda: paths)
    if settings.cors_origins:
        # credentials are never allowed: API keys travel in the Authorization header
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins,
                           allow_credentials=False, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key",
                                          "anthropic-version", "anthropic-beta"])
    return app
