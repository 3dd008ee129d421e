"""Dependencies point one way: app -> engine (its package exports only) -> csrc. The code
imports itself by its installed names, colibri.app and colibri.engine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_engine_never_imports_app() -> None:
    for path in (ROOT / "engine").rglob("*.py"):
        bad = [n for n in _imports(path) if n == "colibri.app" or n.startswith("colibri.app.")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_app_uses_only_engine_exports() -> None:
    files = list((ROOT / "app").rglob("*.py"))
    assert files, "app/ has no Python files"
    for path in files:
        bad = [n for n in _imports(path) if n.startswith("colibri.engine.")]
        assert not bad, f"{path.relative_to(ROOT)} imports engine submodules {bad}"


def _engine_module_names() -> set[str]:
    """Modules and sub-packages directly under engine/ (the C extension included)."""
    names = {p.stem for p in (ROOT / "engine").glob("*.py")} | {"_core"}
    names |= {p.name for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file()}
    return names - {"__init__"}


def test_app_never_imports_engine_modules_by_name() -> None:
    """`from colibri.engine import _core` (or any submodule) reaches past the exports too."""
    modules = _engine_module_names()
    for path in (ROOT / "app").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and node.module == "colibri.engine"
                    and node.level == 0):
                bad = [a.name for a in node.names if a.name in modules]
                assert not bad, f"{path.relative_to(ROOT)} imports engine modules {bad}"


def test_engine_top_level_holds_only_the_facade() -> None:
    """The engine's code lives in sub-packages that show the architecture; the top level keeps
    the package exports, the Python facade (llm), the error types and the C binding."""
    top = {p.name for p in (ROOT / "engine").glob("*.py")}
    assert top == {"__init__.py", "llm.py", "errors.py"}, sorted(top)
    for pkg in ("core", "sample", "text", "models", "format", "executor", "tools", "demo"):
        assert (ROOT / "engine" / pkg / "__init__.py").is_file(), pkg


def test_code_imports_only_installed_names() -> None:
    """`import engine` works from the repository root only; installed, the packages are
    colibri.app and colibri.engine, so no code, script or test may use the bare names."""
    for folder in ("app", "engine", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = [n for n in _imports(path) if n.split(".")[0] in ("app", "engine")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
