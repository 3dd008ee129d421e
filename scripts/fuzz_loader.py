#!/usr/bin/env python
"""Coverage-guided fuzzing (atheris) of the two parsers a model folder reaches first: the C
weight-file loader (csrc/wfile.c, through engine._core.inspect_weight_file) and the
config.json reader (engine.format.jsonfile + engine.models.config.ModelConfig.from_dict).

A finding is a crash (ASan/UBSan report, signal) or an exception other than the documented
ones (FormatError / ValueError for a bad file). Run it through scripts/fuzz.sh, which builds
the extension with AddressSanitizer first. Usage:
    scripts/fuzz_loader.py wfile|config -runs=N [libFuzzer options] [corpus dirs]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris
import numpy as np

with atheris.instrument_imports():
    from colibri.engine.errors import FormatError
    from colibri.engine.format import quant
    from colibri.engine.format.jsonfile import read_json_object
    from colibri.engine.format.wfile import TensorSpec, write_wfile
    from colibri.engine.models.config import ModelConfig

_TMP = Path(tempfile.mkdtemp(prefix="colibri-fuzz-"))
_PATH = _TMP / "input.bin"


def _seed_weight_file() -> bytes:
    def spec(name: str, ty: str, shape: tuple[int, ...]) -> TensorSpec:
        x = np.random.default_rng(len(name)).standard_normal(shape).astype(np.float32)
        return TensorSpec(name, ty, shape, lambda: quant.encode(x, ty))

    p = _TMP / "seed.bin"
    write_wfile(p, [spec("a", "f32", (4, 8)), spec("bb", "q8", (3, 64)),
                    spec("c", "q4", (2, 32)), spec("d", "f16", (5,)), spec("e", "q6", (2, 64))])
    return p.read_bytes()


def fuzz_wfile(data: bytes) -> None:
    from colibri.engine import _core  # the C extension: only this target needs (and loads) it

    _PATH.write_bytes(data)
    try:
        tensors = _core.inspect_weight_file(_PATH)
    except FormatError:
        return
    for t in tensors:  # what the loader accepts must be self-consistent
        assert t["nbytes"] > 0 and all(d >= 1 for d in t["shape"]), t


def fuzz_config(data: bytes) -> None:
    path = _TMP / "config.json"
    path.write_bytes(data)
    try:
        raw = read_json_object(path, "config.json", error=FormatError)
        cfg = ModelConfig.from_dict(raw)
        cfg.to_hparams(cfg.default_n_ctx())
    except (FormatError, ValueError):
        return


def _seed_config() -> bytes:
    """The bundled demo model's converted config.json (converted once into the cache)."""
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.llm import default_model_path

    return (ensure_converted(default_model_path(), "q8") / "config.json").read_bytes()


def main() -> None:
    target = sys.argv.pop(1) if len(sys.argv) > 1 else "wfile"
    fn, seed = {"wfile": (fuzz_wfile, _seed_weight_file),
                "config": (fuzz_config, _seed_config)}[target]
    corpus = _TMP / f"corpus-{target}"
    corpus.mkdir()
    (corpus / "seed").write_bytes(seed())
    for extra in sys.argv[1:]:
        if not extra.startswith("-") and os.path.isdir(extra):
            break
    else:
        sys.argv.append(str(corpus))
    atheris.Setup(sys.argv, fn)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
