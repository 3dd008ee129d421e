"""DeepSeek, Kimi and MiniMax-M2 checkpoints as they ship: FP8 (e4m3) weights with block scales
(`weight_scale_inv`), read tensor by tensor by the converter; and Kimi K2's shape (384 routed
experts, one shared, 61 layers) planned at full size and converted as a tiny copy."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.format.safetensors_io import E4M3, Checkpoint, CheckpointError  # noqa: E402
from colibri.engine.models import archs  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402

BLOCK = 32  # the tiny checkpoint's scale blocks (real ones use 128; several blocks per matrix)
# the linear projections the released checkpoints store in FP8: attention, MLA and the experts
# (DeepSeek's *_proj, MiniMax-M2's experts.j.w1 / w2 / w3); routers, norms, embeddings and
# lm_head stay in 16 bits
FP8_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight",
                ".w3.weight")
# what each family's released quantization_config says beside the block size
QUANT_EXTRA: dict[str, dict[str, Any]] = {
    "deepseek_v3": {"fmt": "e4m3"},
    "minimax_m2": {"fmt": "float8_e4m3fn",
                   "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}


def test_e4m3_table_matches_torch() -> None:
    bits = torch.arange(256, dtype=torch.uint8)
    ref = bits.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    np.testing.assert_array_equal(np.isnan(E4M3), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(E4M3[ok], ref[ok])


def _fp8_copy(hf: Path, out: Path, arch: str = "deepseek_v3") -> tuple[Path, Path]:
    """hf with every linear projection stored as FP8 plus block scales (as DeepSeek ships
    them), and the float32 checkpoint those FP8 weights decode to (the reference)."""
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as save_torch

    tensors = load_file(str(hf / "model.safetensors"))
    fp8: dict[str, Any] = {}
    deq: dict[str, np.ndarray] = {}
    n_fp8 = 0
    for name, a in tensors.items():
        if not name.endswith(FP8_SUFFIXES):
            fp8[name] = torch.from_numpy(a.copy())
            deq[name] = a
            continue
        rows, cols = a.shape
        sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
        pad = np.zeros((sr * BLOCK, sc * BLOCK), np.float32)
        pad[:rows, :cols] = a
        blocks = np.abs(pad.reshape(sr, BLOCK, sc, BLOCK)).max(axis=(1, 3))
        scale = np.where(blocks > 0, blocks / 448.0, 1.0).astype(np.float32)
        full = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:rows, :cols]
        q = torch.from_numpy(a / full).to(torch.float8_e4m3fn)
        fp8[name] = q
        fp8[name + "_scale_inv"] = torch.from_numpy(scale)
        deq[name] = q.to(torch.float32).numpy() * full
        n_fp8 += 1
    assert n_fp8 > 20
    cfg = json.loads((hf / "config.json").read_text())
    paths = []
    for kind, weights in (("fp8", fp8), ("ref", deq)):
        d = out / kind
        shutil.copytree(hf, d)
        (d / "model.safetensors").unlink()
        c = dict(cfg)
        if kind == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", **QUANT_EXTRA[arch],
                                        "weight_block_size": [BLOCK, BLOCK],
                                        "activation_scheme": "dynamic"}
            save_torch(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        else:
            save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(c))
        paths.append(d)
    return paths[0], paths[1]


@pytest.mark.parametrize("arch", ["deepseek_v3", "minimax_m2"])
def test_fp8_checkpoint_converts_to_its_dequantized_reference(tmp_path: Path, arch: str) -> None:
    hf = make_checkpoint(arch, tmp_path / "hf", seed=4)
    fp8, ref = _fp8_copy(hf, tmp_path, arch)
    with Checkpoint(fp8, fp8_block=(BLOCK, BLOCK)) as ck:
        assert not [n for n in ck.names() if n.endswith("_scale_inv")]  # folded into weights
    a = convert(fp8, tmp_path / "from-fp8", quant="f32", progress=False)
    b = convert(ref, tmp_path / "from-ref", quant="f32", progress=False)
    fa = json.loads((a / "config.json").read_text())["files"]
    fb = json.loads((b / "config.json").read_text())["files"]
    assert fa == fb  # every weight file identical, byte for byte

    hf_ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(ref), dtype=torch.float32, attn_implementation="eager").eval()
    ids = np.random.default_rng(2).integers(0, 320, 20).astype(np.int32)
    with torch.no_grad():
        want = hf_ref(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    m = Model.load(a, threads=2, n_ctx=32)
    got = m.forward(ids, np.zeros(20, np.int32), np.arange(20, dtype=np.int32))
    assert float(np.abs(got - want).max() / np.abs(want).max()) <= 1e-4
    # and it converts straight to q4 too
    convert(fp8, tmp_path / "q4", quant="q4", progress=False)


def test_fp8_scales_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    hf = make_checkpoint("deepseek_v3", tmp_path / "hf", seed=4)
    fp8, _ = _fp8_copy(hf, tmp_path)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [16, 16]  # not what the scales cover
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="_scale_inv has shape .* 16x16 blocks"):
        convert(fp8, tmp_path / "out", quant="q8", progress=False)
    assert not (tmp_path / "out").exists()


# Kimi K2's config.json (DeepseekV3ForCausalLM), the fields that shape the model
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", vocab_size=163840,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
    n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1,
    num_experts_per_tok=8, first_k_dense_replace=1, norm_topk_prob=True,
    max_position_embeddings=131072, rms_norm_eps=1e-6, bos_token_id=163584,
    eos_token_id=163585, tie_word_embeddings=False, num_nextn_predict_layers=0,
    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0},
    rope_theta=50000.0, hidden_act="silu",
    quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
)


def _hf_names(c: dict[str, Any]) -> set[str]:
    """The tensor names of a DeepSeek-V3-layout checkpoint of config c (legacy experts)."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + n for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
            "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
            "self_attn.o_proj.weight")}
        if i < c["first_k_dense_replace"]:
            names |= {f"{p}mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
            continue
        names |= {p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"}
        names |= {f"{p}mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")}
        names |= {f"{p}mlp.experts.{j}.{w}_proj.weight"
                  for j in range(c["n_routed_experts"]) for w in ("gate", "up", "down")}
    return names


def test_kimi_k2_plans_at_full_size() -> None:
    cfg = archs.colibri_config(KIMI_K2)
    assert cfg["architecture"] == "deepseek" and cfg["attn"] == "mla"
    assert cfg["n_expert"] == 384 and cfg["layer_ffn"].count("moe") == 60
    assert cfg["n_ff_shared"] == 2048 and cfg["q_lora_rank"] == 1536
    # DeepSeek's softmax scale: qk_head_dim^-0.5 times YaRN's mscale squared
    m = 0.1 * 1.0 * math.log(32.0) + 1.0
    assert cfg["attn_scale"] == pytest.approx(192 ** -0.5 * m * m)
    targets = archs.plan(cfg, _hf_names(KIMI_K2))
    files = {t.file for t in targets}
    assert sum(f.startswith("experts/") for f in files) == 60 * 384
    total = sum(math.prod(t.shape) for t in targets)
    expert = sum(math.prod(t.shape) for t in targets if t.kind == archs.EXPERT)
    active = total - expert + expert * 8 // 384
    print(f"Kimi K2: {total / 1e12:.3f}T parameters, {active / 1e9:.1f}B active")
    assert 1.00e12 < total < 1.06e12  # "1T total"
    assert 31e9 < active < 34e9  # "32B active"


def test_kimi_k2_shape_converts_as_a_tiny_copy(tmp_path: Path) -> None:
    """384 routed experts top-8 in one group, one shared, a dense first layer, YaRN."""
    hf = make_checkpoint(
        "deepseek_v3", tmp_path / "hf", seed=9, n_routed_experts=384, num_experts_per_tok=8,
        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        num_hidden_layers=2, routed_scaling_factor=2.827, moe_intermediate_size=32)
    for quant in ("q8", "f32"):
        out = convert(hf, tmp_path / quant, quant=quant, progress=False)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["n_expert"] == 384 and cfg["layer_ffn"] == ["dense", "moe"]
        assert len([f for f in cfg["files"] if f.startswith("experts/")]) == 384
    m = Model.load(out, threads=2, n_ctx=32)
    ids = np.arange(3, 19, dtype=np.int32)
    logits = m.forward(ids, np.zeros(16, np.int32), np.arange(16, dtype=np.int32))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert float(np.abs(logits - ref).max() / np.abs(ref).max()) <= 1e-4
