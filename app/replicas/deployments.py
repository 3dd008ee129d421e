"""The Ray Serve application: one ingress in front of N replicas, each a whole Colibri server.

`ColibriReplica` runs the very app `colibri serve` runs (app.server.create_app: every route,
the guard, streaming), its own engine, KV cache and expert cache, and answers HTTP requests
relayed to it as ASGI messages. `ColibriIngress` is the endpoint Ray Serve's proxy calls: it
reads the body (Ray's proxy routes before a body arrives, so a router behind the proxy never
sees a prompt), hands the prompt's chunk hashes to the replicas' request router
(router.ColibriRouter) and relays the reply. A reply names its replica in `x-colibri-replica`;
`GET /v1/replicas` lists the replicas; a request with an `x-colibri-replica` header goes to
that replica (its /metrics, for one). A replica that dies mid-request ends that request with
an error in its API's shape; a request it had not started answering is sent to another.

`build(args)` is the import path for Ray's own tools: `serve run
colibri.app.replicas.deployments:build model=/models/my-moe replicas=2`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.types import Message, Receive, Scope, Send

from colibri.app.errors import anthropic_error_body, anthropic_path, error_body, error_bytes
from colibri.app.metrics import Metrics
from colibri.app.middleware import GuardMiddleware, replay_body
from colibri.app.replicas.listing import ASK_TIMEOUT_S, ReplicaReports, routed, router_key
from colibri.app.replicas.prefix import RoutingConfig, chunk_hashes, prompt_text
from colibri.app.replicas.router import RouteInfo
from colibri.app.server import create_app
from colibri.app.settings import Settings

log = logging.getLogger("colibri.app")

REPLICA_HEADER = "x-colibri-replica"
APP_NAME = "colibri"
REPLICA_DEPLOYMENT = "ColibriReplica"
REPLICAS_PATH = "/v1/replicas"
_ROUTER = "colibri.app.replicas.router:ColibriRouter"
_TRIES = 3  # a request no replica has begun to answer is sent this many times at most
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
               "query_string", "root_path", "headers", "client", "server")


def settings_values(settings: Settings) -> dict[str, Any]:
    """settings as plain values (the API key readable) to rebuild them in a replica."""
    values = settings.model_dump()
    if settings.api_key is not None:
        values["api_key"] = settings.api_key.get_secret_value()
    return values


def replica_settings(values: dict[str, Any]) -> Settings:
    """The settings a replica runs with: exactly values, whatever its environment holds."""
    return Settings(_env_file=None, **values)  # type: ignore[call-arg]


def threads_per_replica(settings: Settings) -> int:
    """--threads, else an equal share of this machine's cores among the most replicas."""
    if settings.threads is not None:
        return settings.threads
    most = settings.max_replicas or settings.replicas
    return max(1, (os.cpu_count() or 1) // most)


class ColibriReplica:
    """One whole server: the app of `colibri serve` with its engine, driven by the ingress."""

    async def __init__(self, values: dict[str, Any]) -> None:
        settings = replica_settings(values)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.app = create_app(settings)
        self.state = self.app.state.colibri
        self.id = serve.get_replica_context().replica_id.unique_id
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        # not ready (so no request is routed here) until the model is loaded; a model that
        # cannot load fails the replica, and Ray Serve tries a new one
        while (health := self.state.engine.health()) == "loading":
            await asyncio.sleep(0.1)
        if health != "ready":
            raise RuntimeError(f"replica {self.id}: the model did not load ({health})")
        log.info("replica %s ready (pid %d)", self.id, os.getpid())

    async def handle(self, head: dict[str, Any], body: bytes,
                     route: RouteInfo | None = None) -> AsyncIterator[list[Message]]:
        """Serve one HTTP request (head: its ASGI scope without the server's own objects):
        the ASGI messages of the reply, in batches. `route` is read by the router only."""
        out: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()

        async def disconnect() -> Message:
            await gone.wait()  # the client left (this generator was cancelled) or we are done
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((REPLICA_HEADER.encode(), self.id.encode()))
                message = {**message, "headers": headers}
            await out.put(message)

        task = asyncio.create_task(self.app(dict(head), replay_body(body, disconnect), send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                done = None in batch
                messages = [m for m in batch if m is not None]
                if messages:
                    yield messages
                if done or _ends_reply(messages):
                    break
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 5.0)
            if not task.done():
                task.cancel()
            with contextlib.suppress(BaseException):
                await task

    async def info(self, route: RouteInfo | None = None) -> dict[str, Any]:
        """This replica for GET /v1/replicas."""
        stats = self.state.engine.stats()
        return {"id": self.id, "pid": os.getpid(), "health": self.state.engine.health(),
                "running": int(stats.get("running", 0)), "waiting": int(stats.get("waiting", 0))}

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine failed or whose weights went bad."""
        health = self.state.engine.health()
        if health in ("failed", "faulty"):
            raise RuntimeError(f"replica {self.id}: the engine is {health}")

    async def __del__(self) -> None:
        # Ray Serve calls this once the requests on this replica have finished (or its
        # graceful shutdown time ran out): stop the engine as the single server does
        self.state.draining = True
        await self._lifespan.__aexit__(None, None, None)


def running_replicas(app: str) -> list[dict[str, Any]]:
    """app's replicas that Ray Serve's controller has running: id, pid, node."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    # the controller's instance details follow the public schema (ray.serve.schema
    # ServeInstanceDetails) that `serve status` and the dashboard read
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=10)
    deployment = details["applications"][app]["deployments"][REPLICA_DEPLOYMENT]
    return [{"id": r["replica_id"], "pid": r.get("pid"), "node": r.get("node_ip"),
             "node_id": r.get("node_id")}
            for r in deployment["replicas"] if r["state"] == "RUNNING"]


def _ends_reply(messages: list[Message]) -> bool:
    last = messages[-1] if messages else None
    return (last is not None and last["type"] == "http.response.body"
            and not last.get("more_body", False))


class ColibriIngress:
    """The endpoint: relays each HTTP request to a replica chosen by the request router."""

    def __init__(self, replicas: DeploymentHandle, values: dict[str, Any],
                 chunk_chars: int = RoutingConfig.chunk_chars) -> None:
        self.settings = replica_settings(values)
        self.replicas = replicas
        self.stream = replicas.options(stream=True)
        self.chunk_chars = chunk_chars
        self.draining = False
        self.reports = ReplicaReports()
        # the replicas' list sits behind the same guard as every route (API key, Host, limits)
        self._listing = GuardMiddleware(self._replicas, settings=self.settings,
                                        metrics=Metrics(), known_paths=lambda: {REPLICAS_PATH})

    def __serve_build_asgi_app__(self) -> Any:
        return _Asgi(self)

    async def drain(self) -> None:
        """Refuse new requests from now on (503, Retry-After); those running go on."""
        self.draining = True

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if self.draining:
            await _error(send, 503, "Service unavailable: the server is shutting down.", path,
                         self.settings.retry_after_s, "server_shutting_down")
            return
        if path == REPLICAS_PATH and scope["method"] == "GET":
            await self._listing(scope, receive, send)
            return
        body = await _read_body(receive, self.settings.max_body_bytes)
        route = self._route(scope, body)
        if route.replica is not None and not await self._is_running(route.replica):
            await _error(send, 404, f"No replica {route.replica!r} is running; GET "
                         f"{REPLICAS_PATH} lists them.", path, code="replica_not_found")
            return
        await self._relay(scope, body, route, send)

    async def _is_running(self, replica: str) -> bool:
        app = serve.get_replica_context().app_name
        return any(r["id"] == replica for r in await asyncio.to_thread(running_replicas, app))

    def _route(self, scope: Scope, body: bytes) -> RouteInfo:
        pinned = _header(scope, REPLICA_HEADER)
        if pinned:
            return RouteInfo(replica=pinned)
        if scope["method"] != "POST" or not body:
            return RouteInfo()
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return RouteInfo()  # the replica answers the 400
        if not isinstance(request, dict):
            return RouteInfo()
        return RouteInfo(hashes=chunk_hashes(prompt_text(request), self.chunk_chars))

    async def _relay(self, scope: Scope, body: bytes, route: RouteInfo, send: Send) -> None:
        head = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        path = scope["path"]
        started = False
        streaming = False
        for attempt in range(1 if route.replica else _TRIES):
            try:
                async for messages in self.stream.handle.remote(head, body, route=route):
                    for message in messages:
                        if message["type"] == "http.response.start":
                            started = True
                            streaming = b"text/event-stream" in dict(
                                message.get("headers", [])).get(b"content-type", b"")
                        await send(message)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a replica gone mid-request
                if started:
                    log.warning("the replica serving %s stopped mid-reply: %s", path, exc)
                    await _cut(send, path, streaming, self.settings.retry_after_s)
                    return
                log.warning("replica failed before answering %s (try %d of %d): %s", path,
                            attempt + 1, _TRIES, exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        await _error(send, 503, "Service unavailable: no replica could serve the request.",
                     path, self.settings.retry_after_s)

    async def _replicas(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = serve.get_replica_context().app_name
        # the list comes from Ray Serve's controller; health and queue from each replica
        listed = await asyncio.to_thread(running_replicas, app)
        # read before asking, so the listing's own questions are not counted
        in_flight = routed(router_key(app, REPLICA_DEPLOYMENT))

        async def ask(replica: dict[str, Any]) -> dict[str, Any] | None:
            try:
                return dict(await asyncio.wait_for(
                    self.replicas.info.remote(route=RouteInfo(replica=replica["id"])),
                    ASK_TIMEOUT_S))
            except Exception as exc:  # noqa: BLE001 - listed as pending
                log.info("replica %s did not answer: %s", replica["id"], exc)
                return None

        # one at a time: Ray Serve hands a routed replica to the waiting call that carries
        # the request id of the one routed, and every call made while serving this request
        # carries its id, so two pinned calls in flight together can swap replicas, the
        # other being routed again and again while its caller waits
        answers = [await ask(replica) for replica in listed]
        found = self.reports.listing(listed, answers, time.monotonic(), in_flight)
        body = json.dumps({"object": "list", "data": found}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _Asgi:
    """The ingress as an ASGI 3 application object (what Ray Serve's uvicorn runner wants)."""

    def __init__(self, ingress: ColibriIngress) -> None:
        self.ingress = ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.ingress.asgi(scope, receive, send)


def _header(scope: Scope, name: str) -> str | None:
    key = name.encode()
    for k, v in scope.get("headers", []):
        if k == key:
            return bytes(v).decode("latin-1").strip() or None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The body, up to one byte past limit: the replica's guard answers 413 beyond it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > limit or not message.get("more_body", False):
            break
    return b"".join(chunks)[:limit + 1]


async def _error(send: Send, status: int, message: str, path: str, retry_after: int = 0,
                 code: str | None = None) -> None:
    body = error_bytes(status, message, None, code, path)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _cut(send: Send, path: str, streaming: bool, retry_after: int) -> None:
    """End a reply whose replica died: a stream gets its API's error event (and [DONE] on
    OpenAI's paths), as when the drain timeout cuts it; any other body just ends."""
    message = "The replica serving this request stopped; send the request again."
    if not streaming:
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if anthropic_path(path):
        data = json.dumps(anthropic_error_body(503, message))
        text = f"event: error\r\ndata: {data}\r\n\r\n"
    else:
        data = json.dumps(error_body(503, message, None, "replica_failed"))
        text = f"data: {data}\r\n\r\ndata: [DONE]\r\n\r\n"
    await send({"type": "http.response.body", "body": text.encode(), "more_body": False})


def build_application(settings: Settings) -> Any:
    """The Ray Serve application for settings (replicas, autoscaling, resources, routing)."""
    values = settings_values(settings)
    threads = threads_per_replica(settings)
    values["threads"] = threads
    env = {k: v for k, v in os.environ.items() if k.startswith("COLIBRI_")}
    actor: dict[str, Any] = {"num_cpus": threads, "runtime_env": {"env_vars": env}}
    if settings.replica_gpus:
        actor["num_gpus"] = settings.replica_gpus
    scale: dict[str, Any] = {"num_replicas": settings.replicas}
    if settings.max_replicas is not None:
        # on queue depth: more replicas when requests wait beyond a full batch on each
        scale = {"autoscaling_config": AutoscalingConfig(
            min_replicas=settings.min_replicas or 1, max_replicas=settings.max_replicas,
            initial_replicas=settings.replicas,
            target_ongoing_requests=settings.max_num_seqs)}
    replica = serve.deployment(
        ColibriReplica, name=REPLICA_DEPLOYMENT,
        ray_actor_options=actor,
        # a running batch and its queue; more wait in the ingress's router
        max_ongoing_requests=settings.max_num_seqs + settings.max_queue + 4,
        request_router_config=RequestRouterConfig(
            request_router_class=_ROUTER,
            request_router_kwargs={"policy": settings.replica_routing}),
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 5.0,
        **scale)
    ingress = serve.deployment(
        serve.ingress()(ColibriIngress), name="ColibriIngress", num_replicas=1,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
        max_ongoing_requests=settings.max_connections,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 10.0)
    return ingress.bind(replica.bind(values), values)


def build(args: dict[str, str]) -> Any:
    """For `serve run colibri.app.replicas.deployments:build KEY=VALUE ...` and `serve
    deploy` configs: the options of `colibri serve` by their setting names (model=...,
    replicas=2), over the COLIBRI_* variables."""
    return build_application(Settings(**args))  # type: ignore[arg-type]
