"""Weight types are defined once: engine/format/quant.py's WEIGHT_TYPES is the Python table,
and the C side (the clb_type enum and block structs of csrc/clb_types.h, the traits table the
kernels use, clb_type_row_size) and every table derived from either agree with it on every id,
name, block size and bytes per block."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from colibri.engine import _core as core
from colibri.engine.format import quant

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "clb_types.h"


def _header() -> str:
    return re.sub(r"/\*.*?\*/", " ", HEADER.read_text(), flags=re.DOTALL)


def test_c_enum_spells_every_type_with_its_id() -> None:
    enum = {name.lower(): int(value)
            for name, value in re.findall(r"\bCLB_TYPE_(\w+)\s*=\s*(\d+)", _header())}
    assert enum == {t.name: t.type_id for t in quant.WEIGHT_TYPES}
    assert re.search(r"\bCLB_TYPE_COUNT\b", _header())


def test_c_block_structs_and_block_size() -> None:
    qk = re.search(r"#define\s+CLB_QK\s+(\d+)", _header())
    assert qk is not None and int(qk.group(1)) == quant.QK
    sizes = {name: int(n) for name, n in
             re.findall(r"sizeof\(clb_block_(\w+)\)\s*==\s*(\d+)", _header())}
    by_name = {t.name: t for t in quant.WEIGHT_TYPES}
    assert sizes and all(by_name[name].block_bytes == n for name, n in sizes.items())


def test_c_traits_agree_with_the_table() -> None:
    """The built core's traits table (names, block sizes, bytes per block) and which types a
    weight file may hold."""
    table = [(t.type_id, t.name, t.block_size, t.block_bytes, t.in_files)
             for t in quant.WEIGHT_TYPES]
    assert core.weight_types() == table


def test_c_row_sizes_agree_with_the_table() -> None:
    for t in quant.WEIGHT_TYPES:
        assert core.type_row_size(t.name, 3 * t.block_size) == 3 * t.block_bytes, t.name
        assert core.type_valid_for_file(t.type_id) == t.in_files, t.name
    assert not core.type_valid_for_file(len(quant.WEIGHT_TYPES))


def test_binding_tables_agree_with_the_table() -> None:
    """_kernels.pxi's PRODUCT_TYPES (every type) and KERNEL_TYPES (every type with row access:
    all but the interleaved layouts), and _model.pxi's names of the types files hold."""
    assert core.PRODUCT_TYPES == {t.name: t.type_id for t in quant.WEIGHT_TYPES}
    assert core.KERNEL_TYPES == {t.name: t.type_id for t in quant.WEIGHT_TYPES
                                 if not t.name.endswith("x8")}
    assert core._TYPE_NAMES == quant.TYPE_NAMES


def test_python_tables_agree_with_the_table() -> None:
    files = [t for t in quant.WEIGHT_TYPES if t.in_files]
    assert quant.TYPE_IDS == {t.name: t.type_id for t in files}
    assert quant.TYPE_NAMES == {t.type_id: t.name for t in files}
    assert quant.BLOCK_BYTES == {t.name: t.block_bytes for t in files}
    assert quant.BLOCK_SIZE == {t.name: t.block_size for t in files}
    assert [t.type_id for t in quant.WEIGHT_TYPES] == list(range(len(quant.WEIGHT_TYPES)))
    for name, dtype in (("q8", quant.Q8_DTYPE), ("q4", quant.Q4_DTYPE), ("q6", quant.Q6_DTYPE)):
        assert dtype.itemsize == quant.BLOCK_BYTES[name]
    for t in files:  # what the converter writes is what the table says (8 rows: a group)
        x = np.zeros((8, 2 * t.block_size), dtype=np.float32)
        assert len(quant.encode(x, t.name)) == 16 * t.block_bytes == 8 * quant.row_bytes(
            t.name, 2 * t.block_size)
