"""A model's reply read into reasoning, answer text and tool calls, streamed or whole.

`ReplyParser` chains what a chat template's family needs: the reasoning split
(engine.text.reasoning, or gpt-oss's channels in engine.text.harmony, which read calls too),
then the tool-call parser on the answer (engine.text.toolcalls). Calls are read only from the
answer, never from the reasoning. Every route (chat, responses, messages) maps the same
`ReplyDelta`s onto its protocol, so they agree on what the model said.
"""

from __future__ import annotations

from colibri.engine.text.harmony import HarmonyParser
from colibri.engine.text.reasoning import ReasoningStyle, ThinkSplitter
from colibri.engine.text.reply_types import ParsedReply, ReplyDelta
from colibri.engine.text.toolcalls import ToolCallParser


class ReplyParser:
    """Streams one reply: push(text) and finish() give ReplyDeltas.

    reasoning: the template's reasoning style (None: the model does not think);
    in_reasoning: the prompt opened the reasoning; calls: the tool-call parser of the answer
    (None: the answer is all text).
    """

    def __init__(self, reasoning: ReasoningStyle | None, in_reasoning: bool,
                 calls: ToolCallParser | None) -> None:
        self._harmony = (HarmonyParser(calls.names if calls is not None else set())
                         if reasoning == "harmony" else None)
        self._think = ThinkSplitter(in_reasoning) if reasoning == "think" else None
        self._calls = calls

    def push(self, text: str) -> ReplyDelta:
        if self._harmony is not None:
            return self._harmony.push(text)
        reasoning, answer = self._think.push(text) if self._think else ("", text)
        return self._answer(ReplyDelta(reasoning=reasoning), answer, False)

    def finish(self) -> ReplyDelta:
        if self._harmony is not None:
            return self._harmony.finish()
        reasoning, answer = self._think.finish() if self._think else ("", "")
        return self._answer(ReplyDelta(reasoning=reasoning), answer, True)

    def _answer(self, out: ReplyDelta, text: str, final: bool) -> ReplyDelta:
        if self._calls is None:
            out.content = text
            return out
        if text:
            out.content, out.calls = self._calls.push(text)
        if final:
            content, calls = self._calls.finish()
            out.content += content
            out.calls += calls
        return out


def parse_reply(parser: ReplyParser, text: str) -> ParsedReply:
    """A whole reply read by a fresh parser; reasoning is None when there was none (an empty
    think block, as Qwen3 writes when it decides not to think, included)."""
    out = parser.push(text)
    out += parser.finish()
    return ParsedReply(out.reasoning or None, out.content, out.calls)
