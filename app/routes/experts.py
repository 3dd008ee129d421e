"""The expert cache: GET /v1/expert_cache (JSON, behind the API key like the rest of /v1/)
and the live page at /experts that draws it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from colibri.app.routes.health import STATIC
from colibri.app.schemas import ExpertCacheInfo, error_responses
from colibri.app.state import get_state, unavailable

router = APIRouter()


@router.get("/v1/expert_cache", response_model=None,
            responses={200: {"model": ExpertCacheInfo}, **error_responses(503)})
async def expert_cache(request: Request) -> dict[str, Any]:
    """Residency and heat of every routed expert, the cache's counters and the last minutes
    of speed, batch size and hit rate; 503 while the model loads."""
    state = get_state(request)
    state.model  # noqa: B018 - raises the 503 while loading, draining or faulty
    monitor = state.engine.expert_cache()
    if monitor is None:
        raise unavailable(state)
    # off the event loop: it takes the cache's lock, which the engine thread also holds
    data: dict[str, Any] = await state.off_loop(monitor.page_data)
    return data


@router.get("/experts", include_in_schema=False)
async def page() -> Response:
    """The live page of the expert cache."""
    return FileResponse(STATIC / "experts.html", media_type="text/html; charset=utf-8")
