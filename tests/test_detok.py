"""Incremental detokenization and stop strings, on a real byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from colibri.engine.text.bpe import train_bpe_tokenizer
from colibri.engine.text.detok import IncrementalDetokenizer, StopStringMatcher
from colibri.engine.text.tokenizer import Tokenizer

CORPUS = [
    "Hello world, this is a test of the tokenizer. The quick brown fox jumps over the dog.",
    "Héllo wörld, café naïve résumé. 日本語のテキスト。中文文本。😀🎉👍🏽",
] * 20 + [f"line {i}: some words" for i in range(100)]

MULTIBYTE_TEXTS = [
    "😀🎉👍🏽❤️🚀",
    "日本語のテキストです。中文文本测试。한국어 텍스트",
    "Héllo wörld café naïve résumé señor über Ça Ñandú",
    "mixed 😀 text 日本 with café and 🏳️‍🌈 flags\n\tend",
    "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(CORPUS, 300, d)
    return Tokenizer.from_dir(d)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(t) for t in ids] + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_never_split(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    # The test is only meaningful if characters really are split across tokens.
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    pieces = _stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert pieces[-1] == ""  # nothing was left for flush: every character completed


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_with_prompt_context(tok: Tokenizer, text: str) -> None:
    prompt = np.array(tok.encode("Some prompt 日本 😀"), dtype=np.int32)  # any int sequence
    ids = tok.encode(text)
    pieces = _stream(IncrementalDetokenizer(tok, prompt_ids=prompt), ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hi 😀") + [2] + tok.encode("日本") + [0, 1]
    for skip in (True, False):
        pieces = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)


def test_many_skipped_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("a") + [2] * 100 + tok.encode("b 😀")
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "ab 😀"


def test_truncated_character_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    head = ids[:-1]  # ends in the middle of the emoji's bytes
    assert tok.decode(head).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push(t) for t in head)
    assert "\ufffd" not in pushed
    assert pushed + detok.flush() == tok.decode(head)


def test_invalid_bytes_do_not_stall(tok: Tokenizer) -> None:
    # A lone continuation byte repeated: never valid UTF-8, so the held-back window must be
    # released rather than grow forever; the total still equals decode(all).
    cont = next(t for t in range(tok.vocab_size) if tok.id_to_piece(t) == "\u0140")  # byte 0x80
    assert tok.decode([cont]) == "\ufffd"
    ids = [cont] * 100 + tok.encode("fine")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    assert sum(len(p) for p in pieces[:50]) > 0
    assert "".join(pieces) + detok.flush() == tok.decode(ids)


class _CountingTokenizer:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_linear_work(tok: Tokenizer) -> None:
    ids = tok.encode(" ".join(MULTIBYTE_TEXTS) * 40)
    counter = _CountingTokenizer(tok)
    pieces = _stream(IncrementalDetokenizer(counter, prompt_ids=ids[:100]), ids)
    assert "".join(pieces) == tok.decode(ids)
    assert counter.decoded < 40 * len(ids)  # a fixed window per token, not the whole sequence


def test_random_splits_match_decode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    alphabet = "abc é日本😀👍🏽\n"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(text)
        pieces = _stream(IncrementalDetokenizer(tok), ids)
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == text


# --- stop strings ----------------------------------------------------------------------------


def _run(stops: list[str], chunks: list[str]) -> tuple[str, bool, list[str]]:
    m = StopStringMatcher(stops)
    out: list[str] = []
    stopped = False
    for c in chunks:
        emit, stopped = m.push(c)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
        stopped = m.stopped
    return "".join(out), stopped, out


def test_stop_spanning_chunks() -> None:
    text, stopped, out = _run(["STOP"], ["Hello S", "T", "O", "P and more"])
    assert (text, stopped) == ("Hello ", True)
    assert out[0] == "Hello "  # "S" held back: it may start the stop string


def test_several_stops_earliest_wins() -> None:
    assert _run(["world", "lo"], ["hello world"])[:2] == ("hel", True)
    assert _run(["xyz", "b"], ["a", "xy", "zb"])[:2] == ("a", True)


def test_stop_at_very_start() -> None:
    assert _run(["<end>"], ["<e", "nd>", "more"])[:2] == ("", True)
    assert _run(["a"], ["abc"])[:2] == ("", True)


def test_partial_match_released() -> None:
    text, stopped, out = _run(["STOP"], ["Hello ST", "ART", " again"])
    assert (text, stopped) == ("Hello START again", False)
    assert out[0] == "Hello "
    assert out[1] == "START"


def test_partial_released_at_flush() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.push("end ST") == ("end ", False)
    assert m.flush() == "ST"
    assert not m.stopped


def test_longer_stop_starting_earlier_wins() -> None:
    # "bc" completes first, but "abcd" starts earlier and completes with the next chunk.
    assert _run(["abcd", "bc"], ["xab", "c", "d"])[:2] == ("x", True)
    assert _run(["abcd", "bc"], ["xab", "c", "e"])[:2] == ("xa", True)
    m = StopStringMatcher(["abcd", "bc"])
    assert m.push("xabc") == ("x", False)
    assert m.flush() == "a" and m.stopped


def test_matched_names_the_stop_that_ended_the_stream() -> None:
    def matched(stops: list[str], chunks: list[str]) -> str | None:
        m = StopStringMatcher(stops)
        for c in chunks:
            if m.push(c)[1]:
                return m.matched
        m.flush()
        return m.matched

    assert matched(["world", "lo"], ["hello world"]) == "lo"
    assert matched(["abcd", "bc"], ["xab", "c", "d"]) == "abcd"
    assert matched(["abcd", "bc"], ["xab", "c", "e"]) == "bc"
    assert matched(["abcd", "bc"], ["xabc"]) == "bc"  # found at flush
    assert matched(["STOP"], ["Hello ST", "ART"]) is None


def test_after_stop_nothing_more() -> None:
    m = StopStringMatcher(["."])
    assert m.push("one. two") == ("one", True)
    assert m.push("three") == ("", True)
    assert m.flush() == ""


def test_no_stops_passthrough() -> None:
    m = StopStringMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.flush() == ""


def test_empty_stop_refused() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_stop_random_against_reference() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab😀") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        full = "".join(rng.choice("abc😀") for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(full) + 1), min(len(full) + 1, rng.randint(0, 5))))
        chunks = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)], strict=True)]
        hits = [i for i in (full.find(s) for s in stops) if i >= 0]
        expected = full[: min(hits)] if hits else full
        longest = max(len(s) for s in stops)
        m = StopStringMatcher(stops)
        out, fed, stopped = "", "", False
        for c in chunks:
            emit, stopped = m.push(c)
            out += emit
            fed += c
            if stopped:
                break
            # Held back: at most the longest stop minus one character, unless a shorter stop
            # already matched and a longer one starting earlier is still undecided.
            held = len(fed) - len(out)
            assert held <= longest - 1 or any(s in fed[len(out):] for s in stops)
        if not stopped:
            out += m.flush()
        assert out == expected, (stops, chunks)
        assert m.stopped == bool(hits)
