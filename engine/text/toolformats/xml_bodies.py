"""Call formats that write each argument between tags, as text: Qwen3-Coder, GLM-4.5 and
MiniMax-M2. A value is typed by the tool's parameter schema (common.typed_value): a string
parameter keeps its text, numbers, booleans, objects and arrays are read as JSON.

- Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`;
- GLM-4.5: `<tool_call>NAME\\n<arg_key>P</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`;
- MiniMax-M2: `<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="P">VALUE</parameter>
  \\n</invoke>\\n</minimax:tool_call>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from colibri.engine.text.reply_types import ToolCall
from colibri.engine.text.toolformats.base import CallFormat
from colibri.engine.text.toolformats.common import ToolSet, typed_value


def _call(name: str, pairs: list[tuple[str, str]], tools: ToolSet) -> list[ToolCall] | None:
    if name not in tools.names:
        return None
    props = tools.properties.get(name, {})
    args: dict[str, Any] = {k: typed_value(v, props.get(k)) for k, v in pairs}
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _strip_newline(value: str) -> str:
    """The value as written: the one newline each side that the template adds is not."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_QC_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
_QC_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                       re.DOTALL)


def _qwen3_coder(body: str, tools: ToolSet) -> list[ToolCall] | None:
    m = _QC_FUNCTION.match(body)
    if not m:
        return None
    inner = m.group(2)
    pairs = [(p.group(1).strip(), _strip_newline(p.group(2)))
             for p in _QC_PARAM.finditer(inner)]
    if re.sub(_QC_PARAM, "", inner).strip():
        return None  # text that is not a parameter: not a call
    return _call(m.group(1).strip(), pairs, tools)


_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm45(body: str, tools: ToolSet) -> list[ToolCall] | None:
    name, _, rest = body.partition("<arg_key>")
    rest = "<arg_key>" + rest if _ else ""
    pairs = [(p.group(1).strip(), p.group(2)) for p in _GLM_PAIR.finditer(rest)]
    if re.sub(_GLM_PAIR, "", rest).strip():
        return None
    return _call(name.strip(), pairs, tools)


_MM_INVOKE = re.compile(r'^\s*name="([^"]+)"\s*>(.*)$', re.DOTALL)
_MM_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def _minimax(body: str, tools: ToolSet) -> list[ToolCall] | None:
    m = _MM_INVOKE.match(body)
    if not m:
        return None
    inner = m.group(2)
    pairs = [(p.group(1), _strip_newline(p.group(2))) for p in _MM_PARAM.finditer(inner)]
    if re.sub(_MM_PARAM, "", inner).strip():
        return None
    return _call(m.group(1), pairs, tools)


QWEN3_CODER = CallFormat("<tool_call>", "</tool_call>", _qwen3_coder)
GLM45 = CallFormat("<tool_call>", "</tool_call>", _glm45)
MINIMAX = CallFormat("<invoke ", "</invoke>", _minimax, "<minimax:tool_call>",
                     "</minimax:tool_call>")
