"""Bad model folders and bad inputs: each is a clean Python exception with a clear message.

Weight files are written valid with engine.format.wfile, then corrupted byte by byte; the C loader
(engine._core.inspect_weight_file / Model.load) must refuse each one with FormatError (a
ValueError) naming the file and, where there is one, the tensor. Missing files are
FileNotFoundError; a config.json that disagrees with the files is a ShapeError (ValueError);
bad token ids and positions at forward time are InputError / ContextOverflowError.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core
from colibri.engine.errors import (
    ContextOverflowError,
    FormatError,
    InputError,
    ModelFileNotFoundError,
    ShapeError,
)
from colibri.engine.executor.model import Model
from colibri.engine.format.wfile import TensorSpec, read_wfile, write_wfile

HEADER, ENTRY = 64, 128
# byte offsets inside a table entry
E_DTYPE, E_NDIMS, E_SHAPE, E_OFFSET, E_NBYTES = 64, 68, 72, 104, 112


def _spec(name: str, ty: str, shape: tuple[int, ...]) -> TensorSpec:
    rng = np.random.default_rng(len(name))
    x = rng.standard_normal(shape).astype(np.float32)
    from colibri.engine.format import quant

    return TensorSpec(name, ty, shape, lambda: quant.encode(x, ty))


def _valid_file(path: Path) -> Path:
    write_wfile(path, [_spec("a", "f32", (4, 8)), _spec("bb", "q8", (3, 64)),
                       _spec("c", "q4", (2, 32)), _spec("d", "f16", (5,))])
    return path


def _patch(path: Path, at: int, fmt: str, value: int | bytes) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def _entry(i: int) -> int:
    return HEADER + i * ENTRY


def _entry_u64(path: Path, i: int, field: int) -> int:
    return struct.unpack_from("<Q", path.read_bytes(), _entry(i) + field)[0]


def _refused(path: Path, *words: str) -> str:
    with pytest.raises(FormatError) as ei:
        _core.inspect_weight_file(path)
    msg = str(ei.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_valid_file_is_listed(tmp_path: Path) -> None:
    p = _valid_file(tmp_path / "ok.bin")
    got = _core.inspect_weight_file(p)
    assert [(t["name"], t["dtype"], t["shape"]) for t in got] == [
        ("a", "f32", (4, 8)), ("bb", "q8", (3, 64)), ("c", "q4", (2, 32)), ("d", "f16", (5,))]
    assert got[1]["nbytes"] == 3 * 2 * 34


# (description, mutation, words the message must contain)
def _mutations(p: Path) -> list[tuple[str, object, tuple[str, ...]]]:
    size = p.stat().st_size
    off_bb = _entry_u64(p, 1, E_OFFSET)
    off_c = _entry_u64(p, 2, E_OFFSET)
    return [
        ("bad magic", lambda: _patch(p, 0, "<8s", b"GGUF\0\0\0\0"), ("magic",)),
        ("bad version", lambda: _patch(p, 8, "<I", 2), ("version 2",)),
        ("zero tensors", lambda: _patch(p, 12, "<I", 0), ("n_tensors 0",)),
        ("huge n_tensors", lambda: _patch(p, 12, "<I", 0xFFFFFFFF), ("n_tensors",)),
        ("table past end", lambda: _patch(p, 12, "<I", 4000), ("table",)),
        ("table offset", lambda: _patch(p, 16, "<Q", 128), ("table_offset",)),
        ("data offset unaligned", lambda: _patch(p, 24, "<Q", 65), ("data_offset",)),
        ("data offset inside table", lambda: _patch(p, 24, "<Q", 64), ("data_offset",)),
        ("header file_size", lambda: _patch(p, 32, "<Q", size + 64), ("header says",)),
        ("reserved header", lambda: _patch(p, 50, "<B", 1), ("reserved",)),
        ("offset past end", lambda: _patch(p, _entry(1) + E_OFFSET, "<Q", size // 64 * 64),
         ("'bb'", "past the end")),
        ("offset overflow", lambda: _patch(p, _entry(1) + E_OFFSET, "<Q", 2**64 - 64),
         ("'bb'", "past the end")),
        ("overlapping tensors", lambda: _patch(p, _entry(2) + E_OFFSET, "<Q", off_bb + 64),
         ("overlap",)),
        ("wrong nbytes", lambda: _patch(p, _entry(1) + E_NBYTES, "<Q", 3 * 2 * 34 + 34),
         ("'bb'", "nbytes")),
        ("unaligned offset", lambda: _patch(p, _entry(2) + E_OFFSET, "<Q", off_c + 2),
         ("'c'", "multiple of 64")),
        ("offset before data", lambda: _patch(p, _entry(0) + E_OFFSET, "<Q", 0),
         ("'a'", "before the data")),
        ("name not terminated", lambda: _patch(p, _entry(0), "<64s", b"x" * 64),
         ("tensor #0", "NUL-terminated")),
        ("name not padded", lambda: _patch(p, _entry(0) + 5, "<B", 65), ("NUL-padded",)),
        ("empty name", lambda: _patch(p, _entry(0), "<B", 0), ("empty name",)),
        ("duplicate names", lambda: _patch(p, _entry(2), "<64s", b"bb"),
         ("'bb'", "more than once")),
        ("dtype q8a", lambda: _patch(p, _entry(0) + E_DTYPE, "<I", 5), ("'a'", "dtype 5")),
        ("dtype 99", lambda: _patch(p, _entry(0) + E_DTYPE, "<I", 99), ("'a'", "dtype 99")),
        ("n_dims 0", lambda: _patch(p, _entry(0) + E_NDIMS, "<I", 0), ("'a'", "n_dims 0")),
        ("n_dims 5", lambda: _patch(p, _entry(0) + E_NDIMS, "<I", 5), ("'a'", "n_dims 5")),
        ("zero dim", lambda: _patch(p, _entry(0) + E_SHAPE, "<q", 0), ("'a'", "shape[0]")),
        ("negative dim", lambda: _patch(p, _entry(0) + E_SHAPE, "<q", -4), ("'a'", "shape[0]")),
        ("huge dim", lambda: _patch(p, _entry(0) + E_SHAPE, "<q", 2**41), ("'a'", "shape[0]")),
        ("unused dim not 1", lambda: _patch(p, _entry(0) + E_SHAPE + 24, "<q", 2),
         ("'a'", "unused shape[3]")),
        ("q8 row not whole blocks", lambda: _patch(p, _entry(1) + E_SHAPE + 8, "<q", 48),
         ("'bb'", "whole blocks")),
        ("nbytes overflow", lambda: (_patch(p, _entry(0) + E_SHAPE, "<q", 2**40),
                                     _patch(p, _entry(0) + E_NDIMS, "<I", 4),
                                     _patch(p, _entry(0) + E_SHAPE + 16, "<q", 2**40)),
         ("'a'", "overflow")),
        ("reserved entry", lambda: _patch(p, _entry(3) + 121, "<B", 7), ("'d'", "reserved")),
    ]


_N_MUTATIONS = 31  # len(_mutations(...)); the test checks it


@pytest.mark.parametrize("k", range(_N_MUTATIONS))
def test_corrupt_file_is_refused(tmp_path: Path, k: int) -> None:
    p = _valid_file(tmp_path / "w.bin")
    muts = _mutations(p)
    assert len(muts) == _N_MUTATIONS
    desc, mutate, words = muts[k]
    mutate()
    _refused(p, *words)
    with pytest.raises(ValueError):  # the Python reader agrees the file is bad
        read_wfile(p)


def test_truncated_and_tiny_files(tmp_path: Path) -> None:
    p = _valid_file(tmp_path / "w.bin")
    data = p.read_bytes()
    for n in (0, 10, 63, 64, 200, len(data) - 1):
        q = tmp_path / f"t{n}.bin"
        q.write_bytes(data[:n])
        msg = _refused(q)
        assert "truncated" in msg or "header says" in msg, msg
    (tmp_path / "ext.bin").write_bytes(data + b"\0" * 64)
    _refused(tmp_path / "ext.bin", "header says")


def test_missing_and_not_regular_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing file"):
        _core.inspect_weight_file(tmp_path / "nope.bin")
    with pytest.raises(OSError, match="not a regular file"):
        _core.inspect_weight_file(tmp_path)


def test_random_corruption_never_crashes(tmp_path: Path) -> None:
    """Random byte edits of the header and table: the C loader either accepts the file or
    refuses it with FormatError, and agrees with the Python reader (engine.format.wfile)."""
    p = _valid_file(tmp_path / "w.bin")
    base = p.read_bytes()
    n_meta = HEADER + 4 * ENTRY
    rng = np.random.default_rng(0)
    accepted = 0
    for _ in range(400):
        data = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, n_meta))
            data[i] = int(rng.integers(0, 256))
        q = tmp_path / "f.bin"
        q.write_bytes(bytes(data))
        try:
            read_wfile(q)
            py_ok = True
        except (ValueError, struct.error):
            py_ok = False
        try:
            _core.inspect_weight_file(q)
            c_ok = True
        except FormatError:
            c_ok = False
        if not py_ok and c_ok:
            # the Python reader also insists names are UTF-8; C only needs NUL termination
            with pytest.raises(ValueError, match="UTF-8"):
                read_wfile(q)
            continue
        assert py_ok == c_ok, bytes(data[:n_meta]).hex()
        accepted += c_ok
    assert accepted < 400  # the edits did break files


# ---- whole model folders --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.engine.format.convert import convert
    from tests.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("model")
    hf = make_checkpoint("mixtral", root / "hf", seed=3)
    return convert(hf, root / "q8", quant="q8", progress=False)


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_model, dst)
    return dst


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_good_model_loads(tiny_model: Path) -> None:
    m = Model.load(tiny_model, threads=1, n_ctx=32)
    out = m.forward(np.array([1, 2, 3], np.int32), np.zeros(3, np.int32),
                    np.arange(3, dtype=np.int32))
    assert out.shape == (3, m.n_vocab) and np.isfinite(out).all()


def test_truncated_expert_file(model_copy: Path) -> None:
    f = model_copy / "experts" / "layer_1_expert_2.bin"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(FormatError, match="layer_1_expert_2.bin.*truncated"):
        Model.load(model_copy, threads=1)


def test_corrupt_header_in_model(model_copy: Path) -> None:
    _patch(model_copy / "attention" / "layer_0.bin", 0, "<8s", b"NOTCLB\0\0")
    with pytest.raises(FormatError, match=r"attention/layer_0\.bin: bad magic"):
        Model.load(model_copy, threads=1)


def test_missing_file(model_copy: Path) -> None:
    (model_copy / "router" / "layer_1.bin").unlink()
    with pytest.raises(ModelFileNotFoundError, match=r"missing file: .*router/layer_1\.bin"):
        Model.load(model_copy, threads=1)
    assert issubclass(ModelFileNotFoundError, FileNotFoundError)


def test_missing_config(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        Model.load(model_copy, threads=1)


def test_config_wrong_n_embd(model_copy: Path) -> None:
    _edit_config(model_copy, n_embd=96)
    with pytest.raises(ShapeError, match=r"embeddings\.bin: tensor 'tok_embd' has shape "
                                         r"\[320, 64\], the config wants \[320, 96\]"):
        Model.load(model_copy, threads=1)


def test_config_wrong_n_expert(model_copy: Path) -> None:
    _edit_config(model_copy, n_expert=6)
    with pytest.raises(ShapeError, match=r"router/layer_0\.bin: tensor 'gate_inp' has shape "
                                         r"\[4, 64\], the config wants \[6, 64\]"):
        Model.load(model_copy, threads=1)


def test_config_wrong_n_ff(model_copy: Path) -> None:
    _edit_config(model_copy, n_ff=64)
    with pytest.raises(ShapeError, match=r"experts/layer_0_expert_0\.bin: tensor 'w1'"):
        Model.load(model_copy, threads=1)


def test_config_claims_qkv_bias(model_copy: Path) -> None:
    _edit_config(model_copy, qkv_bias=True)
    with pytest.raises(ShapeError, match=r"attention/layer_0\.bin: tensor 'bq' is missing"):
        Model.load(model_copy, threads=1)


def test_tensor_with_wrong_dtype(model_copy: Path) -> None:
    # a norm must be f32: rewrite attention/layer_0.bin with attn_norm stored as f16
    f = model_copy / "attention" / "layer_0.bin"
    wf = read_wfile(f)
    specs = []
    for name, t in wf.tensors.items():
        raw = wf.raw(name)
        if name == "attn_norm":
            x = np.frombuffer(raw, "<f4").astype(np.float16)
            specs.append(TensorSpec(name, "f16", t.shape, lambda x=x: x.tobytes()))
        else:
            specs.append(TensorSpec(name, t.type_name, t.shape, lambda raw=raw: raw))
    write_wfile(f, specs)
    with pytest.raises(ShapeError, match="'attn_norm' has dtype f16, must be f32"):
        Model.load(model_copy, threads=1)


@pytest.mark.parametrize("changes, words", [
    ({"n_head_kv": 3}, "multiple of n_head_kv"),
    ({"n_expert_used": 9}, "n_expert_used"),
    ({"architecture": "gpt_bigcode"}, "unknown architecture"),
    ({"format_version": 3}, "format_version"),
    ({"n_layer": 0}, "'n_layer' must be positive"),
    ({"n_embd": "64"}, "wrong type"),
    ({"rotary_dim": 3}, "rotary_dim"),
    ({"rms_eps": -1.0}, "rms_eps"),
])
def test_invalid_config_values(model_copy: Path, changes: dict, words: str) -> None:
    _edit_config(model_copy, **changes)
    with pytest.raises(FormatError, match=words):
        Model.load(model_copy, threads=1)


def test_c_checks_hparams_too(tiny_model: Path) -> None:
    """The C loader refuses inconsistent hparams even if Python let them through."""
    from colibri.engine.models.config import ModelConfig

    hp = ModelConfig.from_dir(tiny_model).to_hparams(32)
    for key, value, words in [("n_head_kv", 3, "multiple of n_head_kv"),
                              ("rotary_dim", 17, "rotary_dim"),
                              ("n_expert_used", 5, "n_expert_used"),
                              ("router", 9, "unknown router"),
                              ("layer_ffn", [0, 7], "unknown FFN kind"),
                              ("layer_attn", [0, 32], "unknown bits"),
                              ("layer_attn", [3, 0], "sliding and chunked at once"),
                              ("layer_attn", [2, 0], "needs attn_chunk > 0"),
                              ("layer_attn", [16, 0], "positive attn_temp_floor"),
                              ("route_input", 2, "route_input 2"),
                              ("mtp_input", 2, "mtp_input 2"),
                              ("mtp_input", 1, "mtp_enorm"),
                              ("mtp_keep_first", 2, "mtp_keep_first 2"),
                              ("n_ctx", 0, "n_ctx")]:
        bad = dict(hp, **{key: value})
        with pytest.raises(FormatError, match=words):
            _core.CoreModel.load(str(tiny_model), bad, 1)


def test_bad_inputs_at_forward_time(tiny_model: Path) -> None:
    m = Model.load(tiny_model, threads=1, n_ctx=16, n_seq=2)
    z = np.zeros(1, np.int32)
    ok = m.forward(np.array([1, 2], np.int32), np.zeros(2, np.int32), np.arange(2, dtype=np.int32))
    assert m.seq_len(0) == 2
    cases = [
        (np.array([320], np.int32), z, np.array([2], np.int32), InputError,
         r"token id 320 is not in 0\.\.319"),
        (np.array([-1], np.int32), z, np.array([2], np.int32), InputError, "token id -1 "),
        (np.array([2**40]), z, np.array([2], np.int32), InputError, "token"),
        (np.array([1], np.int32), np.array([2], np.int32), z, InputError, "sequence id 2"),
        (np.array([1], np.int32), np.array([-1], np.int32), z, InputError,
         r"sequence id -1 not in 0\.\.1"),
        (np.array([1], np.int32), z, np.array([16], np.int32), ContextOverflowError,
         r"position 16 is past the context \(n_ctx 16\)"),
        (np.array([1], np.int32), z, np.array([-3], np.int32), InputError,
         "position -3 is negative"),
        (np.array([1], np.int32), z, np.array([5], np.int32), InputError,
         "sequence 0: position 5 skips ahead: the cache holds 2 positions"),
        (np.array([1, 1], np.int32), np.zeros(2, np.int32), np.array([2, 4], np.int32),
         InputError, "consecutive"),
        (np.array([1, 1], np.int32), z, np.array([2, 3], np.int32), InputError, "differ"),
        # the same checks over several tokens (one token takes a path of its own)
        (np.array([1, 320], np.int32), np.zeros(2, np.int32), np.array([2, 3], np.int32),
         InputError, "token id 320"),
        (np.array([1, 1], np.int32), np.array([0, 2], np.int32), np.array([2, 0], np.int32),
         InputError, "sequence id 2"),
        (np.array([1, 1], np.int32), np.array([0, 1], np.int32), np.array([2, -3], np.int32),
         InputError, "position -3 is negative"),
        (np.array([1, 1], np.int32), np.zeros(2, np.int32), np.array([15, 16], np.int32),
         ContextOverflowError, "position 16 is past"),
        (np.array([1, 1], np.int32), np.array([0, 1], np.int32), np.array([2, 1], np.int32),
         InputError, "sequence 1: position 1 skips ahead"),
        (np.array([1.5]), z, np.array([2], np.int32), InputError, "integers"),
    ]
    for tok, seq, pos, exc, words in cases:
        with pytest.raises(exc, match=words):
            m.forward(tok, seq, pos)
        assert m.seq_len(0) == 2 and m.seq_len(1) == 0  # refused calls change nothing
    # C checks again when Python is bypassed
    with pytest.raises(InputError, match="not in 0..319"):
        m.core.forward(m.kv, np.array([320], np.int32), z, np.array([2], np.int32), None,
                       m.slot_tables)
    with pytest.raises(ContextOverflowError, match="past the context"):
        m.core.forward(m.kv, np.array([1], np.int32), z, np.array([99], np.int32), None,
                       m.slot_tables)
    with pytest.raises(InputError, match="want_logits"):
        m.forward(np.array([1], np.int32), z, np.array([2], np.int32), np.ones(2, bool))
    # the model still works and agrees with itself after all the refusals
    m.reset(0)
    again = m.forward(np.array([1, 2], np.int32), np.zeros(2, np.int32),
                      np.arange(2, dtype=np.int32))
    np.testing.assert_array_equal(again, ok)
    with pytest.raises(InputError):
        m.reset(5)


def test_long_call_is_split_into_chunks(tiny_model: Path) -> None:
    """More tokens than one internal chunk (max_batch) give the same logits as small calls."""
    m = Model.load(tiny_model, threads=1, n_ctx=1100, n_seq=2)
    nb = m.core.max_batch
    n = nb + 37
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 320, n).astype(np.int32)
    want = np.zeros(n, bool)
    want[[0, nb - 1, nb, n - 1]] = True
    big = m.forward(ids, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), want)
    parts = []
    for s in range(0, n, 100):
        e = min(n, s + 100)
        parts.append(m.forward(ids[s:e], np.ones(e - s, np.int32), np.arange(s, e, dtype=np.int32)))
    small = np.concatenate(parts)[want]
    np.testing.assert_allclose(big, small, rtol=0, atol=1e-4 * np.abs(small).max())
