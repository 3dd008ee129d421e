"""Reasoning split from the answer, for models that think between `<think>` and `</think>`.

DeepSeek-R1 and V3.1, Qwen3, GLM-4.5 and MiniMax-M2 write their reasoning between these tags;
templates that open `<think>` in the prompt make the reply start inside the reasoning. Which
style a model uses is read from its chat template (`reasoning_style`), never guessed from the
text; gpt-oss's channels are read by engine.text.harmony. The split is streamed: text is
released as it comes, except what could still become a tag. Reasoning comes out stripped of
surrounding blanks, the answer without the blanks after `</think>`.
"""

from __future__ import annotations

from typing import Literal

from colibri.engine.text.markers import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_CHANNEL = "<|channel|>"

ReasoningStyle = Literal["think", "harmony"]


def reasoning_style(template: str | None) -> ReasoningStyle | None:
    """How the template's model writes its reasoning, or None for a model that does not."""
    if not template:
        return None
    if HARMONY_CHANNEL in template and "analysis" in template:
        return "harmony"
    if THINK_OPEN in template or THINK_CLOSE in template:
        return "think"
    return None


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened `<think>` (the reply starts there)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def thinking_switches(effort: str | None) -> dict[str, object]:
    """Template variables that turn thinking on or off for a reasoning effort: the names
    the families' templates read (Qwen3 and GLM-4.5 `enable_thinking`, DeepSeek-V3.1
    `thinking`, gpt-oss `reasoning_effort`). None: nothing is switched."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False, "thinking": False}
    level = "low" if effort == "minimal" else effort
    return {"enable_thinking": True, "thinking": True, "reasoning_effort": level}


class ThinkSplitter:
    """Splits streamed text into (reasoning, answer) at `<think>` ... `</think>`.

    A reply that does not start in reasoning may open it with `<think>` as its first word;
    a `<think>` anywhere else is answer text, as is everything after `</think>`.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self._mode = "reasoning" if in_reasoning else "start"  # start|reasoning|after|content
        self._lead = True  # reasoning: its leading blanks (or a repeated <think>) not yet past
        self._buf = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed text; (reasoning, answer) that can be released now."""
        self._buf += text
        return self._scan(False)

    def finish(self) -> tuple[str, str]:
        """End of the reply: what is left, (reasoning, answer)."""
        return self._scan(True)

    def _scan(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf = head[len(THINK_OPEN):]
                self._mode = "reasoning"
            elif not final and THINK_OPEN.startswith(head):
                return "", ""
            else:
                self._mode = "content"
        if self._mode == "reasoning":
            reasoning = self._reasoning(final)
        if self._mode == "after":
            rest = self._buf.lstrip()
            if not rest and not final:
                self._buf = ""
                return reasoning, ""
            self._buf, self._mode = rest, "content"
        if self._mode == "content":
            out, self._buf = self._buf, ""
            return reasoning, out
        return reasoning, ""

    def _reasoning(self, final: bool) -> str:
        if self._lead:
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                head = head[len(THINK_OPEN):].lstrip()
            elif not final and (not head or THINK_OPEN.startswith(head)):
                return ""
            self._buf = head
            self._lead = not head and not final
        at = self._buf.find(THINK_CLOSE)
        if at >= 0:
            out = self._buf[:at].rstrip()
            self._buf = self._buf[at + len(THINK_CLOSE):]
            self._mode = "after"
            return out
        if final:
            out, self._buf = self._buf.rstrip(), ""
            return out
        keep = partial_suffix(self._buf, THINK_CLOSE)
        body = self._buf[: len(self._buf) - keep]
        out = body.rstrip()  # blanks wait: they are dropped when </think> follows
        self._buf = self._buf[len(out):]
        return out
