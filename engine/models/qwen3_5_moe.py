"""The text part of Qwen3.5 MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): the
Qwen3-Next layer mix (engine/models/qwen3_next.py: gated DeltaNet linear attention between gated
full-attention layers, zero-centred norms, routed experts plus a gated shared expert on every
layer) with the linear layers' input projections as four matrices (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a) and a router that always renormalises its top-k. Its multi-axis RoPE
(mrope_section) rotates text positions as plain RoPE: a text token has the same position on
every axis. The multi-token-prediction module (mtp.*) is converted as Qwen3-Next's is
(qwen3_next.hybrid_mtp_plan, for --speculative mtp). The released checkpoints are multimodal
(Qwen3_5MoeForConditionalGeneration): their text_config and model.language_model.* tensors are
this model; the vision encoder (model.visual.*) is skipped.

Defaults and semantics follow transformers' configuration_qwen3_5_moe.py /
modeling_qwen3_5_moe.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import HFConfig, Target, UnsupportedModel, base_config
from colibri.engine.models.qwen3_next import hybrid_config, hybrid_mtp_plan, hybrid_plan

NAME = "qwen3_5_moe"
HF_CLASSES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MULTIMODAL = "Qwen3_5MoeForConditionalGeneration"
DEFAULTS: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts_per_tok=8, num_experts=256, layer_types=None, full_attention_interval=4,
    partial_rotary_factor=0.25, rope_theta=10000.0, bos_token_id=None, eos_token_id=None,
)


def text_config(raw: dict[str, Any], hf_arch: str) -> dict[str, Any]:
    """The text model's config: raw itself, or a multimodal checkpoint's text_config (with
    the top level's tie_word_embeddings when it does not say)."""
    if hf_arch != MULTIMODAL:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModel(f"config.json: {MULTIMODAL} needs a text_config object")
    text = dict(text)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return text


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(text_config(raw, hf_arch), DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    cfg.update(hybrid_config(hf, cfg, ["moe"] * cfg["n_layer"], norm_topk_prob=True))
    return cfg


def _prefix(names: set[str]) -> str:
    """Where the text model's tensors are: model.language_model. in a multimodal checkpoint."""
    multimodal = "model.language_model.embed_tokens.weight" in names
    return "model.language_model." if multimodal else "model."


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return hybrid_plan(cfg, names, split=True, prefix=_prefix(names))


def mtp_plan(cfg: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list[Target]] | None:
    """The multi-token-prediction module (mtp.*, at the top level of multimodal checkpoints
    too) as a one-layer model."""
    return hybrid_mtp_plan(cfg, names, _prefix(names))
