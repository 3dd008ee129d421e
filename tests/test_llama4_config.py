"""The Llama 4 family module on config.json alone: transformers' Llama4TextConfig defaults
fill what a config leaves out, the layer mix (MoE / dense, RoPE / NoPE, chunked / global)
follows its keys as transformers reads them, and every refusal names the config value it
cannot run."""

from __future__ import annotations

from typing import Any

import pytest

from colibri.engine.models import archs
from colibri.engine.models.config import ModelConfig

BASE: dict[str, Any] = {
    "architectures": ["Llama4ForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
    "intermediate_size_mlp": 96, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 320,
}
# Llama 4 Scout's rope scaling: low and high frequency factors equal
SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "high_freq_factor": 1.0,
              "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
              "rope_theta": 500000.0}


def test_defaults_are_transformers_defaults() -> None:
    cfg = archs.colibri_config(BASE)
    assert cfg["head_dim"] == 128  # Llama4TextConfig's default, not hidden / heads
    assert cfg["rope_theta"] == 500000.0 and cfg["rope"] == {}
    assert (cfg["bos_token_id"], cfg["eos_token_ids"]) == (1, [2])
    # every layer MoE (interleave_moe_layer_step 1), one routed expert of 16 + a shared one
    assert cfg["layer_ffn"] == ["moe"] * 8 and cfg["n_ff_dense"] == 0
    assert (cfg["n_expert"], cfg["n_expert_used"], cfg["n_ff"], cfg["n_ff_shared"]) == (
        16, 1, 32, 32)
    assert cfg["router"] == "sigmoid_topk" and cfg["route_input"] and not cfg["shared_gate"]
    # a NoPE layer every 4 layers, global; the others chunked over 8192 positions
    assert cfg["nope_layers"] == [3, 7]
    assert cfg["layer_attn"] == ["chunked"] * 3 + ["full"] + ["chunked"] * 3 + ["full"]
    assert cfg["attn_chunk"] == 8192 and cfg["qk_norm"] == "l2"
    assert (cfg["attn_temp_floor"], cfg["attn_temp_scale"]) == (8192.0, 0.1)
    assert not cfg["qkv_bias"] and not cfg["o_bias"]


def test_maverick_shape_interleaves_dense_layers() -> None:
    cfg = archs.colibri_config({**BASE, "interleave_moe_layer_step": 2, "use_qk_norm": False,
                                "num_local_experts": 128})
    assert cfg["layer_ffn"] == ["dense", "moe"] * 4 and cfg["n_ff_dense"] == 96
    assert cfg["qk_norm"] == "none" and cfg["n_expert"] == 128
    # moe_layers, when given, overrides the step (out-of-range entries never match a layer)
    given = archs.colibri_config({**BASE, "moe_layers": [0, 5, 9]})
    assert given["layer_ffn"] == ["moe"] + ["dense"] * 4 + ["moe"] + ["dense"] * 2
    dense = archs.colibri_config({**BASE, "moe_layers": []})
    assert dense["n_expert"] == 0 and dense["layer_ffn"] == ["dense"] * 8


def test_layer_keys_as_transformers_reads_them() -> None:
    # an empty no_rope_layers falls back to the interval, as Llama4TextConfig does
    cfg = archs.colibri_config({**BASE, "no_rope_layers": [], "no_rope_layer_interval": 2})
    assert cfg["nope_layers"] == [1, 3, 5, 7]
    cfg = archs.colibri_config({**BASE, "no_rope_layers": [0] + [1] * 7,
                                "attention_chunk_size": None})
    assert cfg["nope_layers"] == [0] and cfg["layer_attn"] == ["full"] * 8
    assert cfg["attn_chunk"] is None
    # layer_types decides the masks even where it disagrees with no_rope_layers
    types = ["full_attention"] * 7 + ["chunked_attention"]
    cfg = archs.colibri_config({**BASE, "layer_types": types, "attention_chunk_size": 32})
    assert cfg["layer_attn"] == ["full"] * 7 + ["chunked"] and cfg["nope_layers"] == [3, 7]
    off = archs.colibri_config({**BASE, "attn_temperature_tuning": False})
    assert off["attn_temp_floor"] == 0.0
    # the first released configs wrote an integer here; transformers reads it as a truth value
    on = archs.colibri_config({**BASE, "attn_temperature_tuning": 4})
    assert (on["attn_temp_floor"], on["attn_temp_scale"]) == (8192.0, 0.1)
    scout = archs.colibri_config({**BASE, "rope_parameters": SCOUT_ROPE})
    assert scout["rope"]["type"] == "llama3" and scout["rope"]["high_freq_factor"] == 1.0


def test_the_core_gets_per_layer_attention_flags() -> None:
    """clb_layer_attn_bit per layer: chunked RoPE layers with the q/k L2 norm, global NoPE
    layers with the query temperature."""
    cfg = archs.colibri_config({**BASE, "num_hidden_layers": 4})
    cfg.update(format="colibri", format_version=1, quant="f32")
    hp = ModelConfig.from_dict(cfg).to_hparams(64)
    chunked, nope, l2, temp = 2, 4, 8, 16
    assert hp["layer_attn"] == [chunked | l2] * 3 + [nope | temp]
    assert (hp["attn_chunk"], hp["attn_temp_floor"], hp["route_input"]) == (8192, 8192.0, 1)
    assert hp["qk_norm"] == 0 and hp["router"] == 2


@pytest.mark.parametrize("over, words", [
    ({"quantization_config": {"quant_method": "fbgemm_fp8"}}, "quantization_config"),
    ({"no_rope_layers": [1, 2, 1, 1, 1, 1, 1, 1]}, "no_rope_layers must list 0 or 1"),
    ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers must list 0 or 1 for each of the 8"),
    ({"no_rope_layer_interval": 0}, "no_rope_layer_interval must be a positive integer"),
    ({"layer_types": ["sliding_attention"] * 8}, "layer_types value 'sliding_attention'"),
    ({"layer_types": ["full_attention"] * 7}, "layer_types must list 8"),
    ({"layer_types": ["chunked_attention"] * 8, "attention_chunk_size": None},
     "chunked_attention layers but attention_chunk_size is null"),
    ({"attention_chunk_size": 0}, "attention_chunk_size must be a positive integer"),
    ({"interleave_moe_layer_step": 0}, "interleave_moe_layer_step must be a positive integer"),
    ({"moe_layers": "all"}, "moe_layers must list layer indices"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok 17 exceeds num_local_experts 16"),
    ({"intermediate_size_mlp": 0, "interleave_moe_layer_step": 2},
     "intermediate_size_mlp must be a positive integer"),
    ({"floor_scale": 0}, "floor_scale must be positive"),
    ({"attn_scale": "strong"}, "attn_scale must be a number"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic'"),
    ({"rope_parameters": {**SCOUT_ROPE, "high_freq_factor": 0.5}},
     "high_freq_factor >= low_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {**SCOUT_ROPE, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
])
def test_refusals_name_the_value(over: dict[str, Any], words: str) -> None:
    with pytest.raises(archs.UnsupportedModel) as e:
        archs.colibri_config({**BASE, **over})
    assert words in str(e.value)


def test_a_multimodal_config_gives_its_text_model() -> None:
    """Llama4ForConditionalGeneration (the released checkpoints): its text_config is the text
    model's config; what it cannot run is refused by key."""
    mm = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
          "tie_word_embeddings": False, "text_config": {**BASE, "rope_parameters": SCOUT_ROPE},
          "vision_config": {"hidden_size": 32}}
    cfg = archs.colibri_config(mm)
    text = archs.colibri_config({**BASE, "rope_parameters": SCOUT_ROPE})
    assert cfg == {**text, "hf_architecture": "Llama4ForConditionalGeneration"}
    for over, words in [({"text_config": None}, "without a text_config object"),
                        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
                        ({"quantization_config": {"quant_method": "compressed-tensors"}},
                         "quantization_config")]:
        with pytest.raises(archs.UnsupportedModel) as e:
            archs.colibri_config({**mm, **over})
        assert words in str(e.value)
