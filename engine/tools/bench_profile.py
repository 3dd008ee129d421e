"""`colibri bench --profile`: where a decoded token's time goes, phase by phase.

Each weight phase of one decode step (attention projections, router, expert gate+up, expert
down, shared expert, lm_head) is replayed on the model's own tensors with one token through
the C matrix product (engine._core.matmul_bench: timed in C, a thread pool like the model's),
layer after layer so the weights come from memory as they do in decode. The phases' sum is set
against the measured time per decoded token; the rest is attention over the cache, norms,
routing, activation packing and thread-pool hand-offs. Experts 0..K-1 of each layer stand for
the K a token routes to (all experts of a layer have one shape). The replay issues one product
per matrix where the forward pass groups a phase's matrices into one dispatch, so a phase here
is an upper bound of its share.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

Matrix = tuple[str, bytes, int, int]  # type name, bytes, n_out, n_in


def _matrices(path: Path, names: tuple[str, ...] | None = None,
              repack: bool = True) -> list[Matrix]:
    """The 2-D tensors of a weight file, in the layout the loaded model multiplies them in
    (repack: the matrix may be repacked at load, as every one but a tied lm_head may)."""
    from engine import _core
    from engine.core.loader import repack_enabled
    from engine.format.wfile import read_wfile

    wf = read_wfile(path)
    out = []
    for name, t in wf.tensors.items():
        if len(t.shape) != 2 or (names is not None and name not in names):
            continue
        kind, raw, n_out, n_in = t.type_name, wf.raw(name), int(t.shape[0]), int(t.shape[1])
        if (repack and repack_enabled() and kind in ("q8", "q4", "q6") and n_out % 8 == 0
                and _core.wants_x8(kind)):
            kind, raw = kind + "x8", _core.repack_x8(kind, raw, n_out, n_in)
        out.append((kind, raw, n_out, n_in))
    return out


def decode_phases(model_dir: str | Path) -> dict[str, list[Matrix]]:
    """The weight matrices one decoded token multiplies, grouped by phase, in layer order."""
    from engine.models.config import ModelConfig

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    files = set(cfg.files)
    phases: dict[str, list[Matrix]] = {k: [] for k in (
        "attention projections", "router", "experts gate+up", "experts down", "shared expert",
        "lm_head")}
    for i in range(cfg.n_layer):
        phases["attention projections"] += _matrices(model_dir / f"attention/layer_{i}.bin")
        phases["router"] += _matrices(model_dir / f"router/layer_{i}.bin")
        for j in range(cfg.n_expert_used):
            ef = model_dir / f"experts/layer_{i}_expert_{j}.bin"
            phases["experts gate+up"] += _matrices(ef, ("w1", "w3"))
            phases["experts down"] += _matrices(ef, ("w2",))
        if f"shared/layer_{i}.bin" in files:
            phases["shared expert"] += _matrices(model_dir / f"shared/layer_{i}.bin")
    emb = _matrices(model_dir / "embeddings.bin", ("output",))
    phases["lm_head"] = emb or _matrices(model_dir / "embeddings.bin", ("tok_embd",),
                                         repack=False)  # tied: rows for the lookup
    return {k: v for k, v in phases.items() if v}


def profile_decode(model_dir: str | Path, n_threads: int, step_s: float,
                   repeat: int = 5) -> dict[str, Any]:
    """Seconds per token of each phase (median of repeat replays) against step_s, the
    measured seconds per decoded token."""
    from engine import _core

    phases = decode_phases(model_dir)
    rng = np.random.default_rng(0)
    rows: dict[str, dict[str, float]] = {}
    for name, mats in phases.items():
        xs = [rng.standard_normal((1, n_in), dtype=np.float32) for _, _, _, n_in in mats]
        for (t, w, n_out, n_in), x in zip(mats, xs, strict=True):  # untimed: page in
            _core.matmul_bench(t, w, n_out, n_in, x, n_threads, 1)
        totals = []
        for _ in range(repeat):
            totals.append(sum(_core.matmul_bench(t, w, n_out, n_in, x, n_threads, 1)[0]
                              for (t, w, n_out, n_in), x in zip(mats, xs, strict=True)))
        s = statistics.median(totals)
        nbytes = sum(len(w) for _, w, _, _ in mats)
        rows[name] = {"s": s, "bytes": nbytes, "gb_s": nbytes / s / 1e9 if s > 0 else 0.0,
                      "products": len(mats)}
    matmul_s = sum(r["s"] for r in rows.values())
    return {"phases": rows, "matmul_s": matmul_s, "step_s": step_s,
            "other_s": step_s - matmul_s,
            "pool_run_us": _core.threadpool_bench(n_threads, 2000, 20) / 1e3 if n_threads > 1
            else 0.0}


def render_profile(p: dict[str, Any]) -> str:
    """A profile_decode result as lines of the bench table."""
    lines = [f"{'profile':15}{'ms/token':>10}{'share':>8}{'GB/s':>8}  (one token, replayed)"]
    for name, r in p["phases"].items():
        lines.append(f"  {name:23}{r['s'] * 1e3:>8.3f}{100 * r['s'] / p['step_s']:>7.1f}%"
                     f"{r['gb_s']:>8.1f}  {r['products']} products")
    lines.append(f"  {'sum of products':23}{p['matmul_s'] * 1e3:>8.3f}"
                 f"{100 * p['matmul_s'] / p['step_s']:>7.1f}%")
    lines.append(f"  {'everything else':23}{p['other_s'] * 1e3:>8.3f}"
                 f"{100 * p['other_s'] / p['step_s']:>7.1f}%  attention over the cache, norms, "
                 "routing, packing, hand-offs")
    lines.append(f"  {'measured decode step':23}{p['step_s'] * 1e3:>8.3f}")
    if p["pool_run_us"]:
        lines.append(f"  thread pool: {p['pool_run_us']:.2f} us per empty run")
    return "\n".join(lines)
