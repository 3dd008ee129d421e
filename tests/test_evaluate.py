"""colibri.engine.tools.evaluate: sliding-window perplexity, the unigram baseline, the demo
validation text."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri.engine.tools.evaluate import perplexity, unigram_perplexity, window_plan

PLAN_CASES = [
    (2, 2, 1), (5, 8, 4), (8, 8, 4), (9, 8, 4), (100, 8, 4), (100, 8, 1), (100, 8, 7),
    (101, 16, 5), (1000, 64, 32), (17, 3, 2), (64, 64, 63),
]


@pytest.mark.parametrize(("n", "window", "stride"), PLAN_CASES)
def test_window_plan_scores_every_token_once(n: int, window: int, stride: int) -> None:
    plan = window_plan(n, window, stride)
    scored = []
    for begin, end, first in plan:
        assert 0 <= begin < first <= end <= n
        assert end - begin == min(window, n)  # every window is full (equal lengths batch)
        scored.extend(range(first, end))
        if begin > 0:
            assert first - begin >= window - stride  # later windows keep enough context
    assert scored == list(range(1, n))
    if n > window:
        assert all(e - f <= stride for _, e, f in plan[1:])


@pytest.mark.parametrize(("n", "window", "stride"), [(1, 8, 4), (10, 1, 1), (10, 8, 0),
                                                      (10, 8, 8), (10, 8, -1)])
def test_window_plan_refuses_bad_arguments(n: int, window: int, stride: int) -> None:
    with pytest.raises(ValueError):
        window_plan(n, window, stride)


@pytest.mark.parametrize("vocab", [7, 4096])
@pytest.mark.parametrize(("n", "window", "stride"), [(50, 16, 8), (50, 64, 32), (333, 32, 5)])
def test_uniform_logits_give_vocab_size(vocab: int, n: int, window: int, stride: int) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=n)

    def uniform(chunk: list[int]) -> np.ndarray:
        return np.full((len(chunk), vocab), 3.25, dtype=np.float32)

    ppl = perplexity(uniform, ids, window=window, stride=stride, progress=False)
    assert ppl == pytest.approx(vocab, rel=1e-12)


def test_each_token_scored_once_with_its_own_probability() -> None:
    # Token ids are their absolute positions, so a "model" that sees only its window still
    # knows where it is; it gives the true next token a position-specific probability.
    n, vocab = 203, 256
    ids = np.arange(n)
    p_true = 0.05 + 0.9 * (np.arange(n) % 11) / 10.0  # p of token at position t
    calls: list[list[int]] = []

    def model(chunk: list[int]) -> np.ndarray:
        calls.append(list(chunk))
        out = np.zeros((len(chunk), vocab), dtype=np.float64)
        for i, tok in enumerate(chunk):
            t = tok + 1  # the position this row predicts
            if t < n:
                p = p_true[t]
                # true token gets p, the other vocab-1 tokens share 1-p evenly
                out[i, :] = math.log((1 - p) / (vocab - 1))
                out[i, t] = math.log(p)
        return out.astype(np.float32)

    for window, stride in [(32, 16), (32, 31), (32, 1), (300, 150)]:
        calls.clear()
        ppl = perplexity(model, ids, window=window, stride=stride, progress=False)
        expected = math.exp(-np.mean(np.log(p_true[1:])))
        assert ppl == pytest.approx(expected, rel=1e-5)
        plan = window_plan(n, window, stride)
        assert calls == [list(range(b, e)) for b, e, _ in plan]  # fresh windows, in order


def test_context_is_used() -> None:
    # A model that is right only when it has seen at least 4 tokens of context: longer
    # windows (more context per scored token) must give a lower perplexity.
    vocab = 16
    ids = np.array([i % vocab for i in range(400)])

    def needs_context(chunk: list[int]) -> np.ndarray:
        out = np.zeros((len(chunk), vocab), dtype=np.float32)
        for i, tok in enumerate(chunk):
            if i >= 3:
                out[i, (tok + 1) % vocab] = 8.0
        return out

    short = perplexity(needs_context, ids, window=8, stride=7, progress=False)
    long = perplexity(needs_context, ids, window=8, stride=4, progress=False)
    assert long < short


def test_bad_logits_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        perplexity(lambda c: np.zeros((len(c) - 1, 5)), np.arange(20) % 5, window=8,
                   progress=False)


def test_unigram_baseline() -> None:
    vocab = 4
    train = [0, 0, 0, 1, 1, 2]  # add-one: counts+1 = 4, 3, 2, 1 over 10
    ev = [3, 0, 1, 2]
    expected = math.exp(-(math.log(0.4) + math.log(0.3) + math.log(0.2)) / 3)
    assert unigram_perplexity(train, ev, vocab) == pytest.approx(expected, rel=1e-12)
    flat = np.repeat(np.arange(vocab), 5)
    assert unigram_perplexity(flat, [1, 2, 3, 0, 1], vocab) == pytest.approx(vocab, rel=1e-12)


# -- `colibri eval` end to end on a tiny random Mixtral, against transformers --------------

@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory):
    from tests.tiny_models import make_checkpoint

    return make_checkpoint("mixtral", tmp_path_factory.mktemp("hf") / "tiny-mixtral", seed=3)


@pytest.fixture
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))


def run_eval(argv: list[str]) -> int:
    import argparse

    from colibri.engine.tools.evaluate import add_eval_parser

    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *argv])
    return args.func(args)


def printed_perplexity(out: str) -> float:
    lines = [ln for ln in out.splitlines() if ln.startswith("perplexity: ")]
    assert len(lines) == 1, out
    return float(lines[0].split(": ")[1])


@pytest.mark.slow  # a transformers run; the command's quick test is on the demo data set
def test_eval_command_matches_transformers(tiny_hf, cache, tmp_path, capsys) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    text = ("Once upon a time there was a little hummingbird who lived in a garden. " * 12
            + "The weather today is sunny with a light breeze from the west.\n") * 2
    path = tmp_path / "text.txt"
    path.write_text(text)
    assert run_eval(["--model", str(tiny_hf), "--quant", "f32", "--text", str(path),
                     "--window", "64", "--threads", "1", "--kv-cache-type", "f32",
                     "--no-progress"]) == 0
    ours = printed_perplexity(capsys.readouterr().out)

    ids = Tokenizer.from_file(str(tiny_hf / "tokenizer.json")).encode(text).ids
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval()

    def hf(chunk: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(input_ids=torch.tensor([chunk])).logits[0].numpy()

    ref = perplexity(hf, ids, window=64, stride=32, progress=False)
    assert len(ids) > 200
    # f32 weights: the engine's logits match transformers to ~1e-6; the printout keeps 4
    # decimals
    assert ours == pytest.approx(ref, rel=2e-5)


def test_eval_command_on_the_demo_dataset(tiny_hf, cache, capsys) -> None:
    assert run_eval(["--model", str(tiny_hf), "--quant", "q8", "--dataset", "demo-validation",
                     "--window", "64", "--score-tokens", "300", "--threads", "1",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tokens: 300" in out
    assert 1.0 < printed_perplexity(out) < 1e6


def test_demo_validation_text_is_the_held_out_plays() -> None:
    import gzip

    from colibri.engine.llm import default_model_path
    from colibri.engine.tools.evaluate import VALIDATION_FILE, demo_validation_text

    text = demo_validation_text()
    shipped = default_model_path() / VALIDATION_FILE
    if shipped.is_file():  # the bundled model's copy is what it reads first
        assert gzip.decompress(shipped.read_bytes()).decode() == text
    assert text.startswith("JULIUS CAESAR")
    assert "TWELFTH NIGHT" in text and "KING RICHARD THE SECOND" in text
    assert 300_000 < len(text) < 500_000
