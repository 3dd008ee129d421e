"""Colibri weight files (`*.bin`, format version 1 of docs/INTERNALS.md): writer and reader.

The writer lays out header, table and 64-byte aligned data from the tensors' shapes, then
streams each tensor's bytes into `<path>.part`, hashing as it goes; fsync and rename make the
final name appear only when the file is complete. The reader checks every rule the C loader
checks (magic, version, counts, offsets, sizes, overlaps, duplicate names) and raises a
ValueError naming the file and tensor; it never trusts a number it has not checked.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.engine.format import quant

MAGIC = b"CLBWGT1\0"
VERSION = 1
HEADER_BYTES = 64
ENTRY_BYTES = 128
ALIGN = 64
MAX_TENSORS = 4096
MAX_DIM = 2**40
NAME_BYTES = 64

_HEADER = struct.Struct("<8sIIQQQ24s")
_ENTRY = struct.Struct("<64sII4qQQ8s")
assert _HEADER.size == HEADER_BYTES and _ENTRY.size == ENTRY_BYTES


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(type_name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of type_name and shape (rows of whole blocks, last dim innermost)."""
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return quant.row_bytes(type_name, int(shape[-1])) * rows


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: produce() returns its encoded bytes (called once, in order)."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    produce: Callable[[], bytes | np.ndarray]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _check_spec(path: Path, spec: TensorSpec) -> None:
    where = f"{path}: tensor {spec.name!r}"
    raw = spec.name.encode("utf-8")
    if not raw or len(raw) >= NAME_BYTES or b"\0" in raw:
        raise ValueError(f"{where}: name must be 1..{NAME_BYTES - 1} bytes without NUL")
    if spec.type_name not in quant.TYPE_IDS:
        raise ValueError(f"{where}: unknown type {spec.type_name!r}")
    if not 1 <= len(spec.shape) <= 4 or not all(1 <= int(d) <= MAX_DIM for d in spec.shape):
        raise ValueError(f"{where}: bad shape {spec.shape}")


def write_wfile(path: str | Path, specs: Iterable[TensorSpec],
                durable: bool = True) -> tuple[int, str]:
    """Write a weight file atomically; returns (size in bytes, sha256 hex of the file).
    durable=False leaves the flush to disk to the caller (one for a whole folder)."""
    path = Path(path)
    specs = list(specs)
    if not 1 <= len(specs) <= MAX_TENSORS:
        raise ValueError(f"{path}: {len(specs)} tensors, must be 1..{MAX_TENSORS}")
    seen: set[str] = set()
    for s in specs:
        _check_spec(path, s)
        if s.name in seen:
            raise ValueError(f"{path}: duplicate tensor {s.name!r}")
        seen.add(s.name)

    data_offset = _align(HEADER_BYTES + len(specs) * ENTRY_BYTES)
    layout: list[tuple[int, int]] = []
    pos = data_offset
    for s in specs:
        pos = _align(pos)
        nbytes = tensor_nbytes(s.type_name, s.shape)
        layout.append((pos, nbytes))
        pos += nbytes
    file_size = pos

    table = bytearray()
    for s, (off, nbytes) in zip(specs, layout, strict=True):
        shape4 = [int(d) for d in s.shape] + [1] * (4 - len(s.shape))
        table += _ENTRY.pack(
            s.name.encode("utf-8"), quant.TYPE_IDS[s.type_name], len(s.shape), *shape4,
            off, nbytes, b"\0" * 8,
        )
    header = _HEADER.pack(MAGIC, VERSION, len(specs), HEADER_BYTES, data_offset, file_size,
                          b"\0" * 24)

    part = path.with_name(path.name + ".part")
    h = hashlib.sha256()
    written = 0
    try:
        with open(part, "wb") as f:

            def put(b: bytes | memoryview) -> None:
                nonlocal written
                f.write(b)
                h.update(b)
                written += len(b)

            put(header)
            put(bytes(table))
            for s, (off, nbytes) in zip(specs, layout, strict=True):
                put(b"\0" * (off - written))
                data = s.produce()
                buf = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray)
                                 else data).cast("B")
                if len(buf) != nbytes:
                    raise ValueError(
                        f"{path}: tensor {s.name!r} produced {len(buf)} bytes, "
                        f"expected {nbytes} for {s.type_name} {s.shape}"
                    )
                put(buf)
            assert written == file_size
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return file_size, h.hexdigest()


class WFile:
    """A validated weight file; tensor data is read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER_BYTES)
            self._parse_header(head, size)
            table = f.read(self.n_tensors * ENTRY_BYTES)
        self._parse_table(table)

    def _fail(self, msg: str) -> ValueError:
        return ValueError(f"{self.path}: {msg}")

    def _parse_header(self, head: bytes, size: int) -> None:
        if len(head) < HEADER_BYTES:
            raise self._fail(f"too short for a header ({size} bytes)")
        magic, version, n, table_off, data_off, file_size, reserved = _HEADER.unpack(head)
        if magic != MAGIC:
            raise self._fail(f"bad magic {magic!r}, not a Colibri weight file")
        if version != VERSION:
            raise self._fail(f"format version {version}, this build reads {VERSION}")
        if not 1 <= n <= MAX_TENSORS:
            raise self._fail(f"tensor count {n} is not in 1..{MAX_TENSORS}")
        if table_off != HEADER_BYTES:
            raise self._fail(f"table offset {table_off}, expected {HEADER_BYTES}")
        if data_off % ALIGN or data_off < table_off + n * ENTRY_BYTES:
            raise self._fail(f"bad data offset {data_off}")
        if file_size != size:
            raise self._fail(f"header says {file_size} bytes but the file has {size} (truncated?)")
        if data_off > size:
            raise self._fail(f"data offset {data_off} is past the end of the file")
        if any(reserved):
            raise self._fail("reserved header bytes are not zero")
        self.n_tensors, self.data_offset, self.file_size = n, data_off, file_size

    def _parse_table(self, table: bytes) -> None:
        spans: list[tuple[int, int, str]] = []
        for i in range(self.n_tensors):
            fields = _ENTRY.unpack_from(table, i * ENTRY_BYTES)
            raw_name, dtype, n_dims = fields[0], fields[1], fields[2]
            shape4, off, nbytes, reserved = fields[3:7], fields[7], fields[8], fields[9]
            nul = raw_name.find(b"\0")
            if nul <= 0 or any(raw_name[nul:]):
                raise self._fail(f"tensor #{i}: name is empty, unterminated or not NUL-padded")
            try:
                name = raw_name[:nul].decode("utf-8")
            except UnicodeDecodeError:
                raise self._fail(f"tensor #{i}: name is not UTF-8") from None
            where = f"tensor {name!r}"
            if name in self.tensors:
                raise self._fail(f"{where}: duplicate name")
            if dtype not in quant.TYPE_NAMES:
                raise self._fail(f"{where}: unknown dtype {dtype}")
            if not 1 <= n_dims <= 4:
                raise self._fail(f"{where}: n_dims {n_dims} not in 1..4")
            if not all(1 <= d <= MAX_DIM for d in shape4) or any(d != 1 for d in shape4[n_dims:]):
                raise self._fail(f"{where}: bad shape {list(shape4)} for {n_dims} dims")
            if any(reserved):
                raise self._fail(f"{where}: reserved bytes are not zero")
            type_name = quant.TYPE_NAMES[dtype]
            shape = tuple(shape4[:n_dims])
            try:
                want = tensor_nbytes(type_name, shape)
            except ValueError as e:
                raise self._fail(f"{where}: {e}") from None
            if nbytes != want:
                raise self._fail(f"{where}: nbytes {nbytes}, {type_name} {shape} needs {want}")
            if off % ALIGN or off < self.data_offset:
                raise self._fail(f"{where}: bad offset {off}")
            if off + nbytes > self.file_size:
                raise self._fail(f"{where}: data runs past the end of the file")
            self.tensors[name] = TensorInfo(name, type_name, shape, off, nbytes)
            spans.append((off, off + nbytes, name))
        spans.sort()
        for (_b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise self._fail(f"tensors {n0!r} and {n1!r} overlap")

    def raw(self, name: str) -> bytes:
        """The stored bytes of a tensor."""
        t = self._info(name)
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            data = f.read(t.nbytes)
        if len(data) != t.nbytes:
            raise self._fail(f"tensor {name!r}: short read (file changed?)")
        return data

    def rows(self, name: str) -> tuple[str, bytes]:
        """A tensor's row type and its bytes in rows: the stored bytes, or an interleaved
        matrix's (q8x8, q4x8, q6x8) put back in the rows of its row type."""
        t = self._info(name)
        data, base = self.raw(name), quant.row_type(t.type_name)
        if base == t.type_name:
            return base, data
        return base, quant.from_x8(data, base, t.shape[0], t.shape[1])

    def array(self, name: str) -> np.ndarray:
        """A tensor decoded to float32 with its shape."""
        t = self._info(name)
        return quant.decode(self.raw(name), t.type_name, t.shape)

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise self._fail(f"no tensor {name!r}")
        return self.tensors[name]


def read_wfile(path: str | Path) -> WFile:
    """Open and validate a weight file (raises ValueError naming file and tensor)."""
    return WFile(path)
