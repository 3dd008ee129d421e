"""The pieces of scripts/bench_long_context.py that are not timing: the two models' configs
(transformers reads them as intended: Qwen3-Next's linear/full mix, full attention in every
layer of the contrast), the checkpoints it builds as Colibri converts and reads them, the
ratio of decode speeds and its command line. The benchmark itself runs only when the script
is run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.scripts_loader import load_script


def _script() -> Any:
    return load_script("bench_long_context")


def _tiny(m: Any) -> Any:
    return m.Dims(vocab=512, hidden=64, layers=8, experts=4, top_k=2, moe_intermediate=32,
                  shared_intermediate=48, heads=4, kv_heads=2, head_dim=16, linear_key_heads=2,
                  linear_value_heads=4, linear_head_dim=16, max_positions=1024)


def test_default_shape_is_qwen3_next_mix_with_full_attention_every_fourth_layer() -> None:
    m = _script()
    cfg = m.make_config(m.Dims(), m.HYBRID)
    assert type(cfg).__name__ == "Qwen3NextConfig"
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] \
        + ["linear_attention"] * 3 + ["full_attention"]
    # the released model's head widths, half its head counts, key heads shared by value heads
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (128, 128)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (8, 16)
    assert cfg.shared_expert_intermediate_size == 512
    assert cfg.mlp_only_layers == []
    # room for an 8K prompt and the decoded tokens
    assert cfg.max_position_embeddings >= 8192 + 64

    full = m.make_config(m.Dims(), m.FULL)
    assert type(full).__name__ == "Qwen3MoeConfig"
    assert not full.use_sliding_window and m.layer_types(m.Dims(), m.FULL) == \
        ["full_attention"] * 8
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "vocab_size", "max_position_embeddings"):
        assert getattr(full, f) == getattr(cfg, f), f


def test_transformers_builds_the_intended_layers() -> None:
    import transformers as tf

    m = _script()
    d = _tiny(m)
    hybrid = tf.Qwen3NextForCausalLM(m.make_config(d, m.HYBRID))
    kinds = ["linear_attn" if hasattr(layer, "linear_attn") else "self_attn"
             for layer in hybrid.model.layers]
    assert kinds == ["linear_attn"] * 3 + ["self_attn"] + ["linear_attn"] * 3 + ["self_attn"]
    assert all(hasattr(layer.mlp, "shared_expert") for layer in hybrid.model.layers)
    full = tf.Qwen3MoeForCausalLM(m.make_config(d, m.FULL))
    assert all(hasattr(layer, "self_attn") and not hasattr(layer, "linear_attn")
               for layer in full.model.layers)
    assert len(full.model.layers) == 8


def test_built_checkpoints_convert_with_the_layer_mix(tmp_path: Path) -> None:
    from colibri.engine.format.convert import convert_once
    from colibri.engine.models.config import ModelConfig

    m = _script()
    d = _tiny(m)
    seen = {}
    for arch in m.ARCHS:
        hf = m.build_checkpoint(tmp_path / arch / "hf", d, arch)
        out = convert_once(hf, tmp_path / arch / "q8", "q8")
        cfg = ModelConfig.from_dir(out)
        assert cfg.n_layer == 8 and cfg.n_vocab == 512 and cfg.max_position_embeddings == 1024
        seen[arch] = cfg
    assert seen[m.HYBRID].hybrid and seen[m.HYBRID].attention_layers == [3, 7]
    assert not seen[m.FULL].hybrid and seen[m.FULL].attention_layers == list(range(8))
    # a second call keeps the cached checkpoint
    stamp = (tmp_path / m.HYBRID / "hf" / "config.json").stat().st_mtime_ns
    m.build_checkpoint(tmp_path / m.HYBRID / "hf", d, m.HYBRID)
    assert (tmp_path / m.HYBRID / "hf" / "config.json").stat().st_mtime_ns == stamp


def test_context_ratios_are_against_the_shortest_prompt() -> None:
    m = _script()
    assert m.context_ratios({8192: 9.0, 256: 10.0, 2048: 9.5}) == {
        "2048/256": pytest.approx(0.95), "8192/256": pytest.approx(0.9)}


def test_command_line() -> None:
    m = _script()
    a = m.parse_args(["--json", "out.json"])
    assert a.prompt_tokens == [256, 8192] and a.quant == "q8" and a.json == "out.json"
    assert m.dims_from_args(a) == m.Dims()
    assert m.dims_from_args(m.parse_args(["--hidden", "256", "--experts", "8"])) == \
        m.Dims(hidden=256, experts=8)
    with pytest.raises(SystemExit):
        m.parse_args(["--prompt-tokens", "256"])  # nothing to compare with
    with pytest.raises(SystemExit):
        m.parse_args(["--gen-tokens", "0"])
