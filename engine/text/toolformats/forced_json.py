"""Forced calls in the JSON-argument families' own markup (Hermes / Qwen3, DeepSeek-V3.1,
Kimi K2, gpt-oss's harmony): a lark_json constraint's value, the calls written as each
family's template renders them back, the JSON written as response_format JSON is (so
json.dumps of the parsed arguments, which templates print, gives the same text). Markers
that are special tokens in the vocabulary are allowed as those tokens (lark_literal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from colibri.engine.text.toolformats.forced_xml import Splitter, lark_literal


@dataclass(frozen=True)
class JsonMarkup:
    """The texts around a family's calls; call_open may hold {name} and {index} (a call's
    number, any digits)."""

    call_open: str
    call_close: str
    sep: str = ""
    section_open: str = ""
    section_close: str = ""
    named_object: bool = False  # the JSON is {"name", "arguments"}, not the arguments alone
    id_between: tuple[str, str] | None = None  # the call's written id stands between these
    single: bool = False  # a call ends the turn: one per reply


JSON_MARKUP: dict[str, JsonMarkup] = {
    "hermes": JsonMarkup("<tool_call>\n", "\n</tool_call>", sep="\n", named_object=True),
    "deepseek": JsonMarkup("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                           section_open="<｜tool▁calls▁begin｜>",
                           section_close="<｜tool▁calls▁end｜>"),
    "kimi": JsonMarkup("<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
                       "<|tool_call_end|>", section_open="<|tool_calls_section_begin|>",
                       section_close="<|tool_calls_section_end|>",
                       id_between=("<|tool_call_begin|>", "<|tool_call_argument_begin|>")),
    # after the prompt's "<|start|>assistant"; <|call|> ends the turn (an end-of-turn token)
    "harmony": JsonMarkup(" to=functions.{name}<|channel|>commentary json<|message|>", "",
                          single=True),
}


def _fn(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else {}


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    params = _fn(tool).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object",
                                                               "properties": {}}


def _open(text: str, name: str, split: Splitter | None) -> str:
    head, _, rest = text.format(name=name, index="\0").partition("\0")
    if not _:
        return lark_literal(head, split)
    return " ".join(p for p in (lark_literal(head, split), "/[0-9]+/",
                                lark_literal(rest, split)) if p)


def forced_calls_markup(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                        family: str, split: Splitter | None = None) -> dict[str, Any] | None:
    """A lark_json constraint's value for forced calls in the family's JSON markup, or None
    when it has none: one call for a named function or without parallel calls. split: the
    tokenizer's Tokenizer.split_special."""
    markup = JSON_MARKUP.get(family)
    if markup is None:
        return None
    chosen = [t for t in tools if name is None or _fn(t).get("name") == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    lit = {k: lark_literal(getattr(markup, k), split)
           for k in ("call_close", "sep", "section_open", "section_close")}
    lines: list[str] = []
    json_rules: dict[str, Any] = {}
    if markup.named_object:
        options = [{"type": "object",
                    "properties": {"name": {"const": _fn(t).get("name")},
                                   "arguments": _params(t)},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for t in chosen]
        json_rules["value"] = options[0] if len(options) == 1 else {"anyOf": options}
        lines.append(f"call: {_open(markup.call_open, '', split)} value {lit['call_close']}")
    else:
        alternatives = []
        for i, tool in enumerate(chosen):
            json_rules[f"args{i}"] = _params(tool)
            opener = _open(markup.call_open, str(_fn(tool).get("name")), split)
            lines.append(" ".join(p for p in (f"call{i}:", opener, f"args{i}", lit["call_close"])
                                  if p))
            alternatives.append(f"call{i}")
        lines.append("call: " + " | ".join(alternatives))
    sep = f"{lit['sep']} " if lit["sep"] else ""
    more = "" if name is not None or not parallel or markup.single else f" ({sep}call)*"
    start = " ".join(p for p in (lit["section_open"], f"call{more}", lit["section_close"]) if p)
    return {"grammar": "\n".join([f"start: {start}", *lines]) + "\n", "json": json_rules}


def cut_json_call(rest: str, family: str, names: set[str]) -> tuple[str, str, str] | None:
    """(name, arguments written so far, the id the model wrote) of a call in the family's JSON
    markup that the token limit cut inside its arguments; None when there is none."""
    markup = JSON_MARKUP.get(family)
    if markup is None:
        return None
    if markup.named_object:
        opener = markup.call_open
        m = _NAMED.match(rest[rest.rindex(opener) + len(opener):]) if opener in rest else None
        return (m.group(1), m.group(2).strip(), "") if m and m.group(1) in names else None
    head = markup.call_open.partition("{")[0]
    if head not in rest:
        return None
    pattern = re.escape(markup.call_open).replace(r"\{name\}", r"(?P<name>[^\s<]+?)")
    pattern = pattern.replace(r"\{index\}", r"\d+")
    body = rest[rest.rindex(head):]
    m = re.match(pattern + r"(?P<args>.*)\Z", body, re.DOTALL)
    if m is None or m.group("name") not in names:
        return None
    written_id = ""
    if markup.id_between is not None:
        start, end = markup.id_between
        written_id = body[len(start):m.start("args") - len(end)]
    return m.group("name"), m.group("args").strip(), written_id


# a Hermes call that the token limit cut inside its arguments
_NAMED = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)", "arguments": (.*)\Z', re.DOTALL)
