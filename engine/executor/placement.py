"""Placement on this machine: its measured device profile (the CPU through the C core's
probes, a torch device through engine/executor/torch_backend/profile.py) and the layers a run
puts on the torch device under a GPU memory budget, by the cost model
(engine/executor/costmodel.py). Runs place whole layers (their experts with them)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from colibri.engine.executor.backend import (
    Placement,
    step_ops,
    torch_cuda_count,
    torch_device_name,
)
from colibri.engine.executor.costmodel import (
    CpuProfile,
    DeviceProfile,
    model_costs,
    step_time,
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


def layer_placement(model_dir: Path, cfg: ModelConfig, profile: DeviceProfile,
                    budget_mb: float, context: int) -> tuple[Placement | None, str]:
    """The placement a run uses under budget_mb: the first k layers whole (their always-used
    work, KV and every expert) on the torch device, k the fastest predicted that fits; the
    lm_head with them when every layer is there. None when no layer is worth placing."""
    mc = model_costs(model_dir, cfg, context=context)
    layer_bytes = [it.gpu_bytes + (mc.experts[it.layer].gpu_bytes * cfg.n_expert
                                   if it.layer in mc.experts else 0)
                   for it in mc.always if it.kind == "layer"]
    head = mc.always[-1].gpu_bytes
    best, best_k, used = step_time(profile, mc, 1, set(), False, {}), 0, 0
    for k in range(1, cfg.n_layer + 1):
        used += layer_bytes[k - 1]
        lm = k == cfg.n_layer and used + head <= budget_mb * 1e6
        if used > budget_mb * 1e6:
            break
        layers = set(range(k))
        t = step_time(profile, mc, 1, layers, lm,
                      {il: set(range(cfg.n_expert)) for il in layers if il in mc.experts})
        if t <= best:
            best, best_k = t, k
    if best_k == 0:
        return None, "every layer on the CPU (nothing placed is predicted faster)"
    ops = {o: "torch" for o in step_ops(cfg) if o.layer < best_k}
    placement = Placement(default="c", ops=ops)
    return placement, (f"layers 0..{best_k - 1} of {cfg.n_layer} on the GPU, the rest on the "
                       f"CPU; decode {1e3 * best:.2f} ms per token predicted")
