"""What routers in front of several servers read from each one (vllm-router, sglang-router):
the load, a generation probe, cache flushing and a summary of the model and the server.

Every answer is the engine's own state: /get_load counts the scheduler's running and waiting
sequences (the numbers /metrics exports as vllm:num_requests_*), /flush_cache empties the
prefix cache on the engine thread, /health_generate generates one token. Nothing here
depends on which router asks, or whether one does.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request

from colibri.app.errors import APIError
from colibri.app.schemas import (
    FlushCacheStatus,
    HealthStatus,
    LoadStatus,
    ModelSummary,
    ServerSummary,
    error_responses,
)
from colibri.app.state import get_state, unavailable
from colibri.engine import EngineUnavailableError, SamplingParams, __version__

router = APIRouter()
log = logging.getLogger("colibri.app")
# a probe waits this long for its one token: a busy server still answers within it
_PROBE_TIMEOUT_S = 30.0


@router.get("/get_load", response_model=None,
            responses={200: {"model": LoadStatus}, **error_responses(503)})
async def get_load(request: Request) -> dict[str, Any]:
    """Sequences running and waiting in the scheduler; `load` is their sum (the figure
    vllm-router's power-of-two policy and sglang-router compare)."""
    state = get_state(request)
    state.model  # noqa: B018 - the 503 while not ready
    stats = state.engine.stats()
    running, waiting = int(stats.get("running", 0)), int(stats.get("waiting", 0))
    return {"load": running + waiting, "running": running, "waiting": waiting,
            "kv_cache_usage": float(stats.get("kv_usage", 0.0))}


@router.get("/health_generate", response_model=None,
            responses={200: {"model": HealthStatus}, **error_responses(503)})
async def health_generate(request: Request) -> dict[str, Any]:
    """Deep health: 200 once the engine has generated one token for a one-token prompt (it
    queues behind the requests already there); 503 when it cannot."""
    state = get_state(request)
    if state.draining or state.engine.health() != "ready":
        raise unavailable(state)
    engine = state.engine
    rid = engine.new_request_id("health")
    prompt = [min(engine.info.eos_token_ids, default=0)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    why = "no token came"
    try:
        async with asyncio.timeout(_PROBE_TIMEOUT_S), \
                aclosing(engine.generate(rid, prompt, params)) as outputs:
            async for out in outputs:
                if out.token_id >= 0:
                    return {"status": "ok"}
    except Exception as exc:  # not ready, queue full, timed out, the step failed: all probed
        why = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
        log.warning("the generation probe failed: %s", why)
    raise APIError(503, f"Service unavailable: the engine could not generate ({why}).",
                   code="generation_failed",
                   headers={"Retry-After": str(state.settings.retry_after_s)})


@router.post("/flush_cache", response_model=None,
             responses={200: {"model": FlushCacheStatus}, **error_responses(503)})
async def flush_cache(request: Request) -> dict[str, Any]:
    """Empty the prefix cache: prompts after this compute every token again. Running
    requests keep their blocks."""
    state = get_state(request)
    try:
        n = await state.engine.reset_prefix_cache()
    except EngineUnavailableError:
        raise unavailable(state) from None
    return {"status": "flushed", "blocks": n}


@router.get("/get_model_info", response_model=None,
            responses={200: {"model": ModelSummary}, **error_responses(503)})
@router.get("/model_info", response_model=None, include_in_schema=False)
async def model_info(request: Request) -> dict[str, Any]:
    """The served model (sglang's shape: the name it was loaded as in `model_path`)."""
    state = get_state(request)
    info = state.model
    return {"model_path": info.name, "tokenizer_path": info.name,
            "served_model_name": state.served_name(), "is_generation": True,
            "max_model_len": info.n_ctx, "max_request_tokens": info.max_request_tokens,
            "vocab_size": info.vocab_size}


@router.get("/get_server_info", response_model=None,
            responses={200: {"model": ServerSummary}, **error_responses(503)})
@router.get("/server_info", response_model=None, include_in_schema=False)
async def server_info(request: Request) -> dict[str, Any]:
    """The server's version, model and the limits a router may plan with."""
    state = get_state(request)
    s = state.settings
    info = state.model
    return {"version": __version__, "served_model_name": state.served_name(),
            "model_path": info.name, "context_length": info.n_ctx,
            "max_num_seqs": s.max_num_seqs, "max_queue": s.max_queue,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "prefix_cache": s.prefix_cache}
