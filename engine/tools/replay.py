"""Replay a routing trace against expert cache policies: `colibri replay TRACE`.

Each layer of the expert cache holds n_slots experts; every forward chunk asks for the
experts its tokens chose (each once, in ascending id order). A request for a resident
expert is a hit, any other a miss that loads it, evicting a victim the policy picks among
the resident experts not pinned and not held by the running wave. Policies:

- "lru": the least recently used.
- "lfu": the least often selected so far (token-expert selections), least recently used on
  ties.
- "lru+heat": the expert cache of the C core, step by step: per chunk, heat[e] = heat[e] *
  (1 - 1/W)^T + rows of e in the chunk (float32, as the core computes it); victim: least heat,
  then least recently used (a use is an acquisition or a load). Experts are taken in "waves":
  when no slot can be freed, or the wave's rows would pass CORE_CHUNK_TOKENS, the wave runs
  and lets its experts go, and the next wave goes on from the refused expert.
  `simulate(trace, n, "lru+heat")` predicts the core's per-layer hits and misses exactly
  (with prefetching off): tests/test_replay.py checks it against the core.
- Belady's optimum: evict the expert used again farthest in the future, starting from the
  best possible contents (its first fills are free), ignoring waves. No policy that serves
  the same requests does better: it is the upper bound of the table.

The table warms every policy over the whole trace and scores the second half; pinned
variants pin, per layer, the experts selected most in the first half.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import colibri.engine.tools.routing_trace as rt
from colibri.engine.core.options import add_option_args, default, option_values
from colibri.engine.tools.routing_trace import RoutingTrace

POLICIES = ("lru", "lfu", "lru+heat")
DEFAULT_PREFETCH_WINDOW: int = default("prefetch_window")  # tokens, the core's default
PIN_FRACTIONS = (0.25, 0.5)


@dataclass(frozen=True)
class LayerRequests:
    """One layer's requests: per chunk, the experts asked for (ascending) and their rows."""

    experts: list[list[int]]
    rows: list[list[int]]
    tokens: list[int]  # tokens of each chunk


def layer_requests(trace: RoutingTrace) -> list[LayerRequests]:
    """The requests of each layer of a trace, chunk by chunk."""
    starts = trace.chunk_starts()
    out = []
    for lay in range(trace.n_layer):
        ex: list[list[int]] = []
        rw: list[list[int]] = []
        for s, t in zip(starts.tolist(), trace.chunks.tolist(), strict=True):
            ids, cnt = np.unique(trace.routes[s:s + t, lay], return_counts=True)
            ex.append(ids.tolist())
            rw.append(cnt.tolist())
        out.append(LayerRequests(ex, rw, trace.chunks.tolist()))
    return out


@dataclass(frozen=True)
class Result:
    """Hits and misses per layer over the scored chunks."""

    hits: np.ndarray  # int64 [n_layer]
    misses: np.ndarray  # int64 [n_layer]

    @property
    def hit_rate(self) -> float:
        n = int(self.hits.sum() + self.misses.sum())
        return float(self.hits.sum()) / n if n else float("nan")


def _simulate_layer(req: LayerRequests, n_expert: int, n_slots: int, policy: str,
                    pinned: Sequence[int], prefetch_window: int, score_from: int
                    ) -> tuple[int, int]:
    """(hits, misses) of one layer over chunks score_from.. (see the module doc)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if len(pinned) > n_slots - 1:
        raise ValueError(f"{len(pinned)} pinned experts need more than {n_slots} slots")
    pin = set(pinned)
    resident: set[int] = set(pin)
    last = [0] * n_expert
    freq = [0] * n_expert
    tick = 0
    for e in sorted(pin):  # the core loads pinned experts first, each a use
        tick += 1
        last[e] = tick
    heat = np.zeros(n_expert, np.float32)
    decay = np.float32(1) - np.float32(1) / np.float32(prefetch_window)
    dense = np.zeros(n_expert, np.float32)
    hits = misses = 0
    for ci, (ids, rows) in enumerate(zip(req.experts, req.rows, strict=True)):
        scored = ci >= score_from
        if policy == "lru+heat":
            dense[:] = 0
            dense[ids] = rows
            heat = heat * np.power(decay, np.float32(req.tokens[ci])) + dense
            hl = heat.tolist()
        for e, c in zip(ids, rows, strict=True):
            freq[e] += c
        wave: set[int] = set()
        wave_rows = 0
        j = 0
        while j < len(ids):
            e, c = ids[j], rows[j]
            if wave_rows + c > rt.CORE_CHUNK_TOKENS:  # the batch of rows is full: run the wave
                wave.clear()
                wave_rows = 0
                continue
            if e not in resident:
                if len(resident) >= n_slots:
                    cands = [x for x in resident if x not in wave and x not in pin]
                    if not cands:  # every slot is held by this wave: run it first
                        wave.clear()
                        wave_rows = 0
                        continue
                    if policy == "lru":
                        victim = min(cands, key=last.__getitem__)
                    elif policy == "lfu":
                        victim = min(cands, key=lambda x: (freq[x], last[x]))
                    else:
                        victim = min(cands, key=lambda x: (hl[x], last[x]))
                    resident.discard(victim)
                resident.add(e)
                misses += scored
            else:
                hits += scored
            tick += 1
            last[e] = tick
            wave.add(e)
            wave_rows += c
            j += 1
    return hits, misses


def simulate(trace: RoutingTrace, n_slots: int, policy: str,
             pinned: Sequence[Sequence[int]] | None = None,
             prefetch_window: int = DEFAULT_PREFETCH_WINDOW, score_from: int = 0,
             requests: list[LayerRequests] | None = None) -> Result:
    """Play the whole trace through a cache of n_slots per layer; count chunks score_from...

    pinned: per layer, the experts pinned from the start (at most n_slots - 1). requests:
    layer_requests(trace), when the caller already has them.
    """
    if not 1 <= n_slots <= trace.n_expert:
        raise ValueError(f"slots per layer must be in 1..{trace.n_expert}, got {n_slots}")
    if prefetch_window < 1:
        raise ValueError(f"prefetch window must be at least 1 token, got {prefetch_window}")
    reqs = requests if requests is not None else layer_requests(trace)
    pins = pinned if pinned is not None else [()] * trace.n_layer
    hm = [_simulate_layer(r, trace.n_expert, n_slots, policy, p, prefetch_window, score_from)
          for r, p in zip(reqs, pins, strict=True)]
    return Result(np.array([h for h, _ in hm], np.int64), np.array([m for _, m in hm], np.int64))


def _belady_layer(seq: list[int], n_slots: int) -> int:
    """Misses of Belady's policy over seq from an empty cache, less the first n_slots fills
    (the misses any start would save at best)."""
    nxt = [0] * len(seq)
    seen: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = seen.get(seq[i], len(seq))
        seen[seq[i]] = i
    when: dict[int, int] = {}  # resident expert -> index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert), stale entries skipped
    misses = 0
    for i, e in enumerate(seq):
        if e not in when:
            misses += 1
            if len(when) >= n_slots:
                while True:
                    nu, v = heapq.heappop(heap)
                    if when.get(v) == -nu:
                        del when[v]
                        break
        when[e] = nxt[i]
        heapq.heappush(heap, (-nxt[i], e))
    return misses - min(n_slots, len(seen))


def belady(trace: RoutingTrace, n_slots: int, score_from: int = 0,
           requests: list[LayerRequests] | None = None) -> Result:
    """Belady's optimum over chunks score_from.., starting from the best contents."""
    if not 1 <= n_slots <= trace.n_expert:
        raise ValueError(f"slots per layer must be in 1..{trace.n_expert}, got {n_slots}")
    reqs = requests if requests is not None else layer_requests(trace)
    hits, misses = [], []
    for r in reqs:
        seq = [e for ids in r.experts[score_from:] for e in ids]
        m = _belady_layer(seq, n_slots)
        hits.append(len(seq) - m)
        misses.append(m)
    return Result(np.array(hits, np.int64), np.array(misses, np.int64))


# -- the table ------------------------------------------------------------------------------

def default_budgets(n_expert: int, k: int) -> list[int]:
    """Slots per layer worth comparing: K, 1.5K, 2K, E/4, E/2 (in 1..E, each once)."""
    raw = [k, (3 * k) // 2, 2 * k, n_expert // 4, n_expert // 2]
    return sorted({min(max(b, 1), n_expert) for b in raw})


def split_chunk(trace: RoutingTrace) -> int:
    """The first chunk of the trace's second half (by tokens)."""
    starts = trace.chunk_starts()
    return int(np.searchsorted(starts, trace.n_tokens / 2, side="left"))


def hot_set(trace: RoutingTrace, n_pin: int, until_chunk: int) -> list[list[int]]:
    """Per layer, the n_pin experts selected most in chunks before until_chunk (lower ids
    first on ties)."""
    end = int(trace.chunk_starts()[until_chunk]) if until_chunk < trace.chunks.size \
        else trace.n_tokens
    out = []
    for lay in range(trace.n_layer):
        counts = np.bincount(trace.routes[:end, lay].reshape(-1), minlength=trace.n_expert)
        out.append(sorted(np.argsort(-counts, kind="stable")[:n_pin].tolist()))
    return out


def replay_table(trace: RoutingTrace, budgets: Sequence[int] | None = None,
                 prefetch_window: int = DEFAULT_PREFETCH_WINDOW) -> dict[str, Any]:
    """Hit rates of every policy at every budget on the second half of the trace."""
    if trace.chunks.size < 2:
        raise ValueError("the trace needs at least two forward chunks to score a second half")
    bs = list(budgets) if budgets else default_budgets(trace.n_expert, trace.k)
    for b in bs:
        if not 1 <= b <= trace.n_expert:
            raise ValueError(f"slots per layer must be in 1..{trace.n_expert}, got {b}")
    reqs = layer_requests(trace)
    half = split_chunk(trace)
    rows: list[dict[str, Any]] = []

    def add(name: str, n: int, n_pin: int, r: Result) -> None:
        rows.append({"policy": name, "slots": n, "pinned": n_pin, "hit_rate": r.hit_rate,
                     "hits": r.hits.tolist(), "misses": r.misses.tolist()})

    for n in bs:
        for policy in POLICIES:
            add(policy, n, 0, simulate(trace, n, policy, None, prefetch_window, half, reqs))
            for frac in PIN_FRACTIONS:
                p = int(n * frac)
                if 1 <= p <= n - 1:
                    pins = hot_set(trace, p, half)
                    add(policy, n, p,
                        simulate(trace, n, policy, pins, prefetch_window, half, reqs))
        add("belady", n, 0, belady(trace, n, half, reqs))
    return {"model": trace.model, "source": trace.source, "n_tokens": trace.n_tokens,
            "n_prefill": int(trace.prefill.sum()), "n_layer": trace.n_layer,
            "n_expert": trace.n_expert, "k": trace.k, "scored_from_token":
            int(trace.chunk_starts()[half]), "prefetch_window": prefetch_window, "budgets": bs,
            "rows": rows}


def _label(row: dict[str, Any]) -> str:
    if row["policy"] == "belady":
        return "belady (optimum)"
    if not row["pinned"]:
        return row["policy"]
    frac = row["pinned"] / row["slots"]
    return f"{row['policy']} + pin {'1/4' if frac < 0.375 else '1/2'}"


def render(t: dict[str, Any]) -> str:
    """The table of replay_table as text: one row per policy, one column per budget."""
    bs = t["budgets"]
    labels: list[str] = []
    cell: dict[tuple[str, int], str] = {}
    for r in t["rows"]:
        lab = _label(r)
        if lab not in labels:
            labels.append(lab)
        cell[(lab, r["slots"])] = f"{100 * r['hit_rate']:.1f}"
    w = max(len(s) for s in labels) + 2
    head = f"{'slots per layer':{w}}" + "".join(f"{b:>8}" for b in bs)
    lines = [f"model    {t['model']}",
             f"trace    {t['n_tokens']} tokens ({t['n_prefill']} prefill), {t['source']}",
             f"         {t['n_layer']} layers, {t['n_expert']} experts, top-{t['k']}; hit rate "
             f"% of expert requests from token {t['scored_from_token']} on",
             head]
    for lab in labels:
        lines.append(f"{lab:{w}}" + "".join(f"{cell.get((lab, b), '-'):>8}" for b in bs))
    return "\n".join(lines)


def add_replay_args(p: argparse.ArgumentParser) -> None:
    """The options of `colibri replay`."""
    p.add_argument("trace", metavar="TRACE",
                   help="routing trace written by `colibri bench --routing-trace FILE`")
    p.add_argument("--budgets", default=None, metavar="N,N,...",
                   help="slots per layer to compare (default: K, 1.5K, 2K, E/4, E/2 for K "
                        "experts per token out of E)")
    add_option_args(p, ("prefetch_window",))  # the expert cache's, simulated by lru+heat
    p.add_argument("--json", action="store_true", help="print one JSON object")


def replay_main(args: argparse.Namespace) -> int:
    """Run `colibri replay` with parsed arguments."""
    trace = RoutingTrace.load(args.trace)
    budgets = None
    if args.budgets:
        try:
            budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError(f"--budgets must be integers separated by commas: {e}") from e
    window = option_values(args, ("prefetch_window",))["prefetch_window"]
    t = replay_table(trace, budgets, window)
    print(json.dumps(t, indent=2) if args.json else render(t))
    return 0
