"""Qwen2-MoE (Qwen2MoeForCausalLM): GQA with q/k/v biases, softmax top-k routing, one shared
expert scaled by a sigmoid gate; a sliding window only when every layer has it.

Defaults and semantics follow transformers' configuration_qwen2_moe.py / modeling_qwen2_moe.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    HFConfig,
    Plan,
    UnsupportedModel,
    base_config,
    build_plan,
    per_expert_names,
)
from colibri.engine.models.mixtral import check_plain_rope, moe_counts, window

NAME = "qwen2_moe"
HF_CLASSES = ("Qwen2MoeForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6,
    moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
    num_experts_per_tok=4, norm_topk_prob=False, tie_word_embeddings=False,
    use_sliding_window=False, sliding_window=4096, max_window_layers=28, decoder_sparse_step=1,
    qkv_bias=True, bos_token_id=None, eos_token_id=None, rope_theta=10000.0,
)


def check_all_sparse(hf: HFConfig) -> None:
    if hf.raw.get("mlp_only_layers"):
        raise UnsupportedModel("config.json: dense layers (mlp_only_layers) are not supported")
    if hf.get("decoder_sparse_step") != 1:
        raise UnsupportedModel("config.json: decoder_sparse_step other than 1 is not supported")


def qwen_window(hf: HFConfig, layer_types: list[str] | None) -> int | None:
    """Qwen's sliding window: used when use_sliding_window is set and every layer slides."""
    if not hf.get("use_sliding_window"):
        return None
    if layer_types is not None and "full_attention" in layer_types:
        if "sliding_attention" in layer_types:
            raise UnsupportedModel(
                "config.json: a sliding window on some layers only is not supported"
            )
        return None
    return window(hf.get("sliding_window"))


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    check_plain_rope(hf)
    check_all_sparse(hf)
    cfg = base_config(hf, NAME, hf_arch, gen)
    cfg.update(moe_counts(hf, "moe_intermediate_size"))
    n = cfg["n_layer"]
    types = raw.get("layer_types")
    if types is None:
        mwl = hf.get("max_window_layers")
        types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention"
                 for i in range(n)]
    fs = hf.pos_int("shared_expert_intermediate_size")
    cfg.update(n_ff_shared=fs, shared_gate=True, norm_topk_prob=bool(hf.get("norm_topk_prob")),
               qk_norm="none", qkv_bias=bool(hf.get("qkv_bias")), clip_qkv=None,
               sliding_window=qwen_window(hf, types))
    return cfg


def _ffn(pl: Plan, i: int, p: str, names: set[str]) -> None:
    moe = p + "mlp."
    pl.router(i, p, moe, shared_gate="shared_expert_gate.weight")
    pl.experts(i, moe, per_expert_names(names, moe))
    pl.shared(i, moe + "shared_expert.")


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names, lambda pl, i, p: _ffn(pl, i, p, names))
