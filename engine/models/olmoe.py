"""OLMoE (OlmoeForCausalLM): MHA/GQA with RMSNorm over the whole q and k projections and an
optional clip of q/k/v, softmax top-k routing, no shared expert, no sliding window.

Defaults and semantics follow transformers' configuration_olmoe.py / modeling_olmoe.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    HFConfig,
    UnsupportedModel,
    base_config,
    build_plan,
    routed_ffn,
)
from colibri.engine.models.mixtral import check_plain_rope, moe_counts

NAME = "olmoe"
HF_CLASSES = ("OlmoeForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
    num_attention_heads=16, num_key_value_heads=None, max_position_embeddings=4096,
    rms_norm_eps=1e-5, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
    tie_word_embeddings=False, attention_bias=False, clip_qkv=None, bos_token_id=None,
    eos_token_id=50279, rope_theta=10000.0,
)


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    check_plain_rope(hf)
    if hf.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias (with an o_proj bias) is not supported")
    cfg = base_config(hf, NAME, hf_arch, gen)
    if cfg["head_dim"] * cfg["n_head"] != cfg["n_embd"]:
        raise UnsupportedModel("config.json: OLMoE with head_dim * heads != hidden_size")
    cfg.update(moe_counts(hf, "intermediate_size"))
    clip = raw.get("clip_qkv")
    cfg.update(n_ff_shared=0, shared_gate=False, norm_topk_prob=bool(hf.get("norm_topk_prob")),
               qk_norm="full", qkv_bias=False, clip_qkv=float(clip) if clip is not None else None,
               sliding_window=None)  # transformers builds a plain causal mask for OLMoE
    return cfg


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names, routed_ffn(names))
