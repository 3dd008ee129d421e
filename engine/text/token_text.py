"""Text forms of single tokens for logprobs: the decoded text and the token's raw bytes.

Byte-level BPE vocabularies spell raw bytes with printable stand-ins (GPT-2's alphabet); a
token's bytes are recovered from its vocabulary entry, so a token that holds half a UTF-8
character still reports its exact bytes. Other vocabularies fall back to the decoded text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_CACHE_LIMIT = 1 << 18


@dataclass
class TokenInfo:
    """Text forms of a token, for logprobs."""

    text: str
    bytes: list[int]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values (char -> byte).

    Printable Latin-1 bytes stand for themselves; the others are shifted to U+0100 and up,
    in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def byte_level_bytes(piece: str) -> bytes | None:
    """The raw bytes of a byte-level vocabulary entry; None if piece is not one."""
    try:
        return bytes(_BYTE_LEVEL[c] for c in piece)
    except KeyError:
        return None


class TokenTexts:
    """Memoised TokenInfo per token id for one tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, TokenInfo] = {}

    def __call__(self, token_id: int) -> TokenInfo:
        info = self._cache.get(token_id)
        if info is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            raw = byte_level_bytes(self._tok.id_to_piece(token_id))
            info = TokenInfo(text, list(raw if raw is not None else text.encode("utf-8")))
            if len(self._cache) < _CACHE_LIMIT:
                self._cache[token_id] = info
        return info
