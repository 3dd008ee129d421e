"""Dependencies point one way: app -> engine (its package exports only) -> csrc. The code
imports itself by its installed names, colibri.app and colibri.engine."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@cache
def _tree(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once for every test here (the sources do not change
    while the tests run)."""
    return ast.parse(path.read_text(), filename=str(path))


@cache
def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(_tree(path)):
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
        for node in ast.walk(_tree(path)):
            if (isinstance(node, ast.ImportFrom) and node.module == "colibri.engine"
                    and node.level == 0):
                bad = [a.name for a in node.names if a.name in modules]
                assert not bad, f"{path.relative_to(ROOT)} imports engine modules {bad}"


# the Python API a user of `from colibri.engine import ...` gets beyond what the server needs
PYTHON_API = {"__version__", "LLM", "SamplingParams", "convert", "ModelError"}


def test_every_engine_export_is_used() -> None:
    """The facade stays narrow: each name it exports is imported by the server or is part of
    the Python API (README's `from colibri.engine import LLM`)."""
    import colibri.engine as engine

    used: set[str] = set()
    for path in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module == "colibri.engine":
                used |= {a.name for a in node.names}
    assert PYTHON_API <= set(engine.__all__)
    unused = set(engine.__all__) - used - PYTHON_API
    assert not unused, f"colibri.engine exports {sorted(unused)}, which nothing in app/ uses"
    unknown = used - set(engine.__all__)
    assert not unknown, f"app/ imports {sorted(unknown)}, which colibri.engine does not export"
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


def test_engine_top_level_holds_only_the_facade() -> None:
    """The engine's code lives in sub-packages that show the architecture; the top level keeps
    the package exports, the Python facade (llm), the error types and the C binding."""
    top = {p.name for p in (ROOT / "engine").glob("*.py")}
    assert top == {"__init__.py", "llm.py", "errors.py"}, sorted(top)
    for pkg in ("core", "sample", "text", "models", "format", "executor", "tools", "demo",
                "isolate"):
        assert (ROOT / "engine" / pkg / "__init__.py").is_file(), pkg


def test_code_imports_only_installed_names() -> None:
    """`import engine` works from the repository root only; installed, the packages are
    colibri.app and colibri.engine, so no code, script or test may use the bare names."""
    for folder in ("app", "engine", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = [n for n in _imports(path) if n.split(".")[0] in ("app", "engine")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


# --- no import circles; engine sub-packages import downward only ---------------------------------

ENGINE = "colibri.engine"

# The engine's layers, lowest first. An engine module may import modules of lower layers, and
# modules of its own layer only inside its own sub-package. A module takes the layer of the
# longest entry its name starts with, so format's file readers and writers sit below the models
# while the rest of format (the converter and the model-folder checks, which need the model
# descriptions, the tokenizer and the bundled demo model) sits above them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_core", "errors", "isolate"),  # the C binding; the error types; bounded child processes
    ("format.jsonfile", "format.quant", "format.safetensors_io", "format.wfile"),  # files
    # architectures; sampling and constraints; drafts for speculative decoding; tokenizer, chat
    ("models", "sample", "spec", "text"),
    ("demo",),  # the bundled demo model and its data
    ("format",),  # convert, verify, check a model folder, fetch one from the Hub
    ("executor",),  # the loaded C model and its expert cache
    ("core",),  # requests, scheduler, step engine, async engine
    ("llm",),  # the Python facade
    ("tools",),  # the command line, benchmarks, evaluation
)


def _module_names() -> dict[str, Path | None]:
    """Every module of colibri.engine and colibri.app by dotted name (None: the C extension,
    which imports no Python module)."""
    mods: dict[str, Path | None] = {f"{ENGINE}._core": None}
    for folder in ("engine", "app"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = ["colibri", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of tree, imports inside functions included, except the bodies of
    `if TYPE_CHECKING:` (only a type checker follows those; engine/__init__.py names its lazy
    exports there)."""
    out: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


@cache
def _import_graph() -> dict[str, set[str]]:
    """module -> the colibri modules it imports, relative imports resolved; `from package
    import name` counts as importing the submodule when name is one, else the package."""
    mods = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph[name] = set()
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(_tree(path)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            graph[name] |= {t for t in targets if t in mods and t != name}
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_find_cycle_reports_the_circle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_import_graph_sees_function_and_relative_imports() -> None:
    graph = _import_graph()
    # modelcheck imports the tokenizer inside a function; app's routes import relatively.
    assert f"{ENGINE}.text.tokenizer" in graph[f"{ENGINE}.format.modelcheck"]
    assert f"{ENGINE}._core" in graph[f"{ENGINE}.executor.model"]
    assert any(t.startswith("colibri.app.") for t in graph["colibri.app.routes.chat"])


def test_no_import_circles() -> None:
    """No chain of imports among colibri.engine and colibri.app modules leads back to where it
    started, whether the imports sit at the top of a file or inside a function."""
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_engine_package_imports_nothing_at_run_time() -> None:
    """engine/__init__.py resolves its exports lazily, so importing the package (for
    __version__, or for one export) never pulls in the rest of the engine."""
    assert not _import_graph()[ENGINE] - {f"{ENGINE}._core"}


def _layer(module: str) -> int:
    rel = module.removeprefix(ENGINE + ".")
    best, found = "", -1
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if (rel == entry or rel.startswith(entry + ".")) and len(entry) > len(best):
                best, found = entry, i
    assert found >= 0, f"{module} is in no layer of LAYERS; add its package there"
    return found


def _subpackage(module: str) -> str:
    return module.removeprefix(ENGINE + ".").split(".")[0]


def test_engine_imports_go_downward() -> None:
    """Every import between engine modules goes to a lower layer of LAYERS, or stays inside
    its own sub-package within its layer."""
    graph = _import_graph()
    engine = [m for m in graph if m.startswith(ENGINE + ".")]
    upward = []
    for module in engine:
        for target in graph[module]:
            if target == ENGINE or not target.startswith(ENGINE + "."):
                continue
            lo, lt = _layer(module), _layer(target)
            if lt > lo or (lt == lo and _subpackage(target) != _subpackage(module)):
                upward.append(f"{module} (layer {lo}) imports {target} (layer {lt})")
    assert not upward, "\n".join(sorted(upward))


# --- csrc: which .c file calls functions defined in which other ----------------------------------

CSRC = ROOT / "csrc"
_ISA_SUFFIXES = ("_avx2.c", "_avx512.c")
_DISPATCHER = "dispatch.c"
# A function definition: at the start of a line, not static, a name, parameters, then `{`.
_C_DEF = re.compile(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b([A-Za-z_]\w*)\s*\([^;{]*\)\s*\{",
                    re.MULTILINE)
# A kernel stamped out by a macro: `CLB_GEMM8_AVX2(clb_gemm_q4_avx2, ...)` at the start of a line
# defines the function its first argument names.
_C_MACRO_DEF = re.compile(r"^[A-Z][A-Z0-9_]*\(\s*([a-z_]\w*)\s*,", re.MULTILINE)


@cache
def _c_code(path: Path) -> str:
    """The file's code without comments, string and character literals."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"\"(\\.|[^\"\\\n])*\"|'(\\.|[^'\\\n])*'", '""', text)


def _c_definitions() -> dict[str, str]:
    """Function name -> the .c file defining it (functions visible to other files only)."""
    defs: dict[str, str] = {}
    for path in sorted(CSRC.glob("*.c")):
        code = _c_code(path)
        for name in _C_DEF.findall(code) + _C_MACRO_DEF.findall(code):
            assert name not in defs, f"{name} defined in {defs[name]} and {path.name}"
            defs[name] = path.name
    return defs


def _c_graph() -> dict[str, dict[str, set[str]]]:
    """file -> {other file: the functions defined there that this file names}."""
    defs = _c_definitions()
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(CSRC.glob("*.c")):
        graph[path.name] = {}
        for ident in set(re.findall(r"\b[A-Za-z_]\w*\b", _c_code(path))):
            owner = defs.get(ident)
            if owner is not None and owner != path.name:
                graph[path.name].setdefault(owner, set()).add(ident)
    return graph


def test_c_parser_finds_the_definitions() -> None:
    defs = _c_definitions()
    expect = {"clb_matmul": "matmul.c", "clb_repack_x8": "dispatch.c",
              "clb_quantize_q8_ref": "kernels_ref.c", "clb_forward": "forward.c",
              "clb_gemm_q4_avx2": "kernels_avx2.c", "clb_type_row_size": "types.c"}
    assert {k: defs.get(k) for k in expect} == expect
    assert "clb_kernels_isa" not in "".join(defs)  # headers are not parsed
    graph = _c_graph()
    assert "clb_matmul" in graph["forward_ops.c"]["matmul.c"]


def test_c_files_call_one_way() -> None:
    """The graph of which csrc/*.c file calls (or takes the address of) a function defined in
    which other .c file has no cycle.

    One exception, the dispatcher's pattern: edges from dispatch.c to the per-ISA kernel files
    (*_avx2.c, *_avx512.c) are left out. dispatch.c only stores those kernels' addresses in its
    tables, and a per-ISA kernel may ask dispatch.c for a run-time setting (kernels_avx512.c
    reads the stream hint). Every other edge counts: per-ISA files to each other and to any
    other file, and dispatch.c to every file that is not per-ISA."""
    graph = _c_graph()
    edges = {
        src: {dst for dst in dsts
              if not (src == _DISPATCHER and dst.endswith(_ISA_SUFFIXES))}
        for src, dsts in graph.items()
    }
    cycle = _find_cycle(edges)
    if cycle is not None:
        pairs = zip(cycle, cycle[1:], strict=False)
        steps = [f"{a} -> {b} {sorted(graph[a][b])}" for a, b in pairs]
        raise AssertionError("csrc call circle:\n" + "\n".join(steps))
