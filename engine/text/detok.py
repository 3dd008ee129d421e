"""Streaming text: incremental detokenization and stop-string matching.

Guarantees: never emits half a UTF-8 character (text is held back while it decodes to a
trailing U+FFFD); the concatenation of what is emitted equals decoding all tokens at once
(for byte-level and other concatenative decoders); each step decodes only a small window,
so a whole stream costs linear time. Stop strings are cut at their earliest occurrence across
chunk boundaries and never emitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
# Tokens kept before the unread ones so that decoders which look at context (SentencePiece's
# leading-space rule) decode the new tokens as they would inside the whole sequence.
_PREFIX_TOKENS = 5
# A character is at most 4 UTF-8 bytes, so a trailing U+FFFD that persists over this many
# unread tokens is real invalid output, not a split character: emit it rather than let the
# window (and the cost of each step) grow.
_MAX_PENDING_TOKENS = 16


class _Decoder(Protocol):
    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, as vLLM does with prefix/read offsets.

    `tokens[prefix:read]` is text already emitted (context only); `tokens[read:]` is pending.
    Each push decodes just these two windows and emits the difference.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        tail = list(prompt_ids)[-_PREFIX_TOKENS:] if prompt_ids is not None else []
        context = [int(t) for t in tail]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(self._prefix, self._read)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _advance(self) -> None:
        # Drop tokens that can no longer be part of the window so memory stays bounded.
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 0:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self._prefix_text = self._decode(self._prefix, self._read)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became decodable (maybe "")."""
        self._ids.append(int(token_id))
        full = self._decode(self._prefix, len(self._ids))
        pending = len(self._ids) - self._read
        if full.endswith(_REPLACEMENT) and pending < _MAX_PENDING_TOKENS:
            return ""  # a multi-byte character is split across tokens: wait for the rest
        if len(full) <= len(self._prefix_text):
            # Nothing new to show, e.g. a special token that is skipped.
            if pending >= _MAX_PENDING_TOKENS:
                self._advance()
            return ""
        new = full[len(self._prefix_text):]
        self._advance()
        return new

    def flush(self) -> str:
        """Return whatever is still held back (e.g. an incomplete character at the end)."""
        full = self._decode(self._prefix, len(self._ids))
        new = full[len(self._prefix_text):]
        self._advance()
        return new


class StopStringMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    `push` returns (text safe to emit, stopped). Text that could be the start of a stop string
    is held back (at most len(longest stop) - 1 characters); once a stop string completes,
    everything from its start on is dropped. When one stop completes while a longer stop that
    starts earlier might still complete, the matcher waits to see which comes first.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: list[str] = [s for s in stops]
        for s in self.stops:
            if not isinstance(s, str) or not s:
                raise ValueError("stop strings must be non-empty strings")
        self._max = max((len(s) for s in self.stops), default=0)
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream
        self._best = ""  # the stop string _first_match found

    def _first_match(self) -> int:
        best = -1
        for s in self.stops:
            i = self._buf.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, self._best = i, s
        return best

    def _could_start(self, pos: int) -> bool:
        """Whether buf[pos:] is a proper prefix of some stop (a match may still complete)."""
        tail = self._buf[pos:]
        return any(len(s) > len(tail) and s.startswith(tail) for s in self.stops)

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (what can be emitted now, whether a stop string was found)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        self._buf += text
        n = len(self._buf)
        match = self._first_match()
        # Only the last (longest stop - 1) positions can begin an incomplete stop string.
        lo = max(0, n - self._max + 1)
        hi = n if match < 0 else match
        hold = next((p for p in range(lo, hi) if self._could_start(p)), -1)
        if hold < 0 and match >= 0:
            emit = self._buf[:match]
            self._buf = ""
            self.stopped, self.matched = True, self._best
            return emit, True
        cut = hold if hold >= 0 else n
        emit = self._buf[:cut]
        self._buf = self._buf[cut:]
        return emit, False

    def flush(self) -> str:
        """End of stream: return held-back text, cut at a stop string if one is complete."""
        if self.stopped:
            return ""
        match = self._first_match()
        emit = self._buf if match < 0 else self._buf[:match]
        self.stopped = match >= 0
        if self.stopped:
            self.matched = self._best
        self._buf = ""
        return emit
