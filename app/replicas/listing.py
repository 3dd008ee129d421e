"""GET /v1/replicas: each running replica as Ray Serve's controller lists it, with the health
and queue it reports itself, and the requests the endpoint's router has in flight there.

A replica that does not answer in time (starting, too busy, or gone since it was listed) is
shown with what is known of it: the controller's fields, `health: "pending"`, and the counts
of its last answer with their age, or no counts when it has never answered. No Ray here.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

ASK_TIMEOUT_S = 5.0  # how long the listing waits for a replica's own answer
REPORTED = ("health", "running", "waiting")  # what a replica says of itself
PENDING = "pending"


class LoadCounter(Protocol):
    def loads(self) -> dict[str, int]: ...


# Ray Serve builds the replicas' request router in the ingress's process from a copy of
# router.py, so the ingress cannot reach it through that module: the router registers here.
_routers: dict[str, weakref.ReferenceType[LoadCounter]] = {}


def router_key(app: str, deployment: str) -> str:
    return f"{app}/{deployment}"


def register_router(key: str, router: LoadCounter) -> None:
    """The request router of deployment key (router_key) in this process, the latest one."""
    _routers[key] = weakref.ref(router)


def routed(key: str) -> dict[str, int]:
    """Requests in flight on each replica of deployment key, as this process's router counts
    them (empty before it has routed anything)."""
    ref = _routers.get(key)
    router = ref() if ref is not None else None
    return router.loads() if router is not None else {}


class ReplicaReports:
    """The last answer of each listed replica, for the next listing."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}  # id -> (when, answer)

    def listing(self, listed: list[dict[str, Any]], answers: list[dict[str, Any] | None],
                now: float, in_flight: Mapping[str, int] | None = None,
                ) -> list[dict[str, Any]]:
        """One entry per listed replica (its answer None: it did not answer in time); now is
        a monotonic clock's reading; in_flight, the router's count of requests on each
        replica, is shown as `routed`. Replicas no longer listed are forgotten."""
        self._last = {r["id"]: self._last[r["id"]] for r in listed if r["id"] in self._last}
        out = []
        for replica, answer in zip(listed, answers, strict=True):
            if in_flight is not None:
                replica = {**replica, "routed": in_flight.get(replica["id"], 0)}
            if answer is not None:
                reported = {k: answer[k] for k in REPORTED}
                self._last[replica["id"]] = (now, reported)
                out.append({**replica, **reported})
                continue
            entry = {**replica, "health": PENDING}
            if replica["id"] in self._last:
                when, last = self._last[replica["id"]]
                entry.update(running=last["running"], waiting=last["waiting"],
                             reported_s_ago=round(now - when, 1))
            out.append(entry)
        return out
