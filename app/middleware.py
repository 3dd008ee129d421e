"""The guard in front of every route: header and body size limits, Host names, API key
(`Authorization: Bearer` or Anthropic's `x-api-key`), request counts.

Pure ASGI (no BaseHTTPMiddleware) so streaming responses and disconnect messages pass
through untouched. Order of checks: request line + headers (431), Host (421), API key (401),
body size (413) and body deadline (408). The body is read here once, bounded, and replayed to
the app; after it, `receive` is the server's own, so the app still sees `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri.app.errors import error_bytes
from colibri.app.metrics import Metrics
from colibri.app.settings import Settings

log = logging.getLogger("colibri.app")

# Paths that need the API key when one is set; /health, /ready, /metrics, /get_load and the
# page do not. The API description is protected too: it tells a stranger what the server can
# be made to do; so are the routers' endpoints that generate, change state or describe it.
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/openapi.json", "/docs", "/health_generate",
             "/flush_cache", "/get_server_info", "/get_model_info", "/server_info",
             "/model_info")
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """A bind address only this machine reaches."""
    return host in LOOPBACK_NAMES or host.startswith("127.")


def host_names(settings: Settings) -> frozenset[str] | None:
    """The Host names the server answers to; None: any. A loopback bind answers its own
    names and the allowed ones; another bind checks only once names are allowed."""
    allowed = {h.strip().lower().rstrip(".") for h in settings.allowed_hosts}
    if "*" in allowed or (not allowed and not is_loopback(settings.host)):
        return None
    return LOOPBACK_NAMES | allowed


def exposure_warning(settings: Settings) -> str | None:
    """What to tell the operator of a server others can reach without a key (None: nothing)."""
    if is_loopback(settings.host) or settings.api_key is not None:
        return None
    return (f"listening on {settings.host} without an API key: anyone who can reach port "
            f"{settings.port} can use the model; set --api-key (or COLIBRI_API_KEY)")


def _host_name(value: bytes) -> str:
    """The name of a Host header, without its port: `[::1]:8000` -> `::1`."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0].rstrip(".") if text.count(":") == 1 else text.rstrip(".")


class GuardMiddleware:
    """Limits, authentication and per-endpoint request counting."""

    def __init__(self, app: ASGIApp, settings: Settings, metrics: Metrics,
                 known_paths: Callable[[], set[str]]) -> None:
        self.app = app
        self._known_paths = known_paths
        self.settings = settings
        self.metrics = metrics
        self._hosts = host_names(settings)
        key = settings.api_key.get_secret_value() if settings.api_key else ""
        self._key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_box = [0]

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = int(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted)
        except Exception as exc:  # noqa: BLE001 - one request's fault is its own 500
            log.error("internal error on %s %s", scope["method"], scope["path"], exc_info=exc)
            if status_box[0] == 0:
                await _reply(send_counted, 500,
                             "The server had an error while processing the request.")
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None)
            if endpoint is None:  # refused before routing: name it only if it is a route
                endpoint = scope["path"] if scope["path"] in self._known_paths() else "unmatched"
            self.metrics.count_request(endpoint, status_box[0])

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        # the request line counts too: a 70 KB query string is as large a head as a header
        head = (len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
                + sum(len(k) + len(v) + 4 for k, v in headers))
        path: str = scope["path"]
        if head > self.settings.max_header_bytes:
            await _reply(send, 431, "Request header fields too large.", path=path)
            return
        if self._hosts is not None:
            raw = next((v for k, v in headers if k == b"host"), None)
            name = None if raw is None else _host_name(raw)
            if name is not None and name not in self._hosts:
                await _reply(send, 421, f"This server does not answer to the host name "
                             f"{name!r}; its operator can allow it with --allowed-hosts.",
                             code="host_not_allowed", path=path)
                return
        if (self._key is not None and scope["method"] != "OPTIONS"
                and path.startswith(PROTECTED) and not self._authorized(headers)):
            await _reply(send, 401, "Incorrect API key provided. Send it as "
                         "'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                         code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")],
                         path=path)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            limit = self.settings.max_body_bytes
            length = _content_length(headers)
            if length is not None and length > limit:
                await _reply(send, 413, f"The request body exceeds {limit} bytes.", path=path)
                return
            try:
                async with asyncio.timeout(self.settings.body_timeout_s):
                    body = await _read_body(receive, limit)
            except TimeoutError:
                await _reply(send, 408, "The request body did not arrive within "
                             f"{self.settings.body_timeout_s:g} s.",
                             extra=[(b"connection", b"close")], path=path)
                return
            if body is None:
                await _reply(send, 413, f"The request body exceeds {limit} bytes.", path=path)
                return
            receive = replay_body(body, receive)
        await self.app(scope, receive, send)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A Bearer token or an x-api-key header (Anthropic's clients send the key there)
        equal to the key; either one may be right when a client sends both."""
        assert self._key is not None
        given: list[bytes] = []
        for k, v in headers:
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                if scheme.lower() == b"bearer":
                    given.append(token.strip())
            elif k == b"x-api-key":
                given.append(v.strip())
        # hashing first makes the comparison constant-time in the length too; the key is
        # never logged
        want = hashlib.sha256(self._key).digest()
        ok = False
        for g in given or [b""]:
            ok |= hmac.compare_digest(hashlib.sha256(g).digest(), want)
        return ok


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for k, v in headers:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes limit bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # client gone: hand the app an empty body
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """receive, with body (already read) handed out first as one message."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send: Send, status: int, message: str, code: str | None = None,
                 extra: list[tuple[bytes, bytes]] | None = None, path: str = "") -> None:
    body = error_bytes(status, message, None, code, path)
    headers: list[Any] = [(b"content-type", b"application/json"),
                          (b"content-length", str(len(body)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
