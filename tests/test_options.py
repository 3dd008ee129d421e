"""One options table (engine/core/options.py) and everything made from it agree on every
option's name and default: the flags and --help of `colibri serve` and of the engine's commands,
the server's Settings and the COLIBRI_* variables it reads, the engine's own reading of the
environment, `.env.example`, docs/configuration.md and the config objects behind them."""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from colibri.app.cli import add_serve_parser
from colibri.app.settings import Settings
from colibri.engine.core.options import (
    COMMANDS,
    EXPERT_CACHE_OPTIONS,
    OPTION,
    OPTIONS,
    REQUEST_DEFAULTS,
    ExpertCacheConfig,
    Option,
    command_options,
    format_value,
    render_config_docs,
    render_env_example,
    settings_options,
)
from colibri.engine.tools.cli import build_parser
from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
# COLIBRI_* names in the code that are not options: the memory limit the server hands its
# child processes (template renders, constraint compiles)
INTERNAL_VARIABLES = {"COLIBRI_WORKER_MEMORY"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser([add_serve_parser])
    sub = next(a for a in parser._actions if a.dest == "command")
    return dict(sub.choices)  # type: ignore[arg-type]


def _other_value(o: Option) -> Any:
    """A valid value of o that is not its default."""
    if o.choices:
        return next(c for c in o.choices if c != o.default)
    if o.pattern:  # an alternative of the pattern that is a plain word
        return next(c for c in o.pattern.split("|")
                    if c != o.default and re.fullmatch(o.pattern, c))
    if o.type is bool:
        return not o.default
    if o.type is list:
        return ["http://localhost:3000"]
    if o.type in (int, float):
        base = o.default if o.default is not None else (o.ge or o.gt or 0)
        value = base + 1 if o.le is None or base + 1 <= o.le else base - 1
        return o.type(value)
    return "something-else"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No COLIBRI_* variable set and no .env in the working folder."""
    import os

    for key in list(os.environ):
        if key.startswith("COLIBRI_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


# -- the table itself -----------------------------------------------------------------------

def test_the_table_is_consistent() -> None:
    assert len(OPTION) == len(OPTIONS), "two options share a name"
    for o in OPTIONS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", o.name), o.name
        assert set(o.commands) <= set(COMMANDS), o.name
        assert o.setting <= ("serve" in o.commands), f"{o.name}: a setting needs a serve flag"
        assert o.commands or o.has_env, f"{o.name} can be set nowhere"
        assert o.check(o.default) == o.default, o.name  # each default within its own limits
        if o.default is None:
            assert o.unset, f"{o.name}: say what unset means"
            if o.example and o.has_env:
                o.parse(o.example)
        if o.choices:
            assert o.default is None or o.default in o.choices, o.name


def test_limits_are_refused_in_one_words_everywhere(clean_env: pytest.MonkeyPatch) -> None:
    """The same limit and words from a flag, a COLIBRI_* variable and the server's settings."""
    from colibri.engine.core.options import check_flag, env_values

    o = OPTION["expert_cache_mb"]
    with pytest.raises(ValueError, match=r"^--expert-cache-mb must be greater than 0, got -1$"):
        check_flag(o, -1.0)
    clean_env.setenv("COLIBRI_EXPERT_CACHE_MB", "-1")
    with pytest.raises(ValueError,
                       match=r"^COLIBRI_EXPERT_CACHE_MB must be greater than 0, got '-1'$"):
        ExpertCacheConfig.from_env()
    with pytest.raises(ValueError, match="expert_cache_mb must be greater than 0"):
        Settings(_env_file=None)  # type: ignore[call-arg]
    for text in ("nan", "inf", "lots"):
        with pytest.raises(ValueError, match="COLIBRI_EXPERT_CACHE_MB must be"):
            env_values(["expert_cache_mb"], {"COLIBRI_EXPERT_CACHE_MB": text})


# -- the server: Settings, the environment, serve's flags ------------------------------------

def test_settings_fields_are_the_table() -> None:
    fields = Settings.model_fields
    assert list(fields) == [o.name for o in settings_options()]
    for o in settings_options():
        f = fields[o.name]
        default = f.default_factory() if f.default_factory else f.default  # type: ignore[call-arg]
        assert default == o.default, o.name
        assert f.description == o.help, o.name
        ann, optional = f.annotation, False
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # X | None
            inner = [a for a in typing.get_args(ann) if a is not type(None)]
            ann, optional = inner[0], len(inner) < len(typing.get_args(ann))
        assert optional == (o.default is None), o.name
        if typing.get_origin(ann) is typing.Literal:
            assert typing.get_args(ann) == o.choices, o.name  # the choices spelled out
        elif o.name == "api_key":
            assert ann is SecretStr
        else:
            assert ann == (list[str] if o.type is list else o.type), (o.name, ann)


def test_settings_read_every_variable_by_its_name(clean_env: pytest.MonkeyPatch) -> None:
    want = {}
    for o in settings_options():
        want[o.name] = _other_value(o)
        clean_env.setenv(o.env, format_value(want[o.name]))
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    for name, value in want.items():
        got = getattr(s, name)
        if isinstance(got, SecretStr):
            got = got.get_secret_value()
        assert got == value, name


def test_env_example_is_the_table(clean_env: pytest.MonkeyPatch) -> None:
    text = (ROOT / ".env.example").read_text(encoding="utf-8")
    assert text == render_env_example(), "run python scripts/make_config_docs.py"
    seen: dict[str, tuple[bool, str]] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(# )?(COLIBRI_[A-Z0-9_]+)=(.*)", line)
        if m:
            assert m[2] not in seen, f"{m[2]} twice"
            seen[m[2]] = (m[1] is not None, m[3])
    assert set(seen) == {o.env for o in OPTIONS if o.has_env}
    for o in OPTIONS:
        if not o.has_env:
            continue
        commented, value = seen[o.env]
        assert commented == (o.default is None), o.env
        if not commented:
            assert o.parse(value) == o.default, o.env
    # copied as it is to .env, it sets every setting to its default
    (Path.cwd() / ".env").write_text(text, encoding="utf-8")
    assert Settings() == Settings(_env_file=None)  # type: ignore[call-arg]


def test_serve_flags_and_help_are_the_table(clean_env: pytest.MonkeyPatch) -> None:
    serve = _subparsers()["serve"]
    text = serve.format_help()
    actions = {a.dest: a for a in serve._actions}
    assert set(command_options("serve")) == {o.name for o in settings_options()}
    for o in settings_options():
        a = actions[o.name]
        assert o.flag in a.option_strings, o.name
        if o.type is bool:
            assert a.option_strings == [o.flag, "--no-" + o.flag[2:]], o.name
        assert a.default is argparse.SUPPRESS, o.name  # Settings gives the default
        assert tuple(a.choices or ()) == o.choices, o.name
        assert f"({o.default_text()})" in " ".join((a.help or "").split()), o.name
        assert o.flag in text, o.name
    # a flag given reaches the setting of the same name
    from colibri.app.cli import settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    for o in settings_options():
        value = _other_value(o)
        if o.type is bool:
            argv = [o.flag if value else "--no-" + o.flag[2:]]
        elif o.type is list:
            argv = [o.flag, *value]
        else:
            argv = [o.flag, str(value)]
        s = settings_from_args(parser.parse_args(["serve", *argv]))
        got = getattr(s, o.name)
        assert (got.get_secret_value() if isinstance(got, SecretStr) else got) == value, o.name


def test_engine_variables_serve_copies_from_dotenv_are_the_tables() -> None:
    from colibri.app.cli import ENGINE_VARIABLES

    assert set(ENGINE_VARIABLES) == {o.env for o in OPTIONS if o.engine_env and not o.setting}


# -- the engine's commands -------------------------------------------------------------------

def test_engine_command_flags_and_help_are_the_table() -> None:
    parsers = _subparsers()
    for command in COMMANDS:
        p = parsers[command]
        actions = {a.dest: a for a in p._actions}
        for name in command_options(command):
            o = OPTION[name]
            a = actions.get(name)
            assert a is not None, f"{command} has no {o.flag}"
            assert o.flag in a.option_strings, (command, name)
            if command != "serve":
                # read from the environment too: filled in after parsing (option_values)
                want = argparse.SUPPRESS if o.engine_env else o.default
                assert a.default == want, (command, name)
            assert f"({o.default_text()})" in " ".join((a.help or "").split()), (command, name)
            assert o.flag in p.format_help(), (command, name)
        # no flag of the command spells a table option another way or for another knob
        for a in p._actions:
            if a.dest in OPTION:
                assert a.dest in command_options(command), (command, a.dest)
                assert OPTION[a.dest].flag in a.option_strings, (command, a.dest)


def test_engine_commands_layer_flags_over_the_environment(
        clean_env: pytest.MonkeyPatch) -> None:
    from colibri.engine.tools.cache_args import expert_cache_from_args

    p = _subparsers()["generate"]
    assert expert_cache_from_args(p.parse_args(["--prompt", "x"])) == ExpertCacheConfig()
    want = {n: _other_value(OPTION[n]) for n in EXPERT_CACHE_OPTIONS}
    for n, v in want.items():
        clean_env.setenv(OPTION[n].env, format_value(v))
    from_env = expert_cache_from_args(p.parse_args(["--prompt", "x"]))
    assert from_env == ExpertCacheConfig(**want) == ExpertCacheConfig.from_env()
    args = p.parse_args(["--prompt", "x", "--expert-cache-size", "5", "--expert-pin"])
    flags = expert_cache_from_args(args)
    assert flags.expert_cache_size == 5 and flags.expert_pin is True
    assert flags.expert_load == want["expert_load"]
    with pytest.raises(ValueError, match="^--prefetch-window must be at least 1, got 0$"):
        expert_cache_from_args(p.parse_args(["--prompt", "x", "--prefetch-window", "0"]))


def test_threads_come_from_the_flag_then_the_environment(clean_env: pytest.MonkeyPatch) -> None:
    """COLIBRI_THREADS sets the thread count of every command and of the Python API; a flag
    still wins, and a bad value is refused by its name."""
    from colibri.engine import EngineConfig
    from colibri.engine.tools.cache_args import threads_from_args

    p = _subparsers()["generate"]
    assert threads_from_args(p.parse_args(["--prompt", "x"])) is None
    assert EngineConfig().threads is None
    clean_env.setenv("COLIBRI_THREADS", "3")
    assert threads_from_args(p.parse_args(["--prompt", "x"])) == 3 == EngineConfig().threads
    assert threads_from_args(p.parse_args(["--prompt", "x", "--threads", "2"])) == 2
    clean_env.setenv("COLIBRI_THREADS", "0")
    with pytest.raises(ValueError, match="COLIBRI_THREADS"):
        EngineConfig()


def test_config_objects_default_to_the_table(clean_env: pytest.MonkeyPatch) -> None:
    from dataclasses import fields

    from colibri.engine import LLM, AsyncEngineConfig, EngineConfig, SamplingParams
    from colibri.engine.core.scheduler import SchedulerConfig
    from colibri.engine.tools.bench import BenchSettings

    objects = [EngineConfig(), SchedulerConfig(), AsyncEngineConfig(), ExpertCacheConfig(),
               BenchSettings(model=None)]
    for obj in objects:
        for f in fields(obj):  # type: ignore[arg-type]
            if f.name in OPTION:
                assert getattr(obj, f.name) == OPTION[f.name].default, (type(obj), f.name)
    assert EngineConfig().expert_cache == ExpertCacheConfig()
    assert {f.name for f in fields(ExpertCacheConfig)} == set(EXPERT_CACHE_OPTIONS)
    assert inspect.signature(LLM.__init__).parameters["quant"].default == OPTION["quant"].default
    for fn in (LLM.generate, LLM.stream):
        params = inspect.signature(fn).parameters
        for name in ("max_tokens", "temperature", "top_p", "seed"):
            assert params[name].default == OPTION[name].default, (fn.__name__, name)
    # top_k reaches LLM.generate as a SamplingParams default
    assert SamplingParams().top_k == OPTION["top_k"].default


def test_request_defaults_in_the_docs_are_the_servers() -> None:
    from colibri.app.protocol import ChatCompletionRequest, CompletionRequest

    models = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
    for field, endpoints, value, _ in REQUEST_DEFAULTS:
        for e in endpoints:
            assert models[e].model_fields[field].default == value, (e, field)
    assert ChatCompletionRequest.model_fields["max_completion_tokens"].default is None


def test_every_colibri_variable_in_the_code_is_an_option() -> None:
    known = {o.env for o in OPTIONS} | INTERNAL_VARIABLES
    found: set[str] = set()
    for folder in ("app", "engine"):
        for path in (ROOT / folder).rglob("*.py"):
            # whole names only: COLIBRI_EXPERT_* and COLIBRI_<OPTION> name no variable
            found |= set(re.findall(r"\bCOLIBRI_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert found & known and not found - known, sorted(found - known)


# -- the generated files --------------------------------------------------------------------

def test_configuration_page_is_the_table() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == render_config_docs(), "run python scripts/make_config_docs.py"
    for o in OPTIONS:
        row = next(line for line in text.splitlines()
                   if line.startswith("| ") and (f"`{o.env}`" in line or f"`{o.flag}`" in line))
        if o.commands:
            assert f"`{o.flag}`" in row, o.name
        if o.has_env:
            assert f"`{o.env}`" in row, o.name
        shown = f"`{format_value(o.default)}`" if o.default is not None else f"unset: {o.unset}"
        assert shown in row, o.name
    assert "docs/configuration.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_script_finds_the_files_up_to_date() -> None:
    assert load_script("make_config_docs").main(["--check"]) == 0
