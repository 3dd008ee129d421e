"""A converted folder's twin as an earlier Colibri wrote it: format version 1, every matrix in
rows (routed experts included), so that the load-time repack and old folders stay tested."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from colibri.engine.format import quant
from colibri.engine.format.wfile import TensorSpec, read_wfile, write_wfile


def rows_twin(folder: Path, dest: Path) -> Path:
    """dest: a copy of folder whose interleaved tensors are stored in the rows of their row
    type, with config.json's tensor_types, files and format_version to match (kept when it
    exists already)."""
    if (dest / "config.json").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    for key, ty in cfg["tensor_types"].items():
        cfg["tensor_types"][key] = quant.row_type(ty)
    for name in cfg["files"]:
        wf = read_wfile(folder / name)
        if not any(t.type_name in quant.ROWS_OF for t in wf.tensors.values()):
            continue
        rows = {n: wf.rows(n) for n in wf.tensors}
        specs = [TensorSpec(n, rows[n][0], t.shape, lambda b=rows[n][1]: b)
                 for n, t in wf.tensors.items()]
        size, digest = write_wfile(tmp / name, specs, durable=False)
        cfg["files"][name] = {"size": size, "sha256": digest}
    cfg["format_version"] = 1
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.rename(dest)
    return dest
