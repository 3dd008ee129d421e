"""Special tokens: a vocabulary's added tokens marked special, recognised by their text in a
chat template's own text only.

Guarantees: encode_segments turns template text into special-token ids and client text into
plain-text ids, honouring each special token's lstrip / rstrip, and gives the same ids as
encoding the whole rendering whenever client text holds no special-token text.
Refuses: nothing; callers decide which text is the template's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer


@dataclass(frozen=True)
class SpecialToken:
    token_id: int
    lstrip: bool  # whitespace before it belongs to the token
    rstrip: bool  # whitespace after it belongs to the token


class SpecialTokens:
    """The special tokens of one vocabulary, by their text."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._by_text: dict[str, SpecialToken] = {}
        for tid, added in hf.get_added_tokens_decoder().items():
            if added.special:
                self._by_text[added.content] = SpecialToken(tid, added.lstrip, added.rstrip)
        self.ids: frozenset[int] = frozenset(s.token_id for s in self._by_text.values())
        # Longest first, so a token whose text starts with another's is found whole.
        names = sorted(self._by_text, key=len, reverse=True)
        self._re = re.compile("|".join(re.escape(n) for n in names)) if names else None

    def id_of(self, text: str) -> int | None:
        """The id of the special token spelled exactly `text`, else None."""
        special = self._by_text.get(text)
        return None if special is None else special.token_id

    def split(self, text: str) -> list[str | int]:
        """text as its plain pieces and the ids of the special tokens spelled in it."""
        if self._re is None:
            return [text] if text else []
        out: list[str | int] = []
        pos = 0
        for m in self._re.finditer(text):
            if m.start() > pos:
                out.append(text[pos:m.start()])
            out.append(self._by_text[m.group(0)].token_id)
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def found_in(self, text: str) -> bool:
        """Whether text contains the text of any special token."""
        return self._re is not None and self._re.search(text) is not None

    def encode_segments(self, pieces: list[tuple[str, bool]],
                        encode_plain: Callable[[str], list[int]]) -> list[int]:
        """Encode [(text, is_template)]: special tokens recognised in template text only;
        everything else goes through encode_plain (which treats special-token text as text).

        Text between template special tokens is joined and encoded as one run, as the HF
        tokenizer does with a whole string (it splits at added tokens first), so the ids
        equal encoding the full rendering whenever client text has no special-token text.
        """
        out: list[int] = []
        run: list[str] = []

        def flush_run(strip_right: bool) -> None:
            text = "".join(run)
            run.clear()
            if strip_right:
                text = text.rstrip()
            if text:
                out.extend(encode_plain(text))

        strip_next_left = False
        for text, is_template in pieces:
            if not is_template or self._re is None:
                if strip_next_left:
                    text = text.lstrip()
                    strip_next_left = bool(text == "")
                run.append(text)
                continue
            pos = 0
            for m in self._re.finditer(text):
                chunk = text[pos:m.start()]
                if strip_next_left:
                    chunk = chunk.lstrip()
                run.append(chunk)
                sp = self._by_text[m.group(0)]
                flush_run(sp.lstrip)
                out.append(sp.token_id)
                strip_next_left = sp.rstrip
                pos = m.end()
            rest = text[pos:]
            if strip_next_left:
                rest = rest.lstrip()
                strip_next_left = bool(rest == "")
            run.append(rest)
        flush_run(False)
        return out
