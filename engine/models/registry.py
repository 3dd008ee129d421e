"""The architecture families Colibri knows, one module each, picked by a Hugging Face
config.json's `architectures[0]` (at conversion) or by our config.json's `architecture` (at
load). Adding a family: write engine/models/<family>.py with NAME, HF_CLASSES, DEFAULTS,
config() and plan(), and list it here (docs/adding-an-architecture.md)."""

from __future__ import annotations

from types import ModuleType

from colibri.engine.models import (
    deepseek,
    glm4_moe,
    gpt_oss,
    llama,
    minimax_m2,
    mixtral,
    olmoe,
    qwen2,
    qwen2_moe,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)

FAMILIES: tuple[ModuleType, ...] = (mixtral, qwen2_moe, qwen3_moe, olmoe, llama, qwen2,
                                    glm4_moe, deepseek, gpt_oss, minimax_m2, qwen3_next,
                                    qwen3_5_moe)
_BY_CLASS = {c: f for f in FAMILIES for c in f.HF_CLASSES}
_BY_NAME = {f.NAME: f for f in FAMILIES}
# Hugging Face class name -> family name
SUPPORTED: dict[str, str] = {c: f.NAME for c, f in _BY_CLASS.items()}


def family_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def for_hf_class(name: str | None) -> ModuleType | None:
    return _BY_CLASS.get(name or "")


def for_name(name: str) -> ModuleType:
    """The family module of a converted model's `architecture`; KeyError if unknown."""
    return _BY_NAME[name]
