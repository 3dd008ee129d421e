"""`colibri generate`, `eval` and `bench` refuse bad options before they load anything: one line
`colibri: error: --option ...` naming the option and the value given, exit status 2, no
traceback. A text for `eval` that cannot be read is named with what is wrong with it.

The loaders are replaced by ones that fail the test, so a check that runs only after loading
cannot pass here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from colibri.engine.tools.cli import main

GEN = ["generate", "--prompt", "hi"]
BAD: list[tuple[list[str], str]] = [
    # (arguments, what the one line must say)
    ([*GEN, "--max-tokens", "-5"], "--max-tokens must be at least 1, got -5"),
    ([*GEN, "--max-tokens", "0"], "--max-tokens must be at least 1, got 0"),
    ([*GEN, "--temperature", "3"], "--temperature must be in [0, 2], got 3"),
    ([*GEN, "--temperature", "nan"], "--temperature must be a finite"),
    ([*GEN, "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    ([*GEN, "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    ([*GEN, "--top-k", "-2"], "--top-k must be -1 (disabled)"),
    ([*GEN, "--threads", "0"], "--threads must be at least 1, got 0"),
    ([*GEN, "--stop", ""], "--stop: stop strings must be non-empty"),
    (["eval", "--dataset", "demo-validation", "--window", "1"],
     "--window must be at least 2, got 1"),
    (["eval", "--dataset", "demo-validation", "--stride", "0"],
     "--stride must be in [1, window - 1]"),
    (["eval", "--dataset", "demo-validation", "--window", "64", "--stride", "64"],
     "--stride must be in [1, window - 1] = [1, 63], got 64"),
    (["eval", "--dataset", "demo-validation", "--score-tokens", "1"],
     "--score-tokens must be at least 2, got 1"),
    (["eval", "--dataset", "demo-validation", "--threads", "-1"],
     "--threads must be at least 1, got -1"),
    (["bench", "--prompt-tokens", "0"], "--prompt-tokens must be positive, got 0"),
    (["bench", "--gen-tokens", "-1"], "--gen-tokens must be positive, got -1"),
    (["bench", "--repeat", "0"], "--repeat must be positive, got 0"),
    (["bench", "--probe-mib", "0"], "--probe-mib must be positive, got 0"),
    (["bench", "--threads", "0"], "--threads must be at least 1, got 0"),
]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading or converting a model fails the test."""
    from colibri.engine.executor.model import Model
    from colibri.engine.llm import LLM

    def loaded(*_: Any, **__: Any) -> Any:
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(LLM, "__init__", loaded)
    monkeypatch.setattr(Model, "load", loaded)
    monkeypatch.setattr("colibri.engine.format.convert.ensure_converted", loaded)


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


@pytest.mark.parametrize("argv, says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_refused_before_loading(argv: list[str], says: str, no_loading: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _one_line_error(argv, capsys)


def test_a_text_that_cannot_be_read_is_named(tmp_path: Path, no_loading: None,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(["eval", "--text", "missing.txt"], capsys)
    assert line == "colibri: error: --text missing.txt: no such file"
    assert "Errno" not in line
    (tmp_path / "folder").mkdir()
    line = _one_line_error(["eval", "--text", "folder"], capsys)
    assert line == "colibri: error: --text folder: a folder, not a text file"
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    line = _one_line_error(["eval", "--text", "latin1.txt"], capsys)
    assert line.startswith("colibri: error: --text latin1.txt: not UTF-8 text"), line
