"""What coding agents send, against `python -m colibri.app serve` (the bundled model with a
template that renders tools): Codex CLI's Responses requests (a `namespace` tool, a hosted
web_search tool, a context error that must name `input`), and a forced tool call cut short by
max_tokens, which must stay a call in chat completions, Responses and Messages alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
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


Probe = Callable[[int, bool], tuple[str, list[tuple[str, str]], str]]


def _scan(probe: Probe) -> None:
    """probe(max_tokens, stream) -> (content, [(name, arguments)], finish) over growing
    budgets (greedy): never any content, and once the budget ends inside a call's arguments
    that call is answered with what was written, the reply's finish saying so."""
    for max_tokens in range(4, 80, 3):
        got = [probe(max_tokens, stream) for stream in (False, True)]
        for content, calls, _ in got:
            assert content == "", (max_tokens, content)
            assert {name for name, _ in calls} <= {"get_weather", "get_time"}
        if all(finish == "length" and calls and _incomplete(calls[-1][1])
               for _, calls, finish in got):
            return
    raise AssertionError("no budget ended inside a call")


@pytest.mark.slow  # dozens of requests; the parsers keep a cut call a call in the quick pass
def test_cut_calls_in_chat(oai: openai.OpenAI) -> None:
    for choice in (NAMED, "required"):
        def probe(max_tokens: int, stream: bool, choice: Any = choice
                  ) -> tuple[str, list[tuple[str, str]], str]:
            kwargs = {"model": MODEL, "messages": ASK, "tools": CHAT_TOOLS, "temperature": 0,
                      "tool_choice": choice, "max_tokens": max_tokens}
            if not stream:
                c = oai.chat.completions.create(**kwargs).choices[0]
                return (c.message.content or "", [(t.function.name, t.function.arguments)
                                                  for t in c.message.tool_calls or []],
                        c.finish_reason)
            chunks = list(oai.chat.completions.create(stream=True, **kwargs))
            calls: list[list[str]] = []
            for ch in chunks:
                for tc in ch.choices[0].delta.tool_calls or []:
                    if tc.id:
                        calls.append([tc.function.name, ""])
                    calls[-1][1] += tc.function.arguments or ""
            finish = [ch.choices[0].finish_reason for ch in chunks
                      if ch.choices[0].finish_reason]
            return ("".join(ch.choices[0].delta.content or "" for ch in chunks),
                    [(n, a) for n, a in calls], finish[0])

        _scan(probe)


@pytest.mark.slow  # dozens of requests, as in chat
def test_cut_call_in_responses(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]

    def probe(max_tokens: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
        kwargs = {"model": MODEL, "input": "Weather in Verona?", "tools": tools,
                  "tool_choice": {"type": "function", "name": "get_weather"},
                  "temperature": 0, "max_output_tokens": max_tokens}
        if stream:
            events = list(oai.responses.create(stream=True, **kwargs))
            items = [e.item for e in events if e.type == "response.output_item.done"]
            status = events[-1].response.status
        else:
            r = oai.responses.create(**kwargs)
            items, status = r.output, r.status
        calls = [i for i in items if i.type == "function_call"]
        if status == "incomplete" and calls:
            assert calls[-1].status == "incomplete"
        text = "".join(c.text for i in items if i.type == "message" for c in i.content)
        return (text, [(c.name, c.arguments) for c in calls],
                "length" if status == "incomplete" else "tool_calls")

    _scan(probe)


@pytest.mark.slow  # dozens of requests, as in chat
def test_cut_call_in_messages(server: SubprocessServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)

    def probe(max_tokens: int, stream: bool) -> tuple[str, list[tuple[str, str]], str]:
        kwargs: dict[str, Any] = {
            "model": MODEL, "max_tokens": max_tokens, "messages": ASK,
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "extra_body": {"temperature": 0}}
        if stream:  # the arguments as they were streamed
            calls: list[list[str]] = []
            text = ""
            with client.messages.stream(**kwargs) as events:
                for e in events:
                    if e.type == "content_block_start" and e.content_block.type == "tool_use":
                        calls.append([e.content_block.name, ""])
                    elif e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                        calls[-1][1] += e.delta.partial_json
                    elif e.type == "content_block_delta" and e.delta.type == "text_delta":
                        text += e.delta.text
                stop = events.get_final_message().stop_reason
            return text, [(n, a) for n, a in calls], {"max_tokens": "length"}.get(stop, stop)
        m = client.messages.create(**kwargs)
        uses = [b for b in m.content if b.type == "tool_use"]
        for b in uses:  # what the cut JSON had so far, as an object
            assert isinstance(b.input, dict) and set(b.input) <= set(WEATHER["properties"])
        # a complete input reads back as JSON; an incomplete one is marked by max_tokens
        args = [json.dumps(b.input) + ("" if m.stop_reason == "tool_use" else "...")
                for b in uses]
        text = "".join(b.text for b in m.content if b.type == "text")
        return (text, [(b.name, a) for b, a in zip(uses, args, strict=True)],
                {"max_tokens": "length"}.get(m.stop_reason, m.stop_reason))

    _scan(probe)
