"""`pip install .` ships every subpackage and the bundled model (a non-editable install once
left out app/routes)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_included() -> None:
    include = _config()["packages"]["find"]["include"]
    for top in ("engine", "app"):
        for init in (ROOT / top).rglob("__init__.py"):
            name = ".".join(init.parent.relative_to(ROOT).parts)
            assert any(fnmatch.fnmatch(name, pat) for pat in include), name


def test_package_data_covers_the_demo_model_and_chat_page() -> None:
    data = _config()["package-data"]
    for folder, key in (("engine/demo_model", "engine"), ("app/static", "app")):
        for f in (ROOT / folder).iterdir():
            rel = str(f.relative_to(ROOT / key))
            assert any(fnmatch.fnmatch(rel, pat) for pat in data[key]), rel
