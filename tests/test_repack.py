"""The 8-row interleaved weight layouts (q8x8, q4x8): the layout against an independent numpy
description, products on it equal the row layout's bit for bit on every ISA, and the
refusals."""

from __future__ import annotations

import numpy as np
import pytest

from engine import _core

BLOCK = {"q8": 34, "q4": 18}  # bytes per 32-value block: f16 scale, then the quants


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


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("shape", [(8, 32), (16, 64), (24, 1024), (200, 160)])
def test_layout_matches_its_description(kind: str, shape: tuple[int, int]) -> None:
    n_out, n_in = shape
    raw = _weights(kind, n_out, n_in, seed=n_out + n_in)
    want = numpy_x8(raw, kind, n_out, n_in)
    assert _core.repack_x8(kind, raw, n_out, n_in) == want
    assert _core.repack_x8(kind, raw, n_out, n_in, in_place=True) == want


@pytest.mark.parametrize("isa", _core.isa_supported())
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_products_equal_the_row_layout_bit_for_bit(isa: str, kind: str) -> None:
    rng = np.random.default_rng(7)
    before = _core.isa_active()
    try:
        _core.isa_force(isa)
        for n_out, n_in in ((8, 32), (40, 256), (1536, 1024), (64, 4096)):
            raw = _weights(kind, n_out, n_in, seed=n_in)
            x8 = _core.repack_x8(kind, raw, n_out, n_in)
            for n_tok in (1, 2, 3, 4, 7, 16, 17, 33):
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
    with pytest.raises(ValueError, match="only q8 and q4"):
        _core.repack_x8("f32", np.zeros(64, np.float32).tobytes(), 8, 8)
    with pytest.raises(ValueError, match="weight bytes"):
        _core.repack_x8("q8", raw[:-1], 8, 64)
    # a product on an interleaved matrix whose rows do not fill whole groups is refused
    with pytest.raises(ValueError, match="clb_matmul failed"):
        _core.matmul("q8x8", raw, 12, 64, np.ones((1, 64), np.float32))
    # interleaved types are for products only
    with pytest.raises(ValueError, match="unknown type"):
        _core.quantize("q8x8", np.ones(32, np.float32))
