"""Tool calls: what a chat template can render, schemas for forced calls, and the parser of
the calls a model writes in its own format.

The format is the template's family (toolformats.family_of reads the markers in the
template's source, never the reply): Hermes / Qwen3 JSON in `<tool_call>`, Qwen3-Coder's,
GLM-4.5's and MiniMax-M2's XML-style calls, DeepSeek-V3/V3.1's and Kimi K2's special-token
sections (engine.text.toolformats), Mistral's `[TOOL_CALLS]` (here), gpt-oss's harmony
commentary channel (engine.text.harmony, with its reasoning). For every template, a reply
that is only JSON (optionally in a ``` fence) of the shape `{"tool_calls": [{"name",
"arguments"}, ...]}`, one `{"name", "arguments"}` object or a list of them, naming a tool that
was offered, is read as calls too (the generic fallback). Anything else is text. Forced calls
(tool_choice "required" or a named function) are constrained, so they always parse: in the
family's own markup, so that the template renders the call back exactly as the model wrote
it (toolformats.forced_json for Hermes / Qwen3, DeepSeek-V3.1, Kimi K2 and gpt-oss,
toolformats.forced_xml for Qwen3-Coder, GLM-4.5 and MiniMax-M2), otherwise (Mistral, the
generic fallback) by a JSON Schema of the generic shape
(`forced_calls_schema`). Knows nothing of HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.nodes

from colibri.engine.text.harmony import HarmonyParser
from colibri.engine.text.markers import partial_suffix
from colibri.engine.text.reply_types import ToolCall
from colibri.engine.text.toolformats import FORMATS, CallStream, ToolSet, family_of
from colibri.engine.text.toolformats.common import call_of as _call_of
from colibri.engine.text.toolformats.common import calls_of as _calls_of
from colibri.engine.text.toolformats.common import dumps as _dumps
from colibri.engine.text.toolformats.forced_json import cut_json_call
from colibri.engine.text.toolformats.forced_xml import XML_MARKUP

MISTRAL_OPEN = "[TOOL_CALLS]"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools."""

    renders_tools: bool  # the template reads the `tools` variable
    family: str  # the call format its model was taught (toolformats.family_of), or "generic"


def _names_read(template: str) -> set[str]:
    """The variable names a template reads, from its parse tree alone. Compiling it (as
    jinja2.meta does) would fold constant expressions such as `'a' * 10**9` here, in the
    server process, outside the render sandbox's time and memory limits."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return set()
    return {n.name for n in tree.find_all(jinja2.nodes.Name) if n.ctx == "load"}


def template_tools(template: str | None) -> TemplateTools:
    """Inspect a chat template's source (no rendering)."""
    if not template:
        return TemplateTools(False, "generic")
    return TemplateTools("tools" in _names_read(template), family_of(template))


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


def markup_calls(text: str, family: str, names: set[str], tools: list[dict[str, Any]],
                 cut: bool = False) -> list[ToolCall]:
    """The calls of a reply constrained by forced_calls_markup or forced_xml_grammar. With cut
    (the reply ended at the token limit), a JSON-markup call cut inside its arguments stays a
    call, with the arguments written so far (incomplete JSON)."""
    if family == "harmony":  # one call, which ends the turn: a cut one is in the text
        harmony = HarmonyParser(names)
        read = harmony.push(text)
        read += harmony.finish()
        calls, rest = read.calls, ("" if read.calls else text)
    else:
        parser = ToolCallParser(family, names, tools)
        calls = parser.push(text)[1]
        rest, more = parser.finish()
        calls += more
    if not cut:
        return calls
    partial = cut_json_call(rest, family, names)
    if partial is not None:
        call = ToolCall(partial[0], partial[1])
        call.id = partial[2] or call.id
        calls.append(call)
    elif family in XML_MARKUP:
        calls += _cut_xml_call(rest, family, ToolSet.of(names, tools))
    return calls


def _cut_xml_call(rest: str, family: str, tools: ToolSet) -> list[ToolCall]:
    """An XML-style call the token limit cut: the parameters written so far (the last one's
    text as far as it got), read by closing what was left open."""
    fmt, markup = FORMATS[family], XML_MARKUP[family]
    if fmt.call_open not in rest:
        return []
    body = rest[rest.rindex(fmt.call_open) + len(fmt.call_open):]
    inner = markup.call_close.partition(fmt.call_close)[0]  # what stands before call_close
    for closer in (markup.param_close + inner, inner, ""):
        got = fmt.read(body + closer, tools)
        if got:
            return got
    opener = markup.param_open.partition("{key}")[0]  # cut inside a parameter's name
    if opener in body:
        got = fmt.read(body[:body.rindex(opener)] + inner, tools)
        if got:
            return got
    return []


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
    if partial is not None and partial.group(1) in names:  # names need no JSON escapes
        calls.append(ToolCall(partial.group(1), partial.group(2).strip()))
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
    tools (the request's tool dicts) type the values of XML-style formats by their schemas.
    """

    def __init__(self, family: str, names: set[str],
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.names = names
        self.family = family
        self._tools = tools
        fmt = FORMATS.get(family)
        self._stream = CallStream(fmt, ToolSet.of(names, tools)) if fmt else None
        self.marker = fmt.opener if fmt else (MISTRAL_OPEN if family == "mistral" else None)
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
        if self._stream is not None:
            buf, self._buf = self._buf, ""
            content, calls = self._stream.push(buf)
            self.calls += calls
            return content, calls
        if self._mode == "content":
            return self._scan_content()
        return "", []  # Mistral's list ends with the reply: parsed in finish()

    def _scan_content(self) -> tuple[str, list[ToolCall]]:
        if self.marker is None:
            out, self._buf = self._buf, ""
            return out, []
        at = self._buf.find(self.marker)
        if at < 0:
            keep = partial_suffix(self._buf, self.marker)
            out = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(out):]
            return out, []
        out = self._buf[:at]
        self._buf = self._buf[at:]
        self._mode = "calls"
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the reply: (remaining content, remaining calls)."""
        buf, self._buf = self._buf, ""
        if self._mode in ("start", "held"):
            calls = parse_generic(buf, self.names)
            if calls is not None:
                self.calls += calls
                return "", calls
            if self.marker and self.marker in buf:  # not the generic form: read it as text
                again = ToolCallParser(self.family, self.names, self._tools)
                again._mode = "content"
                content, calls = again.push(buf)
                tail, more = again.finish()
                self.calls += calls + more
                return content + tail, calls + more
            return buf, []
        if self._stream is not None:
            content, calls = self._stream.finish()
            self.calls += calls
            return content, calls
        if self._mode == "content":
            return buf, []
        calls = _parse_mistral(buf[len(MISTRAL_OPEN):], self.names)
        if calls is None:
            return buf, []
        self.calls += calls
        return "", calls
