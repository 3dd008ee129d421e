"""`colibri serve --replicas N`: start (or join) a Ray cluster, run the application of
`deployments` on it behind Ray Serve's proxy on --host/--port, and stop it on SIGTERM.

A local cluster is started with this machine's CPUs (at least what the replicas declare), a
small object store and no dashboard, and goes away with the server; on a cluster named by
--ray-address only this application is deleted. SIGTERM or SIGINT drains: the ingress refuses
new requests (503), Ray Serve waits for those running on each replica (up to
--drain-timeout-s) before stopping its engine, then the process exits 0.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
from typing import Any

from colibri.app.settings import Settings

log = logging.getLogger("colibri.app")

OBJECT_STORE_BYTES = 100 << 20  # requests and replies only: nothing large goes through it
_SERVE_DEADLINES = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.5",
                    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5"}


def port_outside_ray() -> int:
    """A free loopback port between 20000 and 30000: above Ray's worker ports (10002-19999)
    and below the range the kernel hands out for port 0, where a starting Ray cluster takes
    its own ports after this one was found free."""
    for _ in range(200):
        port = random.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 30000")


def wants_replicas(settings: Settings) -> bool:
    """Whether `colibri serve` runs replicas on Ray Serve rather than one server."""
    return settings.replicas > 1 or settings.max_replicas is not None \
        or settings.ray_address is not None


def check_replica_counts(settings: Settings) -> None:
    """ValueError (one line) unless min_replicas <= replicas <= max_replicas."""
    low = settings.min_replicas or 1
    high = settings.max_replicas if settings.max_replicas is not None else settings.replicas
    if settings.min_replicas is not None and settings.max_replicas is None:
        raise ValueError("--min-replicas needs --max-replicas (scaling on queue depth)")
    if not low <= settings.replicas <= high:
        raise ValueError(f"--replicas {settings.replicas} must lie between --min-replicas "
                         f"{low} and --max-replicas {high}")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'colibri[replicas]'") from None
    return ray


def start_ray(settings: Settings, cpus_needed: int) -> bool:
    """Connect to --ray-address, or start a local cluster; True when it is ours to stop."""
    ray = _import_ray()
    if settings.ray_address is not None:
        ray.init(address=settings.ray_address, logging_level=logging.WARNING,
                 namespace="colibri")
        return False
    # Ray Serve asks a replica for its queue length before each request and gives up on an
    # answer after 0.1 s (1 s after retries): on a machine whose cores the replicas keep busy
    # that sends requests round in retries, so the local cluster waits longer
    for name, value in _SERVE_DEADLINES.items():
        os.environ.setdefault(name, value)
    cpus = max(os.cpu_count() or 1, cpus_needed)
    if cpus_needed > (os.cpu_count() or 1):
        log.warning("the replicas ask for %d CPUs on a machine with %d: they will share them",
                    cpus_needed, os.cpu_count() or 1)
    ray.init(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             logging_level=logging.WARNING, namespace="colibri")
    return True


def serve_replicas(settings: Settings) -> int:
    """Run the replicas until SIGTERM/SIGINT; the process exit code."""
    check_replica_counts(settings)
    from colibri.app.replicas import deployments

    ray = _import_ray()
    from ray import serve

    most = settings.max_replicas or settings.replicas
    stop = threading.Event()
    own = start_ray(settings, most * deployments.threads_per_replica(settings))
    # after ray.init, which installs a SIGTERM handler of its own that aborts the process
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port},
                    proxy_location="HeadOnly")
        app = deployments.build_application(settings)
        try:
            handle = serve.run(app, name=deployments.APP_NAME, route_prefix="/")
        except RuntimeError as e:  # a replica that cannot start: its log has the cause
            log.error("the replicas did not start: %s", e)
            return 1
        if not stop.is_set():
            log.info("%d replica(s) ready behind http://%s:%d", settings.replicas,
                     settings.host, settings.port)
        stop.wait()
        log.info("draining the replicas (up to %gs)", settings.drain_timeout_s)
        handle.drain.remote().result(timeout_s=30)
        serve.delete(deployments.APP_NAME)
        return 0
    finally:
        if own:
            serve.shutdown()
        ray.shutdown()
