"""The 8-row interleaved weight layouts (q8x8, q4x8, q6x8, mxfp4x8) that the SIMD paths repack
weights to at load (AVX-512 reads two groups at once): the layout against an independent numpy
description, products on it equal the row layout's bit for bit on every ISA (so a repacked
model decodes the same tokens and logits), the expert cache's slot repacking gives the
all-resident output, and the refusals."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core
from colibri.engine.demo import default_model_path
from colibri.engine.executor.model import Model
from colibri.engine.format.convert import convert, ensure_converted
from colibri.engine.format.wfile import read_wfile
from tests.rows_folder import rows_twin
from tests.scripts_loader import load_script

BLOCK = {"q8": 34, "q4": 18, "q6": 26}  # bytes per 32-value block: f16 scale, then the quants


def numpy_x8(raw: bytes, kind: str, n_out: int, n_in: int) -> bytes:
    """The interleaved layout as its description states it: per group of 8 rows and per block,
    the 8 rows' scales, then quant bytes 4c..4c+3 of row r at 4 * (8c + r)."""
    bs = BLOCK[kind]
    nb = n_in // 32
    a = np.frombuffer(raw, np.uint8).reshape(n_out // 8, 8, nb, bs)  # group, row, block, byte
    scales = a[..., :2].transpose(0, 2, 1, 3).reshape(n_out // 8, nb, 16)
    quants = a[..., 2:].reshape(n_out // 8, 8, nb, (bs - 2) // 4, 4)
    quants = quants.transpose(0, 2, 3, 1, 4).reshape(n_out // 8, nb, 8 * (bs - 2))
    return np.concatenate([scales, quants], axis=2).tobytes()


def _weights(kind: str, n_out: int, n_in: int, seed: int) -> bytes:
    w = np.random.default_rng(seed).standard_normal((n_out, n_in), dtype=np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 0)
    raw = bytearray(_core.quantize(kind, w))
    if kind == "q8":  # a raw -128, which the quantizer never writes but a file may hold
        raw[2] = 0x80
    return bytes(raw)


@pytest.mark.parametrize("kind", ["q8", "q4", "q6"])
@pytest.mark.parametrize("shape", [(8, 32), (16, 64), (24, 1024), (200, 160)])
def test_layout_matches_its_description(kind: str, shape: tuple[int, int]) -> None:
    n_out, n_in = shape
    raw = _weights(kind, n_out, n_in, seed=n_out + n_in)
    want = numpy_x8(raw, kind, n_out, n_in)
    assert _core.repack_x8(kind, raw, n_out, n_in, ref=True) == want  # the specification
    assert _core.repack_x8(kind, raw, n_out, n_in) == want  # the CPU's fastest copy (AVX2)
    assert _core.repack_x8(kind, raw, n_out, n_in, in_place=True) == want


@pytest.mark.parametrize("isa", _core.isa_supported())
@pytest.mark.parametrize("kind", ["q8", "q4", "q6"])
def test_products_equal_the_row_layout_bit_for_bit(isa: str, kind: str) -> None:
    rng = np.random.default_rng(7)
    before = _core.isa_active()
    try:
        _core.isa_force(isa)
        for n_out, n_in in ((8, 32), (40, 256), (1536, 1024), (64, 4096)):
            raw = _weights(kind, n_out, n_in, seed=n_in)
            x8 = _core.repack_x8(kind, raw, n_out, n_in)
            for n_tok in (1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 33):
                x = rng.standard_normal((n_tok, n_in), dtype=np.float32)
                for threads in (1, 2):
                    want = _core.matmul(kind, raw, n_out, n_in, x, n_threads=threads)
                    got = _core.matmul(kind + "x8", x8, n_out, n_in, x, n_threads=threads)
                    assert np.array_equal(got, want), (isa, kind, n_out, n_in, n_tok, threads)
            # ldy padding is left alone and bias applies as for rows
            x = rng.standard_normal((3, n_in), dtype=np.float32)
            bias = rng.standard_normal(n_out, dtype=np.float32)
            want = _core.matmul(kind, raw, n_out, n_in, x, bias=bias, ldy=n_out + 5)
            got = _core.matmul(kind + "x8", x8, n_out, n_in, x, bias=bias, ldy=n_out + 5)
            assert np.array_equal(got, want)
    finally:
        _core.isa_force(before)


def test_refusals() -> None:
    raw = _weights("q8", 12, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of 8"):
        _core.repack_x8("q8", raw, 12, 64)
    with pytest.raises(ValueError, match="only q8, q4, q6 and mxfp4"):
        _core.repack_x8("f32", np.zeros(64, np.float32).tobytes(), 8, 8)
    with pytest.raises(ValueError, match="weight bytes"):
        _core.repack_x8("q8", raw[:-1], 8, 64)
    # a product on an interleaved matrix whose rows do not fill whole groups is refused
    with pytest.raises(ValueError, match="clb_matmul failed"):
        _core.matmul("q8x8", raw, 12, 64, np.ones((1, 64), np.float32))
    # interleaved types are for products only
    with pytest.raises(ValueError, match="unknown type"):
        _core.quantize("q8x8", np.ones(32, np.float32))


# -- models -----------------------------------------------------------------------------------

PROMPT = (np.arange(1, 31, dtype=np.int32) * 11) % 300


def _decode(m: Model, n: int = 10) -> tuple[list[int], list[np.ndarray]]:
    m.reset(0)
    lg = m.forward(PROMPT, np.zeros(PROMPT.size, np.int32), np.arange(PROMPT.size, dtype=np.int32))
    logits, tok, pos, out = [lg[-1].copy()], int(np.argmax(lg[-1])), PROMPT.size, []
    for _ in range(n):
        out.append(tok)
        lg = m.forward(np.array([tok], np.int32), np.zeros(1, np.int32), np.array([pos], np.int32))
        logits.append(lg[-1].copy())
        tok, pos = int(np.argmax(lg[-1])), pos + 1
    return out, logits


def _gpt_oss_mxfp4(root: Path) -> Path:
    """A random gpt-oss whose experts ship in MXFP4 (scripts/gpt_oss_checkpoint.py, the
    benchmark's writer), converted with the q8 preset: MXFP4 experts, q8 attention."""

    from colibri.engine.text.bpe import train_bpe_tokenizer
    from tests.tiny_models import _TEXT, VOCAB_SIZE

    g = load_script("gpt_oss_checkpoint")
    shape = g.GptOssShape(vocab=VOCAB_SIZE, hidden=64, intermediate=96, layers=2, experts=8,
                          top_k=2, heads=4, kv_heads=2, head_dim=16, window=8)
    hf = g.write_checkpoint(root / "hf", shape, seed=5)
    train_bpe_tokenizer([_TEXT] * 4, VOCAB_SIZE, hf)
    return convert(hf, root / "q8", quant="q8", progress=False)


@pytest.fixture(scope="module", params=["q8", "q4", "mxfp4"])
def quant_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained demo model (q8), a random Mixtral with an untied lm_head (q4), and a random
    gpt-oss with MXFP4 experts (mxfp4); q8 and q4 as an earlier Colibri stored them (every
    matrix in rows: the converter now stores routed experts interleaved)."""
    if request.param == "q8":
        demo = ensure_converted(Path(default_model_path()), "q8", progress=False)
        return rows_twin(demo, tmp_path_factory.mktemp("repack_demo") / "rows")
    pytest.importorskip("transformers")
    if request.param == "mxfp4":
        return _gpt_oss_mxfp4(tmp_path_factory.mktemp("repack_gpt_oss"))
    return rows_twin(_mixtral_q4(), tmp_path_factory.mktemp("repack_mixtral") / "rows")


@functools.cache
def _mixtral_q4() -> Path:
    from tests.tiny_models import make_checkpoint

    root = Path(tempfile.mkdtemp(prefix="repack_mixtral_"))
    hf = make_checkpoint("mixtral", root / "hf", seed=3)
    return convert(hf, root / "q4", quant="q4", progress=False)


@pytest.fixture(scope="module")
def rows_ref(quant_dir: Path) -> tuple[list[int], list[np.ndarray]]:
    return _decode(Model.load(quant_dir, n_seq=1))


def test_a_repacked_model_decodes_the_same_logits(quant_dir: Path, rows_ref: tuple) -> None:
    m = Model.load(quant_dir, n_seq=1)
    n = m.core.repack(experts=True)
    assert (n > 0) == _core.wants_x8("q8")
    assert m.core.repack(experts=True) == 0  # already done: nothing left to copy
    tokens, logits = _decode(m)
    assert tokens == rows_ref[0]
    for a, b in zip(logits, rows_ref[1], strict=True):
        assert np.array_equal(a, b)
    if _core.wants_x8("mxfp4") and m.config.n_expert > 0:  # every expert's three matrices
        other = Model.load(quant_dir, n_seq=1)
        assert n - other.core.repack(experts=False) == 3 * m.config.n_layer * m.config.n_expert


@pytest.mark.parametrize("isa", _core.isa_supported())
def test_a_repacked_model_runs_on_every_isa(quant_dir: Path, isa: str) -> None:
    """Repacked under the best ISA, then run on another one: the same logits as the rows
    under that ISA."""
    before = _core.isa_active()
    packed = Model.load(quant_dir, n_seq=1)
    packed.core.repack(experts=True)
    rows = Model.load(quant_dir, n_seq=1)
    try:
        _core.isa_force(isa)
        got, want = _decode(packed, 3), _decode(rows, 3)
    finally:
        _core.isa_force(before)
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("load", ["pread", "mmap"])
def test_expert_cache_slots_repack_as_they_load(quant_dir: Path, rows_ref: tuple,
                                                load: str) -> None:
    m = Model.load(quant_dir, n_seq=1)
    m.core.repack(experts=False)
    k = m.config.n_expert_used
    m.core.enable_expert_cache(k, load=load, prefetch=True)  # the minimum: many reloads
    tokens, logits = _decode(m)
    assert tokens == rows_ref[0]
    for a, b in zip(logits, rows_ref[1], strict=True):
        assert np.array_equal(a, b)
    assert m.core.expert_cache_stats()["evictions"].sum() > 0
    with pytest.raises(ValueError, match="repack the other weights only"):
        m.core.repack(experts=True)


def test_the_cache_is_refused_after_the_experts_were_repacked(quant_dir: Path) -> None:
    m = Model.load(quant_dir, n_seq=1)
    m.core.repack(experts=True)
    if not _core.wants_x8("q8"):
        pytest.skip("this CPU's kernels read the row layout: nothing was repacked")
    with pytest.raises(ValueError, match="enable the expert cache first"):
        m.core.enable_expert_cache(m.config.n_expert_used)


KERNEL_CHOICES = {"COLIBRI_ISA": (_core.isa_active, _core.isa_force),
                  "COLIBRI_STREAM_HINT": (_core.stream_hint_active, _core.stream_hint_force)}


@pytest.mark.parametrize(("variable", "value"),
                         [("COLIBRI_ISA", isa) for isa in _core.isa_supported()]
                         + [("COLIBRI_STREAM_HINT", hint) for hint in _core.STREAM_HINTS])
def test_kernel_variables_choose_at_load_and_keep_the_tokens(
        quant_dir: Path, variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel path (or AVX-512 prefetch hint) the variable names runs the model, and the
    greedy tokens are those of the ones picked here (the products give the same bits on every
    path, and prefetches change no result)."""
    active, force = KERNEL_CHOICES[variable]
    before = active()
    want = _decode(Model.load(quant_dir, n_seq=1), 3)
    monkeypatch.setenv(variable, f" {value.upper()} ")
    try:
        m = Model.load(quant_dir, n_seq=1)
        assert active() == value
        got = _decode(m, 3)
    finally:
        force(before)
    assert got[0] == want[0]


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("COLIBRI_ISA", "avx1024", "COLIBRI_ISA='avx1024' is not a kernel path this CPU runs; "
                               "choose one of ref"),
    ("COLIBRI_STREAM_HINT", "t7", "COLIBRI_STREAM_HINT='t7' is not a stream hint; choose one of "
                               "l2, nta"),
])
def test_kernel_variables_refuse_an_unknown_choice(quant_dir: Path, variable: str, value: str,
                                                   message: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    active, _ = KERNEL_CHOICES[variable]
    before = active()
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        Model.load(quant_dir, n_seq=1)
    assert active() == before


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_experts_stored_interleaved_decode_as_their_rows(kind: str) -> None:
    """The converter stores routed experts in the layout the products read: the same tokens
    and logits, bit for bit, as the same weights in rows (repacked at load, or read as rows
    on the reference ISA), read in place, copied into memory at load, and through the expert
    cache at its smallest budget."""
    if kind == "q8":
        folder = ensure_converted(Path(default_model_path()), "q8", progress=False)
    else:
        pytest.importorskip("transformers")
        folder = _mixtral_q4()
    stored = {t.type_name for t in read_wfile(folder / "experts" / "layer_0_expert_0.bin")
              .tensors.values()}
    assert stored == {kind + "x8"}
    rows = rows_twin(folder, Path(tempfile.mkdtemp(prefix="rows_")) / "rows")
    want = _decode(Model.load(rows, n_seq=1))
    cached = Model.load(folder, n_seq=1)
    cached.core.enable_expert_cache(cached.config.n_expert_used, load="pread", prefetch=True)
    copied = Model.load(folder, n_seq=1)  # resident: the experts copied onto the pool's pages
    cfg = copied.config
    assert (copied.core.repack(experts=True) - Model.load(folder, n_seq=1).core.repack(
        experts=False)) == 3 * cfg.n_layer * cfg.n_expert
    assert copied.core.repack(experts=True) == 0  # already in memory: nothing copied again
    before = _core.isa_active()
    try:
        runs = [_decode(Model.load(folder, n_seq=1)), _decode(cached), _decode(copied)]
        _core.isa_force("ref")
        runs.append(_decode(Model.load(folder, n_seq=1)))
        ref_rows = _decode(Model.load(rows, n_seq=1))
    finally:
        _core.isa_force(before)
    for got, w in zip(runs, [want, want, want, ref_rows], strict=True):
        assert got[0] == w[0]
        for a, b in zip(got[1], w[1], strict=True):
            assert np.array_equal(a, b)
