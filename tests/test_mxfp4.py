"""MXFP4, the weight type gpt-oss experts ship in, against its descriptions: numpy's decoding
(engine/format/quant.py) against an independent formula and transformers' own dequantizer; the
C decoding against numpy bit for bit; every ISA's product against the reference bit for bit
(tails of 1 to 3 blocks, rows not a multiple of the kernels' tiles, zero blocks, the smallest
and largest exponents) and the reference against numpy's exact product of the same operands;
the 8-row interleaved layout the SIMD paths repack experts to against its description, and its
products against the rows' bits.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core as core
from colibri.engine.format import quant

ISAS = core.isa_supported()
QK = quant.QK
Q8A_DTYPE = np.dtype([("d", "<f4"), ("sum", "<i4"), ("qs", "i1", (QK,))])
# products (n_out, n_in, tokens): 1, 2, 3, 5, 7 and 128 blocks per row; rows past tiles of 16
SHAPES = [(1, 32, 1), (5, 64, 3), (17, 96, 2), (33, 160, 7), (3, 224, 1), (16, 4096, 5),
          (40, 288, 9)]


def _blocks(rng: np.random.Generator, n_blocks: int, extremes: bool = True) -> np.ndarray:
    """Random MXFP4 blocks with exponents around 127 (values near 1), plus an all-zero block
    and, with extremes, the exponents 0, 1 (subnormal scales) and 254 among them."""
    b = np.empty(n_blocks, dtype=quant.MXFP4_DTYPE)
    b["qs"] = rng.integers(0, 256, (n_blocks, QK // 2), dtype=np.uint8)
    b["e"] = rng.integers(118, 132, n_blocks, dtype=np.uint8)
    if n_blocks >= 4:
        b["qs"][1] = 0
        b["e"][1] = 0
    if extremes and n_blocks >= 5:
        b["e"][0], b["e"][2], b["e"][3] = 0, 1, 254
    return b


def test_decode_is_the_e2m1_formula_for_every_nibble_and_exponent() -> None:
    """Every nibble under every exponent: sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6,
    times 2^(e - 127); element 2k is qs[k]'s low nibble, 2k + 1 its high one."""
    blocks = np.empty(256, dtype=quant.MXFP4_DTYPE)
    blocks["e"] = np.arange(256)
    lo, hi = np.arange(16, dtype=np.uint8), (np.arange(16, dtype=np.uint8) + 5) % 16
    blocks["qs"] = lo | (hi << 4)
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

    def value(nib: int, e: int) -> float:
        v = mags[nib & 7] * 2.0 ** (e - 127)
        return -v if nib & 8 else v

    with np.errstate(over="ignore"):  # e 255: 2^128 times 1 and more is inf in float32
        want = np.array([[value(int(lo[k]) if j % 2 == 0 else int(hi[k]), e)
                          for j in range(QK) for k in [j // 2]] for e in range(256)],
                        dtype=np.float64).astype(np.float32)
    got = quant.decode(blocks.tobytes(), "mxfp4", (256, QK))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 stays -0
    for isa in ISAS:
        core.isa_force(isa)
        try:
            np.testing.assert_array_equal(core.to_float("mxfp4", blocks.tobytes(), 256 * QK),
                                          want.reshape(-1))
        finally:
            core.isa_force(core.isa_best())
    np.testing.assert_array_equal(core.dequantize("mxfp4", blocks.tobytes(), 256 * QK),
                                  want.reshape(-1))


def test_decode_equals_transformers_dequantization() -> None:
    """transformers' convert_moe_packed_tensors (how it loads gpt-oss's MXFP4 experts on a
    CPU) gives numpy's values bit for bit, from the checkpoint's *_blocks / *_scales."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    E, rows, n = 3, 8, 96
    b = _blocks(rng, E * rows * n // QK, extremes=False)
    blocks = np.ascontiguousarray(b["qs"]).reshape(E, rows, n // QK, QK // 2)
    scales = np.ascontiguousarray(b["e"]).reshape(E, rows, n // QK)
    ref = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()  # [E, n, rows]
    ours = quant.decode(quant.mxfp4_from_checkpoint(blocks, scales).tobytes(), "mxfp4",
                        (E, rows, n))
    np.testing.assert_array_equal(ref, np.swapaxes(ours, 1, 2))


def test_quantizer_keeps_representable_values_and_rounds_to_the_nearest() -> None:
    rng = np.random.default_rng(2)
    exact = quant.decode(_blocks(rng, 64, extremes=False).tobytes(), "mxfp4", (64 * QK,))
    exact = exact.reshape(-1, QK)
    exact[:, 0] = np.where(np.abs(exact).max(axis=1) > 0, 6.0, 0.0) * 2.0 ** (
        np.floor(np.log2(np.maximum(np.abs(exact).max(axis=1), 1e-30))) - 2)
    x = exact.reshape(-1).astype(np.float32)
    np.testing.assert_array_equal(quant.fake_quantize(x, "mxfp4"), x)
    y = rng.standard_normal(32 * QK).astype(np.float32)
    q = quant.fake_quantize(y, "mxfp4").reshape(-1, QK)
    yb = y.reshape(-1, QK)
    e = np.floor(np.log2(np.abs(yb).max(axis=1))) - 2
    # within half a gap of e2m1's grid (gaps 0.5, 1, 2 scale units), and the values between 6
    # and 8 scale units clamped to 6: at most 2 units of the scale 2^e
    assert np.all(np.abs(q - yb) <= 2.0 * 2.0 ** e[:, None])
    assert np.mean(np.abs(q - yb) <= 0.5 * 2.0 ** e[:, None]) > 0.5
    assert np.all(np.sign(q) * np.sign(yb) >= 0)


def _q8a_values(x: np.ndarray) -> np.ndarray:
    """x as the reference quantizes activations for MXFP4 products (q8a), back in float64."""
    a = np.frombuffer(core.quantize("q8a", x), dtype=Q8A_DTYPE)
    return (a["d"].astype(np.float64)[:, None] * a["qs"].astype(np.float64)).reshape(-1)


@pytest.mark.parametrize("shape", SHAPES)
def test_products_on_every_isa_are_the_reference_bits(shape: tuple[int, int, int]) -> None:
    n_out, n_in, T = shape
    rng = np.random.default_rng(n_out * 1000 + n_in)
    w = _blocks(rng, n_out * n_in // QK).tobytes()
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    x[0, :QK] = 0.0  # a zero activation block
    core.isa_force("ref")
    try:
        ref = core.matmul("mxfp4", w, n_out, n_in, x)
        dots = [core.vec_dot("mxfp4", w[r * n_in // QK * 17:(r + 1) * n_in // QK * 17], x[0])
                for r in range(n_out)]
        for isa in ISAS:
            core.isa_force(isa)
            for n_threads in (1, 3):
                got = core.matmul("mxfp4", w, n_out, n_in, x, n_threads=n_threads)
                np.testing.assert_array_equal(got, ref, err_msg=f"{isa}, {n_threads} threads")
            got_dots = [core.vec_dot("mxfp4", w[r * n_in // QK * 17:(r + 1) * n_in // QK * 17],
                                     x[0]) for r in range(n_out)]
            np.testing.assert_array_equal(np.array(got_dots, np.float32),
                                          np.array(dots, np.float32), err_msg=isa)
    finally:
        core.isa_force(core.isa_best())
    np.testing.assert_array_equal(np.array(dots, np.float32), ref[0])


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_product_is_numpys_exact_product(shape: tuple[int, int, int]) -> None:
    """The reference against numpy's float64 product of the very same operands (the decoded
    weights, the q8a-rounded activations): float32 rounding of n / 32 block terms at most."""
    n_out, n_in, T = shape
    rng = np.random.default_rng(7 + n_in)
    wb = _blocks(rng, n_out * n_in // QK, extremes=False)
    W = quant.decode(wb.tobytes(), "mxfp4", (n_out, n_in)).astype(np.float64)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    core.isa_force("ref")
    try:
        got = core.matmul("mxfp4", wb.tobytes(), n_out, n_in, x)
    finally:
        core.isa_force(core.isa_best())
    xq = np.stack([_q8a_values(row) for row in x])
    exact = xq @ W.T
    bound = (n_in // QK + 2) * 2.0**-24 * (np.abs(xq) @ np.abs(W).T) + 1e-30
    assert np.all(np.abs(got - exact) <= bound)


def numpy_x8(raw: bytes, n_out: int, n_in: int) -> bytes:
    """The interleaved layout (mxfp4x8) as clb_types.h states it: per group of 8 rows and per
    block, the 8 rows' exponents, then each row's nibbles in q4's element order (byte j: element
    j low, j + 16 high) 4 bytes at a time, bytes 4c..4c+3 of row r at 8 + 4 * (8c + r)."""
    nb = n_in // QK
    b = np.frombuffer(raw, quant.MXFP4_DTYPE).reshape(n_out // 8, 8, nb)  # group, row, block
    nib = np.empty((n_out // 8, 8, nb, QK), np.uint8)  # element order
    nib[..., 0::2], nib[..., 1::2] = b["qs"] & 15, b["qs"] >> 4
    q4 = nib[..., :QK // 2] | (nib[..., QK // 2:] << 4)  # [g, r, b, 16]
    quants = q4.reshape(n_out // 8, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4)  # g, b, c, r, byte
    scales = b["e"].transpose(0, 2, 1)  # g, b, r
    return np.concatenate([scales, quants.reshape(n_out // 8, nb, 128)], axis=2).tobytes()


@pytest.mark.parametrize("shape", [(8, 32), (16, 64), (24, 1024), (200, 160)])
def test_interleaved_layout_matches_its_description(shape: tuple[int, int]) -> None:
    n_out, n_in = shape
    raw = _blocks(np.random.default_rng(n_out + n_in), n_out * n_in // QK).tobytes()
    want = numpy_x8(raw, n_out, n_in)
    assert core.repack_x8("mxfp4", raw, n_out, n_in, ref=True) == want  # the specification
    assert core.repack_x8("mxfp4", raw, n_out, n_in) == want  # the CPU's fastest copy
    assert core.repack_x8("mxfp4", raw, n_out, n_in, in_place=True) == want


@pytest.mark.parametrize("isa", ISAS)
def test_interleaved_products_are_the_row_bits(isa: str) -> None:
    """The layout the SIMD paths repack experts to at load (mxfp4x8): one token (decode),
    1 to 8 and more (prefill passes of 8, tails), 1 and 2 threads, bias and a wider ldy, on
    blocks with the extreme exponents: the bits of the rows on the reference."""
    rng = np.random.default_rng(9)
    for n_out, n_in in ((8, 32), (40, 288), (64, 2880), (24, 96)):
        raw = _blocks(rng, n_out * n_in // QK).tobytes()
        x8 = core.repack_x8("mxfp4", raw, n_out, n_in)
        for n_tok in (1, 2, 3, 5, 8, 9, 16, 17):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            core.isa_force("ref")
            try:
                want = core.matmul("mxfp4", raw, n_out, n_in, x)
                core.isa_force(isa)
                for threads in (1, 2):
                    got = core.matmul("mxfp4x8", x8, n_out, n_in, x, n_threads=threads)
                    np.testing.assert_array_equal(got, want, err_msg=f"{n_out}x{n_in} "
                                                  f"{n_tok} tokens {threads} threads")
            finally:
                core.isa_force(core.isa_best())
        bias = rng.standard_normal(n_out).astype(np.float32)
        x = rng.standard_normal((3, n_in)).astype(np.float32)
        core.isa_force(isa)
        try:
            got = core.matmul("mxfp4x8", x8, n_out, n_in, x, bias=bias, ldy=n_out + 5)
            want = core.matmul("mxfp4", raw, n_out, n_in, x, bias=bias, ldy=n_out + 5)
        finally:
            core.isa_force(core.isa_best())
        np.testing.assert_array_equal(got, want)


def test_weight_files_hold_mxfp4_and_the_loader_checks_its_sizes(tmp_path: Path) -> None:
    """An MXFP4 tensor in a weight file: listed with 17 bytes per block by the C loader and
    read back by numpy; a table whose dtype, row length or byte count disagree is refused."""
    from colibri.engine.errors import FormatError
    from colibri.engine.format.wfile import TensorSpec, read_wfile, write_wfile

    rng = np.random.default_rng(4)
    blocks = _blocks(rng, 3 * 64 // QK, extremes=False)
    path = tmp_path / "w.bin"
    write_wfile(path, [TensorSpec("norm", "f32", (4,), lambda: np.ones(4, np.float32).tobytes()),
                       TensorSpec("w", "mxfp4", (3, 64), lambda: blocks.tobytes())])
    got = core.inspect_weight_file(path)
    assert [(t["name"], t["dtype"], t["shape"], t["nbytes"]) for t in got][1] == (
        "w", "mxfp4", (3, 64), 3 * 2 * 17)
    np.testing.assert_array_equal(read_wfile(path).array("w"),
                                  quant.decode(blocks.tobytes(), "mxfp4", (3, 64)))
    entry = 64 + 128  # header, then the second table entry: dtype at +64, shape at +72
    for at, fmt, value, words in ((entry + 64, "<I", 3, "nbytes"),      # read as q8
                                  (entry + 72 + 8, "<q", 48, "whole blocks")):
        bad = tmp_path / f"bad{at}.bin"
        data = bytearray(path.read_bytes())
        struct.pack_into(fmt, data, at, value)
        bad.write_bytes(bytes(data))
        with pytest.raises(FormatError, match=words):
            core.inspect_weight_file(bad)
