"""The tools the reliability suite relies on are installable and described truthfully."""

from __future__ import annotations

import re
import tomllib

from tests.server_helpers import ROOT


def _test_extra() -> list[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [re.split(r"[<>=!~ \[]", d, maxsplit=1)[0].lower()
            for d in meta["project"]["optional-dependencies"]["test"]]


def test_test_extra_has_what_asan_and_schemathesis_need() -> None:
    extra = _test_extra()
    assert "cython" in extra  # scripts/asan.sh builds the extension in a copy of the tree
    assert "schemathesis" in extra  # tests/test_reliability_schema.py


def test_readme_lists_asan_default_tests() -> None:
    script = (ROOT / "scripts" / "asan.sh").read_text()
    block = re.search(r"DEFAULT_TESTS=\(([^)]*)\)", script)
    assert block is not None
    in_script = set(block.group(1).split())
    readme = (ROOT / "README.md").read_text()
    line = readme[readme.index("- `scripts/asan.sh"):]
    line = line[:line.index("\n- ")]
    in_readme = set(re.findall(r"`(tests/[\w/]+\.py)`", line))
    assert in_script == in_readme
    for path in in_script:
        assert (ROOT / path).is_file(), path
