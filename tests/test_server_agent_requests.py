"""What coding agents send, against `python -m colibri.app serve` (the bundled model with a
template that renders tools): Codex CLI's Responses requests (a `namespace` tool, a hosted
web_search tool, a context error that must name `input`), and a forced tool call cut short by
max_tokens, which must stay a call in chat completions, Responses and Messages alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.server_helpers import SubprocessServer, tool_template_model

MODEL = "tiny"
N_CTX = 2048
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "get_time"}}]
ASK = [{"role": "user", "content": "Weather in Verona?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("agents")
    srv = SubprocessServer(tool_template_model(tmp / "model"), tmp / "run",
                           "--served-model-name", MODEL, "--n-ctx", str(N_CTX)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oai(server: SubprocessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


# -- Codex CLI on the Responses API ---------------------------------------------------------
def _fn(name: str, desc: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": desc, "strict": False,
            "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                           "required": ["message"], "additionalProperties": False}}


NAMESPACE = {"type": "namespace", "name": "collaboration", "description": "Sub-agents.",
             "tools": [_fn("spawn_agent", "Spawns an agent."),
                       _fn("wait_agent", "Waits for an agent.")]}
CODEX_TOOLS = [_fn("exec_command", "Runs a command."), NAMESPACE,
               {"type": "web_search", "external_web_access": False}]


def _codex_request(**extra: Any) -> dict[str, Any]:
    """The shape of Codex CLI 0.163's default requests."""
    return {"model": MODEL, "instructions": "You are a coding agent.",
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "List the files."}]}],
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
            "max_output_tokens": 16, **extra}


def test_codex_default_request_is_accepted(oai: openai.OpenAI,
                                           server: SubprocessServer) -> None:
    body = _codex_request()
    events = list(oai.responses.create(stream=True, **body))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "1 tools this server cannot run were dropped (web_search)" in server.log()
    # the namespace's functions are rendered: they cost prompt tokens
    bare = oai.responses.create(**{**body, "tools": [CODEX_TOOLS[0]]})
    full = oai.responses.create(**body)
    assert full.usage.input_tokens > bare.usage.input_tokens + 20


def test_namespace_calls_name_their_namespace(oai: openai.OpenAI) -> None:
    body = _codex_request(tool_choice={"type": "function", "name": "spawn_agent"},
                          max_output_tokens=60)
    r = oai.responses.create(**body)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "spawn_agent" and call.namespace == "collaboration"
    assert isinstance(json.loads(call.arguments)["message"], str)
    done = [e.item for e in oai.responses.create(stream=True, **body)
            if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.namespace) for i in done] == [
        ("function_call", "spawn_agent", "collaboration")]
    plain = oai.responses.create(**_codex_request(
        tool_choice={"type": "function", "name": "exec_command"}, max_output_tokens=60))
    (call,) = [item for item in plain.output if item.type == "function_call"]
    assert call.name == "exec_command" and getattr(call, "namespace", None) is None


def test_context_error_names_input(oai: openai.OpenAI) -> None:
    long = [{"role": "user", "content": [{"type": "input_text", "text": "word " * N_CTX}]}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input=long, max_output_tokens=4)
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="word " * (N_CTX - 100),
                             max_output_tokens=400)
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"


# -- a forced call cut short by max_tokens stays a call -------------------------------------
def _incomplete(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return True
    return False


def test_cut_named_call_in_chat(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                    tool_choice=NAMED, max_tokens=4)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith("{") and _incomplete(call.function.arguments)
    deltas = list(oai.chat.completions.create(model=MODEL, messages=ASK, tools=CHAT_TOOLS,
                                              tool_choice=NAMED, max_tokens=4, stream=True))
    finish = [c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    args = "".join(tc.function.arguments or "" for c in deltas
                   for tc in c.choices[0].delta.tool_calls or [])
    assert finish == ["length"] and text == "" and _incomplete(args) and args


def test_cut_required_calls_in_chat_never_become_text(oai: openai.OpenAI) -> None:
    """At every cut, tool_choice "required" answers calls (the complete ones and the one
    being written once its name is known), never a JSON fragment as content."""
    seen_cut_call = False
    for max_tokens in range(2, 26, 3):
        for stream in (False, True):
            kwargs = {"model": MODEL, "messages": ASK, "tools": CHAT_TOOLS, "temperature": 0,
                      "tool_choice": "required", "max_tokens": max_tokens}
            if stream:
                chunks = list(oai.chat.completions.create(stream=True, **kwargs))
                content = "".join(c.choices[0].delta.content or "" for c in chunks)
                finish = [c.choices[0].finish_reason for c in chunks
                          if c.choices[0].finish_reason][0]
                names = [tc.function.name for c in chunks
                         for tc in c.choices[0].delta.tool_calls or [] if tc.function.name]
                args = [tc.function.arguments for c in chunks
                        for tc in c.choices[0].delta.tool_calls or [] if not tc.id]
            else:
                choice = oai.chat.completions.create(**kwargs).choices[0]
                content, finish = choice.message.content or "", choice.finish_reason
                calls = choice.message.tool_calls or []
                names = [c.function.name for c in calls]
                args = [c.function.arguments for c in calls]
            assert content == "", (max_tokens, content)
            assert finish in ("length", "tool_calls")
            assert set(names) <= {"get_weather", "get_time"}
            if finish == "length" and names and _incomplete(args[-1]):
                seen_cut_call = True
    assert seen_cut_call


def test_cut_named_call_in_responses(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    kwargs = {"model": MODEL, "input": "Weather in Verona?", "tools": tools,
              "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 4}
    r = oai.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.status == "incomplete" and _incomplete(item.arguments)
    events = list(oai.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.type == "function_call" and done.status == "incomplete"


def test_cut_named_call_in_messages(server: SubprocessServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    kwargs: dict[str, Any] = {
        "model": MODEL, "max_tokens": 4, "messages": ASK,
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"}}
    m = client.messages.create(**kwargs)
    assert m.stop_reason == "max_tokens"
    (block,) = m.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert isinstance(block.input, dict) and set(block.input) <= set(WEATHER["properties"])
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.content[0].type == "tool_use"
