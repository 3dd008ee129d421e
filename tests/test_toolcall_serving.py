"""Forced tool calls in the model's own markup, through the server: on a model whose template
renders calls the Hermes / Qwen3 way, `tool_choice` "required" or a named function makes the
model write `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, the answer's calls
validate against their schemas, and the template renders those calls back into the next
turn's prompt as exactly the text the model wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.server_helpers import SubprocessServer, tiny_model
from tests.tiny_models import retokenize_with_specials

# Qwen2.5 / Qwen3's way of rendering tools and calls, cut to the parts that matter here
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for t in tools %}"
    "{{- '\\n' }}{{- t | tojson }}{%- endfor %}{{- '\\n</tools>\\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for tc in m.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + tc.function.name"
    " + '\", \"arguments\": ' }}{{- tc.function.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=["text", "special"])
def server(tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[SubprocessServer]:
    """The Hermes template on a vocabulary where the markers are text, and on one where
    <tool_call> and </tool_call> are special tokens (as in some families' vocabularies)."""
    tmp = tmp_path_factory.mktemp("toolcalls")
    model = tiny_model(tmp / "model", max_position_embeddings=1024)
    if request.param == "special":
        retokenize_with_specials(model, ["<tool_call>", "</tool_call>"])
    cfg_path = Path(model) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    srv = SubprocessServer(model, tmp / "run", "--served-model-name", "m").wait_ready()
    srv.model = model  # type: ignore[attr-defined]
    srv.special = request.param == "special"  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()


def _chat(server: SubprocessServer, **kw: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160,
        "logprobs": True, "seed": 3, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _next_prompt(model: Path, messages: list[dict[str, Any]]) -> str:
    """The next turn's prompt text as the chat path renders it (the model's tokenizer and
    template, tool-call arguments handed to the template as objects)."""
    from colibri.engine import plan_chat
    from colibri.engine.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    plan = plan_chat(tok, messages, TOOLS, "auto")
    return tok.decode(plan.prompt, skip_special_tokens=False)


# a named function forces the call as "required" does, through the same markup and grammar:
# the quick pass runs "required" in both vocabularies, the whole suite the named one too
@pytest.mark.parametrize("choice", [
    "required", pytest.param({"type": "function", "function": {"name": "get_time"}},
                             marks=pytest.mark.slow)])
def test_forced_calls_in_the_family_markup_render_back_the_same(
        server: SubprocessServer, choice: Any) -> None:
    out = _chat(server, tool_choice=choice)
    c = out["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    calls = c["message"]["tool_calls"]
    assert calls and c["message"]["content"] is None
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
    if isinstance(choice, dict):
        assert [x["function"]["name"] for x in calls] == ["get_time"]
    raw = "".join(e["token"] for e in c["logprobs"]["content"])
    assert raw.startswith("<tool_call>\n{\"name\": ")  # the family's markup, not bare JSON
    if server.special:  # type: ignore[attr-defined]
        assert c["logprobs"]["content"][0]["token"] == "<tool_call>"  # the special token
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
               *[{"role": "tool", "tool_call_id": x["id"], "content": "ok"} for x in calls]]
    prompt = _next_prompt(server.model, history)  # type: ignore[attr-defined]
    assert "<|im_start|>assistant\n" + raw + "<|im_end|>" in prompt


def test_forced_markup_streamed_equals_whole(server: SubprocessServer) -> None:
    whole = _chat(server, tool_choice="required")["choices"][0]["message"]["tool_calls"]
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 160, "seed": 3,
            "tool_choice": "required", "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            finish = ch["finish_reason"] or finish
            for tc in ch["delta"].get("tool_calls") or []:
                fn = tc.get("function") or {}
                names[tc["index"]] = names.get(tc["index"], "") + (fn.get("name") or "")
                args[tc["index"]] = args.get(tc["index"], "") + (fn.get("arguments") or "")
    assert finish == "tool_calls"
    assert [(names[i], args[i]) for i in sorted(names)] == [
        (x["function"]["name"], x["function"]["arguments"]) for x in whole]
