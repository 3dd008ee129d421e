"""`colibri verify` and model loading refuse folders that no longer fit together: an edited
config.json, a broken tokenizer, `files` names outside the folder, wrong tensor_types, eos
ids outside the vocabulary and non-finite weights (at conversion, in verify, at run time)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri.engine.errors import FormatError, ModelFaultError
from colibri.engine.executor.model import Model
from colibri.engine.format.convert import convert, verify
from colibri.engine.format.wfile import read_wfile
from tests.server_helpers import ROOT, tiny_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("verify") / "hf")


@pytest.fixture(scope="module")
def converted(hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(hf, tmp_path_factory.mktemp("conv") / "f32", quant="f32", progress=False)


@pytest.fixture()
def copy(converted: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "m"))


def _edit(folder: Path, **changes: object) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def test_fresh_conversion_verifies(converted: Path) -> None:
    verify(converted, full=True, deep=True)
    out = subprocess.run([sys.executable, "-m", "colibri.app", "verify", str(converted)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@pytest.mark.parametrize("key,delta", [("n_embd", 8), ("n_ff", 16), ("n_vocab", 1),
                                       ("n_layer", -1), ("n_expert_used", -1)])
def test_config_edited_after_conversion(copy: Path, key: str, delta: int) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    _edit(copy, **{key: cfg[key] + delta})
    with pytest.raises(ValueError, match=key):
        verify(copy, full=False, deep=True)


def test_truncated_or_missing_tokenizer(copy: Path) -> None:
    tj = copy / "tokenizer.json"
    data = tj.read_bytes()
    tj.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="tokenizer.json"):
        verify(copy, full=False, deep=True)
    tj.unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        verify(copy, full=False, deep=True)


@pytest.mark.parametrize("name", ["../../../../../etc/shadow", "/etc/passwd", "a/../../x",
                                  "link/passwd"])
def test_files_outside_the_folder_are_refused(copy: Path, name: str) -> None:
    (copy / "link").symlink_to("/etc")
    cfg = json.loads((copy / "config.json").read_text())
    cfg["files"][name] = {"size": 1, "sha256": "0" * 64}
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not a file name inside the model folder") as e:
        verify(copy, full=True, deep=True)
    assert "bytes, expected" not in str(e.value)  # the outside file was never looked at


def test_eos_outside_the_vocabulary_refused_at_start(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    _edit(copy, eos_token_ids=[cfg["n_vocab"]])
    with pytest.raises(FormatError, match="outside the vocabulary"):
        Model.load(copy, threads=1, n_ctx=32)


def test_tensor_types_disagreeing_with_files(copy: Path) -> None:
    cfg = json.loads((copy / "config.json").read_text())
    key = next(k for k, v in cfg["tensor_types"].items() if v == "f32" and "expert" in k)
    cfg["tensor_types"][key] = "q8"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="tensor_types"):
        Model.load(copy, threads=1, n_ctx=32)
    with pytest.raises(ValueError, match="tensor_types"):
        verify(copy, full=False, deep=True)


def test_nan_weights_refused_at_conversion(hf: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(hf, tmp_path / "hf"))
    st = next(src.glob("*.safetensors"))
    tensors = load_file(st)
    name = next(n for n in tensors if "experts.0" in n and "w1" in n)
    tensors[name] = tensors[name].copy()
    tensors[name].reshape(-1)[3] = np.nan
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(FormatError, match="non-finite"):
        convert(src, tmp_path / "out", quant="q8", progress=False)
    assert not (tmp_path / "out").exists()


def _poison(folder: Path, file: str, tensor: str) -> None:
    """Write a NaN into an f32 tensor and re-record the file's size and hash."""
    path = folder / file
    info = read_wfile(path).tensors[tensor]
    with open(path, "r+b") as f:
        f.seek(info.offset + 4)
        f.write(struct.pack("<f", float("nan")))
    from colibri.engine.format.convert import _sha256

    cfg = json.loads((folder / "config.json").read_text())
    cfg["files"][file]["sha256"] = _sha256(path)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("seed", range(4))
def test_all_finite_agrees_with_numpy(seed: int) -> None:
    from colibri.engine import _core

    rng = np.random.default_rng(seed)
    f32 = np.finfo(np.float32)
    x = rng.standard_normal((3, 1001)).astype(np.float32)
    x[0, :4] = [f32.max, -f32.max, f32.smallest_subnormal, -0.0]
    assert _core.all_finite(x)
    n = x.size
    for bad in (np.nan, np.inf, -np.inf, np.float32(np.nan) * -1):
        for at in (rng.integers(n), 0, n - 1):  # anywhere, the first and the last included
            y = x.copy()
            y.flat[at] = bad
            assert not _core.all_finite(y) and not np.isfinite(y).all()
    y = x.copy()
    y.view(np.uint32).flat[7] = 0x7F800001  # a signalling NaN
    assert not _core.all_finite(y)
    assert _core.all_finite(np.empty((0, 32000), np.float32))
    with pytest.raises(ValueError):
        _core.all_finite(x[:, ::2])  # not contiguous: refused, never misread


def test_nan_weights_found_by_verify_and_at_run_time(copy: Path) -> None:
    _poison(copy, "embeddings.bin", "output_norm")
    verify(copy, full=False, deep=True)  # sizes and shapes are fine; only full reads values
    with pytest.raises(ValueError, match="non-finite"):
        verify(copy, full=True, deep=True)
    m = Model.load(copy, threads=1, n_ctx=32)
    ids = np.array([1, 2], dtype=np.int32)
    with pytest.raises(ModelFaultError, match="non-finite"):
        m.forward(ids, np.zeros(2, np.int32), np.arange(2, dtype=np.int32))
    assert m.fault is not None
    with pytest.raises(ModelFaultError):
        m.forward(ids, np.zeros(2, np.int32), np.arange(2, dtype=np.int32))
