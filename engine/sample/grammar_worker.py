"""The child process constraints compile in first (python -m colibri.engine.sample.grammar_worker).

It compiles each spec the server sends as the server would and answers {} when it compiled, or
the error the server should give; the server kills it when it runs past its time or memory
(engine.isolate.pool).
"""

from __future__ import annotations

from typing import Any

from colibri.engine.isolate.pool import serve
from colibri.engine.sample.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec

_compiler: ConstraintCompiler | None = None


def _setup(hello: dict[str, Any]) -> None:
    global _compiler
    _compiler = ConstraintCompiler(hello["tokenizer"], int(hello["n_vocab"]),
                                   [int(t) for t in hello["eos"]], bounded=False)


def _compile(req: dict[str, Any]) -> dict[str, Any]:
    assert _compiler is not None
    spec = ConstraintSpec(req["kind"], req.get("value"), req.get("param") or "response_format")
    try:
        _compiler.matcher(spec)
    except ConstraintError as e:
        return {"error": e.message, "param": e.param}
    return {}


if __name__ == "__main__":
    serve(_compile, _setup)
