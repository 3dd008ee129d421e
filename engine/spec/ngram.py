"""Prompt lookup: draft tokens for speculative decoding by finding the sequence's own recent
tokens earlier in its text (prompt and output) and proposing what followed them there.

Code edits, retrieval answers and agents quoting their inputs repeat long runs of their
prompt; there the tokens after an earlier occurrence of the last n tokens are likely next.
Guarantees: drafts come only from the sequence's own tokens (no model is run); the index
grows with the tokens appended (a dict update per token and n), so a lookup costs O(k), not
O(length). The longest n (from `max_n` down to `min_n`) with an earlier occurrence wins, and of
its occurrences the most recent. Refuses nothing: no match gives no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MIN_N = 1
DEFAULT_MAX_N = 3


class NgramDrafter:
    """The n-gram index of one sequence and its draft proposals.

    `propose(tokens, k)` takes the sequence's whole token list each time (it only ever grows:
    prompt then accepted output); the index reads just the new tail.
    """

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # per n: n-gram -> the position just after its most recent occurrence whose next
        # token is known (so the sequence's own suffix never matches itself)
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in
                                                             range(min_n, max_n + 1)}
        self._n_indexed = 0  # tokens[:_n_indexed] have had their n-grams indexed

    def _index(self, tokens: Sequence[int]) -> None:
        # the n-gram ending at position i is indexed once token i + 1 exists
        end = len(tokens) - 1
        if end < self._n_indexed:
            if len(tokens) < self._n_indexed:
                raise ValueError("the token list is shorter than in the previous call")
            return
        for i in range(self._n_indexed, end):
            for n, table in self._after.items():
                if i + 1 >= n:
                    table[tuple(tokens[i + 1 - n:i + 1])] = i + 1
        self._n_indexed = end

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        matching suffix of tokens (n from max_n down to min_n); [] when none matches."""
        if k <= 0 or not tokens:
            return []
        self._index(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._after[n].get(tuple(tokens[length - n:]))
            if start is not None:
                return [int(t) for t in tokens[start:min(start + k, length)]]
        return []
