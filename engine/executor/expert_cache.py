"""The expert cache seen from Python: how large it is, which experts start pinned, and what it
has done.

A model's routed experts are most of its bytes, but a token uses only k of E per layer. When
every expert fits in memory (next to the KV cache and a margin) they all stay mapped and the
cache is off. Otherwise, or when a budget is given, each layer keeps a fixed number of expert
slots, filled on demand by the C core (csrc/xcache.c). The budget never changes a token, only
speed.

Routing history persists next to the model (`expert_routing.json`, selections per expert) so
the next start pins each layer's most used experts before the first request.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the options live above the executor, in engine.core.options
    from colibri.engine.core.options import ExpertCacheConfig

log = logging.getLogger("colibri.engine")

ROUTING_FILE = "expert_routing.json"
LOAD_MODES = ("auto", "direct", "pread", "mmap", "uring")
# left free when the budget comes from free memory: for Python, the server and the page cache
MARGIN_BYTES = 256 << 20
MIN_MARGIN_BYTES = 32 << 20
PIN_SHARE = 0.25  # share of each layer's slots given to pinned experts
# the reader pool's size when --expert-readers is not given: the storage probe reads the expert
# files at these queue depths (reads in flight), PROBE_CHUNKS reads of PROBE_CHUNK bytes at each
# (32 MiB: tens of milliseconds on an NVMe drive), and the readers are the fewest that reach
# READERS_SHARE of the best rate, within MIN_READERS..MAX_READERS
PROBE_DEPTHS = (1, 2, 4, 8, 16)
PROBE_CHUNK = 512 << 10
PROBE_CHUNKS = 64
READERS_SHARE = 0.9
MIN_READERS, MAX_READERS = 2, 16
DEFAULT_READERS = 4  # where the storage cannot be measured


@dataclass
class CachePlan:
    """The decision made at start: per_layer None means every expert stays resident."""

    per_layer: int | None
    expert_bytes: int
    n_layer: int  # the layers with routed experts (dense layers have none to cache)
    n_expert: int
    reason: str
    # every expert also fits in the memory that was free (or that is unknown): resident
    # experts may then be copied (repacked) instead of read through their mappings
    fits: bool = False
    dense_layers: tuple[int, ...] = ()  # layers without experts (drawn apart on the page)
    shared_bytes: int = 0  # shared experts, all layers: always resident, never in the budget
    readers: int = 0  # reader threads started (0: no cache), and why that many
    readers_reason: str = ""

    @property
    def budget_bytes(self) -> int:
        n = self.n_expert if self.per_layer is None else self.per_layer
        return n * self.n_layer * self.expert_bytes


def cgroup_memory_free() -> int | None:
    """Bytes this process's memory cgroup still allows (limit minus anonymous use), or None
    without a limit. Reads cgroup v2's memory.max or v1's memory.limit_in_bytes."""
    try:
        lines = Path("/proc/self/cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        rel = parts[2].lstrip("/")
        if parts[1] == "" or parts[0] == "0":  # v2
            base = Path("/sys/fs/cgroup") / rel
            limit_f, usage_f, stat_key = base / "memory.max", base / "memory.current", "anon"
        elif "memory" in parts[1].split(","):
            base = Path("/sys/fs/cgroup/memory") / rel
            limit_f, usage_f = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
            stat_key = "total_rss"
        else:
            continue
        try:
            raw = limit_f.read_text(encoding="ascii").strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            limit = int(raw)
            used = int(usage_f.read_text(encoding="ascii").strip())
            for s in (base / "memory.stat").read_text(encoding="ascii").splitlines():
                k, _, v = s.partition(" ")
                if k == stat_key:
                    used = int(v)  # page cache can be given back: count anonymous memory
                    break
        except (OSError, ValueError):
            continue
        return max(0, limit - used)
    return None


def memory_free(meminfo_available: int | None) -> int | None:
    """What new memory may take: MemAvailable, capped by a cgroup limit."""
    cg = cgroup_memory_free()
    if meminfo_available is None:
        return cg
    return meminfo_available if cg is None else min(meminfo_available, cg)


def margin_bytes(free: int | None) -> int:
    """What an automatic budget leaves free: 5% of free memory, within 32..256 MB."""
    if free is None:
        return MARGIN_BYTES
    return int(min(MARGIN_BYTES, max(MIN_MARGIN_BYTES, free // 20)))


def resolve_load(load: str, model_dir: Path) -> str:
    """"auto": "direct" where an expert file opens with O_DIRECT (reads that bypass the page
    cache, so they neither push the other weights out of memory nor count twice against a
    memory limit), else "pread"."""
    if load != "auto":
        return load
    probe = next(iter(sorted((model_dir / "experts").glob("*.bin"))), None)
    flag = getattr(os, "O_DIRECT", 0)
    if probe is None or not flag:
        return "pread"
    try:
        fd = os.open(probe, os.O_RDONLY | flag)
    except OSError:
        return "pread"
    os.close(fd)
    return "direct"


def readers_for(rates: dict[int, float]) -> int:
    """Reader threads for measured read rates {queue depth: GB/s}: the fewest reads in flight
    that reach READERS_SHARE of the best rate, within MIN_READERS..MAX_READERS (two at least,
    so that a read-ahead never holds up alone a load the forward pass waits for)."""
    best = max(rates.values())
    depth = min(d for d, r in rates.items() if r >= READERS_SHARE * best)
    return max(MIN_READERS, min(MAX_READERS, depth))


def probe_readers(model_dir: Path) -> tuple[int, str]:
    """Reader threads for the expert files of model_dir, and why: measured with O_DIRECT reads
    at each of PROBE_DEPTHS (readers_for), else DEFAULT_READERS with the reason it was not
    measured (files too small to tell, or O_DIRECT refused)."""
    from colibri.engine import _core

    files = sorted((model_dir / "experts").glob("*.bin"))
    total = sum(f.stat().st_size for f in files)
    need = PROBE_CHUNK * PROBE_CHUNKS * len(PROBE_DEPTHS)
    if total < need:
        return DEFAULT_READERS, (f"the default: {total / 1e6:.0f} MB of expert files are too "
                                 f"few to measure the storage with ({need / 1e6:.0f} MB)")
    rates: dict[int, float] = {}
    try:
        for i, depth in enumerate(PROBE_DEPTHS):  # other chunks at each depth: none read twice
            rates[depth], _ = _core.storage_probe([str(f) for f in files], PROBE_CHUNK,
                                                  i * PROBE_CHUNKS, PROBE_CHUNKS, depth)
    except OSError as exc:
        return DEFAULT_READERS, f"the default: the storage could not be measured ({exc})"
    n = readers_for(rates)
    told = ", ".join(f"{r:.2f} GB/s at {d}" for d, r in rates.items())
    return n, (f"measured with {PROBE_CHUNK >> 10} KiB O_DIRECT reads: {told} in flight; the "
               f"fewest within {READERS_SHARE:.0%} of the best, {MIN_READERS}..{MAX_READERS}")


def plan_cache(core: Any, cfg: ExpertCacheConfig, n_layer: int, n_expert: int, top_k: int,
               other_bytes: int, free: int | None) -> CachePlan:
    """Slots per layer for cfg. other_bytes: what the model needs besides its routed experts
    (attention, embeddings, router, shared experts, KV cache). ValueError when a given budget
    cannot hold one layer's top-k experts."""
    eb = int(core.expert_bytes)
    fits = free is None or n_expert * n_layer * eb + other_bytes + margin_bytes(free) <= free
    plan = _plan_budget(cfg, eb, n_layer, n_expert, top_k, other_bytes, free, fits)
    return replace(plan, fits=fits and plan.per_layer is None)


def _plan_budget(cfg: ExpertCacheConfig, eb: int, n_layer: int, n_expert: int, top_k: int,
                 other_bytes: int, free: int | None, fits: bool) -> CachePlan:
    """plan_cache's decision, for experts of eb bytes each (fits: every expert fits in free
    memory beside the rest and a margin)."""
    layer_bytes = n_layer * eb
    minimum = top_k * layer_bytes
    if cfg.expert_load not in LOAD_MODES:
        raise ValueError(f"expert load mode must be one of {', '.join(LOAD_MODES)}")
    size, mb = cfg.expert_cache_size, cfg.expert_cache_mb
    if size is not None:
        if not top_k <= size <= n_expert:
            raise ValueError(f"--expert-cache-size {size} must be in {top_k}..{n_expert} "
                             f"(the model routes each token to {top_k} of {n_expert} experts "
                             f"per layer)")
        if size == n_expert:
            return CachePlan(None, eb, n_layer, n_expert, "every expert resident (asked)")
        return CachePlan(size, eb, n_layer, n_expert, f"--expert-cache-size {size}")
    if mb is not None:
        per = int(mb * 1024 * 1024) // layer_bytes
        if per < top_k:
            raise ValueError(f"--expert-cache-mb {mb:g} is below the minimum of "
                             f"{minimum / 1e6:.1f} MB ({top_k} experts of "
                             f"{eb / 1e6:.2f} MB in each of {n_layer} layers)")
        if per >= n_expert:
            return CachePlan(None, eb, n_layer, n_expert,
                             f"--expert-cache-mb {mb:g} holds every expert")
        return CachePlan(per, eb, n_layer, n_expert, f"--expert-cache-mb {mb:g}")
    if fits or free is None:
        return CachePlan(None, eb, n_layer, n_expert, "the model fits in memory")
    total = n_expert * layer_bytes
    room = free - other_bytes - margin_bytes(free)
    per = max(top_k, min(n_expert - 1, room // layer_bytes))
    if room < minimum:
        log.warning("expert cache: %.0f MB free after the rest of the model, below the "
                    "minimum of %.1f MB; using the minimum", max(room, 0) / 1e6, minimum / 1e6)
    return CachePlan(int(per), eb, n_layer, n_expert,
                     f"the model's {total / 1e6:.0f} MB of experts do not fit in the "
                     f"{free / 1e6:.0f} MB free")


def load_pinned(model_dir: Path, n_layer: int, n_expert: int, per_layer: int) -> np.ndarray | None:
    """Pinned flags [n_layer, n_expert] from the routing history, or None without one."""
    path = model_dir / ROUTING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        sel = np.asarray(data["selections"], dtype=np.int64)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    if sel.shape != (n_layer, n_expert):
        log.warning("ignoring %s: it is for %s experts, the model has %s", path, sel.shape,
                    (n_layer, n_expert))
        return None
    n_pin = min(per_layer - 1, int(per_layer * PIN_SHARE))
    pinned = np.zeros((n_layer, n_expert), dtype=bool)
    if n_pin <= 0:
        return pinned
    for il in range(n_layer):
        order = np.argsort(-sel[il], kind="stable")[:n_pin]
        pinned[il, order[sel[il, order] > 0]] = True
    return pinned


def save_routing(model_dir: Path, selections: np.ndarray) -> None:
    """Adds this run's selections to the routing history next to the model (best effort: a
    read-only model folder keeps none)."""
    path = model_dir / ROUTING_FILE
    total = np.asarray(selections, dtype=np.int64)
    try:
        old = np.asarray(json.loads(path.read_text(encoding="utf-8"))["selections"],
                         dtype=np.int64)
        if old.shape == total.shape:
            total = total + old
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps({"selections": total.tolist()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.info("routing history not saved (%s): %s", path, exc)


class ExpertCacheMonitor:
    """Counters of a running cache, a short history for the live page, the periodic log line
    and the routing history saved at close."""

    HISTORY_S = 300
    LOG_EVERY_S = 30.0

    def __init__(self, core: Any, plan: CachePlan, model_dir: Path | None) -> None:
        self.core = core
        self.plan = plan
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self.history: deque[dict[str, float]] = deque(maxlen=self.HISTORY_S)
        self._last_t = time.monotonic()
        self._last_log = self._last_t
        self._last_tokens = 0
        self._last_hm = (0, 0)
        self._tokens = 0
        self._batch_sum = 0
        self._batch_n = 0
        self._saved = None
        # the GPU tier (engine/executor/torch_backend/expert_split.py) when some routed
        # experts run on a torch device beside the C core
        self.gpu_tier: Any = None

    def stats(self) -> dict[str, Any] | None:
        return self.core.expert_cache_stats()

    def tier_stats(self) -> dict[str, Any] | None:
        """The GPU tier's counters and placement (ExpertSplit.stats), or None without one."""
        return None if self.gpu_tier is None else self.gpu_tier.stats()

    def tier_counter_names(self) -> list[str]:
        """The names of the GPU tier's counters (each a count since start, in tier_stats), in
        the order its counters declare them; [] without a tier. Read from the counters
        themselves, so that a counter the tier gains shows up wherever this list is read."""
        counters = getattr(self.gpu_tier, "counters", None)
        if counters is None:
            return []
        if is_dataclass(counters):
            return [f.name for f in fields(counters)]
        return list(counters)

    def tier_data(self) -> dict[str, Any] | None:
        """tier_stats, JSON-ready: counters (named in counter_names), per layer and expert 1
        on the GPU, 0 on the CPU, and the heat."""
        ts = self.tier_stats()
        if ts is None:
            return None
        out = {k: v for k, v in ts.items() if k not in ("on_device", "heat", "selections")}
        out["counter_names"] = self.tier_counter_names()
        out["on_device"] = ts["on_device"].tolist()
        out["heat"] = [[round(float(h), 3) for h in row] for row in ts["heat"]]
        return out

    def totals(self, st: dict[str, Any] | None = None) -> dict[str, float]:
        """Summed counters, hit rate and resident bytes of st (default: read now; empty when
        the cache is off)."""
        st = self.stats() if st is None else st
        if st is None:
            return {}
        out: dict[str, float] = {k: float(v.sum()) for k, v in st.items()
                                 if k not in ("state", "heat", "selections")}
        acq = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / acq if acq else 0.0
        out["resident_bytes"] = float((st["state"] >= 1).sum() * self.plan.expert_bytes)
        out["budget_bytes"] = float(self.plan.budget_bytes)
        return out

    def on_step(self, n_seqs: int, n_tokens: int) -> None:
        """Called after each engine step: one history point per second, a log line now and
        then."""
        with self._lock:
            self._tokens += n_tokens
            self._batch_sum += n_seqs
            self._batch_n += 1
            now = time.monotonic()
            if now - self._last_t < 1.0:
                return
            st = self.stats()
            dt = now - self._last_t
            hits = int(st["hits"].sum()) if st else 0
            misses = int(st["misses"].sum()) if st else 0
            dh, dm = hits - self._last_hm[0], misses - self._last_hm[1]
            self.history.append({
                "t": time.time(), "tok_s": (self._tokens - self._last_tokens) / dt,
                "batch": self._batch_sum / max(self._batch_n, 1),
                "hit_rate": dh / (dh + dm) if dh + dm else None})
            self._last_t, self._last_tokens, self._last_hm = now, self._tokens, (hits, misses)
            self._batch_sum = self._batch_n = 0
            if st is not None and now - self._last_log >= self.LOG_EVERY_S:
                self._last_log = now
                acq = hits + misses
                log.info("expert_cache_hit_rate=%.3f hits=%d misses=%d resident_mb=%.1f "
                         "read_mb=%.1f stall_s=%.2f prefetch_used=%d/%d", hits / acq if acq
                         else 0.0, hits, misses, (st["state"] >= 1).sum() *
                         self.plan.expert_bytes / 1e6, st["bytes_read"].sum() / 1e6,
                         st["stall_ns"].sum() / 1e9, int(st["prefetch_used"].sum()),
                         int(st["prefetch_issued"].sum()))

    def page_data(self) -> dict[str, Any]:
        """What the live page draws: per layer and expert state and heat, the totals and the
        history (JSON-ready)."""
        st = self.stats()
        with self._lock:
            hist = list(self.history)
        n_rows = self.plan.n_layer + len(self.plan.dense_layers)
        out: dict[str, Any] = {
            "enabled": st is not None, "n_layer": n_rows, "n_moe_layers": self.plan.n_layer,
            "dense_layers": list(self.plan.dense_layers),
            "shared_expert_bytes": self.plan.shared_bytes,
            "n_expert": self.plan.n_expert, "slots_per_layer": self.plan.per_layer
            or self.plan.n_expert, "expert_bytes": self.plan.expert_bytes,
            "budget_bytes": self.plan.budget_bytes, "reason": self.plan.reason,
            "readers": self.plan.readers, "readers_reason": self.plan.readers_reason,
            "totals": self.totals(st) if st is not None else {}, "history": hist,
            "gpu_tier": self.tier_data()}
        if st is not None:
            out["state"] = st["state"].tolist()
            out["heat"] = [[round(float(h), 3) for h in row] for row in st["heat"]]
            out["layers"] = [{k: int(st[k][i]) for k in st
                              if k not in ("state", "heat", "selections")}
                             for i in range(n_rows)]
        return out

    def close(self) -> None:
        """Saves the routing history (once). Beside a GPU tier, the cache sees only the
        selections of the experts the C core computed: the tier's layers take the tier's
        counts, which are every selection of those layers."""
        st = self.stats()
        if st is None or self.model_dir is None or self._saved:
            return
        self._saved = True
        sel = st["selections"]
        ts = self.tier_stats()
        if ts is not None:
            sel = sel.copy()
            sel[ts["layers"]] = ts["selections"][ts["layers"]]
        save_routing(self.model_dir, sel)
