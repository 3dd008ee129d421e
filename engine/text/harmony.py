"""gpt-oss's harmony format, read from what the model writes after `<|start|>assistant`.

A reply is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|>` (reasoning),
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{...}<|call|>` (a tool call; the recipient may also stand before `<|channel|>`), and
`<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer). Commentary without a
recipient is answer text (a preamble). A reply that does not open with a header is answer
text. `<|call|>` and `<|return|>` are end-of-turn tokens, so they usually end the stream
unseen. Reasoning and answer stream as they come; a call is released when its body ends.
"""

from __future__ import annotations

import re

from colibri.engine.text.markers import first_marker, held_tail
from colibri.engine.text.reply_types import ReplyDelta, ToolCall
from colibri.engine.text.toolformats.common import call_of

MESSAGE = "<|message|>"
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MAX_HEADER = 1024  # a header longer than this is not a header: the rest is answer text


class HarmonyParser:
    """Streams a harmony reply into reasoning, answer text and tool calls.

    names: the tools offered (a call to any other recipient is kept as answer text); with
    none, no calls are read.
    """

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self._buf = ""
        self._mode = "start"  # start | header | body | plain
        self._channel = ""
        self._recipient = ""
        self._args = ""

    def push(self, text: str) -> ReplyDelta:
        self._buf += text
        return self._scan(False)

    def finish(self) -> ReplyDelta:
        return self._scan(True)

    def _scan(self, final: bool) -> ReplyDelta:
        out = ReplyDelta()
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                if head.startswith(("<|", "to=")):
                    self._mode = "header"
                elif not final and (not head or "<|".startswith(head) or "to=".startswith(head)):
                    return out
                else:
                    self._mode = "plain"
            if self._mode == "plain":
                out.content += self._buf
                self._buf = ""
                return out
            if self._mode == "header":
                at = self._buf.find(MESSAGE)
                if at < 0:
                    if len(self._buf) > _MAX_HEADER:
                        self._mode = "plain"
                        continue
                    if final:
                        self._buf = ""  # a header cut off by the end carries nothing
                    return out
                self._open(self._buf[:at])
                self._buf = self._buf[at + len(MESSAGE):]
                self._mode = "body"
                continue
            # body
            at, marker = first_marker(self._buf, _BODY_ENDS)
            if at < 0 and not final:
                keep = held_tail(self._buf, _BODY_ENDS)
                if not self._is_call():  # streamed as it comes
                    self._emit(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                return out
            end = len(self._buf) if at < 0 else at
            self._emit(out, self._buf[:end], done=True)
            self._buf = "" if at < 0 else self._buf[at + (0 if marker == "<|start|>"
                                                           else len(marker)):]
            self._mode = "header"
            if at < 0:
                return out

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else ""
        self._args = ""

    def _is_call(self) -> bool:
        return bool(self._recipient)

    def _emit(self, out: ReplyDelta, text: str, done: bool = False) -> None:
        if self._is_call():
            self._args += text
            if done:
                call = self._call()
                if call is not None:
                    out.calls.append(call)
                else:
                    out.content += self._args
            return
        if self._channel == "analysis":
            out.reasoning += text
        else:
            out.content += text

    def _call(self) -> ToolCall | None:
        name = self._recipient.removeprefix("functions.")
        if name not in self.names:
            return None
        return call_of({"name": name, "arguments": self._args.strip() or "{}"}, self.names)
