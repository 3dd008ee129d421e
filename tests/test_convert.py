"""Converter tests: tiny transformers checkpoints -> Colibri folders, checked tensor by tensor.

The expected layout below is written independently of engine/models/archs.py, from the tensor
names transformers' save_pretrained writes; source weights are read with the safetensors
package (torch), not with engine.format.safetensors_io.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

from colibri.engine import _core as core  # noqa: E402
from colibri.engine.format import quant  # noqa: E402
from colibri.engine.format.convert import convert, ensure_converted, verify  # noqa: E402
from colibri.engine.format.safetensors_io import Checkpoint  # noqa: E402
from colibri.engine.format.wfile import read_wfile  # noqa: E402
from colibri.engine.models import archs  # noqa: E402
from colibri.engine.tools.cli import main as cli_main  # noqa: E402
from colibri.engine.tools.info import describe  # noqa: E402
from tests.tiny_models import ARCHS, make_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the module itself (engine/__init__ re-exports a function of the same name)
convert_mod = importlib.import_module("colibri.engine.format.convert")
PRESETS = ("f32", "f16", "q8", "q4")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hf")
    return {a: make_checkpoint(a, base / a, seed=1) for a in ARCHS}


def load_source(hf_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k).float().numpy()
    return out


def expected_layout(arch: str, src: dict[str, np.ndarray], hf_cfg: dict) -> dict:
    """{file: {tensor: (group, kind, array)}} built from transformers' names."""
    L = hf_cfg["num_hidden_layers"]
    E = hf_cfg.get("num_local_experts", hf_cfg.get("num_experts"))
    lay: dict[str, dict[str, tuple[str, str, np.ndarray]]] = {}
    lay["embeddings.bin"] = {
        "tok_embd": ("embeddings", "vocab", src["model.embed_tokens.weight"]),
        "output_norm": ("embeddings", "norm", src["model.norm.weight"]),
    }
    if not hf_cfg.get("tie_word_embeddings"):
        lay["embeddings.bin"]["output"] = ("embeddings", "vocab", src["lm_head.weight"])
    for i in range(L):
        p = f"model.layers.{i}."
        att = {"attn_norm": ("attention", "norm", src[p + "input_layernorm.weight"])}
        for x in "qkvo":
            att["w" + x] = ("attention", "dense", src[f"{p}self_attn.{x}_proj.weight"])
        if arch == "qwen2_moe":
            for x in "qkv":
                att["b" + x] = ("attention", "bias", src[f"{p}self_attn.{x}_proj.bias"])
        if arch in ("qwen3_moe", "olmoe"):
            for x in "qk":
                att[x + "_norm"] = ("attention", "norm", src[f"{p}self_attn.{x}_norm.weight"])
        lay[f"attention/layer_{i}.bin"] = att
        moe = p + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        rt = {"ffn_norm": ("router", "norm", src[p + "post_attention_layernorm.weight"]),
              "gate_inp": ("router", "router", src[moe + "gate.weight"])}
        if arch == "qwen2_moe":
            rt["shared_gate"] = ("router", "router", src[moe + "shared_expert_gate.weight"])
            lay[f"shared/layer_{i}.bin"] = {
                ours: ("shared", "shared", src[f"{moe}shared_expert.{hf}_proj.weight"])
                for ours, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
            }
        lay[f"router/layer_{i}.bin"] = rt
        for j in range(E):
            if arch == "mixtral":
                names = {w: f"{moe}experts.{j}.{w}.weight" for w in ("w1", "w3", "w2")}
            else:
                names = {ours: f"{moe}experts.{j}.{hf}_proj.weight"
                         for ours, hf in (("w1", "gate"), ("w3", "up"), ("w2", "down"))}
            lay[f"experts/layer_{i}_expert_{j}.bin"] = {
                k: ("experts", "expert", src[v]) for k, v in names.items()
            }
    return lay


def expected_type(kind: str, shape: tuple[int, ...], preset: str) -> str:
    if preset == "f32" or kind in ("norm", "bias", "router"):
        return "f32"
    t = "q6" if (preset == "q4" and kind == "vocab") else preset
    if t in ("q4", "q6", "q8") and shape[-1] % 32:
        return "f16"
    if kind == "expert" and t in ("q4", "q6", "q8") and len(shape) == 2 and shape[0] % 8 == 0:
        return t + "x8"  # routed experts: rows interleaved 8 at a time, as the products read
    return t


def check_folder(out: Path, hf_dir: Path, arch: str, preset: str) -> None:
    src = load_source(hf_dir)
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    cfg = json.loads((out / "config.json").read_text())
    lay = expected_layout(arch, src, hf_cfg)
    assert cfg["quant"] == preset and cfg["architecture"] == arch
    assert set(cfg["files"]) == set(lay)
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*.bin")}
    assert on_disk == set(lay)
    n_checked = 0
    for fname, tensors in lay.items():
        wf = read_wfile(out / fname)
        assert list(wf.tensors) == list(tensors) or set(wf.tensors) == set(tensors)
        for name, (group, kind, arr) in tensors.items():
            info = wf.tensors[name]
            want_t = expected_type(kind, arr.shape, preset)
            assert info.type_name == want_t, (fname, name)
            assert cfg["tensor_types"][f"{group}.{name}"] == want_t
            assert info.shape == arr.shape, (fname, name)
            got = wf.array(name)
            np.testing.assert_array_equal(got, quant.fake_quantize(arr, want_t), err_msg=name)
            assert wf.raw(name) == quant.encode(arr, want_t)
            if want_t.endswith("x8"):  # the C core's own repack of the rows, byte for byte
                rows_t = want_t[:-2]
                assert wf.rows(name) == (rows_t, quant.encode(arr, rows_t))
                assert wf.raw(name) == core.repack_x8(rows_t, wf.rows(name)[1], *arr.shape,
                                                      ref=True)
            n_checked += 1
    assert n_checked == sum(len(t) for t in lay.values())


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_every_tensor(ckpts: dict[str, Path], tmp_path: Path, arch: str,
                              preset: str) -> None:
    out = convert(ckpts[arch], tmp_path / "out", quant=preset, progress=False)
    check_folder(out, ckpts[arch], arch, preset)
    verify(out, full=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (ckpts[arch] / name).read_bytes()


def test_q4_fallback_for_short_rows(tmp_path: Path) -> None:
    # intermediate 48 is not a multiple of 32: w2 [D, 48] rows fall back to f16
    hf = make_checkpoint("mixtral", tmp_path / "hf", intermediate_size=48)
    out = convert(hf, tmp_path / "out", quant="q4", progress=False)
    check_folder(out, hf, "mixtral", "q4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tensor_types"]["experts.w2"] == "f16"
    assert cfg["tensor_types"]["experts.w1"] == "q4x8"
    out32 = convert(hf, tmp_path / "out32", quant="f32", progress=False)
    assert json.loads((out32 / "config.json").read_text())["tensor_types"]["experts.w2"] == "f32"


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_experts_match_legacy(tmp_path: Path, arch: str) -> None:
    legacy = make_checkpoint(arch, tmp_path / "legacy", seed=3)
    fused = make_checkpoint(arch, tmp_path / "fused", seed=3, fused=True)
    with safetensors.safe_open(str(fused / "model.safetensors"), framework="pt") as sf:
        assert any(k.endswith("experts.gate_up_proj") for k in sf.keys())
    a = convert(legacy, tmp_path / "a", quant="q4", progress=False)
    b = convert(fused, tmp_path / "b", quant="q4", progress=False)
    fa = json.loads((a / "config.json").read_text())["files"]
    fb = json.loads((b / "config.json").read_text())["files"]
    assert fa == fb


def test_sharded_input(tmp_path: Path) -> None:
    one = make_checkpoint("qwen2_moe", tmp_path / "one", seed=5)
    many = make_checkpoint("qwen2_moe", tmp_path / "many", seed=5, shards=3)
    assert (many / "model.safetensors.index.json").is_file()
    assert len(list(many.glob("*.safetensors"))) >= 2
    a = convert(one, tmp_path / "a", quant="q8", progress=False)
    b = convert(many, tmp_path / "b", quant="q8", progress=False)
    check_folder(b, many, "qwen2_moe", "q8")
    assert (json.loads((a / "config.json").read_text())["files"]
            == json.loads((b / "config.json").read_text())["files"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_input(tmp_path: Path, dtype: str) -> None:
    hf = make_checkpoint("qwen3_moe", tmp_path / "hf", dtype=dtype)
    out = convert(hf, tmp_path / "out", quant="f32", progress=False)
    check_folder(out, hf, "qwen3_moe", "f32")
    # the same conversion with torch unimportable: bf16/f16 are decoded by numpy alone
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from engine.format.convert import convert\n"
        f"convert({str(hf)!r}, {str(tmp_path / 'notorch')!r}, quant='f32', progress=False)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert (json.loads((out / "config.json").read_text())["files"]
            == json.loads((tmp_path / "notorch" / "config.json").read_text())["files"])


def test_checksums_and_verify(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = convert(ckpts["olmoe"], tmp_path / "out", quant="q4", progress=False)
    files = json.loads((out / "config.json").read_text())["files"]
    for name, meta in files.items():
        data = (out / name).read_bytes()
        assert meta["size"] == len(data)
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    verify(out, full=True)
    victim = out / "experts" / "layer_1_expert_3.bin"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x01
    victim.write_bytes(bytes(data))
    verify(out, full=False)  # same size: only the hash can tell
    with pytest.raises(ValueError, match="layer_1_expert_3.bin.*sha256"):
        verify(out, full=True)
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="layer_1_expert_3.bin"):
        verify(out, full=False)
    with pytest.raises(ValueError, match="layer_1_expert_3.bin"):
        read_wfile(victim)


@pytest.mark.parametrize("syncfs", [True, False])
def test_the_conversion_is_on_disk_before_it_is_renamed_into_place(
        ckpts: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        syncfs: bool) -> None:
    """The weight files are flushed to disk together, once for the whole folder (syncfs),
    or each file and folder on its own where the C library lacks syncfs, and always before
    the folder takes its name: a crash never leaves a named folder with unwritten files."""
    import colibri.engine.format.convert as conv

    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append("fsync")
        real_fsync(fd)

    def rename(src: os.PathLike, dst: os.PathLike) -> None:
        events.append(f"rename {Path(dst).name}")
        real_rename(src, dst)

    class NoSyncfs:  # a C library without syncfs
        pass

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    if not syncfs:
        monkeypatch.setattr(conv, "_libc", lambda: NoSyncfs())
    out = convert(ckpts["olmoe"], tmp_path / "out", quant="q8", progress=False)
    n_files = sum(1 for f in out.rglob("*") if f.is_file())
    before = events[:events.index("rename out")]
    if syncfs:  # config.json's own write, then nothing per weight file
        assert before.count("fsync") == 1 < n_files
    else:
        assert before.count("fsync") > n_files
    verify(out, full=True)


def test_config_matches_transformers(tmp_path: Path) -> None:
    import transformers

    for arch, extra in (("mixtral", {"sliding_window": 8}),
                        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),
                        ("olmoe", {"clip_qkv": 3.5, "tie_word_embeddings": True}),
                        ("qwen2_moe", {"norm_topk_prob": True})):
        hf = make_checkpoint(arch, tmp_path / arch, **extra)
        out = convert(hf, tmp_path / (arch + "_out"), quant="f32", progress=False)
        cfg = json.loads((out / "config.json").read_text())
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf))
        tc = model.config
        inner = model.model
        assert cfg["n_vocab"] == tc.vocab_size and cfg["n_layer"] == tc.num_hidden_layers
        attn = inner.layers[0].self_attn
        assert cfg["head_dim"] == attn.head_dim
        assert cfg["n_head"] * cfg["head_dim"] == attn.q_proj.out_features
        assert cfg["n_head_kv"] * cfg["head_dim"] == attn.k_proj.out_features
        inv = inner.rotary_emb.inv_freq.numpy()
        rd = cfg["rotary_dim"]
        ref = 1.0 / cfg["rope_theta"] ** (np.arange(0, rd, 2, dtype=np.float32) / rd)
        np.testing.assert_allclose(inv, ref, rtol=1e-6)
        assert cfg["rms_eps"] == inner.norm.variance_epsilon
        mlp = inner.layers[0].mlp
        assert cfg["n_expert_used"] == mlp.gate.top_k
        assert cfg["norm_topk_prob"] == getattr(mlp.gate, "norm_topk_prob", True)
        assert cfg["sliding_window"] == extra.get("sliding_window")
        assert cfg["tie_embeddings"] == tc.tie_word_embeddings
        assert cfg["eos_token_ids"] == [2] and cfg["bos_token_id"] is None
        if arch == "olmoe":
            assert cfg["clip_qkv"] == 3.5 and cfg["qk_norm"] == "full"
            assert "output" not in read_wfile(out / "embeddings.bin").tensors
        if arch == "qwen2_moe":
            assert cfg["n_ff_shared"] == 96 and cfg["shared_gate"] and cfg["qkv_bias"]


def _hf_cfg(**over: object) -> dict:
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
           "shared_expert_intermediate_size": 64, "vocab_size": 320}
    cfg.update(over)
    return cfg


def test_config_mapping_details() -> None:
    c = archs.colibri_config(_hf_cfg(rope_theta=5000.0), {"eos_token_id": [7, 2],
                                                           "bos_token_id": 1})
    assert c["rope_theta"] == 5000.0 and c["eos_token_ids"] == [7, 2] and c["bos_token_id"] == 1
    assert archs.colibri_config(_hf_cfg())["rope_theta"] == 10000.0
    mix = _hf_cfg(architectures=["MixtralForCausalLM"], intermediate_size=64)
    assert archs.colibri_config(mix)["rope_theta"] == 1e6  # Mixtral's default_theta
    assert archs.colibri_config(mix)["norm_topk_prob"] is True
    c = archs.colibri_config(_hf_cfg(rope_parameters={"rope_type": "default",
                                                      "rope_theta": 123.0}))
    assert c["rope_theta"] == 123.0
    # Qwen2-MoE sliding window on alternate layers cannot be expressed: refused
    with pytest.raises(ValueError, match="sliding window"):
        archs.colibri_config(_hf_cfg(use_sliding_window=True, sliding_window=16))


@pytest.mark.parametrize("over, msg", [
    ({"architectures": ["GPTBigCodeForCausalLM"]}, "MixtralForCausalLM.*OlmoeForCausalLM"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope type 'llama3'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_refused_configs(over: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        archs.colibri_config(_hf_cfg(**over))


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli_main(args)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_convert_info(ckpts: dict[str, Path], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    rc, so, se = _cli(["convert", str(ckpts["qwen2_moe"]), str(out), "--quant", "q8"], capsys)
    assert rc == 0, se
    check_folder(out, ckpts["qwen2_moe"], "qwen2_moe", "q8")
    rc, so, _ = _cli(["info", str(out)], capsys)
    assert rc == 0 and "qwen2_moe" in so and "active per token" in so
    rc, so, _ = _cli(["info", str(out), "--json"], capsys)
    d = json.loads(so)
    assert d == describe(out)
    assert d["experts_per_layer"] == [8, 8]
    n_total = sum(a.size for a in load_source(ckpts["qwen2_moe"]).values())
    assert d["params_total"] == n_total
    per_expert = 3 * 64 * 64
    assert d["params_active"] == n_total - 2 * (8 - 2) * per_expert
    assert set(d["bytes_by_type"]) == {"f32", "q8"}
    rc, so, _ = _cli(["verify", str(out)], capsys)
    assert rc == 0
    # user mistakes: one line on stderr, exit 2, no traceback
    rc, _, se = _cli(["convert", str(ckpts["qwen2_moe"]), str(out)], capsys)
    assert rc == 2 and "already exists" in se and "Traceback" not in se
    rc, _, se = _cli(["info", str(tmp_path / "nope")], capsys)
    assert rc == 2 and se.count("\n") == 1


def test_cli_subprocess_progress_bar(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "m"
    cli = [sys.executable, "-m", "colibri.engine.tools.cli"]
    r = subprocess.run([*cli, "convert", str(ckpts["mixtral"]), str(out), "--quant", "q4"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "converting" in r.stderr and "100%" in r.stderr
    check_folder(out, ckpts["mixtral"], "mixtral", "q4")
    r = subprocess.run([*cli, "convert", str(tmp_path / "nope"), str(tmp_path / "o")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "colibri: error:" in r.stderr


def _copy_hf(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in skip:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_refuse_pickle_checkpoint(ckpts: dict[str, Path], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    hf = _copy_hf(ckpts["mixtral"], tmp_path / "hf", skip=("model.safetensors",))
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(ValueError, match="pytorch_model.bin.*only safetensors"):
        convert(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    rc, _, se = _cli(["convert", str(hf), str(tmp_path / "out")], capsys)
    assert rc == 2 and "save_pretrained" in se and "Traceback" not in se


def test_refuse_unsupported_and_missing_config(ckpts: dict[str, Path], tmp_path: Path) -> None:
    hf = _copy_hf(ckpts["mixtral"], tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported; supported: .*MixtralForCausalLM"):
        convert(hf, tmp_path / "out", progress=False)
    (hf / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        convert(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_refuse_unused_tensor(ckpts: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    hf = _copy_hf(ckpts["mixtral"], tmp_path / "hf")
    d = load_file(str(hf / "model.safetensors"))
    d["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(d, str(hf / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.bias"):
        convert(hf, tmp_path / "out", progress=False)


def _raw_safetensors(path: Path, header: dict | bytes, data: bytes) -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("case, msg", [
    ("huge_header", "header length"),
    ("bad_json", "not valid JSON"),
    ("past_eof", "past the end of the file"),
    ("overlap", "overlap"),
    ("size_mismatch", "needs 16"),
    ("bad_dtype", "unknown dtype"),
    ("truncated", "too short"),
    ("duplicate", "names 'a' twice"),
])
def test_corrupt_safetensors(tmp_path: Path, case: str, msg: str) -> None:
    f = tmp_path / "model.safetensors"
    good = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    if case == "huge_header":
        f.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    elif case == "bad_json":
        _raw_safetensors(f, b"{not json", b"")
    elif case == "past_eof":
        _raw_safetensors(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
                         b"\0" * 16)
    elif case == "overlap":
        _raw_safetensors(f, {**good, "b": {"dtype": "F32", "shape": [4],
                                           "data_offsets": [8, 24]}}, b"\0" * 24)
    elif case == "size_mismatch":
        _raw_safetensors(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
                         b"\0" * 16)
    elif case == "bad_dtype":
        _raw_safetensors(f, {"a": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}},
                         b"\0" * 16)
    elif case == "duplicate":
        h = b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, ' \
            b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
        _raw_safetensors(f, h, b"\0" * 16)
    elif case == "truncated":
        f.write_bytes(b"\x10\0\0")
    with pytest.raises(ValueError, match=msg) as ei:
        Checkpoint(tmp_path)
    assert "model.safetensors" in str(ei.value)


def test_corrupt_safetensors_in_convert(ckpts: dict[str, Path], tmp_path: Path) -> None:
    hf = _copy_hf(ckpts["olmoe"], tmp_path / "hf")
    st = hf / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])  # truncated download: last tensor runs past EOF
    with pytest.raises(ValueError, match="past the end of the file"):
        convert(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_leaves_nothing(ckpts: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real = convert_mod.write_wfile
    calls = {"n": 0}

    def flaky(path, specs, **kw):  # noqa: ANN001, ANN003, ANN202
        calls["n"] += 1
        if calls["n"] == 5:
            specs = list(specs)

            def boom() -> bytes:
                raise KeyboardInterrupt

            specs[-1] = specs[-1].__class__(specs[-1].name, specs[-1].type_name,
                                            specs[-1].shape, boom)
        return real(path, specs, **kw)

    monkeypatch.setattr(convert_mod, "write_wfile", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert(ckpts["qwen3_moe"], tmp_path / "out", progress=False)
    assert calls["n"] == 5
    assert list(tmp_path.iterdir()) == []  # no output, no temp folder, no .part file


def test_ensure_converted_caches(ckpts: dict[str, Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    hf = _copy_hf(ckpts["mixtral"], tmp_path / "hf")
    first = ensure_converted(hf, "q8")
    assert first.parent == tmp_path / "cache" and first.name.endswith("-q8")
    check_folder(first, hf, "mixtral", "q8")
    assert ensure_converted(first, "q4") == first  # already a Colibri folder

    def no_convert(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("converted again")

    monkeypatch.setattr(convert_mod, "convert", no_convert)
    assert ensure_converted(hf, "q8") == first
    monkeypatch.undo()
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    other = ensure_converted(hf, "q4")
    assert other != first and other.name.endswith("-q4")
    # a changed source (new mtime) gets a new entry
    cfgp = hf / "generation_config.json"
    st = cfgp.stat()
    os.utime(cfgp, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ensure_converted(hf, "q8") not in (first, other)
    # a damaged entry is converted again
    (first / "embeddings.bin").write_bytes(b"x")
    os.utime(cfgp, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = ensure_converted(hf, "q8")
    assert again == first
    verify(again, full=True)
    # an entry an earlier choice of the preset's types made is converted again, in place
    cfg = json.loads((first / "config.json").read_text())
    del cfg["preset_revision"]
    (first / "config.json").write_text(json.dumps(cfg))
    assert ensure_converted(hf, "q8") == first
    assert json.loads((first / "config.json").read_text())["preset_revision"] >= 2


def test_ensure_converted_concurrent(ckpts: dict[str, Path], tmp_path: Path) -> None:
    env = dict(os.environ, COLIBRI_CACHE_DIR=str(tmp_path / "cache"))
    code = ("import sys; from engine.format.convert import ensure_converted; "
            "print(ensure_converted(sys.argv[1], 'q4'))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(ckpts["qwen2_moe"])], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate()[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    verify(outs[0], full=True)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")] == [
        Path(outs[0]).name]


def _wfile(tmp_path: Path) -> tuple[Path, bytes]:
    from colibri.engine.format.wfile import TensorSpec, write_wfile

    rng = np.random.default_rng(0)
    specs = []
    for name, ty, shape in (("a", "f32", (3,)), ("b", "q4", (2, 64)), ("c", "q8", (2, 2, 32)),
                            ("d", "f16", (5, 3)), ("e", "bf16", (1, 2, 3, 4))):
        x = rng.standard_normal(shape).astype(np.float32)
        specs.append(TensorSpec(name, ty, shape, lambda x=x, ty=ty: quant.encode(x, ty)))
    path = tmp_path / "w.bin"
    size, digest = write_wfile(path, specs)
    data = path.read_bytes()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    assert not (tmp_path / "w.bin.part").exists()
    return path, data


def test_wfile_roundtrip(tmp_path: Path) -> None:
    path, data = _wfile(tmp_path)
    wf = read_wfile(path)
    assert list(wf.tensors) == ["a", "b", "c", "d", "e"]
    assert data[:8] == b"CLBWGT1\0" and struct.unpack_from("<IIQQQ", data, 8)[:3] == (1, 5, 64)
    for t in wf.tensors.values():
        assert t.offset % 64 == 0
        assert wf.array(t.name).shape == t.shape
    assert wf.tensors["b"].nbytes == 2 * 2 * 18 and wf.tensors["c"].nbytes == 4 * 34
    assert struct.unpack_from("<4q", data, 64 + 4 * 128 + 72) == (1, 2, 3, 4)


def _entry(i: int) -> int:
    return 64 + i * 128


@pytest.mark.parametrize("patch, msg", [
    (lambda b: b.__setitem__(slice(0, 8), b"GGUF\0\0\0\0"), "bad magic"),
    (lambda b: struct.pack_into("<I", b, 8, 2), "format version 2"),
    (lambda b: struct.pack_into("<I", b, 12, 0), "tensor count 0"),
    (lambda b: struct.pack_into("<I", b, 12, 5000), "tensor count 5000"),
    (lambda b: struct.pack_into("<Q", b, 24, 65), "bad data offset"),
    (lambda b: struct.pack_into("<Q", b, 32, 10**6), "header says"),
    (lambda b: b.__setitem__(slice(_entry(1), _entry(1) + 2), b"a\0"), "duplicate"),
    (lambda b: struct.pack_into("<I", b, _entry(0) + 64, 11), "unknown dtype 11"),
    (lambda b: struct.pack_into("<I", b, _entry(0) + 68, 5), "n_dims 5"),
    (lambda b: struct.pack_into("<q", b, _entry(0) + 72, -3), "bad shape"),
    (lambda b: struct.pack_into("<q", b, _entry(1) + 80, 48), "multiple of 32"),
    (lambda b: struct.pack_into("<Q", b, _entry(0) + 104, 8), "bad offset"),
    (lambda b: struct.pack_into("<Q", b, _entry(0) + 112, 16), "nbytes 16"),
    (lambda b: struct.pack_into("<Q", b, _entry(4) + 104, 10**6 // 64 * 64), "past the end"),
    (lambda b: struct.pack_into("<Q", b, _entry(2) + 104,
                                struct.unpack_from("<Q", b, _entry(1) + 104)[0]), "overlap"),
    (lambda b: b.__setitem__(slice(_entry(0), _entry(0) + 64), b"x" * 64), "unterminated"),
])
def test_wfile_reader_refuses(tmp_path: Path, patch, msg: str) -> None:  # noqa: ANN001
    path, data = _wfile(tmp_path)
    b = bytearray(data)
    patch(b)
    path.write_bytes(bytes(b))
    with pytest.raises(ValueError, match=msg) as ei:
        read_wfile(path)
    assert "w.bin" in str(ei.value)


def test_wfile_truncated(tmp_path: Path) -> None:
    path, data = _wfile(tmp_path)
    for n in (0, 10, 100, len(data) - 1):
        path.write_bytes(data[:n])
        with pytest.raises(ValueError, match="w.bin"):
            read_wfile(path)


def test_convert_once_keeps_a_current_folder_and_redoes_a_stale_one(tmp_path: Path) -> None:
    from colibri.engine.format.convert import PRESET_REVISION, convert_once, is_current_conversion

    hf = make_checkpoint("mixtral", tmp_path / "hf", seed=5)
    out = convert_once(hf, tmp_path / "out", "q4")
    assert is_current_conversion(out, "q4") and not is_current_conversion(out, "q8")
    cfg_path = out / "config.json"
    stamp = cfg_path.stat().st_mtime_ns
    assert convert_once(hf, out, "q4") == out and cfg_path.stat().st_mtime_ns == stamp
    # a folder from an earlier preset revision (no revision recorded) is converted again
    cfg = json.loads(cfg_path.read_text())
    del cfg["preset_revision"]
    cfg_path.write_text(json.dumps(cfg))
    assert not is_current_conversion(out, "q4")
    convert_once(hf, out, "q4")
    assert json.loads(cfg_path.read_text())["preset_revision"] == PRESET_REVISION
    # so is one of another precision
    convert_once(hf, out, "q8")
    assert json.loads(cfg_path.read_text())["quant"] == "q8"
    # a folder that is not a conversion is left alone
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists"):
        convert_once(hf, tmp_path / "other", "q4")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
