"""GET /v1/replicas: each running replica as Ray Serve's controller lists it, with the health
and queue it reports itself.

A replica that does not answer in time (starting, too busy, or gone since it was listed) is
shown with what is known of it: the controller's fields, `health: "pending"`, and the counts
of its last answer with their age, or no counts when it has never answered. No Ray here.
"""

from __future__ import annotations

from typing import Any

ASK_TIMEOUT_S = 5.0  # how long the listing waits for a replica's own answer
REPORTED = ("health", "running", "waiting")  # what a replica says of itself
PENDING = "pending"


class ReplicaReports:
    """The last answer of each listed replica, for the next listing."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}  # id -> (when, answer)

    def listing(self, listed: list[dict[str, Any]], answers: list[dict[str, Any] | None],
                now: float) -> list[dict[str, Any]]:
        """One entry per listed replica (its answer None: it did not answer in time); now is
        a monotonic clock's reading. Replicas no longer listed are forgotten."""
        self._last = {r["id"]: self._last[r["id"]] for r in listed if r["id"] in self._last}
        out = []
        for replica, answer in zip(listed, answers, strict=True):
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
