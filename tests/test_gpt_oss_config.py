"""The gpt-oss family module on config.json alone: transformers' defaults fill what a
config leaves out, and every refusal names the config value it cannot run."""

from __future__ import annotations

from typing import Any

import pytest

from colibri.engine.models import archs

BASE: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 320,
}


def test_defaults_are_transformers_defaults() -> None:
    cfg = archs.colibri_config(BASE)
    assert cfg["layer_attn"] == ["sliding", "full", "sliding", "full"]
    assert cfg["sliding_window"] == 128
    assert cfg["rope_theta"] == 150000.0
    assert cfg["rope"] == {"type": "yarn", "factor": 32.0, "original_max_position_embeddings":
                           4096.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    assert (cfg["glu"], cfg["glu_alpha"], cfg["glu_limit"]) == ("swiglu_clamp", 1.702, 7.0)
    assert cfg["qkv_bias"] and cfg["o_bias"] and cfg["attn_sinks"]
    assert cfg["router_bias"] and cfg["expert_bias"] and cfg["norm_topk_prob"]
    full = archs.colibri_config({**BASE, "layer_types": ["full_attention"] * 4})
    assert full["sliding_window"] is None and full["layer_attn"] == ["full"] * 4


@pytest.mark.parametrize("over, words", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention",
                      "full_attention"]}, "layer_types value 'chunked_attention'"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types must list 4"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
    ({"quantization_config": {"quant_method": "mxfp4"}, "intermediate_size": 48},
     "intermediate_size (48)"),
    ({"swiglu_limit": 0}, "swiglu_limit 0.0"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
])
def test_refusals_name_the_value(over: dict[str, Any], words: str) -> None:
    with pytest.raises(archs.UnsupportedModel) as e:
        archs.colibri_config({**BASE, **over})
    assert words in str(e.value)
