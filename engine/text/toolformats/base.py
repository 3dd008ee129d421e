"""One streaming reader for every call format written between markers.

A format is its markers and a function that reads one call's body. Per-call formats wrap
each call (`<tool_call>...</tool_call>`); section formats wrap all of a turn's calls in a
section and each call in its own markers inside it (DeepSeek, Kimi, MiniMax). Text before the
first marker streams as it comes, holding back only a tail that could still become a marker;
a call is released when its closing marker arrives. A body that does not read as a call of
an offered tool is given back as text, markers included, so text that only looks like a call
stays text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from colibri.engine.text.markers import held_tail
from colibri.engine.text.reply_types import ToolCall
from colibri.engine.text.toolformats.common import ToolSet

BodyReader = Callable[[str, ToolSet], "list[ToolCall] | None"]


@dataclass(frozen=True)
class CallFormat:
    """Where calls stand in a reply and how one call's body reads."""

    call_open: str
    call_close: str
    read: BodyReader  # one call's body (between call_open and call_close) -> its calls
    section_open: str | None = None
    section_close: str | None = None

    @property
    def opener(self) -> str:
        """The marker that starts a turn's calls."""
        return self.section_open or self.call_open


class CallStream:
    """Streams text into (content, completed calls) for one CallFormat."""

    def __init__(self, fmt: CallFormat, tools: ToolSet) -> None:
        self.fmt = fmt
        self.tools = tools
        self._buf = ""
        self._raw = ""  # markers and bodies consumed since the last call that read
        self._mode = "text"  # text | section | call | between
        self._read_any = False  # the current section read a call

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        return self._scan(False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._scan(True)

    def _scan(self, final: bool) -> tuple[str, list[ToolCall]]:
        fmt = self.fmt
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._mode == "text":
                at = self._buf.find(fmt.opener)
                if at < 0:
                    keep = 0 if final else held_tail(self._buf, (fmt.opener,))
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:at])
                self._raw, self._read_any = fmt.opener, False
                self._buf = self._buf[at + len(fmt.opener):]
                self._mode = "section" if fmt.section_open else "call"
            elif self._mode in ("section", "between"):
                step = self._between(final)
                if step is None:
                    break
                if step:  # the calls are over: what stands here is text again
                    content.append(self._raw)
                    self._raw, self._mode = "", "text"
            else:  # call
                at = self._buf.find(fmt.call_close)
                if at < 0:
                    if final:
                        got = fmt.read(self._buf, self.tools)
                        if got:
                            calls += got
                        else:
                            content.append(self._raw + self._buf)
                        self._buf, self._raw, self._mode = "", "", "text"
                    break
                body = self._buf[:at]
                self._buf = self._buf[at + len(fmt.call_close):]
                got = fmt.read(body, self.tools)
                again = body.rfind(fmt.call_open)
                if not got and again >= 0:  # text that named the marker, then a real call
                    got = fmt.read(body[again + len(fmt.call_open):], self.tools)
                    if got:
                        content.append(self._raw + body[:again])
                if got:
                    calls += got
                    self._read_any = True
                    self._mode = "section" if fmt.section_open else "between"
                else:  # text after all; a section goes on, a lone call ends here
                    content.append(self._raw + body + fmt.call_close)
                    self._mode = "section" if fmt.section_open else "text"
                self._raw = ""
        return "".join(content), calls

    def _between(self, final: bool) -> bool | None:
        """Between calls: None to wait for more text, False when the next call's marker was
        consumed, True when the calls are over (the section's end was consumed, or what
        follows is text); self._raw then holds what of them turned out to be text."""
        fmt = self.fmt
        head = self._buf.lstrip()
        gap = self._buf[: len(self._buf) - len(head)]
        if head.startswith(fmt.call_open):
            self._raw += gap + fmt.call_open
            self._buf = head[len(fmt.call_open):]
            self._mode = "call"
            return False
        if fmt.section_close and head.startswith(fmt.section_close):
            self._buf = head[len(fmt.section_close):]
            self._raw = "" if self._read_any else self._raw + gap + fmt.section_close
            return True  # (a section that read no call: its markers are text)
        ends = tuple(m for m in (fmt.call_open, fmt.section_close) if m)
        if not final and (not head or any(m.startswith(head) for m in ends)):
            return None
        if self._mode == "section" and not self._read_any:  # read no call: all text
            self._raw += gap
        self._buf = head  # blanks between a call and the text after it are dropped
        return True
