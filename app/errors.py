"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and in
Anthropic's on the Messages API's paths: `{"type": "error", "error": {"type", "message"}}`.

Every failure a client can see goes through here, with the status OpenAI would use: 400 for
the client's own mistakes (never FastAPI's 422), 401, 404, 413, 431, 503 + Retry-After, and
500 with a fixed message (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("colibri.app")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
}


# Anthropic's error types by status, for the paths that answer in its shape
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_path(path: str) -> bool:
    """Whether path belongs to the Messages API, whose errors take Anthropic's shape."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An error in Anthropic's shape (code: OpenAI's error code, worded as Anthropic does
    where its clients read the words: they compact a conversation on "prompt is too long")."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if code == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


class APIError(Exception):
    """An error answered to the client as-is (status, message, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.err_type = err_type or _TYPES.get(status, "invalid_request_error")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None,
    err_type: str | None = None,
) -> dict[str, Any]:
    """The JSON body of an error."""
    return {"error": {
        "message": message,
        "type": err_type or _TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }}


def error_bytes(status: int, message: str, param: str | None = None,
                code: str | None = None, path: str = "") -> bytes:
    """The body of an error, for raw ASGI responses sent before FastAPI runs (path: the
    request's, which decides the shape)."""
    body = (anthropic_error_body(status, message, code) if anthropic_path(path)
            else error_body(status, message, param, code))
    return json.dumps(body).encode()


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """A JSONResponse for err, in the shape of the API that path belongs to."""
    body = (anthropic_error_body(err.status, err.message, err.code) if anthropic_path(path)
            else error_body(err.status, err.message, err.param, err.code, err.err_type))
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # pydantic names union members (`str`, `list[int]`, function-after[...]) in loc:
    # keep only the field path a client wrote
    keep = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "list")]
    return ".".join(keep) or None


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON", None
    # a union reports one error per member: the deepest location names the field best
    first = max(errors, key=lambda e: len(_param_of(tuple(e.get("loc", ()))) or ""))
    param = _param_of(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return (f"{param}: {msg}" if param else msg), param


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc, request.url.path)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(list(exc.errors()))
    return error_response(APIError(400, message, param), request.url.path)


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(APIError(status, message, headers=getattr(exc, "headers", None)),
                          request.url.path)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, "The server had an error while processing the "
                                   "request."), request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can raise to the OpenAI error shape."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)
