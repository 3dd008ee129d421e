"""Finding markers in streamed text: what can be released now and what must wait.

A streaming parser may release text only when no marker can start inside it; these helpers
say how much of a buffer's end could still grow into one of the markers it looks for.
"""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def held_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text could still become one of markers."""
    return max((partial_suffix(text, m) for m in markers), default=0)


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(position, marker) of the earliest marker in text, (-1, "") when there is none."""
    best, found = -1, ""
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, m
    return best, found
