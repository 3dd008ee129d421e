"""The tool-call formats of the model families, and which one a chat template teaches.

`family_of(template)` reads the markers in a template's source (never the model's output);
`FORMATS` maps each family with marker-delimited calls to its CallFormat.
"""

from __future__ import annotations

from colibri.engine.text.toolformats.base import CallFormat, CallStream
from colibri.engine.text.toolformats.common import ToolSet
from colibri.engine.text.toolformats.json_bodies import DEEPSEEK, HERMES, KIMI
from colibri.engine.text.toolformats.xml_bodies import GLM45, MINIMAX, QWEN3_CODER

FORMATS: dict[str, CallFormat] = {
    "hermes": HERMES,
    "qwen3_coder": QWEN3_CODER,
    "glm45": GLM45,
    "minimax": MINIMAX,
    "deepseek": DEEPSEEK,
    "kimi": KIMI,
}

# (marker in the template source, family), most specific first: Qwen3-Coder's and
# GLM-4.5's templates also write <tool_call>.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|channel|>", "harmony"),
    ("<|tool_calls_section_begin|>", "kimi"),
    ("<｜tool▁calls▁begin｜>", "deepseek"),
    ("<minimax:tool_call>", "minimax"),
    ("<arg_key>", "glm45"),
    ("<parameter=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
)


def family_of(template: str) -> str:
    """The call format a template's model was taught ("generic" when none is recognised)."""
    for marker, family in _MARKERS:
        if marker in template:
            return family
    return "generic"


__all__ = ["FORMATS", "CallFormat", "CallStream", "ToolSet", "family_of"]
