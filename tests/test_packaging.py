"""`pip install .` ships every subpackage and the bundled model (a non-editable install once
left out app/routes), under the installed names colibri.app and colibri.engine."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parent.parent


def _setup_kwargs(monkeypatch) -> dict:
    """What setup.py hands to setuptools.setup (the build itself is not run)."""
    seen: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(ROOT)
    source = (ROOT / "setup.py").read_text()
    exec(compile(source, str(ROOT / "setup.py"), "exec"), {"__name__": "setup_probe"})
    return seen


def test_every_subpackage_is_installed_under_colibri(monkeypatch) -> None:
    kw = _setup_kwargs(monkeypatch)
    assert kw["package_dir"] == {"colibri.app": "app", "colibri.engine": "engine"}
    for top in ("engine", "app"):
        for init in (ROOT / top).rglob("__init__.py"):
            name = "colibri." + ".".join(init.parent.relative_to(ROOT).parts)
            assert name in kw["packages"], name
    assert all(p.startswith(("colibri.app", "colibri.engine")) for p in kw["packages"])


def test_package_data_covers_the_demo_model_and_chat_page() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = data["package-data"]
    for folder, key in (("engine/demo_model", "colibri.engine"), ("app/static", "colibri.app")):
        for f in (ROOT / folder).iterdir():
            rel = str(f.relative_to(ROOT / folder.split("/")[0]))
            assert any(fnmatch.fnmatch(rel, pat) for pat in data[key]), rel
