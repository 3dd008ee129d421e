"""Hugging Face checkpoints -> Colibri config fields and tensor plan, through the family
modules (engine/models/<family>.py, listed in engine/models/registry.py).

`colibri_config(hf_config, generation_config)` picks the family from `architectures[0]` and
returns our config.json fields; `plan(cfg, names)` lists every tensor of the Colibri layout
with its source in the checkpoint. Refuses, with a message, unknown architectures and anything
the family's forward pass would compute differently from transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    BIAS,
    DENSE,
    EXPERT,
    MXFP4,
    NORM,
    ROUTER,
    SHARED,
    VOCAB,
    Source,
    Target,
    UnsupportedModel,
    fused_shape,
)
from colibri.engine.models.registry import SUPPORTED, for_hf_class, for_name

__all__ = ["BIAS", "DENSE", "EXPERT", "MXFP4", "NORM", "ROUTER", "SHARED", "SUPPORTED", "VOCAB",
           "Source", "Target", "UnsupportedModel", "colibri_config", "fused_shape", "mtp_plan",
           "offers_mtp", "plan"]


def colibri_config(hf: dict[str, Any], gen: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Colibri config fields (docs/INTERNALS.md) for a Hugging Face config.json."""
    archs = hf.get("architectures") or []
    hf_arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    family = for_hf_class(hf_arch) if isinstance(hf_arch, str) else None
    if family is None:
        raise UnsupportedModel(
            f"config.json: architecture {archs!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED))}"
        )
    # auto_map (remote code) is never imported: only plain fields are read
    return family.config(hf, hf_arch, gen)


def plan(cfg: dict[str, Any], names: set[str]) -> list[Target]:
    """Every tensor of the Colibri layout with its source, in file order.

    names: the checkpoint's tensor names (to tell legacy from fused experts). Raises
    UnsupportedModel if the checkpoint holds tensors this layout does not use (e.g. biases
    the forward pass would ignore).
    """
    return for_name(cfg["architecture"]).plan(cfg, names)


def mtp_plan(cfg: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list[Target]] | None:
    """The checkpoint's multi-token-prediction layer as a one-layer model of its own (its
    config fields and tensor plan), or None when the family has none or the checkpoint does
    not ship it. Only the families whose layer can be run (DeepSeek-V3, GLM-4.5, Qwen3-Next,
    Qwen3.5) offer one."""
    fn = getattr(for_name(cfg["architecture"]), "mtp_plan", None)
    return fn(cfg, names) if fn is not None else None


def offers_mtp(architecture: str) -> bool:
    """Whether the converter keeps a multi-token-prediction layer for checkpoints of this
    family (our architecture name) that ship one."""
    try:
        family = for_name(architecture)
    except KeyError:
        return False
    return hasattr(family, "mtp_plan")
