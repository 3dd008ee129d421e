"""KV cache element types as users choose them: the C core's types plus "auto", which follows
the weights (an f32 model gets an f32 cache, so a user who converts at f32 to be exact is;
every other precision gets f16). Plain data, so options parse without loading the core."""

from __future__ import annotations

CORE_KV_TYPES = ("f32", "f16", "q8")  # the C core's KV_TYPES (a test checks them)
KV_CACHE_TYPES = ("auto", *CORE_KV_TYPES)
DEFAULT_KV_CACHE_TYPE = "auto"


def resolve_kv_type(requested: str, quant: str) -> str:
    """The core KV type for a requested one and the model's weight precision (config.json
    "quant"); ValueError for an unknown name."""
    if requested == "auto":
        return "f32" if quant == "f32" else "f16"
    if requested not in CORE_KV_TYPES:
        raise ValueError(f"unknown KV cache type {requested!r}; choose one of "
                         f"{', '.join(KV_CACHE_TYPES)}")
    return requested
