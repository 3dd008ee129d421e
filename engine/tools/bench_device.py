"""`colibri bench` on the device a run would use: loads the model where `serve` would put it
(--device, and under --gpu-memory-mb the cost model's placement), and reports where its work
went and, when routed experts are split between a torch device and the C core, what the GPU
tier did during the timed runs (its counters, read by name from the tier, so a counter it
gains is reported too). Measures nothing itself and makes no claim about speed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from colibri.engine.core.loader import (
    EngineConfig,
    attach_monitor,
    choose_placement,
)
from colibri.engine.core.options import ExpertCacheConfig
from colibri.engine.executor.expert_cache import ExpertCacheMonitor
from colibri.engine.executor.model import Model
from colibri.engine.models.config import ModelConfig


def load_bench_model(path: Path, config: EngineConfig, n_ctx: int, kv_type: str,
                     xc: ExpertCacheConfig) -> tuple[Model, ExpertCacheMonitor | None]:
    """The model on config's device, placed as the server would place it for n_ctx positions,
    and its monitor: the expert cache's on the C core, the GPU tier's when routed experts are
    split between a torch device and the C core, None with every expert on the device."""
    cfg = ModelConfig.from_dir(path)
    device, placement, profile = choose_placement(path, cfg, config, n_ctx)
    model = Model.load(path, threads=config.threads, n_ctx=n_ctx, kv_type=kv_type,
                       device=device, placement=placement)
    return model, attach_monitor(model, path, profile, xc,
                                 model.n_kv_blocks * model.kv_block_bytes())


def device_experts(monitor: ExpertCacheMonitor | None) -> list[list[int]] | None:
    """Per layer, the routed experts the GPU tier holds on the device now (None: no tier)."""
    ts = None if monitor is None else monitor.tier_stats()
    if ts is None:
        return None
    return [[int(e) for e in np.flatnonzero(row)] for row in ts["on_device"]]


def placement_text(model: Model) -> str:
    """Where the loaded model runs its work, in words."""
    if model.device == "cpu":
        return "everything on the CPU (the C core)"
    backends = getattr(model.core, "backends", None)
    if backends is None:
        return f"everything on {model.device} (the torch backend)"
    cfg = model.config
    n_torch = sum(b == "torch" for b in backends)
    split = getattr(model.core, "expert_split", None)
    n_all = cfg.n_expert * len(cfg.moe_layers)
    n_on = 0 if split is None else int(split.stats()["experts_on_device"])
    return (f"{n_torch} of {cfg.n_layer} layers on {model.device}"
            + (f" with {n_on} of {n_all} routed experts" if n_all else "")
            + "; the rest on the CPU (the C core)")


def gpu_tier_report(monitor: ExpertCacheMonitor | None, before: dict[str, Any] | None,
                    placed: list[list[int]] | None) -> dict[str, Any] | None:
    """What the GPU tier did during the timed runs: each of its counters now minus the
    snapshot `before` (monitor.tier_stats() taken before them), the share of expert uses
    computed on the device, and the experts the device holds: as placed at load (`placed`)
    and now, per layer. None without a tier."""
    after = None if monitor is None else monitor.tier_stats()
    if monitor is None or after is None or before is None:
        return None
    names = monitor.tier_counter_names()
    out: dict[str, Any] = {k: int(after[k]) - int(before[k]) for k in names}
    used = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / used if used else 0.0
    out["counter_names"] = names
    out["experts_on_device"] = int(after["experts_on_device"])
    out["device_expert_bytes"] = int(after["device_expert_bytes"])
    out["layers"] = [int(il) for il in after["layers"]]
    out["placed_experts"] = placed
    out["device_experts"] = device_experts(monitor)
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def render_gpu_tier(t: dict[str, Any]) -> str:
    """The gpu_tier part of a bench result as lines of its table."""
    n_all = sum(len(row) for row in t["placed_experts"] or [])
    per = " ".join(f"{il}:{len(t['device_experts'][il])}" for il in t["layers"])
    lines = [
        f"GPU tier       {t['experts_on_device']} experts on the device "
        f"({_mb(t['device_expert_bytes'])}; {n_all} placed at load; by layer {per}); "
        f"during the timed runs {t['hits']} of {t['hits'] + t['misses']} expert uses there "
        f"({t['hit_rate']:.3f}), {t['uploads']} uploaded by heat "
        f"({_mb(t['upload_bytes'])}), {t['evictions']} evicted",
    ]
    shown = {"hits", "misses", "uploads", "upload_bytes", "evictions"}
    rest = [f"{k.replace('_', ' ')} {_mb(t[k]) if k.endswith('bytes') else t[k]}"
            for k in t["counter_names"] if k not in shown]
    if rest:
        lines.append(f"{'':15}{', '.join(rest)}")
    return "\n".join(lines)
