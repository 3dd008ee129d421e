"""colibri.engine.sample.sampler: parameter validation and the sampler against plain numpy
references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri.engine.sample.sampler import (
    MAX_STOP_STRINGS,
    Sampler,
    SamplingParamError,
    SamplingParams,
)

V = 64


def _logits(seed: int = 0, n: int = V, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _sampler(**kw) -> Sampler:
    p = SamplingParams(**kw)
    p.validate(V)
    return Sampler(p, V)


def _draws(n: int, logits: np.ndarray, **kw) -> np.ndarray:
    s = _sampler(**kw)
    return np.array([s.sample(logits, [0]).token_id for _ in range(n)])


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


# --- greedy, seeds -------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    for seed in range(20):
        x = _logits(seed)
        assert _sampler(temperature=0.0).sample(x, [1, 2]).token_id == int(np.argmax(x))


def test_greedy_ties_lowest_id() -> None:
    x = np.zeros(V, dtype=np.float32)
    x[[7, 3, 40]] = 5.0
    assert _sampler(temperature=0.0).sample(x, []).token_id == 3
    assert _sampler(top_k=1, seed=1).sample(x, []).token_id == 3


def test_top_k_1_is_greedy() -> None:
    for seed in range(20):
        x = _logits(seed)
        assert _sampler(top_k=1, seed=seed).sample(x, [0]).token_id == int(np.argmax(x))


def test_seed_reproducible() -> None:
    x = _logits(3, scale=0.5)  # flat enough that draws vary
    a = _draws(200, x, seed=1234, top_p=0.95)
    b = _draws(200, x, seed=1234, top_p=0.95)
    c = _draws(200, x, seed=4321, top_p=0.95)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(set(a.tolist())) > 10


def test_negative_and_huge_seeds() -> None:
    x = _logits(3, scale=0.5)
    for seed in (-1, -(2**70), 2**80):
        assert np.array_equal(_draws(50, x, seed=seed), _draws(50, x, seed=seed))


def test_no_seed_uses_entropy() -> None:
    x = _logits(3, scale=0.5)
    assert not np.array_equal(_draws(100, x), _draws(100, x))


# --- filtering: statistical checks with a fixed seed ---------------------------------------


def _freq(draws: np.ndarray, n: int = V) -> np.ndarray:
    return np.bincount(draws, minlength=n) / draws.size


def _assert_close(freq: np.ndarray, probs: np.ndarray, n: int) -> None:
    sigma = np.sqrt(probs * (1 - probs) / n)
    assert np.all(np.abs(freq - probs) <= 5 * sigma + 1e-12), (freq, probs)


N_DRAWS = 10000


def test_plain_sampling_follows_softmax() -> None:
    x = _logits(5, n=8, scale=1.0)
    s = Sampler(SamplingParams(seed=7, temperature=0.7), 8)
    draws = np.array([s.sample(x, []).token_id for _ in range(N_DRAWS)])
    probs = np.exp(_log_softmax64(x / 0.7))
    _assert_close(_freq(draws, 8), probs, N_DRAWS)


def test_top_k_excludes() -> None:
    x = _logits(6, scale=1.0)
    draws = _draws(N_DRAWS, x, seed=11, top_k=5)
    top5 = np.argsort(-x)[:5]
    assert set(draws.tolist()) == set(top5.tolist())
    probs = np.zeros(V)
    probs[top5] = np.exp(_log_softmax64(x[top5]))
    _assert_close(_freq(draws), probs, N_DRAWS)


def test_top_p_excludes() -> None:
    probs = np.array([0.5, 0.25, 0.15, 0.06, 0.04])
    x = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(seed=3, top_p=0.7), 5)
    draws = np.array([s.sample(x, []).token_id for _ in range(N_DRAWS)])
    # 0.5 < 0.7 so token 1 (crossing 0.7) is kept; token 2 starts at 0.75 >= 0.7: dropped.
    expected = np.array([0.5, 0.25, 0, 0, 0]) / 0.75
    assert set(draws.tolist()) == {0, 1}
    _assert_close(_freq(draws, 5), expected, N_DRAWS)


def test_top_p_large_vocab_wide_nucleus() -> None:
    # A flat distribution over a big vocabulary exercises the widening candidate search.
    n = 50_000
    x = _logits(9, n=n, scale=0.3)
    s = Sampler(SamplingParams(seed=5, top_p=0.9), n)
    p = np.exp(_log_softmax64(x))
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    allowed = set(order[before < 0.9].tolist())
    draws = [s.sample(x, []).token_id for _ in range(60)]
    assert set(draws) <= allowed
    assert len(allowed) < n


def test_min_p_excludes() -> None:
    probs = np.array([0.5, 0.3, 0.12, 0.05, 0.03])
    x = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(seed=4, min_p=0.2), 5)  # threshold 0.1
    draws = np.array([s.sample(x, []).token_id for _ in range(N_DRAWS)])
    assert set(draws.tolist()) == {0, 1, 2}
    _assert_close(_freq(draws, 5), np.array([0.5, 0.3, 0.12, 0, 0]) / 0.92, N_DRAWS)


def test_filters_combined() -> None:
    x = _logits(8, scale=1.5)
    draws = _draws(5000, x, seed=2, top_k=10, top_p=0.8, min_p=0.05, temperature=1.3)
    z = x.astype(np.float64) / 1.3
    top = np.argsort(-z, kind="stable")[:10]
    p = np.exp(z[top] - z[top].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = top[before < 0.8]
    pk = np.exp(z[keep] - z[keep].max())
    allowed = set(keep[pk >= 0.05 * pk.max()].tolist())
    assert set(draws.tolist()) <= allowed
    assert len(set(draws.tolist())) == len(allowed)


# --- bias, penalties -----------------------------------------------------------------------


def test_logit_bias_bans_and_forces() -> None:
    x = _logits(1)
    best = int(np.argmax(x))
    for temp in (0.0, 1.0):
        s = _sampler(temperature=temp, seed=0, logit_bias={best: -100.0})
        assert all(s.sample(x, []).token_id != best for _ in range(500))
    s = _sampler(seed=0, logit_bias={5: 100.0})
    assert all(s.sample(x, []).token_id == 5 for _ in range(100))


def _reference_adjusted(x, prompt, generated, bias, rep, presence, frequency) -> np.ndarray:
    out = x.astype(np.float32).copy()
    for t, b in bias.items():
        out[t] += np.float32(b)
    for t in set(prompt) | set(generated):
        out[t] = out[t] / np.float32(rep) if out[t] > 0 else out[t] * np.float32(rep)
    for t in set(generated):
        c = generated.count(t)
        out[t] -= np.float32(frequency) * np.float32(c)
        out[t] -= np.float32(presence)
    return out


@pytest.mark.parametrize(
    "rep,presence,frequency",
    [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 0.4), (0.8, -0.5, 1.2), (1.7, 2.0, -2.0)],
)
def test_penalties_match_reference(rep, presence, frequency) -> None:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, V, 30).tolist()
    bias = {3: 2.5, 10: -7.0}
    params = SamplingParams(
        repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
        logit_bias=bias, seed=1, logprobs=3,
    )
    params.validate(V)
    s = Sampler(params, V)
    history = list(prompt)
    generated: list[int] = []
    for step in range(25):
        x = _logits(100 + step)
        expected = _reference_adjusted(x, prompt, generated, bias, rep, presence, frequency)
        res = s.sample(x, history)
        # adjusted_logits is idempotent for an unchanged history: compare it to the reference
        got = s.adjusted_logits(x, history)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(res.logprob, _log_softmax64(expected)[res.token_id],
                                   rtol=1e-9, atol=1e-9)
        # repeat tokens often so counts above 1 occur
        tok = res.token_id if step % 3 else generated[-1] if generated else 5
        history.append(tok)
        generated.append(tok)


def test_penalties_only_touch_seen_tokens() -> None:
    x = _logits(2)
    s = _sampler(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    got = s.adjusted_logits(x, [4, 9])
    unseen = np.ones(V, dtype=bool)
    unseen[[4, 9]] = False
    assert np.array_equal(got[unseen], x[unseen])
    # presence/frequency apply to generated tokens only: the prompt tokens got just rep.
    expected = np.where(x[[4, 9]] > 0, x[[4, 9]] / 1.5, x[[4, 9]] * 1.5).astype(np.float32)
    np.testing.assert_allclose(got[[4, 9]], expected, rtol=1e-6)


def test_explicit_n_prompt() -> None:
    x = _logits(4)
    s = Sampler(SamplingParams(frequency_penalty=1.0), V, n_prompt=2)
    got = s.adjusted_logits(x, [1, 2, 3, 3])  # tokens 3, 3 were generated
    expected = x.copy()
    expected[3] -= 2.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_history_checks() -> None:
    s = _sampler()
    with pytest.raises(ValueError):
        s.sample(_logits(0), [V])
    s.sample(_logits(0), [1, 2])
    with pytest.raises(ValueError):
        s.sample(_logits(0), [1])
    with pytest.raises(ValueError):
        s.sample(_logits(0, n=V + 1), [1, 2])
    bad = _logits(0)
    bad[3] = np.nan
    with pytest.raises(ValueError):
        s.sample(bad, [1, 2])


# --- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_match_reference(k: int) -> None:
    x = _logits(12, scale=4.0)
    bias = {0: 3.0}
    s = _sampler(logprobs=k, temperature=0.5, top_k=3, seed=1, logit_bias=bias)
    res = s.sample(x, [])
    adj = x.copy()
    adj[0] += np.float32(3.0)
    ref = _log_softmax64(adj)  # before temperature and filtering
    assert res.logprob == pytest.approx(ref[res.token_id], abs=1e-9)
    assert res.top_logprobs is not None and len(res.top_logprobs) == k
    order = np.argsort(-ref, kind="stable")[:k]
    assert [t for t, _ in res.top_logprobs] == order.tolist()
    for t, lp in res.top_logprobs:
        assert lp == pytest.approx(ref[t], abs=1e-9)


def test_no_logprobs_requested() -> None:
    # nothing is scored unless asked: the token alone, the same token as when asked
    res = _sampler(temperature=0.0).sample(_logits(0), [])
    assert res.top_logprobs is None and res.logprob is None
    asked = _sampler(temperature=0.0, logprobs=0).sample(_logits(0), [])
    assert asked.token_id == res.token_id and asked.top_logprobs == []
    assert asked.logprob == pytest.approx(_log_softmax64(_logits(0))[res.token_id], abs=1e-9)


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1), ("temperature", 2.01), ("temperature", float("nan")),
        ("temperature", float("inf")), ("temperature", "hot"), ("temperature", True),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", -1.0), ("top_p", float("nan")),
        ("top_k", -2), ("top_k", 1.5),
        ("min_p", -0.01), ("min_p", 1.01), ("min_p", float("nan")),
        ("presence_penalty", 2.5), ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01), ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
        ("stop", ["x"] * (MAX_STOP_STRINGS + 1)), ("stop", ["ok", ""]), ("stop", [3]),
        ("stop", "STOP"), ("stop", ["x" * 10_000]),
        ("stop_token_ids", [V]), ("stop_token_ids", [-1]),
        ("logit_bias", {V: 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 100.5}),
        ("logit_bias", {3: -101.0}), ("logit_bias", {3: float("nan")}),
        ("logprobs", -1), ("logprobs", 21),
        ("seed", "x"),
        ("ignore_eos", "yes"),
    ],
)
def test_validation(field: str, value) -> None:
    p = SamplingParams(**{field: value})
    with pytest.raises(SamplingParamError) as e:
        p.validate(V)
    assert isinstance(e.value, ValueError)
    assert e.value.param == field


def test_validation_accepts_edges() -> None:
    SamplingParams(
        max_tokens=1, temperature=2.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0,
        frequency_penalty=2.0, repetition_penalty=0.01, stop=["a"] * MAX_STOP_STRINGS,
        stop_token_ids=[0, V - 1], seed=0, logit_bias={0: -100.0, V - 1: 100}, logprobs=20,
    ).validate(V)
    SamplingParams(temperature=0, top_k=-1, logprobs=0).validate(V)
