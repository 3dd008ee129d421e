"""The Ray Serve request router of the replica deployment: prefix-aware (prefix.choose) or
round-robin, by the `replica_routing` option.

Ray Serve calls choose_replicas on the handle's own event loop for each request the ingress
sends; the ingress passes the prompt's chunk hashes as the `route` keyword argument
(`RouteInfo`). Loads are the requests this router has in flight on each replica, counted from
the moment it picks the replica, so requests arriving together spread out. A request pinned
to a replica (`RouteInfo.replica`, from the `x-colibri-replica` request header) goes there or
nowhere.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from colibri.app.replicas import listing
from colibri.app.replicas.prefix import PrefixTable, RoutingConfig, choose

ROUTING_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class RouteInfo:
    """What the ingress tells the router about one request."""

    hashes: list[bytes] = field(default_factory=list)  # prefix.chunk_hashes of its prompt
    replica: str | None = None  # pinned to this replica id


def route_of(pending: PendingRequest | None) -> RouteInfo:
    """The RouteInfo the ingress passed with a request (empty when none). Read by attribute:
    Ray Serve may run this module as a copy shipped by value, whose RouteInfo is another
    class than the ingress's."""
    info = pending.kwargs.get("route") if pending is not None else None
    replica = getattr(info, "replica", None)
    return RouteInfo(hashes=list(getattr(info, "hashes", None) or []),
                     replica=replica if isinstance(replica, str) else None)


class ColibriRouter(RequestRouter):
    """Prefix-aware or round-robin choice among the running replicas."""

    def initialize_state(self, policy: str = "prefix", **config: Any) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")
        self._policy = policy
        self._table = PrefixTable(RoutingConfig(**config))
        self._turn = itertools.count()
        # Ray Serve pairs each on_send_request with one on_request_completed, whether the
        # request finishes, fails, is cancelled or its replica dies (the completion callback
        # of its result). But it picks a replica for every request waiting to be routed
        # before it sends any (a routing task goes on to the next request without yielding),
        # and may first probe the picked replica's queue length (up to
        # RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S): counted only once sent, a burst would
        # all go to whichever replica looked idlest when it came. So a request counts from
        # the pick: as chosen until its routing future is done, then as sent.
        self._sent: dict[str, int] = {}
        self._chosen: dict[asyncio.Future[Any], str] = {}  # routing future -> replica picked
        self._lock = threading.Lock()  # loads() is also read from the ingress's own thread
        listing.register_router(_key(self._deployment_id), self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        self._table.keep_only(alive)
        with self._lock:
            self._sent = {k: v for k, v in self._sent.items() if k in alive}

    def on_send_request(self, replica_id: Any) -> None:
        super().on_send_request(replica_id)
        with self._lock:
            self._sent[replica_id.unique_id] = self._sent.get(replica_id.unique_id, 0) + 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        with self._lock:
            n = self._sent.get(replica_id.unique_id, 0)
            if n > 0:  # Ray Serve also reports a request it failed to send
                self._sent[replica_id.unique_id] = n - 1

    def loads(self) -> dict[str, int]:
        """Requests on each replica (running or queued there, or on their way): those this
        router has picked it for and not seen finish. The one ingress sends every request,
        so this is each replica's whole load. (Ray Serve's own queue-length cache lags by up
        to its timeout: a replica that has just finished a burst would look busy.)"""
        with self._lock:
            out = Counter(self._chosen.values())
            out.update(self._sent)
        return dict(out)

    def _hold(self, pending: PendingRequest | None, replica: str) -> None:
        """Count pending as chosen for replica until its routing future is done. Ray Serve
        resumes the request's task, which sends it (on_send_request), before this future's
        own callbacks run, so the request is never out of the count in between."""
        if pending is None or pending.future.done():
            return
        future = pending.future
        with self._lock:
            first = future not in self._chosen
            self._chosen[future] = replica
        if first:
            future.add_done_callback(self._release)

    def _release(self, future: asyncio.Future[Any]) -> None:
        with self._lock:
            self._chosen.pop(future, None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        if pending_request is not None:
            # every replica is a candidate on every pass (as in Ray Serve's own routers once
            # they have tried the local ones): a pass that routes nothing waits before the next
            # instead of routing again at once, without yielding its event loop
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if route.replica is not None:
            if route.replica not in by_id:
                return []
            self._hold(pending_request, route.replica)
            return [[by_id[route.replica]]]
        if not by_id:
            return []
        if self._policy == "round_robin":
            ids = sorted(by_id)
            start = next(self._turn) % len(ids)
            order = ids[start:] + ids[:start]
            self._hold(pending_request, order[0])
            return [[by_id[i]] for i in order]
        # replicas known to be full wait behind the others (the base class probes them)
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        available = random.sample(available, len(available))
        loads = self.loads()
        order = choose(route.hashes, {r.replica_id.unique_id: loads.get(r.replica_id.unique_id, 0)
                                      for r in available}, self._table)
        if order:
            self._hold(pending_request, order[0])
            if route.hashes:
                # the first is taken unless it filled up since its queue length was read:
                # what it is about to cache is remembered now (Ray Serve reports the routed
                # replica only under its strict queue-length protocol)
                self._table.record(order[0], route.hashes)
        rest = [r for r in by_id if r not in order]
        return [[by_id[i]] for i in order] + ([[by_id[i] for i in rest]] if rest else [])


def _key(deployment_id: Any) -> str:
    return listing.router_key(deployment_id.app_name, deployment_id.name)
