"""Tool calls: what a chat template can render, schemas for forced calls, and parsers for the
calls a model writes in its own format.

Formats understood in model output (tool_choice "auto"):
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`;
- the generic fallback, for every template: a reply that is only JSON (optionally in a ```
  fence) of the shape `{"tool_calls": [{"name", "arguments"}, ...]}`, one `{"name", "arguments"}`
  object or a list of them, naming a tool that was offered. Anything else is text.
Forced calls (tool_choice "required" or a named function) are constrained by JSON Schema
(`forced_calls_schema`), so they always parse. Knows nothing of HTTP.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools."""

    renders_tools: bool  # the template reads the `tools` variable
    family: str  # "hermes" | "mistral" | "generic": the call format its model was taught


def template_tools(template: str | None) -> TemplateTools:
    """Inspect a chat template's source (no rendering)."""
    if not template:
        return TemplateTools(False, "generic")
    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        names = set()
    family = "generic"
    if HERMES_OPEN in template:
        family = "hermes"
    elif MISTRAL_OPEN in template:
        family = "mistral"
    return TemplateTools("tools" in names, family)


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """The `function` object of an OpenAI tool."""
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else {}


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameter schema; OpenAI treats a missing one as 'no parameters'."""
    params = function_of(tool).get("parameters")
    if isinstance(params, dict) and params:
        return params
    return {"type": "object", "properties": {}}


def forced_calls_schema(tools: list[dict[str, Any]], name: str | None,
                        parallel: bool) -> dict[str, Any]:
    """The JSON Schema a forced reply must match: with `name`, that function's arguments
    object; otherwise a list (one item unless parallel) of {"name", "arguments"}."""
    if name is not None:
        for tool in tools:
            if function_of(tool).get("name") == name:
                return parameters_of(tool)
        raise ValueError(f"no tool named {name!r}")
    options = [{
        "type": "object",
        "properties": {"name": {"const": function_of(t).get("name")},
                       "arguments": parameters_of(t)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    item = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, name: str | None, cut: bool = False,
                 names: frozenset[str] | set[str] = frozenset()) -> list[ToolCall]:
    """The calls in a reply constrained by forced_calls_schema (ValueError if it is not).
    A list cut short by the token limit keeps the calls that were complete; with cut (the
    reply ended at the token limit) the call being written stays a call too, with the
    arguments written so far (incomplete JSON), as long as its name (one of names) is known."""
    if name is not None:
        try:
            value = json.loads(text)
        except ValueError:
            if cut:
                return [ToolCall(name, text.strip())]
            raise
        if not isinstance(value, dict):
            raise ValueError("the arguments are not a JSON object")
        return [ToolCall(name, text.strip())]
    try:
        items, rest = json.loads(text), ""
    except ValueError:
        items, rest = _complete_items(text, cut)
    calls = [ToolCall(str(c["name"]), _dumps(c["arguments"])) for c in items]
    partial = _PARTIAL_CALL.match(rest) if cut else None
    if partial is not None:
        fn = _loads('"' + partial.group(1) + '"')
        if isinstance(fn, str) and fn in names:
            calls.append(ToolCall(fn, partial.group(2).strip()))
    return calls


# the start of a {"name", "arguments"} object that the token limit cut inside its arguments
_PARTIAL_CALL = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z',
                           re.DOTALL)


def _complete_items(text: str, cut: bool = False) -> tuple[list[Any], str]:
    """The complete elements at the start of a JSON array whose end was cut off, and the
    text after them. None complete is a ValueError unless cut."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        if cut and not text.strip():
            return [], ""
        raise ValueError("not a JSON array")
    i += 1
    items: list[Any] = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        items.append(value)
    if not items and not cut:
        raise ValueError("no complete call before the reply was cut off")
    return items, text[i:]


def _dumps(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def generic_preamble(tools: list[dict[str, Any]], name: str | None) -> str:
    """The system text that describes tools to a model whose template cannot render them."""
    lines = ["You can call these functions (JSON Schema of each one's arguments):"]
    for tool in tools:
        fn = function_of(tool)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": parameters_of(tool)}, ensure_ascii=False))
    if name is not None:
        lines.append(f"Call the function {name!r}: reply with its arguments as one JSON object.")
    else:
        lines.append('Reply with a JSON list of calls: [{"name": ..., "arguments": {...}}].')
    return "\n".join(lines)


def history_call_text(calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier tool calls written in the generic format (for templates
    that cannot render tool calls)."""
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append({"name": fn.get("name"), "arguments": args})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def _call_of(obj: Any, names: set[str]) -> ToolCall | None:
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


def _calls_of(value: Any, names: set[str]) -> list[ToolCall] | None:
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(v, names) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_generic(text: str, names: set[str]) -> list[ToolCall] | None:
    """Calls if text is nothing but the generic JSON form, else None."""
    body = text.strip()
    m = _FENCE.match(body)
    if m:
        body = m.group(1)
    if not body or body[0] not in "{[":
        return None
    try:
        return _calls_of(json.loads(body), names)
    except ValueError:
        return None


def _parse_mistral(text: str, names: set[str]) -> list[ToolCall] | None:
    body = text.strip()
    if body.startswith("["):
        try:
            return _calls_of(json.loads(body), names)
        except ValueError:
            return None
    calls = []
    for part in body.split(MISTRAL_OPEN):  # newer format: name[ARGS]{...} per call
        if not part.strip():
            continue
        name, sep, args = part.partition("[ARGS]")
        call = _call_of({"name": name.strip(), "arguments": args.strip()}, names) if sep else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


class ToolCallParser:
    """Splits streamed model text into content deltas and tool calls (tool_choice "auto").

    Content is released as it comes, except the tail that could start a call marker; text
    after a marker, and a whole reply that opens with '{', '[' or a ``` fence, is held until it
    can be parsed (then it is either calls or, when it does not parse, content after all).
    """

    def __init__(self, family: str, names: set[str]) -> None:
        self.names = names
        self.family = family
        self.marker = {"hermes": HERMES_OPEN, "mistral": MISTRAL_OPEN}.get(family)
        self._buf = ""
        self._mode = "start"  # start | content | held | calls
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Feed text; returns (content to emit now, calls completed now)."""
        self._buf += text
        if self._mode == "start":
            stripped = self._buf.lstrip()
            if not stripped:
                return "", []
            if stripped[0] in "{[`":
                self._mode = "held"
            else:
                self._mode = "content"
        if self._mode == "held":
            return "", []
        if self._mode == "content":
            return self._scan_content()
        return "", self._scan_calls()

    def _scan_content(self) -> tuple[str, list[ToolCall]]:
        if self.marker is None:
            out, self._buf = self._buf, ""
            return out, []
        at = self._buf.find(self.marker)
        if at < 0:
            keep = _partial_suffix(self._buf, self.marker)
            out = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(out):]
            return out, []
        out = self._buf[:at]
        self._buf = self._buf[at:]
        self._mode = "calls"
        return out, self._scan_calls()

    def _scan_calls(self) -> list[ToolCall]:
        if self.family != "hermes":
            return []  # Mistral's list ends with the reply: parsed in finish()
        done = []
        while True:
            start = self._buf.find(HERMES_OPEN)
            end = self._buf.find(HERMES_CLOSE, start + 1)
            if start < 0 or end < 0:
                return done
            block = self._buf[start + len(HERMES_OPEN): end]
            call = _calls_of(_loads(block), self.names)
            if call is None:
                return done  # not a call we can read: finish() gives the text back
            self._buf = self._buf[end + len(HERMES_CLOSE):]
            self.calls += call
            done += call

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the reply: (remaining content, remaining calls)."""
        buf, self._buf = self._buf, ""
        if self._mode in ("start", "held"):
            calls = parse_generic(buf, self.names)
            if calls is not None:
                self.calls += calls
                return "", calls
            if self.marker and self.marker in buf:  # not the generic form: read it as text
                again = ToolCallParser(self.family, self.names)
                again._mode = "content"
                content, calls = again.push(buf)
                tail, more = again.finish()
                self.calls += calls + more
                return content + tail, calls + more
            return buf, []
        if self._mode == "content":
            return buf, []
        if self.family == "mistral":
            calls = _parse_mistral(buf[len(MISTRAL_OPEN):], self.names)
        else:  # hermes: an unclosed last block still counts when its JSON is complete
            body = buf.strip()
            if not body:
                return "", []
            calls = _calls_of(_loads(body.removeprefix(HERMES_OPEN)), self.names)
        if calls is None:
            return buf, []
        self.calls += calls
        return "", calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
