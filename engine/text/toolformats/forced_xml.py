"""Forced calls in the XML-style families' own markup (Qwen3-Coder, GLM-4.5, MiniMax-M2): a
Lark grammar that lets the model write only calls of the offered tools, each parameter in the
function's schema order (required ones present, optional ones optional), written as the
family's template renders a call back: a string parameter as its bare text, any other as the
JSON its schema allows. Tools whose parameter names could not stand inside the markup (or
whose arguments are not an object of properties) get no grammar: the caller falls back to
the generic JSON shape.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# text -> its plain pieces and special-token ids (Tokenizer.split_special)
Splitter = Callable[[str], "list[str | int]"]


@dataclass(frozen=True)
class XmlMarkup:
    """The texts a family's template writes around calls ({name}, {key} filled in)."""

    call_open: str
    param_open: str
    param_close: str
    call_close: str
    sep: str = ""
    section_open: str = ""
    section_close: str = ""


XML_MARKUP: dict[str, XmlMarkup] = {
    "qwen3_coder": XmlMarkup("<tool_call>\n<function={name}>\n", "<parameter={key}>\n",
                             "\n</parameter>\n", "</function>\n</tool_call>", sep="\n"),
    "glm45": XmlMarkup("\n<tool_call>{name}", "<arg_key>{key}</arg_key>\n<arg_value>",
                       "</arg_value>", "</tool_call>"),
    "minimax": XmlMarkup('<invoke name="{name}">\n', '<parameter name="{key}">',
                         "</parameter>\n", "</invoke>\n",
                         section_open="\n<minimax:tool_call>\n",
                         section_close="</minimax:tool_call>"),
}
_SAFE_KEY = re.compile(r"^[^<>\"=\s]+$")


def lark_literal(text: str, split: Splitter | None = None) -> str:
    """text as a Lark sequence: quoted plain pieces, and special tokens by id (`<[id]>`), which
    a grammar cannot reach through their text."""
    pieces = split(text) if split is not None else [text]
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False)
                    for p in pieces if p != "")


def _rx(text: str) -> str:
    """text as a literal inside a /regex/."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in r".^$*+?()[]{}|\/-" else c)
                   for c in text)


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    out = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out |= _types(sub)
    if not out and isinstance(schema.get("enum"), list):
        out = {"string" if isinstance(v, str) else "other" for v in schema["enum"]}
    return out


def _value(schema: Any, close: str, terminal: str, lines: list[str],
           json_rules: dict[str, Any], split: Splitter | None) -> str:
    """The grammar of one parameter's value followed by close; adds the rules it needs (JSON
    values as rules of json_rules, which the constraint compiler writes out)."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return ("(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + ") "
                + lark_literal(close, split))
    if "string" in _types(schema) or not isinstance(schema, dict) or not schema:
        if split is not None and any(isinstance(p, int) for p in split(close)):
            return ""  # text up to a special token: not expressible here
        # bare text up to the first close: the close ends the terminal, so the lexer stops
        lines.append(f"{terminal}: /(.|\\n)*{_rx(close)}/ & ~/(.|\\n)*{_rx(close)}(.|\\n)+/")
        return terminal
    rule = terminal.lower()
    json_rules[rule] = schema
    return f"{rule} {lark_literal(close, split)}"


def forced_xml_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                       family: str, split: Splitter | None = None) -> dict[str, Any] | None:
    """A lark_json constraint's value for forced calls in family's markup ({"grammar",
    "json"}); None when the family has no XML markup or a tool cannot be written in it.
    split: the tokenizer's Tokenizer.split_special, so that markers which are special tokens
    in its vocabulary are allowed as those tokens."""
    lit = functools.partial(lark_literal, split=split)
    markup = XML_MARKUP.get(family)
    if markup is None:
        return None
    lines: list[str] = []
    json_rules: dict[str, Any] = {}
    calls: list[str] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else {}
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        if not isinstance(props, dict) or not all(_SAFE_KEY.match(k) for k in props):
            return None
        parts = [lit(markup.call_open.format(name=fn.get("name")))]
        for j, (key, schema) in enumerate(props.items()):
            rule = f"c{i}_p{j}"
            value = _value(schema, markup.param_close, f"V{i}_{j}", lines, json_rules, split)
            if not value:
                return None
            lines.append(f"{rule}: {lit(markup.param_open.format(key=key))} {value}")
            parts.append(rule if key in required else f"{rule}?")
        parts.append(lit(markup.call_close))
        lines.append(f"c{i}: " + " ".join(parts))
        calls.append(f"c{i}")
    if not calls:
        return None
    sep = lit(markup.sep) + " " if markup.sep else ""
    more = "" if name is not None or not parallel else f" ({sep}call)*"
    head = lit(markup.section_open) + " " if markup.section_open else ""
    tail = " " + lit(markup.section_close) if markup.section_close else ""
    grammar = "\n".join([f"start: {head}call{more}{tail}", "call: " + " | ".join(calls),
                         *lines]) + "\n"
    return {"grammar": grammar, "json": json_rules}
