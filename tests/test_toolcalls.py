"""Tool-call parsing in each model family's format, streamed in every split, and the schema
of forced calls (checked with jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from colibri.engine.text.toolcalls import (
    ToolCallParser,
    forced_calls,
    forced_calls_schema,
    template_tools,
)

NAMES = {"get_weather", "search"}
WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
SEARCH = {"name": "search", "arguments": {"q": "<tool_call> is text here"}}


def _run(family: str, text: str, splits: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    p = ToolCallParser(family, NAMES)
    content, calls = "", []
    prev = 0
    for cut in [*splits, len(text)]:
        c, got = p.push(text[prev:cut])
        content += c
        calls += got
        prev = cut
    c, got = p.finish()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + got]


def _all_splits(family: str, text: str) -> list[tuple[str, list[tuple[str, dict]]]]:
    results = [_run(family, text, [])]
    results += [_run(family, text, [i]) for i in range(1, len(text))]
    results.append(_run(family, text, list(range(1, len(text)))))  # one character at a time
    return results


HERMES = ("Let me check.\n<tool_call>\n" + json.dumps(WEATHER) + "\n</tool_call>\n<tool_call>"
          + json.dumps(SEARCH) + "</tool_call>")
MISTRAL_LIST = "[TOOL_CALLS]" + json.dumps([WEATHER, SEARCH])
MISTRAL_ARGS = ("[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER["arguments"])
                + "[TOOL_CALLS]search[ARGS]" + json.dumps(SEARCH["arguments"]))
EXPECTED = [("get_weather", WEATHER["arguments"]), ("search", SEARCH["arguments"])]


@pytest.mark.parametrize(("family", "text", "content"), [
    ("hermes", HERMES, "Let me check.\n"),
    ("mistral", MISTRAL_LIST, ""),
    ("mistral", MISTRAL_ARGS, ""),
    ("generic", json.dumps({"tool_calls": [WEATHER, SEARCH]}), ""),
    ("generic", "```json\n" + json.dumps([WEATHER, SEARCH]) + "\n```", ""),
    ("hermes", json.dumps([WEATHER, SEARCH]), ""),  # the generic form works for every family
])
def test_calls_parsed_in_every_split(family: str, text: str, content: str) -> None:
    for got_content, calls in _all_splits(family, text):
        assert got_content.strip() == content.strip()
        assert calls == EXPECTED


def test_plain_text_passes_through_and_streams() -> None:
    text = "No tools needed: 3 < 4 and [brackets] stay text."
    for content, calls in _all_splits("hermes", text):
        assert content == text and calls == []
    p = ToolCallParser("hermes", NAMES)
    assert p.push("No tools ")[0] == "No tools "  # released at once, not held
    assert p.push("<tool")[0] == ""  # could start a marker: held back
    assert p.push("kit>")[0] == "<toolkit>"


@pytest.mark.parametrize("text", [
    '{"name": "unknown_tool", "arguments": {}}',  # not an offered tool
    '{"city": "Paris"}',  # JSON, but not a call
    "<tool_call>{not json}</tool_call>",
    "[TOOL_CALLS]nonsense",
])
def test_what_is_not_a_call_stays_content(text: str) -> None:
    for family in ("hermes", "mistral", "generic"):
        content, calls = _run(family, text, [])
        assert calls == [] and content == text


def test_unclosed_hermes_call_with_complete_json_counts() -> None:
    content, calls = _run("hermes", "<tool_call>" + json.dumps(WEATHER), [])
    assert content == "" and calls == EXPECTED[:1]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search"}},
]


def test_forced_schema_and_parse() -> None:
    schema = forced_calls_schema(TOOLS, None, parallel=True)
    reply = json.dumps([WEATHER, {"name": "search", "arguments": {}}])
    jsonschema.validate(json.loads(reply), schema)
    calls = forced_calls(reply, None)
    assert [c.name for c in calls] == ["get_weather", "search"]
    with pytest.raises(jsonschema.ValidationError):  # wrong arguments for the name
        jsonschema.validate([{"name": "get_weather", "arguments": {"q": 1}}], schema)
    single = forced_calls_schema(TOOLS, None, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(reply), single)
    named = forced_calls_schema(TOOLS, "get_weather", parallel=True)
    assert named == TOOLS[0]["function"]["parameters"]
    assert forced_calls('{"city": "Rome", "unit": "f"}', "get_weather")[0].name == "get_weather"
    ids = {c.id for c in calls}
    assert len(ids) == 2 and all(i.startswith("call_") for i in ids)


def test_template_inspection() -> None:
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert template_tools(plain).renders_tools is False
    hermes = ("{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}"
              "<tool_call>{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    info = template_tools(hermes)
    assert info.renders_tools and info.family == "hermes"
    assert template_tools("{{ tools }}[TOOL_CALLS]").family == "mistral"


def test_forced_calls_cut_by_the_token_limit_keep_the_complete_ones() -> None:
    from colibri.engine.text.toolcalls import forced_calls

    cut = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
           '{"name": "get_weather", "argu')
    calls = forced_calls(cut, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    with pytest.raises(ValueError):
        forced_calls('[{"name": "get_wea', None)


def test_forced_calls_cut_by_the_token_limit_stay_calls() -> None:
    """At the token limit the call being written is kept, its arguments as far as they
    got; its name must be complete and one of the tools."""
    names = {"get_weather", "search"}
    cut = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
           '{"name": "search", "arguments": {"q": "ra')
    calls = forced_calls(cut, None, cut=True, names=names)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", json.dumps({"city": "Paris", "days": 2})), ("search", '{"q": "ra')]
    assert [c.name for c in forced_calls('[{"name": "get_weather", "arguments": ', None,
                                         cut=True, names=names)] == ["get_weather"]
    for before_the_name in ("", "[", '[{"name": "get_wea', '[{"name": "nope", "arguments": {'):
        assert forced_calls(before_the_name, None, cut=True, names=names) == []
    named = forced_calls('{"city": "Par', "get_weather", cut=True)
    assert [(c.name, c.arguments) for c in named] == [("get_weather", '{"city": "Par')]
    with pytest.raises(ValueError):  # without cut, a reply that does not parse is refused
        forced_calls('{"city": "Par', "get_weather")
