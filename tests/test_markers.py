"""Every test file belongs to exactly one subsystem marker (tests/conftest.py), so running a
subsystem's marker runs all of its tests, and a new file cannot be left out of every run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SLOW, SUBSYSTEMS

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_one_subsystem() -> None:
    files = sorted(p.name for p in TESTS.glob("test_*.py"))
    listed = [f for group in SUBSYSTEMS.values() for f in group]
    assert sorted(set(listed)) == sorted(listed), "a file is in two subsystems"
    missing = sorted(set(files) - set(listed))
    assert not missing, f"test files without a subsystem in tests/conftest.py: {missing}"
    assert not set(listed) - set(files), "tests/conftest.py lists files that do not exist"
    assert set(SLOW) <= set(listed)


def test_the_session_keeps_conversions_out_of_the_users_cache() -> None:
    import os

    cache = os.environ["COLIBRI_CACHE_DIR"]
    assert Path(cache).name.startswith("colibri-test-cache-")
    assert Path.home() / ".cache" / "colibri" not in Path(cache).parents
