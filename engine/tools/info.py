"""Summaries of a converted Colibri model folder (`colibri info`).

Reads only config.json and the weight files' tables (never tensor data), validating each
table as the loader would; refuses folders that are not Colibri model folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from colibri.engine.format import quant
from colibri.engine.format.jsonfile import read_json_object
from colibri.engine.format.wfile import read_wfile

_DIMS = ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff",
         "n_expert", "n_expert_used", "n_ff_shared", "n_ff_dense")
_FEATURES = ("router", "n_group", "topk_group", "routed_scale", "norm_topk_prob", "qk_norm",
             "qkv_bias", "o_bias", "clip_qkv", "rope_theta", "rope", "rotary_dim", "rms_eps",
             "sliding_window", "layer_attn", "attn_chunk", "nope_layers", "attn_temp_floor",
             "attn_temp_scale", "route_input", "attn_sinks", "router_bias", "expert_bias", "glu",
             "glu_alpha", "glu_limit", "attn_gate", "lin_n_k_heads", "lin_n_v_heads",
             "lin_k_dim", "lin_v_dim", "lin_conv", "tie_embeddings", "max_position_embeddings",
             "bos_token_id", "eos_token_ids")


def describe(model_dir: str | Path, device: str = "auto", gpu_memory_mb: float | None = None,
             device_profile: str | None = None) -> dict[str, Any]:
    """Architecture, dimensions, parameter counts (total, active per token), bytes by type,
    and where a run on `device` (under gpu_memory_mb, planned with device_profile or this
    machine's measured one) would place its work."""
    from colibri.engine.tools.plan import placement_summary

    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{model_dir}: no config.json (not a model folder)")
    cfg = read_json_object(cfg_path, "model config")
    if cfg.get("format") != "colibri":
        raise ValueError(f"{model_dir}: not a Colibri model folder (run `colibri convert` first)")
    files = cfg.get("files") or {}

    bytes_by_type: dict[str, int] = {}
    params_total = params_expert = params_shared = 0
    experts_per_layer: dict[int, int] = {}
    mtp = cfg.get("mtp") or ""
    params_mtp = 0
    for name in sorted(files):
        if not name.endswith(".bin"):
            continue
        wf = read_wfile(model_dir / name)
        n = 0
        for t in wf.tensors.values():
            numel = 1
            for d in t.shape:
                numel *= d
            n += numel
            ty = quant.row_type(t.type_name)  # by number format, any layout
            bytes_by_type[ty] = bytes_by_type.get(ty, 0) + t.nbytes
        if mtp and name.startswith(f"{mtp}/"):  # drafts only: not part of a decode step
            params_mtp += n
            continue
        params_total += n
        if name.startswith("shared/"):
            params_shared += n
        if name.startswith("experts/"):
            params_expert += n
            layer = int(name.split("_")[1])
            experts_per_layer[layer] = experts_per_layer.get(layer, 0) + 1
    n_expert = int(cfg.get("n_expert") or 1)
    used = int(cfg.get("n_expert_used") or 0)
    params_active = params_total - params_expert + params_expert * used // n_expert
    return {
        "path": str(model_dir),
        "architecture": cfg.get("architecture"),
        "hf_architecture": cfg.get("hf_architecture"),
        "quant": cfg.get("quant"),
        "dims": {k: cfg.get(k) for k in _DIMS},
        "features": {k: cfg.get(k) for k in _FEATURES},
        "params_total": params_total,
        "params_active": params_active,
        "bytes_total": sum(int(m.get("size", 0)) for m in files.values()),
        "bytes_by_type": dict(sorted(bytes_by_type.items())),
        "params_shared_experts": params_shared,
        "layer_ffn": list(cfg.get("layer_ffn") or ["moe"] * int(cfg["n_layer"])),
        "layer_mixer": list(cfg.get("layer_mixer") or ["attention"] * int(cfg["n_layer"])),
        "experts_per_layer": [experts_per_layer.get(i, 0) for i in range(int(cfg["n_layer"]))],
        "n_files": len(files),
        "mtp": {"folder": mtp, "params": params_mtp} if mtp else None,
        "tokenizer": (model_dir / "tokenizer.json").is_file(),
        "placement": placement_summary(model_dir, device, gpu_memory_mb, device_profile),
    }


def _count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _span(idx: list[int]) -> str:
    """Layer indices in short: "3", "3-91", "1-47 step 2" (evenly interleaved), or a list of
    a few; "" for many irregular ones."""
    if len(idx) == 1:
        return f" ({idx[0]})"
    step = idx[1] - idx[0]
    if idx == list(range(idx[0], idx[-1] + 1, step)):
        return f" ({idx[0]}-{idx[-1]}" + (f" step {step})" if step > 1 else ")")
    return f" ({', '.join(map(str, idx))})" if len(idx) <= 8 else ""


def _kinds(kinds: list[str], labels: tuple[tuple[str, str], ...]) -> list[str]:
    parts = []
    for kind, label in labels:
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if idx:
            parts.append(f"{len(idx)} {label}{_span(idx)}")
    return parts


def _layers(d: dict[str, Any]) -> str:
    """The layers by FFN kind, e.g. "3 dense (0-2), 89 MoE (3-91)" or, interleaved,
    "24 dense (0-46 step 2), 24 MoE (1-47 step 2)", and by token mixer when some layers are
    linear attention ("36 linear attention, 12 full attention")."""
    parts = _kinds(d["layer_ffn"], (("dense", "dense"), ("moe", "MoE")))
    mixers = d.get("layer_mixer") or []
    if "linear" in mixers:
        parts += _kinds(mixers, (("linear", "linear attention (recurrent state per sequence)"),
                                 ("attention", "full attention (KV cache)")))
    return ", ".join(parts)


def render(d: dict[str, Any]) -> str:
    """describe()'s result as human-readable text."""
    lines = [
        f"model         {d['path']}",
        f"architecture  {d['architecture']} ({d['hf_architecture']}), quant {d['quant']}",
        "dimensions    " + ", ".join(f"{k}={v}" for k, v in d["dims"].items()),
        "features      " + ", ".join(f"{k}={v}" for k, v in d["features"].items()
                                     if v not in (None, {})),
        f"layers        {_layers(d)}",
        f"parameters    {_count(d['params_total'])} total, "
        f"{_count(d['params_active'])} active per token"
        + (f", {_count(d['params_shared_experts'])} in shared experts (always resident)"
           if d["params_shared_experts"] else ""),
        f"size          {_size(d['bytes_total'])} in {d['n_files']} files",
        "bytes by type " + ", ".join(f"{k}: {_size(v)}" for k, v in d["bytes_by_type"].items()),
        "experts/layer " + " ".join(str(n) for n in d["experts_per_layer"]),
        f"tokenizer     {'tokenizer.json' if d['tokenizer'] else 'missing'}",
    ]
    if d.get("placement"):
        lines.append(f"placement     {d['placement']}")
    if d.get("mtp"):
        lines.append(f"MTP layers    1 multi-token-prediction layer in {d['mtp']['folder']}/ "
                     f"({_count(d['mtp']['params'])} parameters): drafts for "
                     f"--speculative mtp")
    return "\n".join(lines)
