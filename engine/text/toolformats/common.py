"""What every call format shares: reading a call's JSON, and typing the values that XML-style
formats write as bare text by the tool's parameter schema."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from colibri.engine.text.reply_types import ToolCall


@dataclass(frozen=True)
class ToolSet:
    """The tools offered to a request: their names and each one's parameter properties."""

    names: frozenset[str]
    properties: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, names: set[str], tools: list[dict[str, Any]] | None = None) -> ToolSet:
        props: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else {}
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            p = params.get("properties")
            if isinstance(fn.get("name"), str) and isinstance(p, dict):
                props[fn["name"]] = p
        return cls(frozenset(names), props)


def loads(text: str) -> Any:
    """The JSON value of text, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def dumps(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def call_of(obj: Any, names: set[str] | frozenset[str]) -> ToolCall | None:
    """A call from {"name", "arguments" (object or its JSON text)} naming an offered tool."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI's own shape
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or name not in names:
        return None
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def calls_of(value: Any, names: set[str] | frozenset[str]) -> list[ToolCall] | None:
    """Calls from one call object, a list of them or {"tool_calls": [...]}; None unless every
    item is a call."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [call_of(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _types_of(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _types_of(sub)
    if not out and "enum" in schema:
        out = sorted({_json_type(v) for v in schema["enum"]})
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "other")


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter written as bare text, as the value its schema wants: text stays text for a
    string parameter; numbers, booleans, null, objects and arrays are read as JSON (True,
    False and None too, as some templates render them). Text that does not read, or reads as
    a type the schema does not allow where it allows a string, stays text. Without a schema:
    JSON if it reads, else text."""
    types = _types_of(schema)
    if types and all(t == "string" for t in types):
        return raw
    body = raw.strip()
    value = loads(body)
    if value is None and body != "null":
        # Python's spelling, which templates that render values with `| string` write
        python = {"True": True, "False": False, "None": None}
        if body not in python:
            return raw
        value = python[body]
    kind = _json_type(value)
    allowed = set(types) | ({"integer"} if "number" in types else set())
    if types and kind not in allowed and "string" in types:
        return raw
    return value
