"""Settings: defaults are the safe ones; options > COLIBRI_* environment > .env file;
.env.example documents every setting; `serve` is registered on an argparse parser."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.server_helpers import ROOT


def _parse(argv: list[str]) -> argparse.Namespace:
    from colibri.app.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_safe_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from colibri.app.settings import Settings

    monkeypatch.chdir(tmp_path)
    s = Settings()
    assert s.host == "127.0.0.1" and s.port == 8000
    assert s.cors_origins == [] and s.api_key is None
    assert s.allow_client_chat_template is False and s.model is None


def test_precedence_options_env_dotenv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from colibri.app.cli import settings_from_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("COLIBRI_PORT=9100\nCOLIBRI_MAX_QUEUE=3\n"
                                   "COLIBRI_API_KEY=from-file\nCOLIBRI_HOST=10.0.0.1\n")
    monkeypatch.setenv("COLIBRI_MAX_QUEUE", "5")
    monkeypatch.setenv("COLIBRI_HOST", "0.0.0.0")
    s = settings_from_args(_parse(["serve", "--host", "127.0.0.2", "--threads", "2"]))
    assert s.port == 9100  # .env
    assert s.max_queue == 5  # environment over .env
    assert s.host == "127.0.0.2" and s.threads == 2  # options over both
    assert s.api_key is not None and s.api_key.get_secret_value() == "from-file"
    assert "from-file" not in repr(s)  # the key never shows in logs


def test_dotenv_sets_the_engine_variables_too(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The engine reads COLIBRI_ISA, COLIBRI_REPACK and COLIBRI_CACHE_DIR from the
    environment; .env sets them where the environment does not."""
    import os

    from colibri.app.cli import settings_from_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("COLIBRI_ISA=ref\nCOLIBRI_REPACK=false\n"
                                   f"COLIBRI_CACHE_DIR={tmp_path / 'cache'}\n")
    monkeypatch.delenv("COLIBRI_ISA", raising=False)
    monkeypatch.delenv("COLIBRI_CACHE_DIR", raising=False)
    monkeypatch.setenv("COLIBRI_REPACK", "true")
    settings_from_args(_parse(["serve"]))
    assert os.environ["COLIBRI_ISA"] == "ref"
    assert os.environ["COLIBRI_CACHE_DIR"] == str(tmp_path / "cache")
    assert os.environ["COLIBRI_REPACK"] == "true"  # the environment over .env


def test_env_example_lists_every_setting() -> None:
    from colibri.app.settings import Settings

    text = (ROOT / ".env.example").read_text()
    listed = {line.split("=", 1)[0].lstrip("# ").strip() for line in text.splitlines()
              if "=" in line and line.lstrip("# ").startswith("COLIBRI_")}
    wanted = {"COLIBRI_" + name.upper() for name in Settings.model_fields}
    assert wanted <= listed, wanted - listed


def test_serve_options_parse() -> None:
    args = _parse(["serve", "--model", "m", "--port", "0", "--api-key", "k",
                   "--served-model-name", "n", "--cors-origins", "http://a", "http://b",
                   "--allow-client-chat-template"])
    assert args.model == "m" and args.port == 0 and args.api_key == "k"
    assert args.cors_origins == ["http://a", "http://b"]
    assert args.allow_client_chat_template is True and callable(args.handler)
