"""Running code of another Colibri checkout beside this one, for before/after benchmarks.

A checkout from before the packages were installed as colibri.app / colibri.engine imports
itself as `app` / `engine`; a later one as `colibri.app` / `colibri.engine`, which an installed
Colibri would answer for. checkout_python gives the environment and module prefix that make a
fresh Python process import the checkout's own code, whichever names it uses. The checkout
needs its extension built in place: `python setup.py build_ext --inplace`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def checkout_python(checkout: Path, workdir: Path) -> tuple[dict[str, str], str]:
    """(environment, module prefix) for a process that imports checkout's code: `prefix +
    "app.cli"` names its command line. workdir holds the name links a later checkout needs."""
    checkout = checkout.resolve()
    if "colibri.engine" not in (checkout / "engine" / "__init__.py").read_text():
        path, prefix = str(checkout), ""
    else:
        names = workdir / "_names" / "colibri"
        names.mkdir(parents=True, exist_ok=True)
        (names / "__init__.py").touch()
        for part in ("app", "engine"):
            link = names / part
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(checkout / part)
        path, prefix = str(workdir / "_names"), "colibri."
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=path + (os.pathsep + old if old else "")), prefix


def commit_of(checkout: Path) -> str | None:
    """The commit checked out there (None outside a git checkout)."""
    r = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                       text=True)
    return r.stdout.strip() if r.returncode == 0 else None
