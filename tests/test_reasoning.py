"""Reasoning split from the answer: `<think>` tags (DeepSeek-R1/V3.1, Qwen3, GLM-4.5,
MiniMax-M2) and gpt-oss's harmony channels, on replies written as the families' published
chat templates render them, streamed at every chunk boundary and at random multi-splits: the
streamed parse equals the whole one."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from colibri.engine.text.reasoning import (
    opens_reasoning,
    reasoning_style,
    thinking_switches,
)
from colibri.engine.text.reply import ReplyParser, parse_reply
from colibri.engine.text.reply_types import ParsedReply
from colibri.engine.text.toolcalls import ToolCallParser

NAMES = {"get_weather"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]

Factory = Callable[[], ReplyParser]


def streamed(make: Factory, text: str, cuts: list[int]) -> ParsedReply:
    """The reply fed in pieces cut at `cuts`, its deltas joined."""
    p = make()
    reasoning, content, calls = "", "", []
    prev = 0
    for cut in [*cuts, len(text)]:
        d = p.push(text[prev:cut])
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
        prev = cut
    d = p.finish()
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    return ParsedReply(reasoning or None, content, calls)


def key(r: ParsedReply) -> tuple:
    return (r.reasoning, r.content, [(c.name, json.loads(c.arguments)) for c in r.calls])


def every_split(make: Factory, text: str) -> tuple:
    """The whole parse, checked equal to the parse cut at every boundary, one character at a
    time, and at random sets of boundaries."""
    whole = key(parse_reply(make(), text))
    rng = random.Random(len(text))
    cut_sets = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    cut_sets += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k)))
                 for k in (2, 3, 5, 8, 13) for _ in range(4)]
    for cuts in cut_sets:
        assert key(streamed(make, text, cuts)) == whole, cuts
    return whole


def think(in_reasoning: bool, family: str | None = None) -> Factory:
    def make() -> ReplyParser:
        calls = ToolCallParser(family, NAMES, TOOLS) if family else None
        return ReplyParser("think", in_reasoning, calls)
    return make


def harmony(with_tools: bool) -> Factory:
    return lambda: ReplyParser("harmony", False,
                               ToolCallParser("harmony", NAMES, TOOLS) if with_tools else None)


# Replies as each family writes them after its template's generation prompt.
CASES = [
    # Qwen3 (hybrid): the prompt ends "<|im_start|>assistant\n"; the model opens <think>
    ("qwen3", think(False, "hermes"),
     "<think>\nThe user wants Paris weather. I should call the tool.\n</think>\n\n"
     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
     "</tool_call>",
     ("The user wants Paris weather. I should call the tool.", "",
      [("get_weather", {"city": "Paris"})])),
    # Qwen3-Thinking-2507 / DeepSeek-R1: the prompt opens "<think>\n"
    ("deepseek-r1", think(True),
     "Okay, 2 + 2: add them.\nThat is 4.\n</think>\n\nThe answer is **4**.",
     ("Okay, 2 + 2: add them.\nThat is 4.", "The answer is **4**.", [])),
    # DeepSeek-V3.1 thinking: "<｜Assistant｜><think>" then reasoning, "</think>", the answer
    # and its special-token call section
    ("deepseek-v3.1", think(True, "deepseek"),
     "Need the weather tool.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
     "get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 2}<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>",
     ("Need the weather tool.", "Checking.", [("get_weather", {"city": "Paris", "days": 2})])),
    # GLM-4.5: "<|assistant|>" then "\n<think>...</think>\n" and the answer
    ("glm-4.5", think(False, "glm45"),
     "\n<think>Look it up.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
     "</tool_call>",
     ("Look it up.", "", [("get_weather", {"city": "Paris", "days": 3})])),
    # MiniMax-M2: the prompt ends "]~b]ai\n<think>\n"
    ("minimax-m2", think(True, "minimax"),
     "Weather question.\n</think>\n\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
     "<parameter name=\"city\">Paris</parameter>\n</invoke>\n</minimax:tool_call>",
     ("Weather question.", "", [("get_weather", {"city": "Paris"})])),
    # a thinking model cut short by max_tokens inside its reasoning
    ("cut-short", think(True), "Still thinking about th",
     ("Still thinking about th", "", [])),
    # thinking switched off: the template closed <think> itself, the reply is all answer
    ("qwen3-no-think", think(False), "Paris is sunny.", (None, "Paris is sunny.", [])),
    # Qwen3 deciding not to think: an empty think block is no reasoning
    ("qwen3-empty-think", think(False), "<think>\n\n</think>\n\nHi!", (None, "Hi!", [])),
    # gpt-oss: analysis, then the final channel
    ("gpt-oss", harmony(False),
     "<|channel|>analysis<|message|>User greets. Reply politely.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?",
     ("User greets. Reply politely.", "Hello! How can I help?", [])),
    # gpt-oss: analysis, then a call on the commentary channel with its recipient
    ("gpt-oss-call", harmony(True),
     "<|channel|>analysis<|message|>Need to use get_weather.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     "{\"city\":\"Paris\",\"days\":1}<|call|>",
     ("Need to use get_weather.", "", [("get_weather", {"city": "Paris", "days": 1})])),
    # gpt-oss: the recipient before the channel, and a preamble on commentary before it
    ("gpt-oss-preamble", harmony(True),
     "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant "
     "to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Rome\"}",
     (None, "Let me check.", [("get_weather", {"city": "Rome"})])),
]


@pytest.mark.parametrize(("name", "make", "text", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_reasoning_split_in_every_split(name: str, make: Factory, text: str,
                                        expected: tuple) -> None:
    assert every_split(make, text) == expected


@pytest.mark.parametrize(("make", "text"), [
    (think(False), "I like <think> tags in HTML-ish prose."),  # not the reply's first word
    (think(False), "<thinking>is not the tag</thinking>"),
    (think(False), "Answer first.</think> then a stray closing tag"),
    (harmony(False), "A plain reply without channels <|end|> stays text."),
])
def test_what_only_looks_like_reasoning_stays_answer(make: Factory, text: str) -> None:
    assert every_split(make, text) == (None, text, [])


def test_answer_streams_as_it_comes_holding_only_possible_tags() -> None:
    p = ReplyParser("think", True, None)
    assert p.push("Step one").reasoning == "Step one"
    assert p.push(" </th").reasoning == ""  # could be </think>: held
    d = p.push("ink>\n\nDone")
    assert (d.reasoning, d.content) == ("", "Done")
    assert p.push(" now.").content == " now."


def test_a_non_thinking_model_is_untouched() -> None:
    p = ReplyParser(None, False, None)
    text = "<think>literal</think> text of a model that does not think"
    assert key(parse_reply(p, text)) == (None, text, [])


def test_style_read_from_the_template() -> None:
    qwen3 = ("{%- if enable_thinking is defined and enable_thinking is false %}"
             "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    assert reasoning_style(qwen3) == "think"
    r1 = "{% set content = content.split('</think>')[-1] %}<｜Assistant｜><think>\\n"
    assert reasoning_style(r1) == "think"
    gpt_oss = "<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>"
    assert reasoning_style(gpt_oss) == "harmony"
    assert reasoning_style("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert reasoning_style(None) is None


def test_prompt_that_opens_reasoning() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert opens_reasoning("<｜Assistant｜><think>")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|assistant|>\n<think></think>")


def test_effort_to_template_switches() -> None:
    assert thinking_switches(None) == {}
    assert thinking_switches("none") == {"enable_thinking": False, "thinking": False}
    assert thinking_switches("high") == {"enable_thinking": True, "thinking": True,
                                         "reasoning_effort": "high"}
    assert thinking_switches("minimal")["reasoning_effort"] == "low"
