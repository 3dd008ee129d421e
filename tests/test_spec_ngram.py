"""Prompt lookup drafts (engine.spec.ngram) against a plain scan of the whole token list: the
longest n-gram, the occurrence that agrees furthest back, a copy that keeps its place, a loop
drafted past the end, and the match length each proposal reports."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from colibri.engine.spec.ngram import MAX_MATCH, RESUME_MIN_MATCH, NgramDrafter


def _agree(tokens: list[int], src: int) -> int:
    """Tokens before src that equal those before the end (at most MAX_MATCH)."""
    m = 0
    while m < MAX_MATCH and m < src and tokens[src - 1 - m] == tokens[len(tokens) - 1 - m]:
        m += 1
    return m


def _from(tokens: list[int], src: int, k: int) -> list[int]:
    """k tokens from src on, the ones past the end copied from those drafted before them."""
    out: list[int] = []
    for i in range(k):
        out.append(tokens[src + i] if src + i < len(tokens) else out[src + i - len(tokens)])
    return out


def _search(tokens: list[int], min_n: int, max_n: int, max_candidates: int = 8) -> int:
    """The search written the obvious way: for n from max_n down, every earlier start j
    (j + n < len) of the last n tokens; of the latest max_candidates, the source j + n that
    agrees furthest back with the end (the latest on a tie); -1 when none."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        starts = [j for j in range(length - n) if tokens[j:j + n] == tokens[length - n:]]
        if starts:
            return max(reversed([j + n for j in starts[-max_candidates:]]),
                       key=lambda s: _agree(tokens, s))
    return -1


def _scan(tokens: list[int], k: int, min_n: int, max_n: int,
          max_candidates: int = 8) -> list[int]:
    """Drafts of a fresh search."""
    src = _search(tokens, min_n, max_n, max_candidates)
    return _from(tokens, src, k) if src >= 0 and k > 0 else []


class _Reference:
    """The whole rule the obvious way: keep following the last proposal's source while the
    tokens since then are what followed it; else search, and where nothing matches and only
    the last token differs from the source, go on past the one it replaced; (drafts, match
    length)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.src, self.at, self.match = -1, 0, 0
        self.resumed = False  # the source went on past a replaced token, unconfirmed since

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        new = len(tokens) - self.at
        if self.src >= 0 and tokens[self.src:self.src + new] == tokens[self.at:]:
            self.src, self.match = self.src + new, min(self.match + new, MAX_MATCH)
        else:
            src = _search(tokens, self.min_n, self.max_n)
            past = self.src + new  # after the token the last one replaced
            match = min(self.match + new - 1, MAX_MATCH)
            if src < 0 and self.src >= 0 and match >= RESUME_MIN_MATCH and \
                    past < len(tokens) and (new > 1 or not self.resumed) and \
                    tokens[self.src:past - 1] == tokens[self.at:-1]:
                self.src, self.match, self.resumed = past, match, True
                self.at = len(tokens)
                return _from(tokens, self.src, k), self.match
            self.src = src
            self.match = _agree(tokens, src) if src >= 0 else 0
        self.resumed = False
        self.at = len(tokens)
        if self.src < 0:
            return [], 0
        return _from(tokens, self.src, k), self.match


def test_proposes_what_followed_the_earlier_occurrence() -> None:
    d = NgramDrafter(1, 3)
    text = [5, 6, 7, 8, 9, 10, 1, 2, 5, 6, 7]
    assert d.propose(text, 3) == [8, 9, 10]
    assert d.match_len == 3
    # past the end the source is the drafts themselves: the text from 8 on, repeated
    assert d.propose(text, 10) == [8, 9, 10, 1, 2, 5, 6, 7, 8, 9]


def test_a_loop_is_drafted_whole() -> None:
    d = NgramDrafter(1, 3)
    text = [1, 9, 5, 6, 7, 5, 6, 7, 5, 6]
    assert d.propose(text, 7) == [7, 5, 6, 7, 5, 6, 7]
    assert d.match_len == 5  # the five tokens after the 9 agree with the last five


def test_the_occurrence_that_agrees_furthest_back_wins() -> None:
    # the 1-gram [3] last occurred before 40 (agreeing one token back), the 2-gram [2, 3]
    # before 20; with one n-gram size, [3] before 20 agrees two tokens back, [3] before 40 one
    text = [2, 3, 20, 21, 9, 3, 40, 41, 2, 3]
    assert NgramDrafter(1, 3).propose(text, 2) == [20, 21]
    d = NgramDrafter(1, 1)
    assert d.propose(text, 2) == [20, 21] and d.match_len == 2
    d = NgramDrafter(1, 1, max_candidates=1)  # only the latest occurrence is looked at
    assert d.propose(text, 2) == [40, 41] and d.match_len == 1


def test_most_recent_occurrence_on_a_tie() -> None:
    text = [1, 2, 10, 1, 2, 11, 7, 1, 2]
    assert NgramDrafter(2, 2).propose(text, 1) == [11]


def test_a_copy_keeps_its_place_and_its_match_grows() -> None:
    """A copy of the prompt's first line: once the drafter follows it, tokens that agree with
    the copy keep it there even where the latest occurrence of the last tokens is elsewhere,
    and the match length grows with every token that follows the source."""
    line = [10, 11, 12, 13, 14, 15, 16, 17]
    noise = [12, 13, 14, 99, 98]
    prompt = line + noise + [10, 11]
    d = NgramDrafter(1, 3, max_candidates=1)
    assert d.propose(prompt, 2) == [12, 13] and d.match_len == 2
    # the model agreed, then gave 14: the latest [12, 13, 14] is in the noise (then 99), yet
    # the copy goes on
    grown = prompt + [12, 13, 14]
    assert d.propose(grown, 3) == [15, 16, 17] and d.match_len == 5
    assert NgramDrafter(1, 3, max_candidates=1).propose(grown, 3) == [99, 98, 10]
    # a token that breaks the copy and occurs earlier: searched again
    other = NgramDrafter(1, 3, max_candidates=1)
    other.propose(grown, 3)
    assert other.propose(grown + [15, 99], 2) == [98, 10] and other.match_len == 1


def test_a_copy_goes_on_past_a_token_it_replaced() -> None:
    """A token that breaks the copy and occurs nowhere earlier replaced the source's: the
    drafts go on after that one, on the evidence of the copy before it (six tokens here), and
    the copy then keeps its place; a token that breaks a copy where none was followed, a copy
    shorter than RESUME_MIN_MATCH, or that was not the only one to differ, finds nothing."""
    line = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    prompt = line + [7, 10, 11]
    d = NgramDrafter(1, 3)
    assert d.propose(prompt, 3) == [12, 13, 14] and d.match_len == 2
    copy = prompt + [12, 13, 14, 15]
    assert d.propose(copy, 2) == [16, 17] and d.match_len == 6
    slip = copy + [50]  # 50 in place of 16
    assert d.propose(slip, 2) == [17, 18] and d.match_len == 6
    assert d.propose(slip + [17], 2) == [18, 19] and d.match_len == 7
    # a second slip at once is not taken for one: nothing confirmed the first
    again = NgramDrafter(1, 3)
    again.propose(copy, 2)
    assert again.propose(slip, 2) == [17, 18]
    assert again.propose(slip + [51], 2) == [] and again.match_len == 0
    assert NgramDrafter(1, 3).propose(slip, 2) == []  # no copy followed before the slip
    short = NgramDrafter(1, 3)  # a copy of two tokens (less than RESUME_MIN_MATCH): searched
    assert short.propose(prompt, 3) == [12, 13, 14] and short.match_len == 2
    assert short.propose(prompt + [50], 2) == [] and short.match_len == 0
    d = NgramDrafter(1, 3)
    d.propose(copy, 2)
    assert d.propose(copy + [51, 50], 2) == []  # two tokens differ from the source


def test_no_match_no_drafts() -> None:
    d = NgramDrafter(2, 3)
    assert d.propose([1, 2, 3, 4, 5], 4) == []
    assert d.match_len == 0
    assert d.propose([], 4) == []
    assert d.propose([1, 2, 1, 2], 0) == []


def test_refuses_bad_sizes_and_shrinking_lists() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(0, 2)
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError):
        NgramDrafter(1, 2, max_candidates=0)
    d = NgramDrafter()
    d.propose([1, 2, 3, 4, 1, 2], 2)
    with pytest.raises(ValueError, match="shorter"):
        d.propose([1, 2, 3], 2)


def _growing_sequences(rng: np.random.Generator, min_n: int, max_n: int,
                       ) -> Iterator[tuple[int, list[int], NgramDrafter, _Reference]]:
    """20 random starts (a small vocabulary, so n-grams repeat), each with a fresh drafter and
    reference rule: the caller grows each sequence in place as decoding does."""
    for _ in range(20):
        vocab = int(rng.integers(2, 12))
        tokens = [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 20)))]
        yield vocab, tokens, NgramDrafter(min_n, max_n), _Reference(min_n, max_n)


def _grow(rng: np.random.Generator, tokens: list[int], kept: list[int], vocab: int) -> None:
    """tokens += the kept drafts and one or two tokens of the model's own."""
    tokens += kept + [int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 3)))]


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_incremental_index_equals_a_full_scan(min_n: int, max_n: int) -> None:
    """Growing a sequence as decoding does (some of the drafts kept, then the model's token)
    gives at every length the drafts and match length of the rule written with full scans,
    and a fresh drafter those of a plain search."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    n_followed = 0
    for trial, (vocab, tokens, d, ref) in enumerate(_growing_sequences(rng, min_n, max_n)):
        for _ in range(40):
            k = int(rng.integers(1, 6))
            drafts = d.propose(tokens, k)
            assert (drafts, d.match_len) == ref.propose(tokens, k), (trial, tokens)
            assert NgramDrafter(min_n, max_n).propose(tokens, k) == _scan(tokens, k, min_n,
                                                                           max_n)
            kept = drafts[:int(rng.integers(0, len(drafts) + 1))]
            n_followed += len(kept)
            _grow(rng, tokens, kept, vocab)
    assert n_followed > 100  # the drafts were followed often enough to test continuing


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 4)])
def test_find_and_drafts_give_what_propose_gives(min_n: int, max_n: int) -> None:
    """The sequence given as two parts split anywhere (a prompt and an output), then any
    number of drafts: the match length of the reference rule and the first drafts of its
    proposal, loops included."""
    rng = np.random.default_rng(100 + min_n * 10 + max_n)
    n_matched = 0
    for trial, (vocab, tokens, d, ref) in enumerate(_growing_sequences(rng, min_n, max_n)):
        for _ in range(40):
            want, match = ref.propose(tokens, 20)
            cut = int(rng.integers(0, len(tokens) + 1))
            assert d.find(tokens[:cut], tokens[cut:]) == match == d.match_len, (trial, tokens)
            k = int(rng.integers(0, 20))
            drafts = d.drafts(k)
            assert drafts == want[:k] and all(type(t) is int for t in drafts), (trial, tokens)
            n_matched += match > 0
            _grow(rng, tokens, want[:int(rng.integers(0, len(want) + 1))] if want else [], vocab)
    assert n_matched > 200
    with pytest.raises(ValueError, match="shorter"):
        d.find(tokens[:1], [])
