"""The Ray Serve request router of the replica deployment: prefix-aware (prefix.choose) or
round-robin, by the `replica_routing` option.

Ray Serve calls choose_replicas on the handle's own event loop for each request the ingress
sends; the ingress passes the prompt's chunk hashes as the `route` keyword argument
(`RouteInfo`). Loads are the requests this router has in flight on each replica. A request
pinned to a replica (`RouteInfo.replica`, from the `x-colibri-replica` request header) goes
there or nowhere.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

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
        self._inflight: dict[str, int] = {}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        self._table.keep_only(alive)
        self._inflight = {k: v for k, v in self._inflight.items() if k in alive}

    def on_send_request(self, replica_id: Any) -> None:
        super().on_send_request(replica_id)
        self._inflight[replica_id.unique_id] = self._inflight.get(replica_id.unique_id, 0) + 1

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        n = self._inflight.get(replica_id.unique_id, 0)
        self._inflight[replica_id.unique_id] = max(0, n - 1)

    def _loads(self, candidates: list[RunningReplica]) -> dict[str, int]:
        """Requests running and queued on each replica: what this router sent there and has
        not seen finish, counted at once so requests arriving together spread out. (Ray
        Serve's own queue-length cache lags by up to its timeout: a replica that has just
        finished a burst would look busy.) The one ingress sends every request, so this is
        each replica's whole load."""
        return {r.replica_id.unique_id: self._inflight.get(r.replica_id.unique_id, 0)
                for r in candidates}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        route = route_of(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if route.replica is not None:
            return [[by_id[route.replica]]] if route.replica in by_id else []
        if not by_id:
            return []
        if self._policy == "round_robin":
            ids = sorted(by_id)
            start = next(self._turn) % len(ids)
            return [[by_id[i]] for i in ids[start:] + ids[:start]]
        # replicas known to be full wait behind the others (the base class probes them)
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        available = random.sample(available, len(available))
        order = choose(route.hashes, self._loads(available), self._table)
        if order and route.hashes:
            # the first is taken unless it filled up since its queue length was read: what
            # it is about to cache is remembered now (Ray Serve reports the routed replica
            # only under its strict queue-length protocol)
            self._table.record(order[0], route.hashes)
        rest = [r for r in by_id if r not in order]
        return [[by_id[i]] for i in order] + ([[by_id[i] for i in rest]] if rest else [])
