"""clb_hparams has one definition (csrc/clb_model.h); the Cython declaration, the binding's
key lists and ModelConfig.to_hparams() are checked against it field by field, type by type,
so a field added in one place and not the others fails here, not as garbage in C."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fields(block: str) -> dict[str, str]:
    """{name: C type} of declarations like `int64_t a, b;` (C) or `int64_t a, b` (Cython)."""
    out: dict[str, str] = {}
    block = re.sub(r"/\*.*?\*/", "", block, flags=re.S)  # comments may span lines
    for line in block.splitlines():
        line = re.sub(r"#.*", "", line).strip().rstrip(";")
        m = re.match(r"(const (?:int32_t|float) \*|int32_t|int64_t|float|double)\s*(.+)", line)
        if m:
            for name in m.group(2).split(","):
                out[name.strip()] = m.group(1).replace(" ", "")
    return out


def _c_struct() -> dict[str, str]:
    text = (ROOT / "csrc" / "clb_model.h").read_text()
    body = re.search(r"typedef struct \{(.*?)\} clb_hparams;", text, re.S)
    assert body, "clb_hparams not found in clb_model.h"
    return _fields(body.group(1))


def _pxi_text() -> str:
    return (ROOT / "engine" / "_model.pxi").read_text()


def test_cython_declaration_matches_the_c_struct() -> None:
    text = _pxi_text()
    body = re.search(r"ctypedef struct clb_hparams:\n((?:        .*\n)+)", text)
    assert body, "clb_hparams not declared in _model.pxi"
    declared = _fields(body.group(1))
    c = _c_struct()
    # Cython may leave out fields it never sets; every field it declares must match C's
    for name, ty in declared.items():
        assert c.get(name) == ty, f"{name}: C has {c.get(name)}, _model.pxi has {ty}"


def test_binding_key_lists_cover_the_struct() -> None:
    text = _pxi_text()

    def keys(var: str) -> set[str]:
        m = re.search(var + r" = \((.*?)\)", text, re.S)
        assert m, var
        return set(re.findall(r'"(\w+)"', m.group(1)))

    ints, floats = keys("_HPARAM_INT_KEYS"), keys("_HPARAM_FLOAT_KEYS")
    arrays = keys("_HPARAM_ARRAY_KEYS")
    c = _c_struct()
    assert ints | floats | arrays == set(c), "binding keys and C fields differ"
    assert floats == {n for n, t in c.items() if t == "float"}
    assert arrays == {n for n, t in c.items() if t.endswith("*")}


def test_model_config_fills_every_field(tmp_path: Path) -> None:
    from colibri.engine.models.config import ModelConfig
    from tests.tiny_models import make_checkpoint

    hf = make_checkpoint("qwen2_moe", tmp_path / "hf", seed=0)
    from colibri.engine.format.convert import convert

    out = convert(hf, tmp_path / "c", "f32", progress=False)
    hp = ModelConfig.from_dir(out).to_hparams(64)
    c = _c_struct()
    assert set(hp) == set(c)
    for name, ty in c.items():
        if ty.endswith("*"):  # arrays: None (the C default) or a list of the element type
            assert hp[name] is None or isinstance(hp[name], list), name
            continue
        want = float if ty == "float" else int
        assert isinstance(hp[name], want) and not isinstance(hp[name], bool), name
