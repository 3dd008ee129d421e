"""The replicas' routing decision (app/replicas/prefix.py) without Ray: prompt texts in
rendering order, chained chunk hashes, and which replica a request goes to; what
GET /v1/replicas shows of a replica that has not answered (app/replicas/listing.py); and,
with Ray imported but no cluster, the request router (app/replicas/router.py) driven by Ray
Serve's own routing loop over fake replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import pytest

from colibri.app.replicas.listing import (
    PENDING,
    ReplicaReports,
    register_router,
    routed,
    router_key,
)
from colibri.app.replicas.prefix import (
    PrefixTable,
    RoutingConfig,
    choose,
    chunk_hashes,
    prompt_text,
)

SYSTEM = "You are a careful assistant who answers in the voice of a Shakespearean actor. " * 4


def _chat(*turns: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, "max_tokens": 16}


def test_a_next_turn_starts_with_the_previous_turn() -> None:
    first = prompt_text(_chat("Good morrow!"))
    second = prompt_text(_chat("Good morrow!", "And to you, sir.", "What news?"))
    assert second.startswith(first)
    # sampling fields and the model name are not part of the prompt
    other = {**_chat("Good morrow!"), "temperature": 0.3, "model": "x"}
    assert prompt_text(other) == first


def test_prompt_text_of_each_api() -> None:
    assert prompt_text({"prompt": "ROMEO.\n"}) == "ROMEO.\n\x1e"
    assert prompt_text({"prompt": ["a", "b"]}) == "a\x1eb\x1e"
    responses = prompt_text({"instructions": "Be brief.", "input": "hi"})
    assert responses.index("Be brief.") < responses.index("hi")
    anthropic = prompt_text({"system": "sys", "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.startswith("sys\x1e")
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prompt_text({"tools": tools, "messages": [{"role": "user", "content": "x"}]})
    assert with_tools.startswith(json.dumps(tools, sort_keys=True))
    assert prompt_text({"max_tokens": 3}) == ""


def test_chunk_hashes_are_equal_exactly_over_a_shared_start() -> None:
    a = chunk_hashes("x" * 64 + "y" * 64 + "z" * 10, 64)
    b = chunk_hashes("x" * 64 + "q" * 64, 64)
    assert len(a) == 2 and len(b) == 2  # partial chunks are left out
    assert a[0] == b[0] and a[1] != b[1]
    # chained: the same second chunk after a different first one hashes differently
    c = chunk_hashes("w" * 64 + "y" * 64, 64)
    assert c[1] != a[1]
    assert chunk_hashes("short", 64) == []


def _table(**kw: int) -> PrefixTable:
    return PrefixTable(RoutingConfig(**kw))


def test_the_next_turn_goes_where_the_conversation_was() -> None:
    table = _table()
    first = chunk_hashes(prompt_text(_chat("Good morrow!")), 64)
    order = choose(first, {"a": 0, "b": 0}, table)
    table.record(order[0], first)
    nxt = chunk_hashes(prompt_text(_chat("Good morrow!", "Hail.", "What news?")), 64)
    # even when the other replica is a little less loaded
    loads = {"a": 1, "b": 0} if order[0] == "a" else {"a": 0, "b": 1}
    assert choose(nxt, loads, table)[0] == order[0]


def test_a_much_busier_replica_loses_its_prefix() -> None:
    table = _table(max_imbalance=4)
    h = chunk_hashes(SYSTEM, 64)
    table.record("a", h)
    assert choose(h, {"a": 4, "b": 0}, table) == ["a", "b"]
    assert choose(h, {"a": 5, "b": 0}, table) == ["b", "a"]


def test_without_a_long_enough_match_the_least_loaded_goes_first() -> None:
    table = _table(min_match_chunks=2)
    h = chunk_hashes(SYSTEM, 64)
    table.record("a", h[:1])  # one shared chunk: too short to count
    assert choose(h, {"a": 0, "b": 0, "c": 2}, table)[0] == "a"  # ties keep the given order
    assert choose(h, {"b": 0, "a": 0, "c": 2}, table) == ["b", "a", "c"]
    assert choose(h, {"a": 3, "b": 1, "c": 2}, table) == ["b", "c", "a"]
    assert choose([], {"a": 3, "b": 1}, table) == ["b", "a"]
    assert choose(h, {}, table) == []


def test_the_longest_match_wins() -> None:
    table = _table()
    h = chunk_hashes(SYSTEM + "tail" * 40, 64)
    table.record("a", h[:3])
    table.record("b", h[:6])
    assert choose(h, {"a": 0, "b": 2}, table)[0] == "b"


def test_the_table_is_bounded_and_forgets_gone_replicas() -> None:
    table = _table(max_entries=8)
    old = chunk_hashes("o" * 64 * 8, 64)
    new = chunk_hashes("n" * 64 * 8, 64)
    table.record("a", old)
    table.record("a", new)  # evicts the least recently used: all of old
    assert table.match("a", old) == 0 and table.match("a", new) == 8
    table.keep_only(["b"])
    assert table.match("a", new) == 0


def test_replica_counts_are_checked_before_ray_starts() -> None:
    from colibri.app.replicas.launch import check_replica_counts, wants_replicas
    from colibri.app.settings import Settings

    def settings(**kw: object) -> Settings:
        return Settings(_env_file=None, **kw)  # type: ignore[call-arg, arg-type]

    assert not wants_replicas(settings())
    assert wants_replicas(settings(replicas=2))
    assert wants_replicas(settings(max_replicas=3))
    check_replica_counts(settings(replicas=2, min_replicas=1, max_replicas=4))
    with pytest.raises(ValueError, match="--min-replicas needs --max-replicas"):
        check_replica_counts(settings(replicas=2, min_replicas=2))
    with pytest.raises(ValueError, match="between --min-replicas 1 and --max-replicas 2"):
        check_replica_counts(settings(replicas=3, max_replicas=2))
    with pytest.raises(ValueError, match="replica_routing"):
        settings(replica_routing="random")


def _listed(*ids: str) -> list[dict]:
    return [{"id": i, "pid": 100 + n, "node": "10.0.0.5", "node_id": "02b7"}
            for n, i in enumerate(ids)]


def test_a_replica_that_has_not_answered_is_pending_with_what_is_known() -> None:
    reports = ReplicaReports()
    first = reports.listing(_listed("a", "b"), [
        {"id": "a", "pid": 100, "health": "ready", "running": 3, "waiting": 1}, None], 10.0)
    # one that answered: the controller's fields and its own report
    assert first[0] == {"id": "a", "pid": 100, "node": "10.0.0.5", "node_id": "02b7",
                        "health": "ready", "running": 3, "waiting": 1}
    # one that has never answered: what the controller knows, pending, and no counts at all
    assert first[1] == {"id": "b", "pid": 101, "node": "10.0.0.5", "node_id": "02b7",
                        "health": PENDING}
    assert None not in [v for e in first for v in e.values()]
    # silent now: pending, with its last counts and how old they are
    later = reports.listing(_listed("a", "b"), [None, None], 16.44)
    assert later[0] == {"id": "a", "pid": 100, "node": "10.0.0.5", "node_id": "02b7",
                        "health": PENDING, "running": 3, "waiting": 1, "reported_s_ago": 6.4}
    assert later[1]["health"] == PENDING and "running" not in later[1]
    # answering again replaces the last report; its health is its own again
    again = reports.listing(_listed("a", "b"), [
        {"health": "draining", "running": 0, "waiting": 0},
        {"health": "ready", "running": 2, "waiting": 0}], 20.0)
    assert [(e["health"], e["running"]) for e in again] == [("draining", 0), ("ready", 2)]
    assert not any("reported_s_ago" in e for e in again)


def test_a_replica_no_longer_listed_is_forgotten() -> None:
    reports = ReplicaReports()
    reports.listing(_listed("a"), [{"health": "ready", "running": 5, "waiting": 0}], 1.0)
    assert reports.listing(_listed("c"), [None], 2.0) == [
        {"id": "c", "pid": 100, "node": "10.0.0.5", "node_id": "02b7", "health": PENDING}]
    # listed again under the same id: nothing of its earlier reports is shown
    assert "running" not in reports.listing(_listed("a"), [None], 3.0)[0]


class _Counts:
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def loads(self) -> dict[str, int]:
        return dict(self.counts)


def test_the_listing_shows_what_the_router_has_in_flight_on_each_replica() -> None:
    key = router_key("app-under-test", "ColibriReplica")
    assert routed(key) == {}  # no router in this process yet
    counts = _Counts({"a": 2})
    register_router(key, counts)
    assert routed(key) == {"a": 2}
    entries = ReplicaReports().listing(_listed("a", "b"), [
        {"health": "ready", "running": 1, "waiting": 1}, None], 1.0, routed(key))
    # answered or not, each replica shows the router's own count (0 when it has none)
    assert [(e["id"], e["routed"], e["health"]) for e in entries] == [
        ("a", 2, "ready"), ("b", 0, PENDING)]
    del counts  # a router that is gone (its handle shut down) counts nothing
    assert routed(key) == {}


@pytest.mark.slow  # importing Ray takes seconds
def test_the_application_declares_resources_scaling_and_the_router() -> None:
    """What `colibri serve --replicas` and `serve run ...deployments:build` hand Ray Serve
    (building the application needs no cluster)."""
    pytest.importorskip("ray.serve")
    from ray.serve._private.build_app import build_app

    from colibri.app.replicas.deployments import build

    fixed = {d.name: d for d in build_app(build({"replicas": "3", "threads": "2",
                                                  "replica_gpus": "1"}), name="c").deployments}
    replica = fixed["ColibriReplica"]
    assert replica._deployment_config.num_replicas == 3
    assert replica.ray_actor_options["num_cpus"] == 2
    assert replica.ray_actor_options["num_gpus"] == 1
    router = replica._deployment_config.request_router_config
    assert router.request_router_kwargs == {"policy": "prefix"}
    assert fixed["ColibriIngress"].ray_actor_options["num_cpus"] == 0
    scaled = {d.name: d for d in build_app(build({"replicas": "2", "min_replicas": "1",
                                                   "max_replicas": "4", "threads": "1"}),
                                           name="c").deployments}
    auto = scaled["ColibriReplica"]._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas) == (1, 4, 2)
    assert auto.target_ongoing_requests == 16  # a full batch (--max-num-seqs) on each


class _FakeReplica:
    """What Ray Serve's request router reads of a running replica; its queue length is
    probed in probe_s seconds."""

    def __init__(self, unique_id: str, probe_s: float = 0.0) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DeploymentID(
            name="ColibriReplica", app_name="colibri"))
        self.max_ongoing_requests = 36
        self.probe_s = probe_s

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self.probe_s)
        return 0


def _router(*replicas: _FakeReplica) -> Any:
    """ColibriRouter as Ray Serve builds it in the ingress (queue lengths cached, as under
    strict max_ongoing_requests), over replicas."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from colibri.app.replicas.router import ColibriRouter

    router = ColibriRouter(deployment_id=DeploymentID(name="ColibriReplica",
                                                      app_name="colibri"),
                           handle_source=DeploymentHandleSource.UNKNOWN,
                           use_replica_queue_len_cache=True)
    router.initialize_state(policy="prefix")
    router.update_replicas(list(replicas))
    return router


def _pending(n: int, pin: str | None = None) -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    from colibri.app.replicas.router import RouteInfo

    return PendingRequest(args=[], kwargs={"route": RouteInfo(replica=pin)},
                          metadata=RequestMetadata(request_id=f"r{n}",
                                                   internal_request_id=f"i{n}",
                                                   is_streaming=True))


async def _send(router: Any, pending: Any) -> str:
    """What Ray Serve's handle does for one request (_private/router.py,
    _route_and_send_request_once): wait for the routing to pick a replica, send there."""
    replica = await router._choose_replica_for_request(pending)
    router.on_send_request(replica.replica_id)
    return str(replica.replica_id.unique_id)


@pytest.mark.slow  # importing Ray takes seconds
def test_a_burst_spreads_over_replicas_when_one_has_a_request_in_flight() -> None:
    """Ray Serve routes every request of a burst before it sends the first (one routing
    task drains the queue without yielding), so loads counted only at the send would send
    all of them to whichever replica was idlest when the burst came."""
    pytest.importorskip("ray.serve")

    async def run() -> None:
        a, b = _FakeReplica("a"), _FakeReplica("b")
        router = _router(a, b)
        await asyncio.sleep(0.05)  # the queue lengths of new replicas are probed
        assert await _send(router, _pending(0, pin="a")) == "a"  # one stream runs on a
        sent = await asyncio.gather(*(_send(router, _pending(i)) for i in range(1, 17)))
        loads = router.loads()
        assert sum(loads.values()) == 17
        assert abs(loads["a"] - loads["b"]) <= 1, (loads, sent)
        for i, replica in enumerate(["a", *sent]):
            router.on_request_completed(_FakeReplica(replica).replica_id, f"i{i}")
        assert router.loads() == {"a": 0, "b": 0}

    asyncio.run(run())


@pytest.mark.slow  # importing Ray takes seconds
def test_a_request_waiting_on_a_probe_counts_and_a_cancelled_one_does_not() -> None:
    """A replica whose queue length Ray Serve must probe first still counts the requests
    routed to it meanwhile; a request whose caller gives up while it is being routed (the
    client left) leaves nothing counted, and neither does a completion Ray Serve reports
    for a request it could not send."""
    pytest.importorskip("ray.serve")

    async def run() -> None:
        a, b = _FakeReplica("a"), _FakeReplica("b", probe_s=0.3)
        router = _router(a, b)
        router.queue_len_response_deadline_s = 10.0  # b answers late, but answers
        await asyncio.sleep(0.05)
        router.replica_queue_len_cache.invalidate_key(b.replica_id)  # b must be probed
        sent = await asyncio.gather(*(_send(router, _pending(i)) for i in range(8)))
        assert abs(sent.count("a") - sent.count("b")) <= 1, sent
        assert router.loads() == {"a": sent.count("a"), "b": sent.count("b")}
        for i, replica in enumerate(sent):
            router.on_request_completed(_FakeReplica(replica).replica_id, f"i{i}")
        router.replica_queue_len_cache.invalidate_key(b.replica_id)
        waiting = asyncio.ensure_future(_send(router, _pending(9, pin="b")))
        await asyncio.sleep(0.1)  # routed to b, its queue length being probed
        assert router.loads() == {"a": 0, "b": 1}
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)
        assert router.loads() == {"a": 0, "b": 0}
        router.on_request_completed(a.replica_id, "never-sent")
        assert router.loads() == {"a": 0, "b": 0}

    asyncio.run(run())


@pytest.mark.slow  # importing Ray takes seconds
def test_a_request_ray_cannot_hand_its_replica_waits_between_tries() -> None:
    """Ray Serve hands a routed replica to the waiting request with the routed one's request
    id; calls made while serving one request share its id, so of two pinned to different
    replicas one may never be handed its own. Its routing must back off, not route it again
    and again without yielding the event loop (which would also stall every other request)."""
    pytest.importorskip("ray.serve")

    async def run() -> None:
        a, b = _FakeReplica("a"), _FakeReplica("b")
        router = _router(a, b)
        await asyncio.sleep(0.05)
        first, second = _pending(1, pin="a"), _pending(1, pin="b")  # one request id
        choose = router.choose_replicas
        tries = {"n": 0}

        async def counted(*args: Any, **kwargs: Any) -> Any:
            tries["n"] += 1
            return await choose(*args, **kwargs)

        router.choose_replicas = counted
        routed = [asyncio.ensure_future(_send(router, p)) for p in (first, second)]
        done, pending = await asyncio.wait(routed, timeout=1.0)
        assert len(done) == 1 and len(pending) == 1  # one of them is never handed a replica
        assert tries["n"] < 100, tries  # and is routed again only after waiting
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(0)
        assert router.loads()[next(iter(done)).result()] == 1  # only the one sent counts

    asyncio.run(run())
