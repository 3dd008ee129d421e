"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from colibri.app.errors import APIError
from colibri.app.schemas import ModelCard, ModelList, error_responses
from colibri.app.state import get_state

router = APIRouter()


def _card(name: str, created: int, n_ctx: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "colibri",
            "max_model_len": n_ctx}


@router.get("/v1/models", response_model=None,
            responses={200: {"model": ModelList}, **error_responses(503)})
async def list_models(request: Request) -> dict[str, Any]:
    """The served model (one per server)."""
    state = get_state(request)
    n_ctx = state.model.n_ctx
    return {"object": "list", "data": [_card(state.served_name(), state.started, n_ctx)]}


@router.get("/v1/models/{model:path}", response_model=None,
            responses={200: {"model": ModelCard}, **error_responses(404, 503)})
async def get_model(model: str, request: Request) -> dict[str, Any]:
    """One model by name; 404 for any other."""
    state = get_state(request)
    n_ctx = state.model.n_ctx
    if model not in state.model_names() and not state.settings.accept_any_model:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return _card(state.served_name(), state.started, n_ctx)
