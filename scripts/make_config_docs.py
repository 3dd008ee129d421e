"""Write .env.example and docs/configuration.md from the options table (engine/core/options.py).

    python scripts/make_config_docs.py           # rewrite both files
    python scripts/make_config_docs.py --check   # exit 1 if either differs from the table

Edit an option in the table, never in the generated files; tests/test_options.py fails while
the committed files differ from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colibri.engine.core.options import render_config_docs, render_env_example

ROOT = Path(__file__).resolve().parent.parent
GENERATED = {
    ".env.example": render_env_example,
    "docs/configuration.md": render_config_docs,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only compare: exit 1 when a file differs from the table")
    args = ap.parse_args(argv)
    stale = []
    for rel, render in GENERATED.items():
        path = ROOT / rel
        text = render()
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current == text:
            continue
        stale.append(rel)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {rel}")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/make_config_docs.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
