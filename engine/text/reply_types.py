"""What a model's reply is read into: reasoning, answer text and tool calls.

`ReplyDelta` is one step of a streamed reply; `ParsedReply` a whole one. Every reply parser
(engine.text.reply, engine.text.harmony) yields these, so a route only maps them onto its
protocol's fields and events.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)


@dataclass
class ReplyDelta:
    """What a parser releases after one push: reasoning text, answer text, completed calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ReplyDelta) -> ReplyDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


@dataclass
class ParsedReply:
    """A whole reply: reasoning (None when the model did not think), content, calls."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]
