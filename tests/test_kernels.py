"""C kernels (csrc/) against numpy: conversions, quantizers, dot products and matmul.

Every weight type is tested on every ISA variant this CPU and build support (the variant is
forced through the isa_force hook). Quantizers must match engine/format/quant.py byte for byte;
dot products and matmuls must match an exact (float64) product of the very same rounded
operands within the rounding budget below; quantize->dequantize must stay within each type's
quantization budget.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core as core
from colibri.engine.format import quant

# ---- error budgets -------------------------------------------------------------------------
# U: unit roundoff of float32. Any order of float32 summation of k terms (with or without FMA)
# is within (k - 1) * U * sum|term| of the exact sum, and each term here carries at most two
# more roundings (q types: d_w * d_a, then * integer block sum; float types: the product). So
# a kernel result may differ from the exact dot product of its rounded operands by at most
# DOT_ROUNDING_UNITS(n) * U * sum_i |w_i x_i|. We take k = n (the element count) for every
# type: it is the loosest honest bound (q types sum only n / 32 block terms) and it holds for
# the reference and for every SIMD variant alike. TINY covers float32 underflow of tiny terms.
U = 2.0**-24
TINY = 1e-30


def DOT_ROUNDING_UNITS(n: int) -> float:  # noqa: N802 - a named constant of the budget
    return n + 2.0


# Quantization budgets, per element, in units of the block's float32 scale d (q8, q8a: d =
# amax / 127; q4: |d| = amax / 8; q6: |d| = amax / 32) plus an absolute floor for subnormal
# f16 scales:
# - q8: rint is off by at most d/2; the f16 scale adds at most 2^-11 * d per unit of |q| <= 127.
Q8_ERR_PER_SCALE = 0.5 + 127 * 2.0**-11 + 1e-5
Q8_ERR_ABS = 127 * 2.0**-25  # f16 subnormal spacing is 2^-24: rounding error <= 2^-25 per unit
# - q4: values map into [-8, 8]; +8 is clamped to 7, so one element may be off by a whole |d|;
#   the f16 scale adds 2^-11 * |d| per unit of |q| <= 8.
Q4_ERR_PER_SCALE = 1.0 + 8 * 2.0**-11 + 1e-5
Q4_ERR_ABS = 8 * 2.0**-25
# - q6: the same with [-32, 32], +32 clamped to 31.
Q6_ERR_PER_SCALE = 1.0 + 32 * 2.0**-11 + 1e-5
Q6_ERR_ABS = 32 * 2.0**-25
# - q8a: the scale stays float32, so only the rint half step (and float32 rounding of x / d).
Q8A_ERR_PER_SCALE = 0.5 + 1e-5
# - f16: relative 2^-11 for normal values, absolute 2^-25 in the subnormal range.
F16_ERR_REL, F16_ERR_ABS = 2.0**-11, 2.0**-25
# - bf16: relative 2^-8 (8 significant bits).
BF16_ERR_REL = 2.0**-8

WEIGHT_TYPES = ["f32", "f16", "bf16", "q8", "q4", "q6"]
BLOCK_TYPES = ["q8", "q4", "q6"]
ISAS = core.isa_supported()
Q8A_DTYPE = np.dtype([("d", "<f4"), ("sum", "<i4"), ("qs", "i1", (quant.QK,))])


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    """Forces one ISA variant for the test, then restores the best one."""
    core.isa_force(request.param)
    yield request.param
    core.isa_force(core.isa_best())


# ---- inputs --------------------------------------------------------------------------------


def make_cases(n: int, seed: int, max_abs: float = 1e4) -> dict[str, np.ndarray]:
    """Named float32 vectors of length n (a multiple of 32) covering the hard cases."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(n).astype(np.float32)
    cases = {
        "normal": normal,
        "large": (normal * np.float32(max_abs / 5)).astype(np.float32),
        "tiny": (normal * np.float32(1e-6)).astype(np.float32),  # f16 scales go subnormal
        "zeros": np.zeros(n, np.float32),
        "all_equal": np.full(n, -3.25, np.float32),
        "spike": np.where(np.arange(n) == n // 3, np.float32(max_abs / 2), 0).astype(np.float32),
    }
    mixed = normal.copy()
    mixed.reshape(-1, 32)[::2] = 0.0  # every other block is all zero
    cases["zero_blocks"] = mixed
    # exact halves with amax 127 (q8: d = 1) and -8 (q4: d = 1): exercises round-half-even
    halves = (rng.integers(-15, 15, n) + 0.5).astype(np.float32)
    halves.reshape(-1, 32)[:, 5] = 127.0
    cases["halves_q8"] = halves
    halves4 = (rng.integers(-7, 7, n) + 0.5).astype(np.float32)
    halves4.reshape(-1, 32)[:, 9] = -8.0
    cases["halves_q4"] = halves4
    halves6 = (rng.integers(-31, 31, n) + 0.5).astype(np.float32)
    halves6.reshape(-1, 32)[:, 17] = -32.0
    cases["halves_q6"] = halves6
    # q4 ties on |x|: +a first, then -a: the first one sets the sign of d
    ties = normal.copy()
    ties.reshape(-1, 32)[:, 3] = 9.0
    ties.reshape(-1, 32)[:, 20] = -9.0
    cases["abs_ties"] = ties
    return cases


def q8a_spec(x: np.ndarray) -> bytes:
    """numpy specification of the q8a activation type: q8 arithmetic, scale kept float32."""
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, quant.QK)
    amax = np.max(np.abs(b), axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty(b.shape[0], dtype=Q8A_DTYPE)
    out["d"] = d
    out["sum"] = q.astype(np.int32).sum(axis=1)
    out["qs"] = q
    return out.tobytes()


def exact_weights(type_name: str, data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The weight values the kernel computes with, in float64 (exact for every type)."""
    return quant.decode(data, type_name, shape).astype(np.float64)


def exact_activations(type_name: str, x: np.ndarray) -> np.ndarray:
    """The activation values a kernel for weights of type_name computes with, in float64."""
    if type_name in BLOCK_TYPES:
        blocks = np.frombuffer(q8a_spec(x), dtype=Q8A_DTYPE)
        d = blocks["d"].astype(np.float64)[:, None]
        return (d * blocks["qs"].astype(np.float64)).reshape(x.shape)
    return x.astype(np.float64)


def dot_budget(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Allowed |kernel - exact| for y = x @ w.T given the exact (float64) operands."""
    n = w.shape[-1]
    return DOT_ROUNDING_UNITS(n) * U * (np.abs(x) @ np.abs(w).T) + TINY


# ---- ISA dispatch --------------------------------------------------------------------------


def test_isa_dispatch() -> None:
    assert ISAS[0] == "ref"
    assert core.isa_best() == ISAS[-1]
    for name in ISAS:
        core.isa_force(name)
        assert core.isa_active() == name
    core.isa_force(core.isa_best())
    with pytest.raises(ValueError):
        core.isa_force("neon")


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs Linux's /proc/cpuinfo")
def test_each_simd_path_is_offered_exactly_where_the_cpu_has_its_instructions() -> None:
    """The table the dispatcher builds follows the CPU's flags as the kernel reports them."""
    flags = _cpu_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    assert ("avx2" in ISAS) == avx2
    assert ("avxvnni" in ISAS) == (avx2 and "avx_vnni" in flags)
    assert ("avx512" in ISAS) == (
        avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags)


def test_type_sizes() -> None:
    for t in WEIGHT_TYPES:
        for n in (32, 64, 4096):
            assert core.type_row_size(t, n) == quant.row_bytes(t, n)
    assert core.type_row_size("q8a", 64) == 80
    assert core.type_row_size("q8", 33) == 0
    assert core.type_row_size("f16", 33) == 66
    # 5: the activation type; 6, 7: q8 and q4 interleaved (routed experts are stored so);
    # 8: q6; 9: q6 interleaved; 10: mxfp4; 11: mxfp4 interleaved (in memory only)
    assert [core.type_valid_for_file(i) for i in range(12)] == (
        [True] * 5 + [False] + [True] * 5 + [False])


# ---- scalar conversions --------------------------------------------------------------------


def test_f16_to_f32_all_patterns() -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = core.f16_bits_to_f32(bits)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_f32_to_f16_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    random_bits = rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32)
    # every f16 value, and every midpoint between neighbours (exact in float32): ties
    halves = np.arange(1 << 15, dtype=np.uint16).view(np.float16).astype(np.float64)
    halves = halves[np.isfinite(halves)]
    mids = (halves[:-1] + halves[1:]) / 2
    specials = np.array([65504, 65519.99, 65520, 65536, 1e-8, 2.0**-25, 2.0**-24, 2.0**-14,
                         np.inf], dtype=np.float64)
    x = np.concatenate([random_bits.view(np.float32), halves.astype(np.float32),
                        mids.astype(np.float32), specials.astype(np.float32)])
    x = np.concatenate([x, -x])
    got = core.f32_to_f16_bits(x)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert np.all(np.isnan(got[nan].view(np.float16)))
    assert np.array_equal(got[~nan], want[~nan])


def test_bf16_matches_quant() -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, np.array([np.inf, -np.inf, 0.0, -0.0, 3.0e38], np.float32)])
    assert np.array_equal(core.f32_to_bf16_bits(x), quant.f32_to_bf16_bits(x))
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got, want = core.bf16_bits_to_f32(bits), quant.bf16_bits_to_f32(bits)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- quantizers: bit-exact with engine/format/quant.py -----------------------------------------


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("n", [32, 96, 4096])
def test_quantize_bytes_match_spec(type_name: str, n: int) -> None:
    for name, x in make_cases(n, seed=n).items():
        assert core.quantize(type_name, x) == quant.encode(x, type_name), name


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_dequantize_matches_spec(type_name: str, isa: str) -> None:
    for name, x in make_cases(160, seed=3, max_abs=1e3).items():
        data = quant.encode(x, type_name)
        want = quant.decode(data, type_name, x.shape)
        for got in (core.dequantize(type_name, data, x.size),
                    core.to_float(type_name, data, x.size)):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_q4_all_bytes_through_lookup_table() -> None:
    blocks = np.zeros(16, dtype=quant.Q4_DTYPE)
    blocks["d"] = np.float16(0.5)
    blocks["qs"] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    data = blocks.tobytes()
    want = quant.decode(data, "q4", (16 * 32,))
    assert np.array_equal(core.dequantize("q4", data, 16 * 32), want)


def test_q6_every_value_in_every_position() -> None:
    """Every 6-bit value at every element: the C reference's unpacking against numpy's and
    against the values themselves."""
    u = (np.arange(64 * 32) % 64).reshape(64, 32).astype(np.float32)
    u = (u + np.arange(64, dtype=np.float32)[:, None]) % 64  # block k: value (j + k) % 64
    x = (u - 32) * np.float32(0.25)
    x[:, 0] = -32 * 0.25  # the block's largest magnitude, negative: d = 0.25 exactly
    data = quant.encode(x, "q6")
    assert np.array_equal(quant.decode(data, "q6", x.shape), x)
    assert np.array_equal(core.dequantize("q6", data, x.size), x.reshape(-1))


@pytest.mark.parametrize("n", [32, 64, 96, 224, 4096])
def test_q8a_every_isa_matches_spec(n: int, isa: str) -> None:
    for name, x in make_cases(n, seed=n + 7).items():
        assert core.quantize("q8a", x) == q8a_spec(x), name


def test_quantization_error_budgets() -> None:
    for name, x in make_cases(4096, seed=11, max_abs=1e3).items():
        b = x.reshape(-1, 32).astype(np.float64)
        amax = np.max(np.abs(b), axis=1, keepdims=True)
        for t, per_scale, floor, scale in (
            ("q8", Q8_ERR_PER_SCALE, Q8_ERR_ABS, amax / 127),
            ("q4", Q4_ERR_PER_SCALE, Q4_ERR_ABS, amax / 8),
            ("q6", Q6_ERR_PER_SCALE, Q6_ERR_ABS, amax / 32),
        ):
            err = np.abs(quant.fake_quantize(x, t).reshape(-1, 32) - b)
            assert np.all(err <= per_scale * scale + floor), (t, name)
        deq = core.dequantize("q8a", core.quantize("q8a", x), x.size).reshape(-1, 32)
        assert np.all(np.abs(deq - b) <= Q8A_ERR_PER_SCALE * amax / 127), ("q8a", name)
        err16 = np.abs(quant.fake_quantize(x, "f16") - x)
        assert np.all(err16 <= F16_ERR_REL * np.abs(x) + F16_ERR_ABS), ("f16", name)
        errb = np.abs(quant.fake_quantize(x, "bf16") - x)
        assert np.all(errb <= BF16_ERR_REL * np.abs(x)), ("bf16", name)


# ---- dot products --------------------------------------------------------------------------


def dot_lengths(type_name: str) -> list[int]:
    block = [32, 64, 96, 160, 4096 + 32]
    return block if type_name in BLOCK_TYPES else [1, 7, 15, 17, 33, 100, *block, 1000]


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_vec_dot_within_budget(type_name: str, isa: str) -> None:
    rng = np.random.default_rng(5)
    for n in dot_lengths(type_name):
        cases = make_cases(((n + 31) // 32) * 32, seed=n, max_abs=1e3)
        xs = rng.standard_normal(n).astype(np.float32)
        for name, w in cases.items():
            w = w[:n]
            for x in (xs, w):  # w . w covers all-equal, spikes and zeros on both sides
                data = quant.encode(w, type_name)
                got = core.vec_dot(type_name, data, x)
                we = exact_weights(type_name, data, (1, n))
                xe = exact_activations(type_name, x)[None, :]
                want = float((xe @ we.T)[0, 0])
                budget = float(dot_budget(we, xe)[0, 0])
                assert abs(got - want) <= budget, (n, name, got, want, budget)


def test_vec_mad_f32_within_budget(isa: str) -> None:
    # y + a * x: at most two roundings (multiply, then add; one with FMA) per element
    rng = np.random.default_rng(11)
    for n in (1, 7, 15, 16, 17, 33, 64, 100, 1000):
        y = rng.standard_normal(n).astype(np.float32)
        x = (rng.standard_normal(n) * 1e3).astype(np.float32)
        x[n // 2] = 0.0
        for a in (0.0, 1.0, -0.3125, 7.1e-3):
            got = core.vec_mad_f32(y, x, a)
            exact = y.astype(np.float64) + np.float64(np.float32(a)) * x.astype(np.float64)
            budget = 2 * U * (np.abs(y) + np.abs(np.float32(a) * x.astype(np.float64))) + TINY
            assert got.shape == (n,) and np.all(np.abs(got - exact) <= budget), (n, a)


def test_f16_to_float_every_isa_all_patterns(isa: str) -> None:
    # the active ISA's f16 conversion (attention's f16 KV rows): exact for every number, and a
    # NaN stays a NaN (F16C quiets signalling NaNs; their payload is not kept)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = core.to_float("f16", bits.tobytes(), bits.size)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("hd", [1, 7, 8, 64, 80, 100, 128, 256])
def test_att_dots_within_budget_and_independent_of_grouping(hd: int, isa: str) -> None:
    rng = np.random.default_rng(hd)
    q = rng.standard_normal(hd).astype(np.float32)
    k = (rng.standard_normal((21, hd)) * 10).astype(np.float32)
    k[3] = 0.0
    k[5] = q  # q . q: every product positive
    got, top = core.att_dots(q, k)
    exact = k.astype(np.float64) @ q.astype(np.float64)
    # hd products and at most hd additions, each one rounding (FMA: fewer)
    budget = (hd + 1) * U * (np.abs(k.astype(np.float64)) @ np.abs(q.astype(np.float64))) + TINY
    assert got.shape == (21,) and np.all(np.abs(got - exact) <= budget)
    assert top == got.max()
    # scaled: each sum times the scale, one rounding, and the largest of those
    scaled, top = core.att_dots(q, k, 0.125)
    assert np.array_equal(scaled.view(np.uint32), (got * np.float32(0.125)).view(np.uint32))
    assert top == scaled.max()
    # a row's score is the same bits in any call: alone, in any slice, at any place
    for lo, hi in ((0, 1), (3, 4), (5, 13), (13, 21), (2, 21), (20, 21)):
        part, top = core.att_dots(q, k[lo:hi])
        assert np.array_equal(part.view(np.uint32), got[lo:hi].view(np.uint32)), (lo, hi)
        assert top == got[lo:hi].max(), (lo, hi)


def test_att_dots_maximum_passes_over_a_nan(isa: str) -> None:
    q = np.ones(16, np.float32)
    k = np.arange(16 * 11, dtype=np.float32).reshape(11, 16) / 100
    k[10] = -1.0  # the last row, repeated in the kernels' unused lanes, is the smallest
    k[4, 3] = np.nan
    got, top = core.att_dots(q, k, 0.5)
    assert np.isnan(got[4]) and top == np.nanmax(got) == got[9]
    # a score of -inf stays one; the maximum of scores all -inf is -inf
    got, top = core.att_dots(q, np.full((3, 16), -np.inf, np.float32))
    assert np.all(got == -np.inf) and top == -np.inf


@pytest.mark.parametrize("hd", [1, 7, 8, 40, 64, 80, 128])
def test_att_mad_rows_equal_one_mad_per_row(hd: int, isa: str) -> None:
    rng = np.random.default_rng(100 + hd)
    out = rng.standard_normal(hd).astype(np.float32)
    v = (rng.standard_normal((16, hd)) * 3).astype(np.float32)
    w = rng.random(16).astype(np.float32)
    w[4] = 0.0
    for n in (1, 5, 16):
        want = out
        for r in range(n):
            want = core.vec_mad_f32(want, v[r], float(w[r]))
        got = core.att_mad_rows(out, v[:n], w[:n])
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
    with pytest.raises(ValueError):
        core.att_mad_rows(out, v[:2], w[:3])
    with pytest.raises(ValueError):
        core.att_dots(out, v[:0])


@pytest.mark.parametrize("hd", [7, 16, 64, 80, 128])
def test_att_kernels_of_every_isa_agree_with_the_reference(hd: int, isa: str) -> None:
    # the scores' addition order differs between ISAs (within the budget above); the
    # weighted sums of rows are the same fused multiply-adds on every SIMD path
    rng = np.random.default_rng(400 + hd)
    q = rng.standard_normal(hd).astype(np.float32)
    k = rng.standard_normal((13, hd)).astype(np.float32)
    w = rng.random(13).astype(np.float32)
    out = rng.standard_normal(hd).astype(np.float32)
    got, top = core.att_dots(q, k, 0.25)
    mad = core.att_mad_rows(out, k, w)
    core.isa_force("ref")
    want, want_top = core.att_dots(q, k, 0.25)
    want_mad = core.att_mad_rows(out, k, w)
    core.isa_force(isa)
    bound = 2 * (hd + 1) * U * (np.abs(k) @ np.abs(q)) * 0.25 + TINY
    assert np.all(np.abs(got - want) <= bound) and abs(top - want_top) <= bound.max()
    mad_bound = 2 * 14 * U * (np.abs(out) + w @ np.abs(k)) + TINY
    assert np.all(np.abs(mad - want_mad) <= mad_bound)
    if isa != "ref":
        core.isa_force("avx2")
        avx2_mad = core.att_mad_rows(out, k, w)
        core.isa_force(isa)
        assert np.array_equal(mad.view(np.uint32), avx2_mad.view(np.uint32))


@pytest.mark.parametrize("n", [1, 5, 15, 16, 17, 33, 300])
def test_att_exp_sum_is_exp_within_two_units_and_the_same_bits_on_every_isa(n: int,
                                                                            isa: str) -> None:
    rng = np.random.default_rng(200 + n)
    s = rng.uniform(-80.0, 3.0, n).astype(np.float32)
    s[0] = 3.0  # the maximum: exp(0) is exactly 1
    if n > 4:
        s[1:5] = [-1e-30, -0.0, 3.0 - 87.0, -400.0]  # near 0, at the clamp, far below it
    got, total = core.att_exp_sum(s, 3.0)
    assert not np.array_equal(got, s) and np.array_equal(core.att_exp_sum(s, 3.0)[0], got)
    exact = np.exp((s - np.float32(3.0)).astype(np.float64))  # of the f32 difference, as computed
    normal = exact >= np.float64(np.exp(-87.0))
    assert got[0] == 1.0
    assert np.all(np.abs(got[normal] - exact[normal]) <= 2 * U * exact[normal])
    # below the clamp the weight is exp(-87), about 1.6e-38: nothing next to the maximum's 1
    assert np.all((got[~normal] > 0) & (got[~normal] <= np.float32(1.7e-38)))
    assert abs(total - exact.sum()) <= 2 * n * U * exact.sum()
    # every ISA gives the reference's bits, sum included, and each value is the same in any
    # call (its lane among 16 decides only where it is added)
    core.isa_force("ref")
    ref, ref_total = core.att_exp_sum(s, 3.0)
    core.isa_force(isa)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)) and total == ref_total
    for lo in sorted({0, min(1, n - 1), n // 2}):
        assert np.array_equal(core.att_exp_sum(s[lo:], 3.0)[0].view(np.uint32),
                              got[lo:].view(np.uint32)), lo


def test_att_exp_sum_keeps_a_nan(isa: str) -> None:
    s = np.zeros(40, np.float32)
    s[21] = np.nan
    got, total = core.att_exp_sum(s, 0.0)
    assert np.isnan(got[21]) and np.isnan(total)
    assert np.all(np.delete(got, 21) == 1.0)
    with pytest.raises(ValueError):
        core.att_exp_sum(s[:0], 0.0)


@pytest.mark.parametrize("n", [1, 7, 8, 13, 64, 301])
def test_silu_mul_is_silu_times_up_and_the_same_bits_on_every_isa(n: int, isa: str) -> None:
    rng = np.random.default_rng(300 + n)
    g = (rng.standard_normal(n) * 6).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    if n > 6:
        g[:6] = [0.0, -0.0, 90.0, -86.0, -120.0, 1e-30]  # large, at and past the clamp, tiny
    got = core.silu_mul(g, u)
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    exact = g64 / (1.0 + np.exp(-g64)) * u64
    inside = g >= -87.0  # exp(-g) is clamped at exp(88) beyond: the result is about 0 there
    # the exponent's 2 units, then the add, the division and the product's roundings
    tol = 4 * U * np.abs(exact[inside]) + np.finfo(np.float32).tiny
    assert np.all(np.abs(got[inside] - exact[inside]) <= tol)
    assert np.all(np.abs(got[~inside]) <= np.abs(g64 * u64)[~inside] * 1e-37)
    # every ISA gives the reference's bits, and each element depends on its own inputs alone
    core.isa_force("ref")
    ref = core.silu_mul(g, u)
    core.isa_force(isa)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    for lo in sorted({0, min(1, n - 1), n // 2}):
        assert np.array_equal(core.silu_mul(g[lo:], u[lo:]).view(np.uint32),
                              got[lo:].view(np.uint32)), lo


def test_silu_mul_keeps_a_nan_and_refuses_lengths_that_differ(isa: str) -> None:
    g = np.ones(20, np.float32)
    g[11] = np.nan
    got = core.silu_mul(g, np.full(20, 2.0, np.float32))
    assert np.isnan(got[11]) and np.all(np.isfinite(np.delete(got, 11)))
    with pytest.raises(ValueError):
        core.silu_mul(g, g[:19])


# ---- matmul --------------------------------------------------------------------------------

MATMUL_SHAPES = [  # (n_out, n_in, n_tokens)
    (1, 32, 1),
    (17, 64, 1),
    (37, 96, 3),
    (64, 256, 8),
    (33, 160, 5),
    (130, 512, 2),
    (39, 96, 7),  # row tail of 3, token tail of 3, odd block count
    (64, 224, 6),
]


def matmul_inputs(n_out: int, n_in: int, n_tok: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    if n_out > 1:
        w[n_out // 2] = 0.0  # an all-zero row
    w[0, :32] *= 1e3  # a block of large values
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, 32:64] = 0.0 if n_in >= 64 else x[:, 32:64]  # zero activation blocks
    bias = rng.standard_normal(n_out).astype(np.float32)
    return w, x, bias


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
@pytest.mark.parametrize("shape", MATMUL_SHAPES)
def test_matmul_within_budget(type_name: str, shape: tuple[int, int, int], isa: str) -> None:
    n_out, n_in, n_tok = shape
    w, x, bias = matmul_inputs(n_out, n_in, n_tok, seed=n_out * n_in)
    data = quant.encode(w, type_name)
    we = exact_weights(type_name, data, w.shape)
    xe = exact_activations(type_name, x)
    want = xe @ we.T
    budget = dot_budget(we, xe)
    y = core.matmul(type_name, data, n_out, n_in, x, None, 1)
    assert y.shape == (n_tok, n_out) and not np.isnan(y).any()
    assert np.all(np.abs(y - want) <= budget)
    yb = core.matmul(type_name, data, n_out, n_in, x, bias, 1)
    assert np.array_equal(yb, (y + bias).astype(np.float32))
    # a row stride wider than n_out: padding columns must stay untouched
    ldy = n_out + 5
    yp = core.matmul(type_name, data, n_out, n_in, x, bias, 1, ldy)
    assert np.array_equal(yp[:, :n_out], yb) and np.all(yp[:, n_out:] == 12345.0)
    for n_threads in (2, 3, 4):
        yt = core.matmul(type_name, data, n_out, n_in, x, bias, n_threads)
        assert np.array_equal(yt, yb), n_threads


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_matmul_token_tiles_do_not_change_results(type_name: str, isa: str) -> None:
    # the kernels tile rows and tokens; a row's result must not depend on which tile (or how
    # many tokens) it was computed with: prefill and decode give the same numbers
    n_out, n_in, n_tok = 23, 288, 9
    w, x, _ = matmul_inputs(n_out, n_in, n_tok, seed=3)
    data = quant.encode(w, type_name)
    y = core.matmul(type_name, data, n_out, n_in, x, None, 1)
    for t in range(n_tok):
        yt = core.matmul(type_name, data, n_out, n_in, x[t:t + 1], None, 1)
        assert np.array_equal(yt[0], y[t]), t
    for r0, r1 in ((0, 1), (5, 11), (20, 23)):
        yr = core.matmul(type_name, data[r0 * len(data) // n_out:r1 * len(data) // n_out],
                         r1 - r0, n_in, x, None, 2)
        assert np.array_equal(yr, y[:, r0:r1]), (r0, r1)


def test_matmul_rejects_bad_arguments() -> None:
    w = quant.encode(np.ones((4, 64), np.float32), "q8")
    x = np.ones((2, 64), np.float32)
    with pytest.raises(ValueError):
        core.matmul("q8", w, 4, 64, x, None, 1, 3)  # ldy < n_out
    with pytest.raises(ValueError):
        core.matmul("q8", w[:-1], 4, 64, x, None, 1)  # short weights
    with pytest.raises(ValueError):
        core.matmul("q8", w, 4, 48, np.ones((2, 48), np.float32), None, 1)  # not whole blocks
    with pytest.raises(ValueError):
        core.matmul("q8a", core.quantize("q8a", np.ones(64, np.float32)), 1, 64, x, None, 1)


def test_matmul_zero_tokens() -> None:
    w = quant.encode(np.ones((4, 64), np.float32), "q4")
    y = core.matmul("q4", w, 4, 64, np.zeros((0, 64), np.float32), None, 2)
    assert y.shape == (0, 4)


@pytest.mark.parametrize("type_name", WEIGHT_TYPES)
def test_get_row(type_name: str) -> None:
    w, _, _ = matmul_inputs(9, 64, 1, seed=9)
    data = quant.encode(w, type_name)
    full = quant.decode(data, type_name, w.shape)
    for row in (0, 4, 8):
        assert np.array_equal(core.get_row(type_name, data, 64, row), full[row])
