"""A small safetensors reader: Hugging Face checkpoints as read-only numpy views, no torch.

Guarantees: the JSON header is parsed with a size cap; every tensor's dtype, shape and byte
range is checked (inside the file, matching size, no overlaps, unique names) before any
data is viewed, so a truncated or malicious file fails with a ValueError naming the file
and tensor instead of crashing under mmap. Refuses pickle checkpoints (.bin/.pt/.pth/.ckpt),
which can run code when loaded. Reads F32, F16 and BF16 data (bf16 decoded without torch),
and FP8 (e4m3) weights as DeepSeek and Kimi ship them: each `W` with a `W_scale_inv` of one
float per block (128x128 unless the checkpoint's config says otherwise), decoded one tensor at
a time into W * scale, the scale tensors folded into their weights.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.engine.format.jsonfile import read_json_object
from colibri.engine.format.quant import bf16_bits_to_f32

HEADER_MAX_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# dtype name -> bytes per element, for every dtype the format defines (for validation)
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
READABLE_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")
SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales, multiplied in when decoding


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8 e4m3fn bytes (sign, 4 exponent bits with bias
    7, 3 mantissa bits; exponent 0 subnormal; 0x7f / 0xff NaN, no infinities)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return (sign * val).astype(np.float32)


E4M3 = _e4m3_table()
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read safely; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


class SafetensorsFile:
    """One .safetensors file: validated header plus a read-only mmap of the data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.entries: dict[str, TensorEntry] = {}
        self.metadata: dict[str, str] = {}
        self._mm: mmap.mmap | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._parse(f, size)
            if size > 0:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def _fail(self, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {msg}")

    def _parse(self, f, size: int) -> None:  # noqa: ANN001 - a binary file object
        if size < 8:
            raise self._fail(f"not a safetensors file ({size} bytes, too short for a header)")
        n = int.from_bytes(f.read(8), "little")
        if n < 2 or n > HEADER_MAX_BYTES:
            raise self._fail(f"header length {n} is not in 2..{HEADER_MAX_BYTES}")
        if 8 + n > size:
            raise self._fail(f"header length {n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._fail(f"header is not valid JSON ({e})") from None
        except _DuplicateKey as e:
            raise self._fail(f"header names {e.args[0]!r} twice") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        data_start = 8 + n
        data_len = size - data_start
        meta = header.pop("__metadata__", None)
        if meta is not None:
            if not isinstance(meta, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
            ):
                raise self._fail("__metadata__ must map strings to strings")
            self.metadata = meta
        spans: list[tuple[int, int, str]] = []
        for name, info in header.items():
            entry = self._check_entry(name, info, data_len)
            self.entries[name] = TensorEntry(
                name, entry[0], entry[1], data_start + entry[2], entry[3] - entry[2]
            )
            spans.append((entry[2], entry[3], name))
        spans.sort()
        for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise self._fail(f"tensors {n0!r} and {n1!r} overlap")

    def _check_entry(self, name: str, info: object, data_len: int):  # noqa: ANN202
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise self._fail(f"{where}: entry is not a JSON object")
        dtype = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise self._fail(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape
        ):
            raise self._fail(f"{where}: bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise self._fail(f"{where}: bad data_offsets {offs!r}")
        begin, end = offs
        if not 0 <= begin <= end:
            raise self._fail(f"{where}: bad data_offsets {offs!r}")
        if end > data_len:
            raise self._fail(
                f"{where}: data_offsets {offs} run past the end of the file "
                f"(data section is {data_len} bytes; truncated file?)"
            )
        numel = 1
        for d in shape:
            numel *= d
        if numel * DTYPE_SIZES[dtype] != end - begin:
            raise self._fail(
                f"{where}: {end - begin} bytes stored but shape {shape} of {dtype} "
                f"needs {numel * DTYPE_SIZES[dtype]}"
            )
        return dtype, tuple(shape), begin, end

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view (no copy)."""
        e = self.entries[name]
        if e.nbytes == 0 or self._mm is None:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(self._mm, dtype=np.uint8, count=e.nbytes, offset=e.start)

    def get(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor (or its slice [index] along the first dim) as float32.

        A view for F32, a decoded copy otherwise; slicing first means a fused expert tensor
        is decoded one expert at a time.
        """
        e = self.entries[name]
        if e.dtype not in READABLE_DTYPES:
            raise self._fail(
                f"tensor {name!r} has dtype {e.dtype}; only {', '.join(READABLE_DTYPES)} are read"
            )
        code = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1"}[e.dtype]
        arr = self.raw(name).view(code).reshape(e.shape)
        if index is not None:
            if not e.shape or not 0 <= index < e.shape[0]:
                raise self._fail(f"tensor {name!r}: index {index} out of range for {e.shape}")
            arr = arr[index]
        if e.dtype == "F16":
            return arr.astype(np.float32)
        if e.dtype == "BF16":
            return bf16_bits_to_f32(arr).reshape(arr.shape)
        if e.dtype == "F8_E4M3":
            return E4M3[arr]
        return arr

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views still alive; the map is released when they are
            self._mm = None


def _refuse_pickles(folder: Path) -> None:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder}: found {', '.join(pickles)} but no .safetensors file. Colibri reads only "
            "safetensors checkpoints (pickle files can run code when loaded). Re-save the model "
            "in a trusted environment with transformers: "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out_dir) "
            "(safetensors is the default)."
        )
    raise CheckpointError(
        f"{folder}: no {SINGLE_NAME}, {INDEX_NAME} or other .safetensors file found"
    )


class Checkpoint:
    """A Hugging Face checkpoint folder (single file or sharded) as one tensor namespace."""

    def __init__(self, folder: str | Path, fp8_block: tuple[int, int] = (128, 128)) -> None:
        self.folder = Path(folder)
        self.fp8_block = fp8_block  # rows, columns of the weights one FP8 scale covers
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a folder")
        self.files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index = self.folder / INDEX_NAME
        if index.is_file():
            names = self._read_index(index)
        else:
            names = sorted(p.name for p in self.folder.glob("*.safetensors") if p.is_file())
            if not names:
                _refuse_pickles(self.folder)
        for fname in names:
            sf = SafetensorsFile(self.folder / fname)
            self.files[fname] = sf
            for t in sf.entries:
                if t in self._where:
                    raise CheckpointError(
                        f"{self.folder}: tensor {t!r} appears in both {self._where[t]} and {fname}"
                    )
                self._where[t] = fname
        if index.is_file():
            for t, fname in self._index_map.items():
                if self._where.get(t) != fname:
                    raise CheckpointError(f"{index}: tensor {t!r} is not in {fname}")

    def _read_index(self, index: Path) -> list[str]:
        data = read_json_object(index, "safetensors index", HEADER_MAX_BYTES, CheckpointError)
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty weight_map")
        for t, fname in wm.items():
            if (
                not isinstance(fname, str)
                or Path(fname).name != fname
                or not fname.endswith(".safetensors")
            ):
                raise CheckpointError(f"{index}: tensor {t!r} maps to a bad file name {fname!r}")
            if not (self.folder / fname).is_file():
                raise CheckpointError(f"{index}: shard {fname} (tensor {t!r}) is missing")
        self._index_map: dict[str, str] = dict(wm)
        return sorted(set(wm.values()))

    def _is_scale(self, name: str) -> bool:
        """Whether name is an FP8 weight's block scales (read with the weight, not alone)."""
        w = name[: -len(SCALE_SUFFIX)]
        return (name.endswith(SCALE_SUFFIX) and w in self._where
                and self.entry(w).dtype == "F8_E4M3")

    def names(self) -> list[str]:
        """The tensors, FP8 block scales left out: they are part of their weights."""
        return sorted(n for n in self._where if not self._is_scale(n))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def entry(self, name: str) -> TensorEntry:
        return self.files[self._where[name]].entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def get(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` (or its slice [index]) as float32 (see SafetensorsFile.get); an FP8
        weight comes multiplied by its block scales."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        a = self.files[self._where[name]].get(name, index)
        if self.entry(name).dtype != "F8_E4M3":
            return a
        return self._scaled(name, a, index)

    def get_u8(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` (or its slice [index]) of dtype U8 as it is stored (MXFP4 blocks and
        scales); refuses any other dtype."""
        if name not in self._where:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        e = self.entry(name)
        if e.dtype != "U8":
            raise CheckpointError(f"{self.folder}: tensor {name!r} has dtype {e.dtype}, "
                                  f"MXFP4 blocks and scales are U8")
        a = self.files[self._where[name]].raw(name).reshape(e.shape)
        if index is not None:
            if not e.shape or not 0 <= index < e.shape[0]:
                raise CheckpointError(f"{self.folder}: tensor {name!r}: index {index} out of "
                                      f"range for {e.shape}")
            a = a[index]
        return a

    def _scaled(self, name: str, a: np.ndarray, index: int | None) -> np.ndarray:
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self._where:
            raise CheckpointError(f"{self.folder}: FP8 tensor {name!r} has no {scale_name}")
        if a.ndim != 2 or index is not None:
            raise CheckpointError(f"{self.folder}: FP8 tensor {name!r} of shape "
                                  f"{self.shape(name)}: only 2-D FP8 weights are read")
        br, bc = self.fp8_block
        rows, cols = a.shape
        want = (-(-rows // br), -(-cols // bc))
        s = self.files[self._where[scale_name]].get(scale_name)
        if s.shape != want:
            raise CheckpointError(f"{self.folder}: {scale_name} has shape {list(s.shape)}; "
                                  f"{br}x{bc} blocks of {list(a.shape)} need {list(want)}")
        full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:rows, :cols]
        return a * full

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
