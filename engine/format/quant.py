"""Reference quantizers in numpy: the specification of Colibri's weight types.

The converter writes weights with these functions, and the C reference quantizers must
match them bit for bit (see docs/INTERNALS.md). Everything is computed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32


@dataclass(frozen=True)
class WeightType:
    name: str
    type_id: int  # clb_type in csrc/clb_types.h, the id weight files store
    block_size: int  # elements per block
    block_bytes: int  # bytes per block
    in_files: bool  # may be stored in a weight file (the others exist in memory only)


# Every type the C core knows, in clb_type order: the Python side's one table of them.
# tests/test_weight_types.py checks it against the C enum, the C traits and the binding.
WEIGHT_TYPES: tuple[WeightType, ...] = (
    WeightType("f32", 0, 1, 4, True),
    WeightType("f16", 1, 1, 2, True),
    WeightType("bf16", 2, 1, 2, True),
    WeightType("q8", 3, QK, 34, True),
    WeightType("q4", 4, QK, 18, True),
    WeightType("q8a", 5, QK, 40, False),  # activations: q8 with an f32 scale and a sum
    # q8, q4, q6 rows interleaved 8 at a time (to_x8): the layout the SIMD products read. The
    # converter stores routed experts so, and the loader repacks the other matrices at load
    WeightType("q8x8", 6, QK, 34, True),
    WeightType("q4x8", 7, QK, 18, True),
    WeightType("q6", 8, QK, 26, True),
    WeightType("q6x8", 9, QK, 26, True),
    WeightType("mxfp4", 10, QK, 17, True),  # OCP microscaling FP4 (gpt-oss experts)
    WeightType("mxfp4x8", 11, QK, 17, False),  # mxfp4 rows interleaved 8 at a time at load
)
_FILE_TYPES = tuple(t for t in WEIGHT_TYPES if t.in_files)
# The types weight files hold, which the converter writes and the loader reads.
TYPE_IDS = {t.name: t.type_id for t in _FILE_TYPES}
TYPE_NAMES = {t.type_id: t.name for t in _FILE_TYPES}
BLOCK_BYTES = {t.name: t.block_bytes for t in _FILE_TYPES}
BLOCK_SIZE = {t.name: t.block_size for t in _FILE_TYPES}

# a row type and its interleaved layout (the ones weight files may hold)
X8_OF = {"q8": "q8x8", "q4": "q4x8", "q6": "q6x8"}
ROWS_OF = {v: k for k, v in X8_OF.items()}


def row_type(type_name: str) -> str:
    """The number format of a stored type, whatever its layout: an interleaved type's row
    type, any other type itself."""
    return ROWS_OF.get(type_name, type_name)

Q8_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
Q4_DTYPE = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
# q6: the low nibbles as in q4, then 8 bytes of 2-bit high parts (see quantize_q6)
Q6_DTYPE = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2 + QK // 4,))])
# mxfp4: an e8m0 exponent e (scale 2^(e - 127)), then 16 bytes of e2m1 nibbles, element 2k
# in the low nibble of qs[k] and 2k + 1 in its high nibble (the checkpoints' own order)
MXFP4_DTYPE = np.dtype([("e", "u1"), ("qs", "u1", (QK // 2,))])
assert (Q8_DTYPE.itemsize, Q4_DTYPE.itemsize, Q6_DTYPE.itemsize, MXFP4_DTYPE.itemsize) == (
    BLOCK_BYTES["q8"], BLOCK_BYTES["q4"], BLOCK_BYTES["q6"], BLOCK_BYTES["mxfp4"])
# e2m1: sign bit 3, magnitudes by bits 0-2 (transformers' FP4_VALUES)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def row_bytes(type_name: str, n: int) -> int:
    """Bytes of one row of n elements; raises if n does not fill whole blocks."""
    bs = BLOCK_SIZE[type_name]
    if n % bs:
        raise ValueError(f"row length {n} is not a multiple of {bs} for {type_name}")
    return n // bs * BLOCK_BYTES[type_name]


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of {QK}")
    return x.reshape(-1, QK)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        inv = np.float32(1.0) / d
    return np.where(d != 0, inv, np.float32(0.0)).astype(np.float32)


def quantize_q8(x: np.ndarray) -> np.ndarray:
    """x[..., n] float -> structured array of q8 blocks, shape [prod(...) * n / 32]."""
    b = _blocks(x)
    amax = np.max(np.abs(b), axis=1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    inv = _inverse(d)
    q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty(b.shape[0], dtype=Q8_DTYPE)
    out["d"] = d.astype(np.float16)
    out["qs"] = q
    return out


def _signed_max_scale(b: np.ndarray, levels: float) -> tuple[np.ndarray, np.ndarray]:
    """Per block: d = (the value of largest magnitude, first on ties) / -levels, and 1/d."""
    idx = np.argmax(np.abs(b), axis=1)
    m = b[np.arange(b.shape[0]), idx]
    d = (m / np.float32(-levels)).astype(np.float32)
    return d, _inverse(d)


def quantize_q4(x: np.ndarray) -> np.ndarray:
    """x[..., n] float -> structured array of q4 blocks (see docs/INTERNALS.md)."""
    b = _blocks(x)
    d, inv = _signed_max_scale(b, 8.0)
    q = np.clip(np.rint(b * inv[:, None]) + 8, 0, 15).astype(np.uint8)
    out = np.empty(b.shape[0], dtype=Q4_DTYPE)
    out["d"] = d.astype(np.float16)
    out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
    return out


def quantize_q6(x: np.ndarray) -> np.ndarray:
    """x[..., n] float -> structured array of q6 blocks: u = rint(x / d) + 32 in 0..63 with
    d = (the value of largest magnitude) / -32, stored as a low nibble (element j < 16: low
    nibble of qs[j], j + 16: its high nibble) and two high bits (element 16h + 4k + i: bits
    2k, 2k + 1 of qs[16 + 4h + i])."""
    b = _blocks(x)
    d, inv = _signed_max_scale(b, 32.0)
    u = np.clip(np.rint(b * inv[:, None]) + 32, 0, 63).astype(np.uint8)
    out = np.empty(b.shape[0], dtype=Q6_DTYPE)
    out["d"] = d.astype(np.float16)
    out["qs"][:, : QK // 2] = (u[:, : QK // 2] & 15) | ((u[:, QK // 2 :] & 15) << 4)
    hi = (u >> 4).reshape(-1, 2, 4, 4)  # [block, h, k, i]
    packed = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out["qs"][:, QK // 2 :] = packed.reshape(-1, QK // 4)
    return out


def quantize_mxfp4(x: np.ndarray) -> np.ndarray:
    """x[..., n] float -> structured array of mxfp4 blocks: per block of 32, the exponent
    e = floor(log2(amax)) - 2 + 127 (the OCP rule: the largest value lands in [4, 8) before
    rounding; e 0 for an all-zero block, clamped to 0..254), then each x / 2^(e - 127) rounded
    to the nearest e2m1 magnitude (ties to the smaller), clamped to 6, with x's sign."""
    b = _blocks(x)
    amax = np.max(np.abs(b), axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2 + 127, 0)
    e = np.clip(e, 0, 254).astype(np.int32)
    v = (np.abs(b) / np.ldexp(np.float32(1.0), e - 127)[:, None]).astype(np.float32)
    mags = FP4_VALUES[:8]
    code = np.argmin(np.abs(v[..., None] - mags), axis=-1).astype(np.uint8)  # first on ties
    code |= np.where(np.signbit(b), 8, 0).astype(np.uint8)
    out = np.empty(b.shape[0], dtype=MXFP4_DTYPE)
    out["e"] = e.astype(np.uint8)
    out["qs"] = code[:, 0::2] | (code[:, 1::2] << 4)
    return out


def dequantize_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """mxfp4 blocks -> float32: FP4_VALUES[nibble] * 2^(e - 127), exact."""
    q = blocks["qs"]
    v = np.empty((q.shape[0], QK), dtype=np.float32)
    v[:, 0::2] = FP4_VALUES[q & 15]
    v[:, 1::2] = FP4_VALUES[q >> 4]
    with np.errstate(over="ignore"):  # e 255 times 1 and more: inf, as in float32 anywhere
        out = np.ldexp(v, blocks["e"].astype(np.int32)[:, None] - 127).astype(np.float32)
    return out.reshape(-1)


def mxfp4_from_checkpoint(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's *_blocks [..., n / 32, 16] and *_scales [..., n / 32] (uint8) as mxfp4
    blocks, byte for byte: nothing is quantized again."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != QK // 2:
        raise ValueError(f"mxfp4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         f"do not pair up")
    out = np.empty(scales.size, dtype=MXFP4_DTYPE)
    out["e"] = scales.reshape(-1)
    out["qs"] = blocks.reshape(-1, QK // 2)
    return out


def dequantize_q8(blocks: np.ndarray) -> np.ndarray:
    d = blocks["d"].astype(np.float32)
    return (d[:, None] * blocks["qs"].astype(np.float32)).reshape(-1)


def dequantize_q4(blocks: np.ndarray) -> np.ndarray:
    d = blocks["d"].astype(np.float32)
    lo = (blocks["qs"] & 0x0F).astype(np.int8) - 8
    hi = (blocks["qs"] >> 4).astype(np.int8) - 8
    q = np.concatenate([lo, hi], axis=1).astype(np.float32)
    return (d[:, None] * q).reshape(-1)


def dequantize_q6(blocks: np.ndarray) -> np.ndarray:
    d = blocks["d"].astype(np.float32)
    nib = blocks["qs"][:, : QK // 2]
    lo = np.concatenate([nib & 15, nib >> 4], axis=1)
    packed = blocks["qs"][:, QK // 2 :].reshape(-1, 2, 1, 4)  # [block, h, -, i]
    hi = (packed >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    u = lo | (hi.reshape(-1, QK) << 4)
    return (d[:, None] * (u.astype(np.float32) - 32)).reshape(-1)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    out = ((u + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def bf16_bits_to_f32(u: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _x8_parts(n_out: int, n_in: int, type_name: str) -> tuple[int, int, int]:
    """Groups of 8 rows, blocks per row and 4-byte chunks of a block's quants, for a matrix
    of a row type that has an interleaved layout."""
    if type_name not in X8_OF:
        raise ValueError(f"{type_name!r} has no interleaved layout in weight files")
    if n_out % 8 or n_in % QK:
        raise ValueError(f"a [{n_out}, {n_in}] matrix has no interleaved layout: rows must be "
                         f"a multiple of 8 and columns of {QK}")
    return n_out // 8, n_in // QK, (BLOCK_BYTES[type_name] - 2) // 4


def to_x8(rows: bytes | np.ndarray, type_name: str, n_out: int, n_in: int) -> bytes:
    """A [n_out, n_in] matrix of row type type_name (q8, q4, q6) in its interleaved layout:
    per group of 8 rows and per block, the 8 rows' f16 scales, then their quants 4 bytes at a
    time, bytes 4c..4c+3 of row r at 16 + 4 * (8c + r) (as csrc's clb_repack_x8_ref)."""
    g, nb, nc = _x8_parts(n_out, n_in, type_name)
    b = np.frombuffer(rows, np.uint8).reshape(g, 8, nb, BLOCK_BYTES[type_name])
    scales = b[..., :2].transpose(0, 2, 1, 3).reshape(g, nb, 16)
    quants = b[..., 2:].reshape(g, 8, nb, nc, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, -1)
    return np.concatenate([scales, quants], axis=2).tobytes()


def from_x8(x8: bytes | np.ndarray, type_name: str, n_out: int, n_in: int) -> bytes:
    """to_x8 undone: the interleaved bytes of a [n_out, n_in] matrix of row type type_name
    back in rows."""
    g, nb, nc = _x8_parts(n_out, n_in, type_name)
    b = np.frombuffer(x8, np.uint8).reshape(g, nb, 8 * BLOCK_BYTES[type_name])
    scales = b[..., :16].reshape(g, nb, 8, 2).transpose(0, 2, 1, 3)
    quants = b[..., 16:].reshape(g, nb, nc, 8, 4).transpose(0, 3, 1, 2, 4).reshape(
        g, 8, nb, 4 * nc)
    return np.concatenate([scales, quants], axis=3).tobytes()


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"an interleaved layout holds matrices, not shape {shape}")
    return shape[0], shape[1]


def encode(x: np.ndarray, type_name: str) -> bytes:
    """A 2-D (or 1-D) float array as the bytes of type_name, row-major, rows of whole blocks
    (an interleaved type: a matrix's rows of its row type, then to_x8)."""
    x = np.asarray(x, dtype=np.float32)
    if type_name in ROWS_OF:
        base = ROWS_OF[type_name]
        return to_x8(encode(x, base), base, *_matrix_shape(x.shape))
    if type_name == "f32":
        return np.ascontiguousarray(x).astype("<f4").tobytes()
    if type_name == "f16":
        return np.ascontiguousarray(x).astype("<f2").tobytes()
    if type_name == "bf16":
        return f32_to_bf16_bits(x).astype("<u2").tobytes()
    if type_name == "q8":
        return quantize_q8(x).tobytes()
    if type_name == "q4":
        return quantize_q4(x).tobytes()
    if type_name == "q6":
        return quantize_q6(x).tobytes()
    if type_name == "mxfp4":
        return quantize_mxfp4(x).tobytes()
    raise ValueError(f"unknown type {type_name!r}")


def decode(data: bytes | np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes of type_name back to float32 of the given shape."""
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray) else data
    if type_name in ROWS_OF:
        base = ROWS_OF[type_name]
        return decode(from_x8(buf, base, *_matrix_shape(shape)), base, shape)
    if type_name == "f32":
        out = buf.view("<f4").astype(np.float32)
    elif type_name == "f16":
        out = buf.view("<f2").astype(np.float32)
    elif type_name == "bf16":
        out = bf16_bits_to_f32(buf.view("<u2"))
    elif type_name == "q8":
        out = dequantize_q8(buf.view(Q8_DTYPE))
    elif type_name == "q4":
        out = dequantize_q4(buf.view(Q4_DTYPE))
    elif type_name == "q6":
        out = dequantize_q6(buf.view(Q6_DTYPE))
    elif type_name == "mxfp4":
        out = dequantize_mxfp4(buf.view(MXFP4_DTYPE))
    else:
        raise ValueError(f"unknown type {type_name!r}")
    return out.reshape(shape)


def fake_quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x rounded through type_name and back: what the engine computes with."""
    x = np.asarray(x, dtype=np.float32)
    return decode(encode(x, type_name), type_name, x.shape)
