"""RoPE frequencies for the rope types families use, computed as transformers computes them
(float32, modeling_rope_utils.py), so the C core only rotates by the angles it is given.

`rope_frequencies(rope, theta, rotary_dim)` returns the inverse frequencies [rotary_dim / 2]
and the factor cos and sin are multiplied by; (None, 1.0) for plain RoPE, whose frequencies
the C core computes itself. `rope_config` checks a family's rope parameters once, at
conversion, and keeps only the values these formulas read (stored in config.json as "rope").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from colibri.engine.models.family import UnsupportedModel

TYPES = ("default", "linear", "llama3", "yarn")


def _num(params: dict[str, Any], key: str, default: float | None = None) -> float:
    v = params.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise UnsupportedModel(f"config.json: rope parameter {key} must be a positive number, "
                               f"got {v!r}")
    return float(v)


def rope_config(params: dict[str, Any], max_position_embeddings: int) -> dict[str, Any]:
    """The "rope" entry of our config.json for HF rope parameters ({} for plain RoPE)."""
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind not in TYPES:
        raise UnsupportedModel(f"config.json: rope type {kind!r} is not supported "
                               f"(supported: {', '.join(TYPES)})")
    if kind == "default":
        return {}
    out: dict[str, Any] = {"type": kind, "factor": _num(params, "factor")}
    if kind == "llama3":
        out.update(low_freq_factor=_num(params, "low_freq_factor"),
                   high_freq_factor=_num(params, "high_freq_factor"),
                   original_max_position_embeddings=_num(
                       params, "original_max_position_embeddings"))
        if out["high_freq_factor"] < out["low_freq_factor"]:  # equal: no smoothed band
            raise UnsupportedModel("config.json: llama3 rope needs high_freq_factor >= "
                                   "low_freq_factor")
    elif kind == "yarn":
        out["original_max_position_embeddings"] = _num(
            params, "original_max_position_embeddings", max_position_embeddings)
        for k in ("attention_factor", "mscale", "mscale_all_dim"):
            if params.get(k) is not None:
                out[k] = float(params[k])
        out["beta_fast"] = float(params.get("beta_fast") or 32)
        out["beta_slow"] = float(params.get("beta_slow") or 1)
        out["truncate"] = bool(params.get("truncate", True))
    return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 above scale 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _default(theta: float, dim: int) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def _llama3(inv: np.ndarray, r: dict[str, Any]) -> np.ndarray:
    factor, lo, hi = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    if hi == lo:  # Llama 4 Scout: the band between the two wavelengths is empty
        return scaled
    smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(theta: float, dim: int, r: dict[str, Any]) -> tuple[np.ndarray, float]:
    factor, orig = r["factor"], r["original_max_position_embeddings"]
    att = r.get("attention_factor")
    if att is None:
        ms, ms_all = r.get("mscale"), r.get("mscale_all_dim")
        att = (yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all
               else yarn_mscale(factor))

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(r["beta_fast"]), corr_dim(r["beta_slow"])
    if r["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extra = (np.float32(1.0) / pos).astype(np.float32)
    inter = (np.float32(1.0) / (np.float32(factor) * pos)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)
    return (inter * (1 - keep) + extra * keep).astype(np.float32), float(att)


def rope_frequencies(rope: dict[str, Any], theta: float,
                     rotary_dim: int) -> tuple[list[float] | None, float]:
    """(inverse frequencies or None for plain RoPE, cos/sin factor) of a config's "rope"."""
    kind = rope.get("type", "default") if rope else "default"
    if kind == "default":
        return None, 1.0
    if kind == "linear":
        return (_default(theta, rotary_dim) / np.float32(rope["factor"])).tolist(), 1.0
    if kind == "llama3":
        return _llama3(_default(theta, rotary_dim), rope).tolist(), 1.0
    if kind == "yarn":
        freqs, att = _yarn(theta, rotary_dim, rope)
        return freqs.tolist(), att
    raise ValueError(f"unknown rope type {kind!r}")
