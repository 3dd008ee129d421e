"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head q/k RMSNorm, softmax top-k routing, no
shared expert.

Defaults and semantics follow transformers' configuration_qwen3_moe.py / modeling_qwen3_moe.py.
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
from colibri.engine.models.qwen2_moe import check_all_sparse, qwen_window

NAME = "qwen3_moe"
HF_CLASSES = ("Qwen3MoeForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=False,
    tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
    decoder_sparse_step=1, attention_bias=False, bos_token_id=None, eos_token_id=None,
    rope_theta=10000.0,
)


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    check_plain_rope(hf)
    check_all_sparse(hf)
    if hf.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias (with an o_proj bias) is not supported")
    cfg = base_config(hf, NAME, hf_arch, gen)
    cfg.update(moe_counts(hf, "moe_intermediate_size"))
    cfg.update(n_ff_shared=0, shared_gate=False, norm_topk_prob=bool(hf.get("norm_topk_prob")),
               qk_norm="head", qkv_bias=False, clip_qkv=None,
               sliding_window=qwen_window(hf, None))
    return cfg


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names, routed_ffn(names))
