"""colibri.engine.sample.batch.sample_rows against the per-sequence Sampler (the specification): the
same tokens, logprobs and random draws for every row, whatever the other rows are."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.engine.sample.batch import sample_rows
from colibri.engine.sample.sampler import Sampler, SampleResult, SamplingParams


def _same(a: SampleResult, b: SampleResult) -> bool:
    """Bit-identical token, logprob and top logprobs; b is Sampler's, whose top logprobs may
    list masked (-inf) tokens, which the batched sampler leaves out by design."""
    top = None if b.top_logprobs is None else [(t, lp) for t, lp in b.top_logprobs
                                               if lp > -np.inf]
    return a.token_id == b.token_id and a.logprob == b.logprob and a.top_logprobs == top


@st.composite
def _params(draw: st.DrawFn, vocab: int) -> SamplingParams:
    temperature = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0, 1.7]) | st.floats(0.05, 2.0))
    top_k = draw(st.sampled_from([-1, 0, 1, 2, 7, 40, vocab - 1, vocab, vocab + 5]))
    top_p = draw(st.sampled_from([1.0, 0.99, 0.95, 0.9, 0.5, 0.1, 1e-9]))
    min_p = draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.3, 1.0]))
    pen = draw(st.booleans())
    bias = draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=4))
    p = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])) if pen else 0.0,
        frequency_penalty=draw(st.sampled_from([0.0, 0.3, 2.0])) if pen else 0.0,
        repetition_penalty=draw(st.sampled_from([1.0, 1.1, 0.8, 3.0])) if pen else 1.0,
        seed=draw(st.none() | st.integers(-(2**70), 2**70)),
        logit_bias=bias,
        logprobs=draw(st.none() | st.integers(0, 20)),
    )
    if p.seed is None:
        p.seed = draw(st.integers(0, 2**32))  # the comparison needs reproducible streams
    p.validate(vocab)
    return p


def _logits(rng: np.random.Generator, n: int, vocab: int, kind: str) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal((n, vocab)) * rng.uniform(0.1, 6.0)).astype(np.float32)
    if kind == "ties":  # few distinct values: ties at every cut
        return rng.integers(-3, 4, (n, vocab)).astype(np.float32)
    if kind == "flat":  # top_p needs more than the first candidate set
        return (rng.standard_normal((n, vocab)) * 0.3).astype(np.float32)
    x = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    x[rng.random((n, vocab)) < 0.7] = -np.inf  # masked, as a constraint leaves them
    x[:, rng.integers(0, vocab)] = 1.0  # keep a finite token in every row
    return x


def _run_case(data: st.DataObject, vocab: int, n_rows: int) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    params = [data.draw(_params(vocab)) for _ in range(n_rows)]
    prompts = [rng.integers(0, vocab, rng.integers(1, 30)).tolist() for _ in range(n_rows)]
    spec = [Sampler(copy.deepcopy(p), vocab) for p in params]
    batch = [Sampler(copy.deepcopy(p), vocab) for p in params]
    alone = [Sampler(copy.deepcopy(p), vocab) for p in params]
    hist = [list(h) for h in prompts]
    for _step in range(3):
        kind = data.draw(st.sampled_from(["normal", "ties", "flat", "masked"]))
        logits = _logits(rng, n_rows, vocab, kind)
        want = [s.sample(logits[i], hist[i]) for i, s in enumerate(spec)]
        got = sample_rows(logits, batch, hist)
        for i in range(n_rows):
            solo = sample_rows(logits[i:i + 1], [alone[i]], [hist[i]])[0]
            assert got[i].error is None and solo.error is None
            assert _same(got[i].result, want[i]), (i, params[i], kind)
            assert _same(solo.result, want[i]), (i, params[i], kind)
        for i in range(n_rows):
            hist[i].append(want[i].token_id)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([5, 64, 300]), st.integers(1, 9))
def test_rows_match_sampler_small_vocab(data: st.DataObject, vocab: int, n_rows: int) -> None:
    _run_case(data, vocab, n_rows)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([1500, 20000]), st.integers(1, 6))
def test_rows_match_sampler_large_vocab(data: st.DataObject, vocab: int, n_rows: int) -> None:
    """Vocabularies past the first top_p candidate set (1024) and its first widening."""
    _run_case(data, vocab, n_rows)


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.2,
         repetition_penalty=1.1),
    dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.02, logprobs=5),
    dict(temperature=0.7, min_p=0.05),
    dict(temperature=1.3),
])
def test_full_size_batch_matches_sampler_and_solo(scale: float, params: dict) -> None:
    """16 rows of a 32000-token vocabulary, from peaked to flat (the widest nucleus)."""
    vocab, n_rows = 32000, 16
    rng = np.random.default_rng(7)
    mk = [lambda i: Sampler(SamplingParams(seed=100 + i, **params), vocab)] * 3
    spec, batch, alone = ([f(i) for i in range(n_rows)] for f in mk)
    hist = [rng.integers(0, vocab, 20).tolist() for _ in range(n_rows)]
    for _step in range(2):
        logits = (rng.standard_normal((n_rows, vocab)) * scale).astype(np.float32)
        want = [s.sample(logits[i], hist[i]) for i, s in enumerate(spec)]
        got = sample_rows(logits, batch, hist)
        for i in range(n_rows):
            solo = sample_rows(logits[i:i + 1], [alone[i]], [hist[i]])[0].result
            assert _same(got[i].result, want[i]) and _same(solo, want[i])
            hist[i].append(want[i].token_id)


def test_row_order_and_batch_size_do_not_matter() -> None:
    vocab = 4096
    rng = np.random.default_rng(3)
    params = [SamplingParams(temperature=0.9, top_p=p, top_k=k, seed=s)
              for p, k, s in [(0.95, -1, 1), (0.5, 20, 2), (1.0, -1, 3), (0.99, 2000, 4)]]
    logits = (rng.standard_normal((4, vocab)) * 0.5).astype(np.float32)
    ref = sample_rows(logits, [Sampler(p, vocab) for p in params], [[0]] * 4)
    perm = [2, 0, 3, 1]
    got = sample_rows(logits[perm], [Sampler(params[j], vocab) for j in perm], [[0]] * 4)
    for i, j in enumerate(perm):
        assert _same(got[i].result, ref[j].result)


class _Allow:
    """A constraint that allows only the given tokens."""

    def __init__(self, allowed: list[int], fail: bool = False) -> None:
        self.allowed = allowed
        self.fail = fail

    def apply(self, row: np.ndarray) -> None:
        if self.fail:
            raise RuntimeError("constraint failed")
        mask = np.ones(row.shape[0], dtype=bool)
        mask[self.allowed] = False
        row[mask] = -np.inf


def test_constraints_and_row_errors_stay_in_their_row() -> None:
    vocab = 2000
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((5, vocab)) * 2).astype(np.float32)
    logits[3, 10] = np.nan
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(5)]
    params[1].constraint = _Allow([7, 1500, 1999])  # type: ignore[attr-defined]
    params[2].constraint = _Allow([1], fail=True)  # type: ignore[attr-defined]
    params[4].constraint = _Allow([42])  # type: ignore[attr-defined]
    samplers = [Sampler(p, vocab) for p in params]
    out = sample_rows(logits, samplers, [[0, 1]] * 5)
    assert isinstance(out[2].error, RuntimeError) and out[2].result is None
    assert isinstance(out[3].error, ValueError) and out[3].result is None
    assert out[1].result is not None and out[1].result.token_id in (7, 1500, 1999)
    assert out[4].result is not None and out[4].result.token_id == 42
    # the healthy rows equal Sampler on the constrained logits
    for i in (0, 1, 4):
        x = logits[i].copy()
        if i in (1, 4):
            params[i].constraint.apply(x)  # type: ignore[attr-defined]
        want = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=i), vocab).sample(x, [0, 1])
        assert _same(out[i].result, want)


def test_fully_masked_row_fails_alone() -> None:
    vocab = 100
    logits = np.zeros((2, vocab), dtype=np.float32)
    params = [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, seed=0)]
    params[0].constraint = _Allow([])  # type: ignore[attr-defined]
    out = sample_rows(logits, [Sampler(p, vocab) for p in params], [[0], [0]])
    assert out[0].error is not None and out[1].result is not None


def test_penalty_counts_advance_like_sampler() -> None:
    vocab = 500
    rng = np.random.default_rng(9)
    p = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7,
                       repetition_penalty=1.3)
    spec, batch = Sampler(p, vocab), Sampler(p, vocab)
    hist = rng.integers(0, vocab, 40).tolist()
    for _ in range(20):
        logits = (rng.standard_normal(vocab) * 0.2).astype(np.float32)
        want = spec.sample(logits, hist)
        got = sample_rows(logits[None], [batch], [hist])[0].result
        assert _same(got, want)
        hist.append(want.token_id)
    assert np.array_equal(spec._counts, batch._counts)
    assert np.array_equal(spec._seen, batch._seen)
