"""Dependencies point one way: app -> engine (its package exports only) -> csrc."""

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
        bad = [n for n in _imports(path) if n == "app" or n.startswith("app.")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_app_uses_only_engine_exports() -> None:
    files = list((ROOT / "app").rglob("*.py"))
    assert files, "app/ has no Python files"
    for path in files:
        bad = [n for n in _imports(path) if n.startswith("engine.")]
        assert not bad, f"{path.relative_to(ROOT)} imports engine submodules {bad}"
