"""MiniMax-M2 beyond the parity cases (tests/test_parity_families.py): the released
config.json (with the original remote code's switches) read as transformers reads it and
planned at full size; each switch at a value transformers would not honour refused by name;
both tensor layouts converting alike; and everything around the model (convert's summary,
`colibri info`, routing traces, the expert cache and its page) on a MiniMax-M2 model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from colibri.engine.models import archs

# MiniMax-M2's config.json as released: transformers' fields plus the remote code's switches
RELEASED: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "attn_type_list": [1] * 62, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 1536, "layernorm_full_attention_beta": 1.0,
    "layernorm_linear_attention_beta": 1.0, "layernorm_mlp_beta": 1.0,
    "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
    "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3,
    "output_router_logits": False, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
    "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "shared_moe_mode": "sigmoid", "sliding_window": None, "swa_rope_theta": -1.0,
    "tie_word_embeddings": False, "use_cache": True, "use_mtp": True, "use_qk_norm": True,
    "use_routing_bias": True, "vocab_size": 200064,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
                            "quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias",
                                                       "lm_head"]},
}
SMALL: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"], "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 320,
}


def _released_names(c: dict[str, Any]) -> set[str]:
    """The tensor names of a released MiniMax-M2 checkpoint of config c (FP8 scales left out:
    the converter folds them into their weights)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + n for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias")}
        names |= {f"{p}block_sparse_moe.experts.{j}.w{w}.weight"
                  for j in range(c["num_local_experts"]) for w in (1, 2, 3)}
    return names


def test_released_config_reads_as_transformers_reads_it() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = archs.colibri_config(RELEASED)
    raw = {k: v for k, v in RELEASED.items() if k not in ("quantization_config", "model_type")}
    tf = transformers.MiniMaxM2Config(**raw)
    assert cfg["architecture"] == "minimax_m2" and cfg["head_dim"] == tf.head_dim == 128
    assert cfg["rotary_dim"] == int(tf.head_dim * tf.rope_parameters["partial_rotary_factor"])
    assert cfg["rotary_dim"] == 64 and cfg["rope"] == {}
    assert cfg["rope_theta"] == tf.rope_parameters["rope_theta"] == 5e6
    assert (cfg["n_expert"], cfg["n_expert_used"], cfg["n_ff"]) == (256, 8, 1536)
    assert (cfg["router"], cfg["n_group"], cfg["routed_scale"]) == ("sigmoid_grouped", 1, 1.0)
    assert cfg["norm_topk_prob"] and cfg["n_ff_shared"] == 0 and cfg["qk_norm"] == "full"
    assert cfg["sliding_window"] is None and cfg["n_mtp_layers"] == 3
    assert cfg["layer_ffn"] == ["moe"] * 62 and cfg["rms_eps"] == tf.rms_norm_eps


def test_released_shape_plans_at_full_size() -> None:
    cfg = archs.colibri_config(RELEASED)
    targets = archs.plan(cfg, _released_names(RELEASED))
    assert sum(f.startswith("experts/") for f in {t.file for t in targets}) == 62 * 256
    total = sum(math.prod(t.shape) for t in targets)
    expert = sum(math.prod(t.shape) for t in targets if t.kind == archs.EXPERT)
    vocab = sum(math.prod(t.shape) for t in targets if t.kind == archs.VOCAB)
    active = total - expert + expert * 8 // 256 - vocab
    print(f"MiniMax-M2: {total / 1e9:.1f}B parameters, {active / 1e9:.1f}B active "
          "(embeddings and lm_head left out)")
    assert 225e9 < total < 235e9  # "230B total"
    assert 9.5e9 < active < 10.5e9  # "10B active"


def test_rotary_width_follows_transformers_precedence() -> None:
    """rope_parameters' partial_rotary_factor, then a top-level one, then rotary_dim."""
    transformers = pytest.importorskip("transformers")
    variants: list[dict[str, Any]] = [
        {"rotary_dim": 10}, {"rotary_dim": 16}, {}, {"rotary_dim": None},
        {"rotary_dim": 8, "partial_rotary_factor": 0.75},
        {"rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.25}},
    ]
    for over in variants:
        raw = {**SMALL, **over}
        tf = transformers.MiniMaxM2Config(**{k: v for k, v in raw.items()
                                             if k != "architectures"})
        want = int(tf.head_dim * tf.rope_parameters.get("partial_rotary_factor", 1.0))
        assert archs.colibri_config(raw)["rotary_dim"] == want, over


@pytest.mark.parametrize("over, words", [
    ({"use_qk_norm": False}, "use_qk_norm False"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"use_routing_bias": False}, "use_routing_bias False"),
    ({"shared_intermediate_size": 512}, "shared_intermediate_size 512"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor 2.5"),
    ({"num_expert_group": 4}, "num_expert_group 4"),
    ({"sliding_window": 4096}, "sliding_window 4096"),
    ({"attn_window_size": 4096}, "attn_window_size 4096"),
    ({"layernorm_mlp_beta": 2.0}, "layernorm_mlp_beta 2.0"),
    ({"layernorm_full_attention_alpha": 3.5}, "layernorm_full_attention_alpha 3.5"),
    ({"attn_type_list": [0, 1]}, "attn_type_list [0, 1]"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq'"),
    ({"rotary_dim": 7}, "rotary_dim 7"),
    ({"rotary_dim": 32}, "rotary_dim 32"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope type 'dynamic'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "top-9 of 8"),
])
def test_refusals_name_the_value(over: dict[str, Any], words: str) -> None:
    with pytest.raises(archs.UnsupportedModel) as e:
        archs.colibri_config({**SMALL, **over})
    assert words in str(e.value)


def test_switches_at_transformers_values_are_accepted() -> None:
    ok = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
          "use_routing_bias": True, "shared_intermediate_size": 0, "routed_scaling_factor": 1.0,
          "num_expert_group": None, "topk_group": None, "sliding_window": None,
          "attn_window_size": None, "layernorm_mlp_beta": 1, "attn_type_list": [1, 1],
          "layer_types": ["full_attention"] * 2, "use_mtp": False}
    cfg = archs.colibri_config({**SMALL, **ok})
    assert cfg["qk_norm"] == "full" and cfg["n_mtp_layers"] == 0


# ---- on a tiny checkpoint -----------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from tests.tiny_models import make_checkpoint

    return make_checkpoint("minimax_m2", tmp_path_factory.mktemp("mm2") / "hf", seed=3)


@pytest.fixture(scope="module")
def q8(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from colibri.engine.format.convert import convert

    return convert(hf, tmp_path_factory.mktemp("mm2q8") / "q8", quant="q8", progress=False)


def test_both_tensor_layouts_convert_alike(hf: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The released names (block_sparse_moe., experts.j.w1/w3/w2) and transformers 5's (mlp.,
    fused experts) give the same files; convert says what it recognised."""
    import safetensors

    from colibri.engine.format.convert import convert
    from tests.tiny_models import make_checkpoint

    fused = make_checkpoint("minimax_m2", tmp_path / "fused", seed=3, fused=True)
    with safetensors.safe_open(str(fused / "model.safetensors"), framework="np") as sf:
        keys = set(sf.keys())
    assert "model.layers.0.mlp.e_score_correction_bias" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    a = convert(hf, tmp_path / "a", quant="q4", progress=True)
    err = capsys.readouterr().err
    assert ("recognised MiniMaxM2ForCausalLM as the minimax_m2 family: 3 layers, 3 with 8 "
            "experts, top-2 (sigmoid_grouped router), rotary on 10 of 24 head dims, q/k RMSNorm "
            "over the whole projection") in err
    b = convert(fused, tmp_path / "b", quant="q4", progress=False)
    assert (json.loads((a / "config.json").read_text())["files"]
            == json.loads((b / "config.json").read_text())["files"])


def test_info_and_routing_traces(q8: Path, tmp_path: Path) -> None:
    from colibri.engine.executor.model import Model
    from colibri.engine.tools.info import describe, render
    from colibri.engine.tools.routing_trace import RouteRecorder, RoutingTrace, greedy_run

    d = describe(q8)
    text = render(d)
    assert "layers        3 MoE (0-2)" in text
    assert "router=sigmoid_grouped" in text and "qk_norm=full" in text
    assert d["experts_per_layer"] == [8, 8, 8]
    assert d["params_active"] == d["params_total"] - 3 * 6 * 3 * 64 * 32
    rec = RouteRecorder(Model.load(q8, threads=2, n_ctx=64))
    greedy_run(rec, np.arange(5, 25, dtype=np.int32), 6)
    trace = rec.trace("test")
    assert trace.n_layer == 3 and trace.n_tokens == 20 + 6
    assert trace.routes.min() >= 0 and trace.routes.max() < 8
    again = RoutingTrace.load(trace.save(tmp_path / "t.npz"))
    np.testing.assert_array_equal(again.routes, trace.routes)


@pytest.fixture(scope="module")
def server(hf: Path) -> Iterator[Any]:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings
    from colibri.engine import LLM, EngineConfig
    from colibri.engine.core.options import ExpertCacheConfig
    from tests.server_helpers import InProcessServer, wait_for

    llm = LLM(hf, threads=2, quant="q8", n_ctx=128, config=EngineConfig(
        expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False)))
    app = create_app(Settings(_env_file=None), loader=lambda: llm.core)  # type: ignore[call-arg]
    srv = InProcessServer(app).start()
    wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
    yield srv
    srv.stop()


def test_serves_with_its_expert_cache_and_page(server: Any) -> None:
    from colibri.app.schemas import ExpertCacheInfo

    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "The river runs", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12
    info = ExpertCacheInfo.model_validate(httpx.get(server.url + "/v1/expert_cache").json())
    assert info.enabled and (info.n_layer, info.n_moe_layers, info.n_expert) == (3, 3, 8)
    assert info.dense_layers == [] and info.shared_expert_bytes == 0
    assert info.budget_bytes == 3 * 3 * info.expert_bytes
    assert info.state is not None and info.layers is not None
    for layer in range(3):
        assert sum(s >= 1 for s in info.state[layer]) == 3 and info.layers[layer]["loads"] > 0
    assert info.totals["resident_bytes"] == 3 * 3 * info.expert_bytes
    page = httpx.get(server.url + "/experts")
    assert page.status_code == 200 and "/static/experts.js" in page.text
