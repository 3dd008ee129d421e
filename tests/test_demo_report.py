"""The measures of scripts/demo_model_report.py: loop detection and the word split."""

from __future__ import annotations

from tests.scripts_loader import load_script


def _report():  # noqa: ANN202
    return load_script("demo_model_report")


def test_loops_are_blocks_repeated_three_times() -> None:
    r = _report()
    stage = [11, 12, 13, 14, 15, 16, 17]  # "[Enter PUTLAT.]\n\n" three times over
    assert r.longest_loop([1, 2] + stage * 3 + [3]) == (21, 7, 3)
    assert r.is_loop([1, 2] + stage * 3 + [3])
    assert not r.is_loop([1, 2] + stage * 2 + [3])  # twice is a refrain, not a loop
    assert r.is_loop([5] * 12) and not r.is_loop([5] * 11)  # too short to count
    assert not r.is_loop(list(range(60)))
    assert r.longest_loop([]) == (0, 0, 0)


def test_words_keep_inner_apostrophes() -> None:
    r = _report()
    assert r.words_of("O'er the hills, ne'er--'tis THEE.") == ["o'er", "the", "hills", "ne'er",
                                                               "tis", "thee"]


def test_seq_rep_counts_repeated_four_grams() -> None:
    r = _report()
    assert r.seq_rep(list(range(10))) == 0.0
    assert r.seq_rep([1, 2, 3, 4] * 3) == 1.0 - 4 / 9  # 9 four-grams, 4 distinct
    assert r.seq_rep([1, 2]) == 0.0
