"""Batch invariance and reference equality of the matrix products, on every compiled ISA path.

A row's result must not depend on how many rows (tokens) share the call or where the row sits
among them: prefill, decode, continuous batching and the expert groups of a step all give a
token the same numbers. The q8/q4/q6/mxfp4 products of every ISA path must also equal the
plain C reference (`ref`) bit for bit: they compute each row's exact integer block sums and
scale and add them in the reference's order. Outputs are pre-filled with NaN by
engine._core.matmul, so an element a kernel fails to write cannot pass.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri.engine import _core as core
from colibri.engine.format import quant
from tests.conftest import quick_params

WEIGHT_TYPES = ["f32", "f16", "bf16", "q8", "q4", "q6"]
ISAS = core.isa_supported()
F16_MAX = 65504.0


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    """Forces one ISA variant for the test, then restores the best one."""
    core.isa_force(request.param)
    yield request.param
    core.isa_force(core.isa_best())


@pytest.fixture(params=core.STREAM_HINTS)
def hint(request: pytest.FixtureRequest):
    """Forces one prefetch hint of the AVX-512 interleaved products (the other paths ignore
    it), then restores the one picked at start."""
    core.stream_hint_force(request.param)
    yield request.param
    core.stream_hint_force(core.stream_hint_best())


def _weights(type_name: str, n_out: int, n_in: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    w[n_out // 2] = 0.0  # an all-zero row
    w[min(1, n_out - 1), 32:64] = 0.0  # an all-zero block
    w[min(2, n_out - 1), :32] *= 1e3  # a block of large values
    return quant.encode(w, type_name)


def _raw_block_weights(type_name: str, n_out: int, n_in: int, seed: int) -> bytes:
    """Arbitrary q8/q4/q6 bytes, beyond what the quantizer writes: q8 values -128..127, every
    q4 nibble, every q6 byte, f16 scales from zero and subnormal up to the largest finite;
    mxfp4: every nibble, exponents 0 and 1 (subnormal scales) and 110..140."""
    rng = np.random.default_rng(seed)
    nb = n_out * n_in // quant.QK
    if type_name == "mxfp4":
        b = np.empty(nb, dtype=quant.MXFP4_DTYPE)
        b["qs"] = rng.integers(0, 256, (nb, quant.QK // 2), dtype=np.uint8)
        b["qs"][4::9] = 0x77  # the largest magnitude, 6, in both nibbles
        b["e"] = rng.integers(110, 141, nb, dtype=np.uint8)
        b["e"][::7], b["e"][3::11] = 0, 1
        return b.tobytes()
    scales = rng.standard_normal(nb).astype(np.float32) * np.float32(0.02)
    scales[::7] = 0.0
    scales[3::11] = np.float32(3e-6)  # f16 subnormal
    scales[5::13] = np.float32(F16_MAX)
    d = scales.astype(np.float16).view(np.uint16)
    if type_name == "q8":
        qs = rng.integers(-128, 128, (nb, quant.QK)).astype(np.int8)
        qs[1::5] = -128
        dt = np.dtype([("d", "<u2"), ("qs", "i1", (quant.QK,))])
    else:
        n_bytes = quant.BLOCK_BYTES[type_name] - 2
        qs = rng.integers(0, 256, (nb, n_bytes)).astype(np.uint8)
        qs[2::5] = 0x08 if type_name == "q4" else 0  # q4: value 0; q6: all -32
        qs[4::9] = 0xFF  # the largest values: 7, or 31
        dt = np.dtype([("d", "<u2"), ("qs", "u1", (n_bytes,))])
    out = np.empty(nb, dtype=dt)
    out["d"] = d
    out["qs"] = qs
    return out.tobytes()


def _activations(n_tok: int, n_in: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 32:64] = 0.0  # zero activation blocks
    x[1::3, :32] *= np.float32(1e4)
    x[2::3, 64:96] *= np.float32(1e-6)
    return x


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_row_alone_equals_row_in_any_batch(type_name: str, n_threads: int, isa: str) -> None:
    # 45 rows: two whole 16-row groups and a tail of 13; 288 columns: 9 blocks (odd)
    n_out, n_in = 45, 288
    data = _weights(type_name, n_out, n_in, seed=11)
    pool = _activations(17, n_in, seed=12)
    alone = np.stack([core.matmul(type_name, data, n_out, n_in, pool[i:i + 1], None,
                                  n_threads)[0] for i in range(17)])
    assert not np.isnan(alone).any()
    for n_tok in range(2, 18):
        for first in sorted({0, (17 - n_tok) // 2, 17 - n_tok}):
            y = core.matmul(type_name, data, n_out, n_in, pool[first:first + n_tok], None,
                            n_threads)
            np.testing.assert_array_equal(y, alone[first:first + n_tok],
                                          err_msg=f"{n_tok} rows from {first}")
    # the same row at every position of one batch built from copies of other rows
    for pos in range(0, 17, 4):
        batch = np.repeat(pool[5:6], 17, axis=0)
        batch[pos] = pool[9]
        y = core.matmul(type_name, data, n_out, n_in, batch, None, n_threads)
        np.testing.assert_array_equal(y[pos], alone[9])


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_output_rows_do_not_depend_on_the_row_range(type_name: str, isa: str) -> None:
    # a worker computes a slice of the matrix's rows: any slice gives the same numbers
    n_out, n_in = 45, 288
    data = _weights(type_name, n_out, n_in, seed=21)
    row = len(data) // n_out
    x = _activations(9, n_in, seed=22)
    full = core.matmul(type_name, data, n_out, n_in, x, None, 1)
    for r0, r1 in ((0, 1), (3, 20), (15, 17), (16, 45), (31, 45), (44, 45)):
        part = core.matmul(type_name, data[r0 * row:r1 * row], r1 - r0, n_in, x, None, 2)
        np.testing.assert_array_equal(part, full[:, r0:r1], err_msg=f"rows {r0}..{r1}")


@pytest.mark.parametrize("type_name", ["q8", "q4", "q6"])
@pytest.mark.parametrize("shape", [(1, 32, 1), (16, 64, 8), (45, 288, 17), (70, 4096, 3),
                                   (33, 96, 9)])
@pytest.mark.parametrize("raw", [False, True])
def test_block_products_equal_reference_bits(type_name: str, shape: tuple[int, int, int],
                                             raw: bool, isa: str) -> None:
    n_out, n_in, n_tok = shape
    data = (_raw_block_weights(type_name, n_out, n_in, seed=n_out) if raw
            else _weights(type_name, n_out, n_in, seed=n_out))
    x = _activations(n_tok, n_in, seed=n_in)
    got = core.matmul(type_name, data, n_out, n_in, x, None, 2)
    core.isa_force("ref")
    want = core.matmul(type_name, data, n_out, n_in, x, None, 1)
    core.isa_force(isa)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


# The interleaved layouts the SIMD paths repack to at load: the same two promises, on whole
# 8-row groups (40 rows: two 16-row pairs of groups and a lone group, as AVX-512 reads them).
@pytest.mark.parametrize("kind", ["q8", "q4", "q6", "mxfp4"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_interleaved_row_alone_equals_row_in_any_batch(kind: str, n_threads: int,
                                                       isa: str) -> None:
    n_out, n_in = 40, 288
    data = core.repack_x8(kind, _raw_block_weights(kind, n_out, n_in, seed=31), n_out, n_in)
    pool = _activations(17, n_in, seed=32)
    alone = np.stack([core.matmul(kind + "x8", data, n_out, n_in, pool[i:i + 1], None,
                                  n_threads)[0] for i in range(17)])
    assert not np.isnan(alone).any()
    for n_tok in range(2, 18):
        for first in sorted({0, (17 - n_tok) // 2, 17 - n_tok}):
            y = core.matmul(kind + "x8", data, n_out, n_in, pool[first:first + n_tok], None,
                            n_threads)
            np.testing.assert_array_equal(y, alone[first:first + n_tok],
                                          err_msg=f"{n_tok} rows from {first}")


# Several products in one dispatch, as the forward pass runs a layer's projections and experts:
# the workers claim spans of row tiles across all the jobs, so a span may begin in one job and
# end in the next, and which worker computes a row depends on timing. Every job must come out
# exactly as it does alone on one thread. n_in = 4096 makes a row tile (16 rows) big enough
# that spans are one to a few tiles, so every job is split between workers.
@pytest.mark.parametrize("kind", ["f32", "q8", "q4x8", "q6x8", "mxfp4x8"])
@pytest.mark.parametrize("n_threads", quick_params([2, 3, 4], [3]))  # 3: spans split unevenly
def test_jobs_in_one_dispatch_equal_each_job_alone(kind: str, n_threads: int,
                                                   isa: str) -> None:
    n_in = 4096
    base = kind.removesuffix("x8")
    # (rows, tokens, gated): a partial last tile, a job with no tokens, single groups
    shapes = [(200, 3, False), (24, 1, True), (8, 0, False), (136, 5, True), (40, 17, False)]
    jobs = []
    for i, (n_out, n_tok, gated) in enumerate(shapes):
        mats = [_weights(base, n_out, n_in, seed=50 + 2 * i + u) for u in range(1 + gated)]
        if kind != base:
            mats = [core.repack_x8(base, m, n_out, n_in) for m in mats]
        x = _activations(n_tok, n_in, seed=70 + i)
        jobs.append((kind, mats[0], n_out, n_in, x, mats[1] if gated else None))
    together = core.matmul_jobs(jobs, n_threads)
    for job, got in zip(jobs, together, strict=True):
        name, w, n_out, _, x, w_up = job
        alone = core.matmul_jobs([job], 1)[0]
        assert got.shape == (len(x), n_out)
        assert np.isfinite(alone).all()
        np.testing.assert_array_equal(got, alone)
        gate = core.matmul(name, w, n_out, n_in, x, None, 1)
        if w_up is None:
            np.testing.assert_array_equal(got, gate)
        else:  # silu(gate) * up, from the products alone
            up = core.matmul(name, w_up, n_out, n_in, x, None, 1)
            with np.errstate(over="ignore"):  # exp(-gate) of a large negative gate: inf
                want = gate / (np.float32(1) + np.exp(-gate)) * up
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["q8", "q4", "q6", "mxfp4"])
@pytest.mark.parametrize("shape", [(8, 32, 1), (16, 64, 8), (40, 288, 17), (72, 4096, 3),
                                   (24, 96, 9), (32, 160, 4)])
def test_interleaved_products_equal_reference_bits(kind: str, shape: tuple[int, int, int],
                                                   isa: str, hint: str) -> None:
    # extreme bytes (q8 -128, every nibble, f16 scales from zero to the largest finite)
    n_out, n_in, n_tok = shape
    rows = _raw_block_weights(kind, n_out, n_in, seed=n_out + 1)
    x = _activations(n_tok, n_in, seed=n_in + 1)
    got = core.matmul(kind + "x8", core.repack_x8(kind, rows, n_out, n_in), n_out, n_in, x,
                      None, 2)
    core.isa_force("ref")
    want = core.matmul(kind, rows, n_out, n_in, x, None, 1)
    core.isa_force(isa)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)
