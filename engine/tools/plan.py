"""`colibri plan`: where each part of a model would run under a GPU memory budget, and the
predicted decode ms per token and prefill ms per 512 tokens (engine/executor/costmodel.py).

Without --profile it measures this machine: the CPU's read GB/s (the C probe `colibri bench`
uses) and its GMAC/s per weight type (the C products on a 1024 x 1024 matrix over 64 tokens),
and, when torch sees a CUDA device, that device (engine/executor/torch_backend/profile.py).
--profile plans for another machine (a JSON file, or "h200", a profile kept with Colibri).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from colibri.engine.executor.costmodel import DeviceProfile, Plan, make_plan, model_costs
from colibri.engine.executor.placement import budget_text, measure_profile, plan_placement
from colibri.engine.models.config import ModelConfig


def plan_for(model_dir: Path, profile: DeviceProfile, budget_mb: float | None,
             context: int = 1024) -> tuple[Plan, dict[str, Any]]:
    """The plan for a converted folder (budget None: the profile's whole GPU memory)."""
    cfg = ModelConfig.from_dir(model_dir)
    mc = model_costs(model_dir, cfg, context=context)
    mb = budget_mb if budget_mb is not None else (profile.gpu.memory_mb if profile.gpu else 0)
    plan = make_plan(profile, mc, float(mb))
    n_exp = sum(len(v) for v in plan.gpu_experts.values())
    info = {"model": str(model_dir), "profile": profile.name, "profile_source": profile.source,
            "gpu": profile.gpu.name if profile.gpu else None, "n_layer": cfg.n_layer,
            "n_experts": cfg.n_expert * len(cfg.moe_layers), "gpu_experts": n_exp,
            "context": context}
    return plan, info


def placement_summary(model_dir: Path, device: str, gpu_memory_mb: float | None,
                      device_profile: str | None = None) -> str:
    """What a run with these options would place where (`colibri info`): a device without
    torch's figures is not measured; a budget is planned with device_profile, or this
    machine's measured profile."""
    from colibri.engine.executor.backend import resolve_device, torch_unsupported

    cfg = ModelConfig.from_dir(model_dir)
    try:
        dev = resolve_device(device)
    except ValueError as e:
        return f"cannot run here: {e}"
    missing = torch_unsupported(cfg)
    if dev != "cpu" and missing:
        return (f"{device}: the GPU path does not run {', '.join(missing)}; "
                + ("everything on the CPU (the C core)" if device == "auto" else "refused"))
    if dev == "cpu":
        return "everything on the CPU (the C core)"
    if gpu_memory_mb is None:
        return f"everything on {dev} (the torch backend)"
    prof = DeviceProfile.load(device_profile) if device_profile else measure_profile(0, dev)
    n_ctx = cfg.default_n_ctx()  # what serve holds without --n-ctx
    _p, text, _plan = plan_placement(model_dir, cfg, prof, gpu_memory_mb, n_ctx)
    return f"{dev} under {budget_text(gpu_memory_mb)} (a KV cache of {n_ctx} positions): {text}"


def render(plan: Plan, info: dict[str, Any]) -> str:
    lines = [f"profile        {info['profile']} ({info['profile_source']})"
             + (f", GPU {info['gpu']}" if info["gpu"] else ", no GPU")]
    if not info["gpu"]:
        lines.append("placement      everything on the CPU (the C core)")
    else:
        gl = plan.gpu_layers
        lines += [
            f"budget         {plan.budget_mb:.0f} MB of GPU memory, {plan.gpu_bytes / 1e6:.0f} "
            "MB placed",
            f"GPU            {len(gl)} of {info['n_layer']} layers' attention, norms, routers, "
            f"shared and dense FFNs with their KV ({info['context']} positions)"
            + (", the lm_head" if plan.lm_head_on_gpu else ""),
            f"               {info['gpu_experts']} of {info['n_experts']} routed experts, "
            "hottest first",
        ]
        if plan.gpu_experts:
            per = " ".join(f"{il}:{len(v)}" for il, v in sorted(plan.gpu_experts.items()))
            lines += textwrap.wrap(per, 92, initial_indent="  by layer     ",
                                   subsequent_indent=" " * 15)
        lines.append("CPU            the rest: a GPU layer's other experts run on the CPU beside "
                     "it, and move to the GPU by heat between steps")
    lines += [
        f"decode         {plan.decode_ms:.2f} ms per token predicted "
        f"(all on the CPU: {plan.cpu_decode_ms:.2f})",
        f"prefill        {plan.prefill_ms:.1f} ms per 512 tokens predicted "
        f"(all on the CPU: {plan.cpu_prefill_ms:.1f})",
    ]
    return "\n".join(lines)


def plan_main(model_dir: Path, profile: str | None, budget_mb: float | None, as_json: bool,
              threads: int = 0) -> str:
    prof = DeviceProfile.load(profile) if profile else measure_profile(threads)
    plan, info = plan_for(model_dir, prof, budget_mb)
    if as_json:
        return json.dumps({**info, "plan": plan.to_dict()}, indent=2)
    return render(plan, info)
