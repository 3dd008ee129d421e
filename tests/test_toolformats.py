"""Each family's own tool-call format, on replies written as the families' published chat
templates render calls: Qwen3 JSON in <tool_call>, Qwen3-Coder's, GLM-4.5's and MiniMax-M2's
XML-style calls, DeepSeek-V3/V3.1's and Kimi K2's special-token sections. Every reply is cut
at every chunk boundary and at random multi-splits (the streamed parse equals the whole one);
text that only looks like a call stays text; the family is read from the template."""

from __future__ import annotations

import json
import re

import pytest

from colibri.engine.text.toolcalls import ToolCallParser, template_tools
from colibri.engine.text.toolformats import family_of
from colibri.engine.text.toolformats.common import typed_value
from tests.conftest import quick_params
from tests.test_reasoning import every_split

NAMES = {"get_weather", "run", "edit"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"},
                                         "env": {"type": "object"},
                                         "timeout": {"type": ["number", "null"]}}}}},
    {"type": "function", "function": {"name": "edit", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "text": {"type": "string"}}}}},
]


def maker(family: str):  # noqa: ANN201
    from colibri.engine.text.reply import ReplyParser

    return lambda: ReplyParser(None, False, ToolCallParser(family, NAMES, TOOLS))


PARIS = ("get_weather", {"city": "Paris", "days": 3})
RUN = ("run", {"command": "ls -la", "env": {"A": "1"}, "timeout": 2.5})
# a string parameter whose text reads as JSON stays a string
EDIT = ("edit", {"path": "a.py", "text": "42"})

CASES = [
    ("qwen3", "hermes",
     'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": {"command": '
     '"ls -la", "env": {"A": "1"}, "timeout": 2.5}}\n</tool_call>',
     "I will check both.\n", [PARIS, RUN]),
    ("qwen3-coder", "qwen3_coder",
     "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=run>\n<parameter=command>\nls -la\n</parameter>\n<parameter=env>\n"
     '{"A": "1"}\n</parameter>\n<parameter=timeout>\n2.5\n</parameter>\n</function>\n'
     "</tool_call>\n<tool_call>\n<function=edit>\n<parameter=path>\na.py\n</parameter>\n"
     "<parameter=text>\n42\n</parameter>\n</function>\n</tool_call>",
     "Let me look.\n", [PARIS, RUN, EDIT]),
    ("glm-4.5", "glm45",
     "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>edit\n"
     "<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n<arg_key>text</arg_key>\n"
     "<arg_value>42</arg_value>\n</tool_call>",
     "Checking.\n", [PARIS, EDIT]),
    ("minimax-m2", "minimax",
     'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
     '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="run">\n'
     '<parameter name="command">ls -la</parameter>\n<parameter name="env">{"A": "1"}'
     '</parameter>\n<parameter name="timeout">2.5</parameter>\n</invoke>\n'
     "</minimax:tool_call>",
     "Sure.\n", [PARIS, RUN]),
    ("deepseek-v3.1", "deepseek",
     "On it.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>run<｜tool▁sep｜>'
     '{"command": "ls -la", "env": {"A": "1"}, "timeout": 2.5}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>",
     "On it.", [PARIS, RUN]),
    ("deepseek-v3", "deepseek",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "", [PARIS]),
    ("kimi-k2", "kimi",
     "Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
     "<|tool_call_begin|>functions.run:1<|tool_call_argument_begin|>"
     '{"command": "ls -la", "env": {"A": "1"}, "timeout": 2.5}<|tool_call_end|>'
     "<|tool_calls_section_end|>",
     "Calling.", [PARIS, RUN]),
]


@pytest.mark.parametrize(("name", "family", "text", "content", "calls"), CASES,
                         ids=[c[0] for c in CASES])
def test_calls_in_every_split(name: str, family: str, text: str, content: str,
                              calls: list) -> None:
    assert every_split(maker(family), text) == (None, content, calls)


LOOKALIKES = {
    "hermes": ["Use <tool_call> tags like <tool_call>{not json}</tool_call> here.",
               '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'],
    "qwen3_coder": ["Write <tool_call><function=nope>\n</function></tool_call> to call.",
                    "<tool_call>\nplain words\n</tool_call> after"],
    "glm45": ["<tool_call>unknown_tool\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
              "</tool_call>", "The <tool_call> tag opens a call"],
    "minimax": ['<minimax:tool_call>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>',
                "Say <minimax:tool_call> and stop"],
    "deepseek": ["<｜tool▁calls▁begin｜>just words", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                 "get_weather<｜tool▁sep｜>{broken<｜tool▁call▁end｜><｜tool▁calls▁end｜>"],
    "kimi": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0"
             "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"],
}


@pytest.mark.parametrize(("family", "text"),
                         [(f, t) for f, texts in LOOKALIKES.items() for t in texts])
def test_what_only_looks_like_a_call_stays_text(family: str, text: str) -> None:
    assert every_split(maker(family), text) == (None, text, [])


def test_a_marker_named_in_text_before_a_real_call() -> None:
    text = ('Calls look like <tool_call> blocks:\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>')
    assert every_split(maker("hermes"), text) == (
        None, "Calls look like <tool_call> blocks:\n", [PARIS])


def test_text_streams_and_holds_only_what_could_become_a_marker() -> None:
    p = ToolCallParser("minimax", NAMES, TOOLS)
    assert p.push("Hello <mini") == ("Hello ", [])
    assert p.push("ature>") == ("<miniature>", [])
    content, calls = p.push('<minimax:tool_call>\n<invoke name="get_weather">\n'
                            '<parameter name="city">Oslo</parameter>\n</invoke>')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]  # released when its </invoke> arrives


def test_kimi_keeps_the_written_id() -> None:
    p = ToolCallParser("kimi", NAMES, TOOLS)
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:7"
            '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
            "<|tool_calls_section_end|>")
    _, calls = p.push(text)
    assert [c.id for c in calls] == ["functions.get_weather:7"]


def test_values_typed_by_the_schema() -> None:
    assert typed_value("42", {"type": "string"}) == "42"
    assert typed_value("42", {"type": "integer"}) == 42
    assert typed_value("true", {"type": "boolean"}) is True
    assert typed_value("null", {"type": ["number", "null"]}) is None
    assert typed_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert typed_value("not json", {"type": "object"}) == "not json"
    assert typed_value("[1, 2]", {"anyOf": [{"type": "array"}, {"type": "string"}]}) == [1, 2]
    assert typed_value("12", {"anyOf": [{"type": "boolean"}, {"type": "string"}]}) == "12"
    assert typed_value("3.5", None) == 3.5
    assert typed_value("Paris", None) == "Paris"


@pytest.mark.parametrize(("template", "family"), [
    ("{%- for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n"
     '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>', "hermes"),
    ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
     "</parameter>\n</function>\n</tool_call>", "qwen3_coder"),
    ("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
     "</arg_value>\n</tool_call>", "glm45"),
    ("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}<invoke name=\"tool-name-1\">",
     "minimax"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
     "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek"),
    ("<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
     "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>", "kimi"),
    ("<|start|>assistant<|channel|>commentary to=functions.{{ name }} <|constrain|>json"
     "<|message|>", "harmony"),
    ("{{ tools }}[TOOL_CALLS]", "mistral"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
])
def test_family_read_from_the_template(template: str, family: str) -> None:
    assert family_of(template) == family
    assert template_tools(template).family == family


def test_forced_calls_in_the_hermes_markup() -> None:
    import jsonschema

    from colibri.engine.text.toolcalls import markup_calls
    from colibri.engine.text.toolformats.forced_json import forced_calls_markup

    value = forced_calls_markup(TOOLS, None, True, "hermes")
    assert value is not None
    assert value["grammar"] == ('start: call ("\\n" call)*\n'
                                'call: "<tool_call>\\n" value "\\n</tool_call>"\n')
    schema = value["json"]["value"]
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"days": "2"}}, schema)
    named = forced_calls_markup(TOOLS, "run", True, "hermes")
    assert named is not None and named["grammar"].startswith("start: call\n")  # one call
    assert named["json"]["value"]["properties"]["name"] == {"const": "run"}
    assert forced_calls_markup(TOOLS, None, True, "qwen3_coder") is None  # not JSON markup
    with pytest.raises(ValueError):
        forced_calls_markup(TOOLS, "nope", True, "hermes")
    # a marker that is a special token of the vocabulary is allowed as that token
    split = {"<tool_call>": [7], "</tool_call>": [8]}
    special = forced_calls_markup(TOOLS, "run", False, "hermes",
                                  lambda t: [p for x in t.split("\n") for p in
                                             (split.get(x, [x] if x else []) + ["\n"])][:-1])
    assert special is not None
    assert special["grammar"] == 'start: call\ncall: <[7]> "\\n" value "\\n" <[8]>\n'

    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
             '\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": {"command": "ls')
    whole = [(c.name, c.arguments) for c in markup_calls(reply, "hermes", NAMES, TOOLS)]
    assert whole == [("get_weather", '{"city": "Paris", "days": 3}')]
    cut = [(c.name, c.arguments) for c in markup_calls(reply, "hermes", NAMES, TOOLS, cut=True)]
    assert cut == [*whole, ("run", '{"command": "ls')]  # the cut call stays a call


# Templates that render calls the way the families' published templates do (the assistant's
# tool calls, the generation prompt), around a bare ChatML-like frame.
_FRAME_USER = "{%- if tools %}{{- '<tools>' + (tools | tojson) + '</tools>\\n' }}{%- endif %}"\
    "{%- for m in messages %}{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + "\
    "m.content + '<|im_end|>\\n' }}{%- elif m.tool_calls %}"
XML_TEMPLATES = {
    "qwen3_coder": _FRAME_USER + (
        "{{- '<|im_start|>assistant\\n' }}{%- for tc in m.tool_calls %}"
        "{%- set tc = tc.function %}{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}"
        "{%- for k, v in tc.arguments|items %}{{- '<parameter=' + k + '>\\n' }}"
        "{{- v | string if v is string else v | tojson }}{{- '\\n</parameter>\\n' }}"
        "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
        "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    "glm45": _FRAME_USER + (
        "{{- '<|assistant|>\\n<think></think>' }}{%- for tc in m.tool_calls %}"
        "{%- set tc = tc.function %}{{- '\\n<tool_call>' + tc.name }}"
        "{%- for k, v in tc.arguments.items() %}{{- '<arg_key>' + k + '</arg_key>\\n"
        "<arg_value>' }}{{- v if v is string else v | tojson }}{{- '</arg_value>' }}"
        "{%- endfor %}{{- '</tool_call>' }}{%- endfor %}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>' }}"
        "{{- '\\n<think></think>' if enable_thinking is defined and not enable_thinking }}"
        "{%- endif %}"),
    "minimax": _FRAME_USER + (
        "{{- ']~b]ai\\n' + '\\n<minimax:tool_call>\\n' }}{%- for tc in m.tool_calls %}"
        "{%- set tc = tc.function %}{{- '<invoke name=\"' + tc.name + '\">\\n' }}"
        "{%- for k, v in tc.arguments|items %}{{- '<parameter name=\"' + k + '\">' }}"
        "{{- v | tojson if v is not string else v }}{{- '</parameter>\\n' }}{%- endfor %}"
        "{{- '</invoke>\\n' }}{%- endfor %}{{- '</minimax:tool_call>[e~[\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- ']~b]ai\\n<think>\\n' }}{%- endif %}"),
}
XML_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {
            "command": {"enum": ["ls", "pwd"]}, "verbose": {"type": "boolean"},
            "env": {"type": "object", "properties": {"A": {"type": "integer"}},
                    "required": ["A"], "additionalProperties": False}},
        "required": ["command", "verbose"]}}},
]


@pytest.fixture(scope="module")
def demo():  # noqa: ANN201
    from colibri.engine import LLM

    return LLM(None)


# every family's markup is parsed in the quick pass (test_calls_in_every_split); one family
# of each style runs through the model there, the rest in the whole suite
@pytest.mark.parametrize("family", quick_params(sorted(XML_TEMPLATES), ["qwen3_coder"]))
def test_forced_xml_calls_render_back_as_written(demo, family: str) -> None:  # noqa: ANN001
    """Forced calls on an XML-style template: the model writes the family's markup, the
    calls validate, and the template renders them back into the next prompt verbatim."""
    import jsonschema

    from colibri.engine import SamplingParams, compile_constraints, plan_chat

    tok, template = demo.tokenizer, XML_TEMPLATES[family]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in XML_TOOLS}
    messages = [{"role": "user", "content": "What now?"}]
    for seed in range(3):
        plan = plan_chat(tok, messages, XML_TOOLS, "required", parallel_tool_calls=False,
                         client_template=template)
        assert (plan.family, plan.spec.kind) == (family, "lark_json")
        constraint = compile_constraints(tok, demo.vocab_size, plan.spec, [300])[0]
        outs = list(demo.generate_tokens(plan.prompt, SamplingParams(
            max_tokens=300, temperature=1.0, seed=seed, constraint=constraint)))
        text = "".join(o.text for o in outs)
        assert outs[-1].finish_reason == "stop", text
        calls = plan.calls_of_forced(text)
        assert calls is not None and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
        again = plan_chat(tok, history, XML_TOOLS, "auto", client_template=template,
                          add_generation_prompt=False)
        assert text in tok.decode(again.prompt, skip_special_tokens=False)


def test_cut_xml_call_stays_a_call_with_what_was_written() -> None:
    from colibri.engine.text.toolcalls import markup_calls

    cut = "<tool_call>\n<function=run>\n<parameter=verbose>\ntrue\n</parameter>\n<parameter=c"
    calls = markup_calls(cut, "qwen3_coder", {"run"}, XML_TOOLS, cut=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", {"verbose": True})]
    cut = '\n<minimax:tool_call>\n<invoke name="run">\n<parameter name="command">ls -'
    calls = markup_calls(cut, "minimax", {"run"}, XML_TOOLS, cut=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("run", {"command": "ls -"})]
    assert markup_calls(cut, "minimax", {"run"}, XML_TOOLS) == []  # not cut: not a call


# DeepSeek-V3.1's way: the call's arguments are concatenated into the markup as JSON text
DEEPSEEK_TEMPLATE = (
    "{%- if tools %}{{- '## Tools\\n' + (tools | tojson) }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{{- '<｜User｜>' + m.content }}"
    "{%- elif m.tool_calls %}{{- '<｜Assistant｜></think><｜tool▁calls▁begin｜>' }}"
    "{%- for tool in m.tool_calls %}{{- '<｜tool▁call▁begin｜>' + tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}{%- endfor %}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}"
    "{%- elif m.role == 'tool' %}{{- '<｜tool▁output▁begin｜>' + m.content + "
    "'<｜tool▁output▁end｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜></think>' }}{%- endif %}")


def test_deepseek_templates_get_arguments_as_text(demo) -> None:  # noqa: ANN001
    """DeepSeek's templates concatenate a call's arguments into the markup, so they get the
    JSON text (other templates get an object); the rendered call reads back as the call."""
    from colibri.engine import plan_chat
    from colibri.engine.text.reply import ReplyParser, parse_reply

    tok = demo.tokenizer
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    plan = plan_chat(tok, history, TOOLS, "auto", client_template=DEEPSEEK_TEMPLATE)
    assert plan.family == "deepseek"
    text = tok.decode(plan.prompt, skip_special_tokens=False)
    call = text[text.index("<｜tool▁calls▁begin｜>"):text.index("<｜end▁of▁sentence｜>")]
    got = parse_reply(ReplyParser(None, False, ToolCallParser("deepseek", NAMES, TOOLS)), call)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [
        ("get_weather", {"city": "Paris"})]


# Kimi K2's way: the written id and the arguments between special-token markers
KIMI_TEMPLATE = (
    "{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + "
    "'<|im_end|>' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + "
    "m.content + '<|im_end|>' }}{%- elif m.tool_calls %}"
    "{{- '<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>' }}"
    "{%- for tc in m.tool_calls %}{{- '<|tool_call_begin|>' + tc.id + "
    "'<|tool_call_argument_begin|>' }}{%- if tc.function.arguments is string %}"
    "{{- tc.function.arguments }}{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}"
    "{{- '<|tool_call_end|>' }}{%- endfor %}{{- '<|tool_calls_section_end|><|im_end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}")


# gpt-oss's way: a call is a commentary message to its recipient, ended by <|call|>
HARMONY_TEMPLATE = (
    "{%- if tools %}{{- '<|start|>developer<|message|>' + (tools | tojson) + '<|end|>' }}"
    "{%- endif %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}{%- elif m.tool_calls %}"
    "{%- for tc in m.tool_calls %}{{- '<|start|>assistant to=functions.' + tc.function.name }}"
    "{{- '<|channel|>commentary json<|message|>' }}{{- tc.function.arguments | tojson }}"
    "{{- '<|call|>' }}{%- endfor %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")
JSON_MARKUP_TEMPLATES = {"deepseek": DEEPSEEK_TEMPLATE, "kimi": KIMI_TEMPLATE,
                         "harmony": HARMONY_TEMPLATE}


@pytest.mark.parametrize("family", quick_params(sorted(JSON_MARKUP_TEMPLATES), ["harmony"]))
def test_forced_json_markup_calls_render_back_as_written(demo, family: str) -> None:  # noqa: ANN001
    """DeepSeek's, Kimi's and gpt-oss's forced calls: the model writes the family's markup
    (Kimi's id numbered, gpt-oss's recipient), the calls validate, and the template renders
    them back verbatim."""
    import jsonschema

    from colibri.engine import SamplingParams, compile_constraints, plan_chat

    tok = demo.tokenizer
    template = JSON_MARKUP_TEMPLATES[family]
    tools = [{"type": "function", "function": {**t["function"], "parameters": {
        **t["function"]["parameters"], "additionalProperties": False}}} for t in XML_TOOLS]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "What now?"}]
    rendered_back = 0
    for seed in range(3):
        plan = plan_chat(tok, messages, tools, "required", parallel_tool_calls=seed != 0,
                         client_template=template)
        assert (plan.family, plan.spec.kind) == (family, "lark_json")
        constraint = compile_constraints(tok, demo.vocab_size, plan.spec, [300])[0]
        outs = list(demo.generate_tokens(plan.prompt, SamplingParams(
            max_tokens=300, temperature=1.0, seed=seed, constraint=constraint)))
        text = "".join(o.text for o in outs)
        calls = plan.calls_of_forced(text, cut=outs[-1].finish_reason == "length")
        assert calls, text
        complete = calls if outs[-1].finish_reason == "stop" else calls[:-1]
        for c in complete:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        if family == "kimi":
            assert all(re.fullmatch(r"functions\.[a-z_]+:\d+", c.id) for c in calls)
        if outs[-1].finish_reason != "stop":
            continue
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}]
        again = plan_chat(tok, history, tools, "auto", client_template=template,
                          add_generation_prompt=False)
        assert text in tok.decode(again.prompt, skip_special_tokens=False)
        rendered_back += 1
    assert rendered_back  # not every reply was cut by the budget


def test_cut_json_markup_call_stays_a_call() -> None:
    from colibri.engine.text.toolcalls import markup_calls

    cut = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
           '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
           '<|tool_call_begin|>functions.run:1<|tool_call_argument_begin|>{"command": "l')
    calls = markup_calls(cut, "kimi", NAMES, TOOLS, cut=True)
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris", "days": 3}'),
        ("functions.run:1", "run", '{"command": "l')]
    cut = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>run<｜tool▁sep｜>"
           '{"command": "ls", "env": {"A"')
    calls = markup_calls(cut, "deepseek", NAMES, TOOLS, cut=True)
    assert [(c.name, c.arguments) for c in calls] == [("run", '{"command": "ls", "env": {"A"')]
    assert markup_calls(cut, "deepseek", NAMES, TOOLS) == []
    cut = ' to=functions.run<|channel|>commentary json<|message|>{"command": "pw'
    calls = markup_calls(cut, "harmony", NAMES, TOOLS, cut=True)
    assert [(c.name, c.arguments) for c in calls] == [("run", '{"command": "pw')]
