"""Liveness, readiness, metrics and the chat page; none of them needs the API key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response

from colibri.app.schemas import HealthStatus, ReadyStatus
from colibri.app.state import get_state

router = APIRouter()
_READY: dict[int | str, dict[str, Any]] = {
    200: {"model": ReadyStatus},
    503: {"model": ReadyStatus, "description": "Loading, draining or failed."}}
STATIC = Path(__file__).resolve().parent.parent / "static"


@router.get("/health", response_model=None, responses={
    200: {"model": HealthStatus}, 503: {"model": HealthStatus, "description": "Engine fault."}})
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the process works (also while loading); 503 after an engine fault
    or once the model is faulty (a weight file changed, non-finite outputs)."""
    state = get_state(request)
    if state.engine.health() in ("failed", "faulty"):
        return JSONResponse({"status": "error"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready", response_model=None, responses=_READY)
@router.get("/health/ready", response_model=None, responses=_READY)
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the model is loaded; 503 while loading, draining or failed."""
    state = get_state(request)
    health = state.engine.health()
    retry = {"Retry-After": str(state.settings.retry_after_s)}
    if health == "failed":
        return JSONResponse({"status": "failed", "model_loaded": False}, 503, retry)
    if health == "faulty":
        return JSONResponse({"status": "failed", "model_loaded": True}, 503, retry)
    if state.draining or health == "stopping":
        return JSONResponse({"status": "draining", "model_loaded": True}, 503, retry)
    if health != "ready":
        return JSONResponse({"status": "loading", "model_loaded": False}, 503, retry)
    return JSONResponse({"status": "ready", "model_loaded": True,
                         "model": state.served_name()})


@router.get("/metrics", response_class=PlainTextResponse, responses={
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text exposition."""
    text = get_state(request).metrics.render()
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/", include_in_schema=False)
async def page() -> Response:
    """The chat page."""
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    """The page's script and style (only files that exist directly in static/)."""
    files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
    path = files.get(name)
    if path is None:
        return JSONResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                       "param": None, "code": None}}, status_code=404)
    return FileResponse(path)
