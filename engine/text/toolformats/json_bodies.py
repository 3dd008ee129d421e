"""Call formats whose arguments are JSON: Hermes / Qwen3, DeepSeek-V3 and V3.1, Kimi K2.

- Hermes / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call;
- DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; DeepSeek-V3 writes
  `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` inside the same markers;
- Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`; the written
  id (`functions.NAME:0`) becomes the call's id, which Kimi's template renders back.
"""

from __future__ import annotations

import re

from colibri.engine.text.reply_types import ToolCall
from colibri.engine.text.toolformats.base import CallFormat
from colibri.engine.text.toolformats.common import ToolSet, call_of, calls_of, loads


def _hermes(body: str, tools: ToolSet) -> list[ToolCall] | None:
    return calls_of(loads(body.strip()), tools.names)


DS_SEP = "<｜tool▁sep｜>"
_DS_V3 = re.compile(r"^\s*(\S+)\s*\n```(?:json)?\s*\n(.*?)\n```\s*$", re.DOTALL)


def _deepseek(body: str, tools: ToolSet) -> list[ToolCall] | None:
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    name, args = head.strip(), rest.strip()
    v3 = _DS_V3.match(rest)
    if name == "function" and v3:
        name, args = v3.group(1), v3.group(2)
    call = call_of({"name": name, "arguments": args}, tools.names)
    return [call] if call else None


KIMI_ARGS = "<|tool_call_argument_begin|>"
_KIMI_ID = re.compile(r"^\s*(?:functions\.)?([A-Za-z0-9_.:-]+?)(?::\d+)?\s*$")


def _kimi(body: str, tools: ToolSet) -> list[ToolCall] | None:
    head, sep, args = body.partition(KIMI_ARGS)
    m = _KIMI_ID.match(head)
    if not sep or not m:
        return None
    call = call_of({"name": m.group(1), "arguments": args.strip()}, tools.names)
    if call is None:
        return None
    call.id = head.strip()
    return [call]


HERMES = CallFormat("<tool_call>", "</tool_call>", _hermes)
DEEPSEEK = CallFormat("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _deepseek,
                      "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
KIMI = CallFormat("<|tool_call_begin|>", "<|tool_call_end|>", _kimi,
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
