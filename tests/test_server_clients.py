"""Clients nobody here wrote, against `python -m colibri.app serve` on the bundled demo model:
the openai SDK (parse, streamed parse, tool-call round trips, the Responses API), LangChain's
ChatOpenAI (with_structured_output, bind_tools), instructor, and an Open WebUI-shaped
streaming request with 36 tools. The demo model writes Shakespeare, not JSON: every answer
that parses here does so because the server enforces the schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_helpers import SubprocessServer

MODEL = "demo"
ASK = [{"role": "user", "content": "Who art thou, and how old?"}]


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Clock"}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("clients")
    srv = SubprocessServer(None, tmp / "run", "--served-model-name", MODEL,
                           "--allow-client-chat-template").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: SubprocessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


# -- openai SDK: structured output -------------------------------------------------------------
def test_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                          max_tokens=80, temperature=1.0, seed=seed)
        msg = r.choices[0].message
        assert isinstance(msg.parsed, Person), msg.content
        assert r.choices[0].finish_reason == "stop"


def test_parse_streamed(client: openai.OpenAI) -> None:
    deltas = []
    with client.chat.completions.stream(model=MODEL, messages=ASK, response_format=Person,
                                        max_tokens=80, seed=4) as stream:
        for event in stream:
            if event.type == "content.delta":
                deltas.append(event.delta)
        final = stream.get_final_completion()
    assert len(deltas) > 1  # it streamed
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Person)
    assert Person.model_validate_json("".join(deltas)) == parsed


def test_json_object_on_completions_too(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="ROMEO.\n", max_tokens=60, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)


# -- openai SDK: tools ------------------------------------------------------------------------
def _round_trip_final(client: openai.OpenAI, first: Any, messages: list[Any]) -> None:
    msg = first.choices[0].message
    history = [*messages, msg.model_dump(exclude_none=True)]
    for call in msg.tool_calls:
        history.append({"role": "tool", "tool_call_id": call.id, "content": "Rain, 12 C"})
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           max_tokens=24, seed=2)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_tool_round_trip_required(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Verona for three days?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=80, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        jsonschema.validate(args, WEATHER_PARAMS)
    _round_trip_final(client, r, messages)


def test_tool_round_trip_named_with_parsed_arguments(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Mantua?"}]
    r = client.chat.completions.parse(
        model=MODEL, messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=80, seed=5)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert r.choices[0].finish_reason == "tool_calls"
    _round_trip_final(client, r, messages)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_streamed_tool_calls(client: openai.OpenAI, choice: Any) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Padua?"}],
            tools=TOOLS, tool_choice=choice, max_tokens=80, seed=6, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for tc in c.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += tc.id or ""
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["id"].startswith("call_") and entry["name"] in ("get_weather", "get_time")
        args = json.loads(entry["arguments"])
        if entry["name"] == "get_weather":
            jsonschema.validate(args, WEATHER_PARAMS)


def _webui_tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Built-in tool number {i}",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}} for i in range(n)]


def test_open_webui_shaped_request_streams_an_answer(server: SubprocessServer) -> None:
    body = {"model": MODEL, "stream": True, "tools": _webui_tools(36),
            "messages": [{"role": "user", "content": "Hail, good friend."}],
            "max_tokens": 24, "stream_options": {"include_usage": True}}
    text, calls, finish = "", [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                finish = c["finish_reason"] or finish
    assert finish in ("stop", "length", "tool_calls")
    assert text or calls
    if finish == "tool_calls":
        assert all(c["function"]["name"].startswith("tool_") for c in calls if "id" in c)
    assert "cannot render tools" in server.log()


def test_tool_definitions_count_against_the_context(client: openai.OpenAI) -> None:
    tools = _webui_tools(40)
    for t in tools:
        t["function"]["description"] = "A very detailed description. " * 120
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools,
                                       tool_choice="required", max_tokens=16)
    assert err.value.code == "context_length_exceeded"
    assert "40 tools" in err.value.message


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_that_renders_tools(client: openai.OpenAI) -> None:
    extra = {"chat_template": HERMES_TEMPLATE}
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           extra_body=extra)
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          max_tokens=16, extra_body=extra)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools are in it
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", max_tokens=80,
                                            extra_body=extra)
    call = forced.choices[0].message.tool_calls[0]
    history = [*ASK, forced.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=8, extra_body=extra)
    assert after.choices[0].message.content is not None
    bare = [*ASK, {"role": "assistant", "content": ""},
            {"role": "tool", "tool_call_id": call.id, "content": "done"}]
    without = client.chat.completions.create(model=MODEL, messages=bare, tools=TOOLS,
                                             tool_choice="none", max_tokens=1,
                                             extra_body=extra)
    # the earlier call is rendered by the template
    assert after.usage.prompt_tokens > without.usage.prompt_tokens + 5


def test_hosted_only_fields_are_ignored(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, seed=1, store=True, metadata={"k": "v"},
        service_tier="auto", user="u1", prompt_cache_key="p", safety_identifier="s")
    same = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, seed=1)
    assert r.choices[0].message.content == same.choices[0].message.content


# -- openai SDK: Responses API ---------------------------------------------------------------
def test_responses_create(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Good morrow.", instructions="Speak plainly.",
                                max_output_tokens=12, store=False, metadata={"a": "b"})
    assert r.object == "response" and isinstance(r.output_text, str) and r.output_text
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.status in ("completed", "incomplete")


def test_responses_streaming(client: openai.OpenAI) -> None:
    types, deltas, seqs, final = [], [], [], None
    for event in client.responses.create(model=MODEL, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Speak."}]}],
            max_output_tokens=16, stream=True):
        types.append(event.type)
        seqs.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert deltas and final is not None
    assert final.output_text == "".join(deltas)
    assert seqs == list(range(len(seqs)))


def test_responses_structured_and_tools(client: openai.OpenAI) -> None:
    r = client.responses.parse(model=MODEL, input="Who goes there?", text_format=Person,
                               max_output_tokens=80)
    assert isinstance(r.output_parsed, Person)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    r = client.responses.create(model=MODEL, input="Weather?", tools=tools,
                                tool_choice="required", max_output_tokens=80)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_PARAMS)
    follow = client.responses.create(model=MODEL, tools=tools, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}])
    assert follow.output_text


def test_responses_streamed_function_call(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}]
    args, done = "", None
    for event in client.responses.create(model=MODEL, input="Weather?", tools=tools,
                                         tool_choice={"type": "function",
                                                      "name": "get_weather"},
                                         max_output_tokens=80, stream=True):
        if event.type == "response.function_call_arguments.delta":
            args += event.delta
        if event.type == "response.function_call_arguments.done":
            done = event.arguments
    assert done == args
    jsonschema.validate(json.loads(args), WEATHER_PARAMS)


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    # a hosted tool is dropped (not refused), so it cannot be the tool a call is forced to
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
])
def test_responses_refuses_stateful_features(server: SubprocessServer, body: dict[str, Any],
                                             param: str) -> None:
    r = httpx.post(server.url + "/v1/responses",
                   json={"model": MODEL, "input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# -- LangChain and instructor ------------------------------------------------------------------
def test_langchain_structured_output_and_bind_tools(server: SubprocessServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL,
                     max_tokens=80, temperature=1.0, max_retries=0)
    # (method="json_mode" sends no schema, only json_object: a model has to follow the prompt)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Person, method=method).invoke(
            "Name a person as JSON with name and age.")
        assert isinstance(out, Person), method
    msg = llm.bind_tools([GetWeather], tool_choice="required").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "GetWeather"
    GetWeather.model_validate(msg.tool_calls[0]["args"])


def test_instructor_response_model(client: openai.OpenAI) -> None:
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        ic = instructor.from_openai(client, mode=mode)
        person = ic.chat.completions.create(model=MODEL, messages=ASK, response_model=Person,
                                            max_tokens=80, max_retries=0)
        assert isinstance(person, Person), mode
