"""Dense Llama and Mistral (LlamaForCausalLM, MistralForCausalLM): GQA attention (biases on
q/k/v/o with attention_bias), Llama 3's or linear rope scaling, a SiLU-gated FFN in every
layer (a model without routed experts); Mistral's sliding window.

Defaults and semantics follow transformers' configuration_llama.py / modeling_llama.py and
configuration_mistral.py / modeling_mistral.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    HFConfig,
    Plan,
    UnsupportedModel,
    base_config,
    build_plan,
    no_experts,
    rope_parameters,
)
from colibri.engine.models.mixtral import window
from colibri.engine.models.rope import rope_config

NAME = "llama"
HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM")
DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, head_dim=None, rope_theta=10000.0,
)
MISTRAL_DEFAULTS: dict[str, Any] = dict(
    DEFAULTS, intermediate_size=14336, num_key_value_heads=8,
    max_position_embeddings=4096 * 32, sliding_window=4096,
)


def dense_config(hf: HFConfig, name: str, hf_arch: str,
                 gen: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of a dense model: every layer dense, rope from its parameters."""
    cfg = base_config(hf, name, hf_arch, gen)
    params = rope_parameters(hf)
    prf = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} is not supported")
    cfg.update(no_experts())
    cfg.update(n_ff_dense=hf.pos_int("intermediate_size"),
               layer_ffn=["dense"] * cfg["n_layer"],
               rope=rope_config(params, cfg["max_position_embeddings"]),
               qk_norm="none", qkv_bias=False, o_bias=False, clip_qkv=None, sliding_window=None)
    return cfg


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    mistral = hf_arch == "MistralForCausalLM"
    hf = HFConfig(raw, MISTRAL_DEFAULTS if mistral else DEFAULTS)
    if hf.get("mlp_bias"):
        raise UnsupportedModel("config.json: mlp_bias is not supported")
    if raw.get("layer_types") and len(set(raw["layer_types"])) > 1:
        raise UnsupportedModel("config.json: per-layer attention types are not supported")
    cfg = dense_config(hf, NAME, hf_arch, gen)
    bias = bool(hf.get("attention_bias"))
    cfg.update(qkv_bias=bias, o_bias=bias)
    if mistral:
        cfg["sliding_window"] = window(hf.get("sliding_window"))
    return cfg


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    """Every layer: attention, then a dense FFN (shared by the dense families)."""
    return build_plan(cfg, names, Plan.dense_ffn)
