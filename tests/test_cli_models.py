"""The `colibri` command line: one default model and precision everywhere, and one clear
line (exit status 2, no traceback) for every bad model on every command, `serve` included.

Bad models: a missing folder, a folder that is no model, a config.json nested 100,000 deep
(json raises RecursionError), and a truncated tokenizer.json ("EOF while parsing").
`serve` checks the port, then the model, before it binds or loads anything.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibri.engine.format.convert import DEFAULT_QUANT, convert
from colibri.engine.format.modelcheck import bundled_model_path
from tests.server_helpers import ROOT, free_port, tiny_model

MODEL_COMMANDS: dict[str, list[str]] = {
    # command -> its arguments with MODEL where the model folder goes
    "convert": ["convert", "MODEL", "OUT"],
    "info": ["info", "MODEL"],
    "info --model": ["info", "--model", "MODEL"],
    "verify": ["verify", "MODEL"],
    "generate": ["generate", "--model", "MODEL", "--prompt", "hi", "--max-tokens", "2"],
    "eval": ["eval", "--model", "MODEL", "--dataset", "demo-validation", "--score-tokens", "8"],
    "bench": ["bench", "--model", "MODEL", "--repeat", "1", "--gen-tokens", "2"],
    "serve": ["serve", "--model", "MODEL", "--port", "0"],
}


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    hf = tiny_model(root / "hf")
    out: dict[str, Path] = {"missing": root / "no-such-folder"}
    (root / "not-a-model").mkdir()
    (root / "not-a-model" / "notes.txt").write_text("hello\n")
    out["not a model folder"] = root / "not-a-model"
    deep = root / "deep"
    shutil.copytree(hf, deep)
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    out["config nested 100,000 deep"] = deep
    tok = root / "truncated-tokenizer"
    shutil.copytree(hf, tok)
    (tok / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes()[:500])
    out["truncated tokenizer.json (HF)"] = tok
    conv = convert(hf, root / "colibri", progress=False)
    (conv / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes()[:500])
    out["truncated tokenizer.json (converted)"] = conv
    header = convert(hf, root / "colibri-header", progress=False)
    victim = sorted((header / "experts").glob("*.bin"))[0]
    with open(victim, "r+b") as f:  # same size, damaged magic
        f.write(b"NOTCLB\0\0")
    out["damaged weight-file header"] = header
    return out


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from colibri.app.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("command", list(MODEL_COMMANDS))
@pytest.mark.parametrize("kind", ["missing", "not a model folder", "config nested 100,000 deep",
                                  "truncated tokenizer.json (HF)",
                                  "truncated tokenizer.json (converted)",
                                  "damaged weight-file header"])
def test_bad_model_is_one_line_and_exit_2(bad_models: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], command: str,
                                          kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    model = bad_models[kind]
    argv = [str(model) if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a
            for a in MODEL_COMMANDS[command]]
    code, out, err = _run_main(argv, capsys)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri: error: "), err
    assert "Traceback" not in err and "Uvicorn" not in err + out
    assert str(model) in lines[0]
    if kind == "config nested 100,000 deep":
        assert "nested too deeply" in lines[0]
    if kind == "damaged weight-file header":
        assert "experts" in lines[0] and ".bin" in lines[0], lines[0]
    if kind.startswith("truncated"):
        assert "tokenizer.json" in lines[0] and "EOF while parsing" in lines[0]
    if command != "convert" and kind in ("missing", "not a model folder"):
        assert "Colibri or Hugging Face model folder" in lines[0]  # what to pass instead


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
           "COLIBRI_CACHE_DIR": str(cwd / "cache"), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-m", "colibri.app", "serve", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_serve_bad_model_exits_before_binding(tmp_path: Path) -> None:
    port = free_port()
    r = _serve("--model", str(tmp_path / "nope"), "--port", str(port), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert "Uvicorn running" not in r.stdout + r.stderr
    assert r.stderr.startswith(f"colibri: error: model folder not found: {tmp_path / 'nope'}")


def test_serve_taken_port_is_found_before_the_model(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        # a bad model too: the port must be the first thing checked
        r = _serve("--model", str(tmp_path / "nope"), "--port", str(port), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"colibri: error: cannot listen on 127.0.0.1:{port}: the port "
                                f"is already in use; pass --port another port (or set "
                                f"COLIBRI_PORT)")
    assert time.monotonic() - t0 < 60


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.engine import __version__

    code, out, _ = _run_main(["--version"], capsys)
    assert code == 0 and out.strip() == f"colibri {__version__}"


def test_one_default_quant_everywhere() -> None:
    from colibri.app.cli import add_serve_parser
    from colibri.app.settings import Settings
    from colibri.engine import LLM
    from colibri.engine.format.convert import convert as convert_fn
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.tools.bench import BenchSettings
    from colibri.engine.tools.cli import build_parser

    parser = build_parser([add_serve_parser])
    sub = next(a for a in parser._actions if a.dest == "command")
    seen = []
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        quant = [a for a in p._actions if a.dest == "quant"]
        if name in ("verify", "replay"):  # a converted folder / a trace: nothing to convert
            continue
        assert quant, f"{name} has no --quant"
        default = quant[0].default
        if name == "serve":  # options of serve default to the settings (env, .env)
            default = Settings.model_fields["quant"].default
        assert default == DEFAULT_QUANT == "q8", name
        assert f"default {DEFAULT_QUANT}" in (quant[0].help or ""), name
        seen.append(name)
    assert set(seen) == {"convert", "info", "generate", "eval", "bench", "serve", "plan"}
    import inspect

    for fn in (convert_fn, ensure_converted, LLM.__init__):
        assert inspect.signature(fn).parameters["quant"].default == DEFAULT_QUANT
    assert BenchSettings(model=None).quant == DEFAULT_QUANT


def test_help_texts_speak_to_users() -> None:
    from colibri.app.cli import add_serve_parser
    from colibri.engine.tools.cli import build_parser

    parser = build_parser([add_serve_parser])
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.dest == "command")
    texts += [p.format_help() for p in sub.choices.values()]  # type: ignore[union-attr]
    for text in texts:
        for jargon in ("seeds", "colibri-cli", "issue"):
            assert jargon not in text, text


def test_info_defaults_to_the_bundled_model_and_takes_hf_folders(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = _run_main(["info", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    demo = json.loads((bundled_model_path() / "config.json").read_text())
    assert d["architecture"] == "qwen3_moe" and d["quant"] == DEFAULT_QUANT
    assert d["dims"]["n_layer"] == demo["num_hidden_layers"]
    assert d["features"]["max_position_embeddings"] == demo["max_position_embeddings"]
    hf = tiny_model(tmp_path / "hf")
    for argv in (["info", str(hf), "--json"], ["info", "--model", str(hf), "--json"]):
        code, out, err = _run_main(argv, capsys)
        assert code == 0, err
        assert json.loads(out)["dims"]["n_embd"] == 64


def test_bench_defaults_to_the_bundled_model(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = _run_main(["bench", "--prompt-tokens", "8", "--gen-tokens", "4",
                                "--repeat", "1", "--probe-mib", "16", "--threads", "1",
                                "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    assert r["quant"] == DEFAULT_QUANT and "demo_model" in r["model"]
    assert r["decode_tok_s"]["median"] > 0


def test_bad_setting_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLIBRI_QUANT", "q9")
    code, _, err = _run_main(["serve", "--port", "0"], capsys)
    assert code == 2
    assert err.strip() == ("colibri: error: invalid setting (quant: quant must be one of f32, "
                           "f16, q8, q4); fix the option, its COLIBRI_* variable or .env")


def test_serve_context_longer_than_the_model_is_refused_at_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    demo = json.loads((bundled_model_path() / "config.json").read_text())
    most = demo["max_position_embeddings"]
    code, _, err = _run_main(["serve", "--port", "0", "--n-ctx", str(most + 1)], capsys)
    assert code == 2
    assert err.strip() == (f"colibri: error: --n-ctx {most + 1}: demo_model handles 1 to "
                           f"{most} positions; pass --n-ctx {most} or less, or leave it out "
                           f"for {min(most, 4096)}")
