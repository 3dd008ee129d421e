"""scripts/run_agents.py without the agents: its model (the bundled one with a 64k context and a
tool-rendering template) served with its forcing of the first call, driven by the anthropic SDK
with a request shaped like Claude Code's, and its verdict on the requests it recorded."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.scripts_loader import load_script


def _script() -> Any:
    return load_script("run_agents")


def test_first_call_forced_then_the_result_goes_back(tmp_path: Path) -> None:
    ra = _script()
    model = ra.make_model(tmp_path / "model")
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] \
        == ra.CONTEXT
    project = tmp_path / "project"
    server, forcing = ra.start_server(model, functools.partial(ra.force_claude, project),
                                      tmp_path / "cache")
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key=ra.KEY, max_retries=0)
        tools: list[Any] = [
            {"name": "Bash", "input_schema": {"type": "object", "properties": {
                "command": {"type": "string"}}, "required": ["command"]}},
            {"name": "Read", "input_schema": {"type": "object", "properties": {
                "file_path": {"type": "string"}}, "required": ["file_path"]}}]
        ask: list[Any] = [{"role": "user", "content": "Read the README."}]
        first = client.messages.create(model="claude-any", max_tokens=200, tools=tools,
                                       messages=ask)
        assert first.stop_reason == "tool_use"
        (call,) = first.content
        assert call.name == "Read" and call.input == {"file_path": str(project / "README.md")}
        history = [*ask, {"role": "assistant", "content": [call.model_dump()]},
                   {"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": call.id, "content": "# A"}]}]
        second = client.messages.create(model="claude-any", max_tokens=8, tools=tools,
                                        messages=history)
        assert second.type == "message"
    finally:
        server.stop()
    posts = [r for r in forcing.records if r.method == "POST"]
    assert [(r.forced, r.has_tool_result, r.status) for r in posts] == [
        ("Read", False, 200), (None, True, 200)]
    claude = next(a for a in ra.AGENTS if a.name == "claude")
    assert ra.verdict(claude, 0, forcing.records) == []
    assert ra.verdict(claude, 1, forcing.records) == ["exit status 1"]
    assert ra.verdict(claude, 0, posts[:1]) == [
        "no later request carried the tool result back"]


def test_unknown_agents_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        _script().main(["--agents", "claude,nope"])
    assert exc.value.code == 2
