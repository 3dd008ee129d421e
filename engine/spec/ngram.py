"""Prompt lookup: draft tokens for speculative decoding by finding the sequence's own recent
tokens earlier in its text (prompt and output) and proposing what followed them there.

Code edits, retrieval answers and agents quoting their inputs repeat long runs of their
prompt; there the tokens after an earlier occurrence of the last n tokens are likely next, and
the further back the two places agree, the likelier. Guarantees: drafts come only from the
sequence's own tokens (no model is run); the index grows with the tokens appended (a dict
update per token and n), so a lookup costs O(k + candidates x extension), not O(length). A
proposal whose source the tokens since then followed continues from there (a copy stays on
its place in the prompt), and a copy of RESUME_MIN_MATCH tokens at least that broke on a token
occurring nowhere earlier goes on past the token it replaced (an edit that changes a token, a
copy with a slip); otherwise the longest n (from `max_n` down to `min_n`) with an
earlier occurrence wins, and of its latest `max_candidates` occurrences the one that agrees
furthest back (the most recent on a tie). A source that runs into the sequence's end repeats
itself (a loop drafts a whole loop). Each proposal's evidence, `match_len`, is how many
tokens before the drafts agree with those before their source. Refuses nothing: no match
gives no drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_MIN_N = 1
DEFAULT_MAX_N = 3
MAX_CANDIDATES = 8  # occurrences of the matching n-gram compared, latest first
MAX_MATCH = 64  # how far back a match is followed (evidence saturates well before)
RESUME_MIN_MATCH = 4  # a copy this long at least goes on past a token the output replaced


class NgramDrafter:
    """The n-gram index of one sequence and its draft proposals.

    `propose(tokens, k)` takes the sequence's whole token list each time (it only ever grows:
    prompt then accepted output); `find(prompt, output)` takes it in its two parts, so a
    caller need not join them, and `drafts(k)` then gives the drafts, so a caller that wants
    fewer than it may have builds no more than it wants. Either way the drafter copies and
    indexes just the tokens it has not seen. After a proposal, `match_len` holds its evidence
    (0 when it found nothing).
    """

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N,
                 max_candidates: int = MAX_CANDIDATES) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be at least 1, got {max_candidates}")
        self.min_n = min_n
        self.max_n = max_n
        self.max_candidates = max_candidates
        # per n: n-gram -> the positions just after its occurrences whose next token is
        # known, in order (so the sequence's own suffix never matches itself)
        self._after: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(min_n, max_n + 1)}
        self._seq: list[int] = []  # the sequence as far as seen
        self._tables = sorted(self._after.items())  # (n, its table), n ascending
        self._n_indexed = 0  # _seq[:_n_indexed] have had their n-grams indexed
        self.match_len = 0
        self._src = -1  # where the last proposal's drafts came from (-1: none)
        self._at = 0  # the sequence's length at the last proposal
        self._match = 0  # and its match length
        self._resumed = False  # and whether it went on past a replaced token

    @staticmethod
    def _agree(tokens: Sequence[int], src: int, length: int, skip: int) -> int:
        """How many tokens before src agree with those before length (src < length), the
        first `skip` known to: at most MAX_MATCH."""
        n = skip
        while n < MAX_MATCH and n < src and tokens[src - 1 - n] == tokens[length - 1 - n]:
            n += 1
        return n

    def _search(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(source, match length) of the best earlier occurrence of a suffix; (-1, 0)."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            starts = self._after[n].get(tuple(tokens[length - n:]))
            if starts:
                best, best_len = -1, -1
                for src in reversed(starts[-self.max_candidates:]):
                    m = self._agree(tokens, src, length, n)
                    if m > best_len:
                        best, best_len = src, m
                return best, best_len
        return -1, 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the source of a suffix of tokens (see the module);
        [] when none matches."""
        self.match_len = 0
        if k <= 0 or not tokens:
            return []
        self.find(tokens)
        return self.drafts(k)

    def find(self, head: Sequence[int], tail: Sequence[int] = ()) -> int:
        """Look up the source of the sequence head + tail (see the module) for drafts(k); its
        match length, 0 when none matches."""
        # one function, not one per part: it runs for every sequence at every step, mostly
        # on caches the forward pass has just emptied, where each call costs more than its
        # work
        tokens = self._seq  # append what head + tail holds past it
        n_seen, n_head = len(tokens), len(head)
        length = n_head + len(tail)
        if length < n_seen:
            raise ValueError("the token list is shorter than in the previous call")
        if n_seen < n_head:
            tokens += map(int, head[n_seen:])
            tokens += map(int, tail)
        elif n_seen < length:
            tokens += map(int, tail[n_seen - n_head:])
        self.match_len = 0
        if not length:
            return 0
        start = self._n_indexed  # index the n-grams whose next token is new
        for p in range(start + 1, length):  # p: the position after the n-gram
            for n, table in self._tables:
                if p < n:
                    break
                key = tuple(tokens[p - n:p])
                at = table.get(key)
                if at is None:
                    table[key] = [p]
                else:
                    at.append(p)
        self._n_indexed = max(start, length - 1)
        src, at = self._src, self._at
        grown = length - at
        resumed = False
        if src >= 0 and tokens[src:src + grown] == tokens[at:]:  # the source goes on
            src, match = src + grown, min(self._match + grown, MAX_MATCH)
        elif length < self.min_n or tuple(tokens[length - self.min_n:]) not in \
                self._after[self.min_n]:
            # no suffix occurs earlier (an occurrence of a longer one holds the shortest): the
            # source broke on a token seen nowhere before; a copy long enough goes on past the
            # token it replaced, on the evidence it had (not again before a token confirms it)
            match = min(self._match + grown - 1, MAX_MATCH)
            if src >= 0 and match >= RESUME_MIN_MATCH and src + grown < length and \
                    (grown > 1 or not self._resumed) and \
                    tokens[src:src + grown - 1] == tokens[at:length - 1]:
                src, resumed = src + grown, True
            else:
                src, match = -1, 0
        else:
            src, match = self._search(tokens)
        self._src, self._at, self._match, self._resumed = src, length, match, resumed
        if src >= 0:
            self.match_len = match
        return self.match_len

    def drafts(self, k: int) -> list[int]:
        """k tokens from the source the last find found ([] when it found none): the
        sequence from there on, and past its end the drafts themselves (a loop repeats)."""
        src, length = self._src, self._at
        if k <= 0 or src < 0:
            return []
        if src + k <= length:
            return self._seq[src:src + k]
        loop = self._seq[src:length]
        return (loop * (k // len(loop) + 1))[:k]
