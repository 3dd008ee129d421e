"""`colibri bench --profile`: where a decoded token's time goes, phase by phase.

Every figure is timed in place, in C, during the timed decode of the run with the median decode
time: the weight products of each phase of a layer (attention projections, router, expert
gate+up, expert down, shared expert, lm_head: each dispatch with its activation packing and
thread-pool hand-off), attention over the KV cache, the rest of the forward calls (norms,
routing, combining the experts' outputs), and what the caller spends outside the forward calls
(Python: argument checks, sampling). Each phase's rate is set against the memory read measured
just before and just after that run.
"""

from __future__ import annotations

from typing import Any, Protocol


class DecodeTimings(Protocol):
    """What a profile reads of one timed run; bench.RunTiming has it. Typed by shape, so that
    this module never imports bench: bench imports it, never the other way round."""

    @property
    def decode_s(self) -> float: ...
    @property
    def decode_phases(self) -> dict[str, dict[str, float]]: ...
    @property
    def decode_attention_s(self) -> float: ...
    @property
    def decode_forward_s(self) -> float: ...
    @property
    def decode_products_s(self) -> float: ...


def decode_profile(run: DecodeTimings, n_gen: int, read_gb_s: float,
                   n_threads: int) -> dict[str, Any]:
    """Seconds, weight bytes and calls per decoded token of each product phase of `run` (the
    phases that ran), the non-product parts, and read_gb_s, the memory's read rate around the
    run; with the thread pool's cost of one empty run on n_threads threads."""
    from colibri.engine import _core

    phases = {}
    for name, ph in run.decode_phases.items():
        if ph["calls"] == 0:
            continue
        s, nbytes = ph["s"] / n_gen, ph["weight_bytes"] / n_gen
        phases[name] = {"s": s, "bytes": nbytes, "calls": ph["calls"] / n_gen,
                        "gb_s": nbytes / s / 1e9 if s > 0 else 0.0}
    products = run.decode_products_s / n_gen
    attention = run.decode_attention_s / n_gen
    forward = run.decode_forward_s / n_gen
    step = run.decode_s / n_gen
    return {"phases": phases, "products_s": products, "attention_s": attention,
            "rest_of_forward_s": forward - products - attention,
            "outside_forward_s": step - forward, "step_s": step, "read_gb_s": read_gb_s,
            "pool_run_us": _core.threadpool_bench(n_threads, 2000, 20) / 1e3 if n_threads > 1
            else 0.0}


def _dispatches(n: float) -> str:
    return "1 dispatch" if round(n) == 1 else f"{n:.0f} dispatches"


def render_profile(p: dict[str, Any]) -> str:
    """A decode_profile result as lines of the bench table."""
    step, read = p["step_s"], p["read_gb_s"]

    def line(name: str, s: float, tail: str = "") -> str:
        return f"  {name:25}{s * 1e3:>8.3f}{100 * s / step:>7.1f}%{tail}"

    lines = [f"{'profile':17}{'ms/token':>10}{'share':>8}{'GB/s':>8}{'% read':>8}  "
             f"(median run, timed in place; read {read:.1f} GB/s around it)"]
    for name, r in p["phases"].items():
        lines.append(line(name, r["s"], f"{r['gb_s']:>8.1f}{100 * r['gb_s'] / read:>8.1f}"
                                        f"  {_dispatches(r['calls'])}"))
    lines.append(line("all products", p["products_s"]))
    lines.append(line("attention over the cache", p["attention_s"]))
    lines.append(line("rest of the forward pass", p["rest_of_forward_s"],
                      "  norms, routing, combining experts"))
    lines.append(line("outside the forward pass", p["outside_forward_s"],
                      "  Python: checks, sampling"))
    lines.append(f"  {'measured decode step':25}{step * 1e3:>8.3f}")
    if p["pool_run_us"]:
        lines.append(f"  thread pool: {p['pool_run_us']:.2f} us per empty run")
    return "\n".join(lines)
