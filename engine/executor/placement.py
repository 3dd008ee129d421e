"""Placement on this machine: its measured device profile (the CPU through the C core's
probes, a torch device through engine/executor/torch_backend/profile.py) and what a run puts
on the torch device under a GPU memory budget, by the cost model's plan
(engine/executor/costmodel.py): layers' always-used work first, then routed experts hottest
first, a device layer's other experts left to the C core."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from colibri.engine.executor.backend import (
    LayerOp,
    Op,
    Placement,
    step_ops,
    torch_cuda_count,
    torch_device_name,
)
from colibri.engine.executor.costmodel import (
    CpuProfile,
    DeviceProfile,
    Plan,
    make_plan,
    model_costs,
)
from colibri.engine.format import quant
from colibri.engine.models.config import ModelConfig

BENCH_TYPES = ("f32", "f16", "q8", "q4")
PROBE_MIB = 128


def measure_cpu(threads: int = 0) -> CpuProfile:
    """This CPU's read GB/s and GMAC/s per weight type, measured with the C core's probes."""
    from colibri.engine import _core

    n = threads or os.cpu_count() or 1
    gbs = _core.bandwidth_probe(PROBE_MIB << 20, n, 3)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1024, 1024)).astype(np.float32)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    gmacs = {}
    for t in BENCH_TYPES:
        secs = _core.matmul_bench(t, quant.encode(w, t), 1024, 1024, x, n, 5)
        gmacs[t] = 1024 * 1024 * 64 / min(secs[1:]) / 1e9
    return CpuProfile(float(gbs), gmacs)


def measure_profile(threads: int = 0, device: str | None = None) -> DeviceProfile:
    """This machine's profile: its CPU, and the torch device `device` (a resolved device:
    "cuda:N" or "torch-cpu"; None: the first CUDA device when torch sees one)."""
    cpu = measure_cpu(threads)
    if device is None and torch_cuda_count() > 0:
        device = "cuda:0"
    gpu = None
    if device is not None and device != "cpu":
        from colibri.engine.executor.torch_backend.profile import measure_gpu

        gpu = measure_gpu(torch_device_name(device))
    return DeviceProfile("this machine", "measured", cpu, gpu)


def plan_placement(model_dir: Path, cfg: ModelConfig, profile: DeviceProfile,
                   budget_mb: float, context: int) -> tuple[Placement | None, str, Plan]:
    """The placement a run uses under budget_mb, from the cost model's plan (make_plan): the
    always-used work of the first layers (attention, norms, router, shared and dense FFNs,
    with their KV) on the torch device, then routed experts hottest first; a device layer's
    other experts run on the C core beside it. None when nothing is worth placing."""
    mc = model_costs(model_dir, cfg, context=context)
    plan = make_plan(profile, mc, budget_mb)
    if not plan.gpu_layers:
        return None, "every layer on the CPU (nothing placed is predicted faster)", plan
    layers = set(plan.gpu_layers)
    ops = {o: "torch" for o in step_ops(cfg) if o.layer in layers and o.op != Op.EXPERTS}
    experts: dict[tuple[int, int], str] = {}
    for il in sorted(layers & set(cfg.moe_layers)):
        on = plan.gpu_experts.get(il, [])
        if len(on) == cfg.n_expert:
            ops[LayerOp(il, Op.EXPERTS)] = "torch"
        else:
            experts.update({(il, e): "torch" for e in on})
    text = (f"layers 0..{max(layers)} of {cfg.n_layer} on the GPU"
            + _experts_text(cfg, plan)
            + (", the rest on the CPU" if len(layers) < cfg.n_layer else "")
            + f"; decode {plan.decode_ms:.2f} ms per token predicted")
    return Placement(default="c", ops=ops, experts=experts), text, plan


def _experts_text(cfg: ModelConfig, plan: Plan) -> str:
    """The routed experts a plan puts on the GPU, in words: how many, and how many of each
    layer when some stay on the CPU ("" for a model without routed experts)."""
    n_all = cfg.n_expert * len(cfg.moe_layers)
    if not n_all:
        return ""
    n_on = sum(len(v) for v in plan.gpu_experts.values())
    out = f" with {n_on} of {n_all} routed experts"
    if 0 < n_on < n_all:
        per = " ".join(f"{il}:{len(v)}" for il, v in sorted(plan.gpu_experts.items()) if v)
        out += (f" (hottest first; by layer {per}; the others run on the CPU beside them, "
                "and move by heat)")
    elif n_on == 0:
        out += " (they run on the CPU beside the GPU's layers)"
    return out


def budget_text(mb: float) -> str:
    """A GPU memory budget in MB as people write it: whole MB, or 3 digits below 100 MB."""
    return f"{mb:.0f} MB" if mb >= 100 else f"{mb:.3g} MB"
