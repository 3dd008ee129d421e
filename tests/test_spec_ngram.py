"""Prompt lookup drafts (engine.spec.ngram) against a plain scan of the whole token list."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.engine.spec.ngram import NgramDrafter


def _scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule written the obvious way: for n from max_n down, the latest earlier start j
    (j + n < len) with tokens[j:j+n] equal to the last n tokens; the k tokens after it."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for j in range(length - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


def test_proposes_what_followed_the_earlier_occurrence() -> None:
    d = NgramDrafter(1, 3)
    text = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert d.propose(text, 3) == [8, 9, 10]
    assert d.propose(text, 10) == [8, 9, 10, 1, 2, 5, 6, 7]  # up to the end, never past it


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    # the 1-gram [3] last occurred before 40, the 2-gram [2, 3] before 20
    text = [2, 3, 20, 21, 9, 3, 40, 41, 2, 3]
    assert NgramDrafter(1, 3).propose(text, 2) == [20, 21]
    assert NgramDrafter(1, 1).propose(text, 2) == [40, 41]


def test_most_recent_occurrence_of_the_same_n() -> None:
    text = [1, 2, 10, 1, 2, 11, 7, 1, 2]
    assert NgramDrafter(2, 2).propose(text, 1) == [11]


def test_no_match_no_drafts() -> None:
    d = NgramDrafter(2, 3)
    assert d.propose([1, 2, 3, 4, 5], 4) == []
    assert d.propose([], 4) == []
    assert d.propose([1, 2, 1, 2], 0) == []


def test_refuses_bad_sizes_and_shrinking_lists() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(0, 2)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    d = NgramDrafter()
    d.propose([1, 2, 3, 4, 1, 2], 2)
    with pytest.raises(ValueError, match="shorter"):
        d.propose([1, 2, 3], 2)


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_incremental_index_equals_a_full_scan(min_n: int, max_n: int) -> None:
    """Growing a sequence a few tokens at a time (as decoding does, accepted drafts included)
    gives at every length the drafts of a full scan of the list so far."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    for trial in range(20):
        vocab = int(rng.integers(2, 12))
        tokens = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 20)))]
        d = NgramDrafter(min_n, max_n)
        for _ in range(40):
            k = int(rng.integers(1, 6))
            assert d.propose(tokens, k) == _scan(tokens, k, min_n, max_n), (trial, tokens)
            tokens += [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 4)))]
