"""The cost model that decides how many drafts a sequence verifies per step (engine.spec.cost):
its decisions on made-up profiles, its expectations against simulations in numpy, its fit of
a step's cost against known coefficients, the measured union of experts, the smoothed
acceptance rate and the acceptance learned by the drafter's evidence."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.engine.spec.cost import (
    Acceptance,
    BatchPlan,
    MatchPrior,
    MoEShape,
    StepCost,
    StepCostMeter,
    UnionMeter,
    choose_k,
    expected_accepted,
    speedup,
)

# a memory-bound MoE decode: a step reads its fixed weights (1 ms) and 2 ms per 16 experts
# (8 layers of 16, top 4), each token's compute costs 0.1 ms
MIXTRAL = MoEShape(n_moe_layers=8, n_expert=16, top_k=4)
BOUND = StepCost(step_s=1e-3, expert_s=2e-3 / 16, token_s=1e-4)
# many small experts (64, top 8): a verify step's union grows slowly per token
FINE = MoEShape(n_moe_layers=4, n_expert=64, top_k=8)


def _k(cost: StepCost, shape: MoEShape, alpha: float, k_max: int = 8, n_running: int = 1,
       **kw: float) -> int:
    return choose_k(cost, shape, alpha, k_max, BatchPlan(n_running, n_running), **kw)


def test_union_of_experts_matches_a_simulation_of_uniform_routing() -> None:
    rng = np.random.default_rng(0)
    for shape in (MIXTRAL, FINE):
        for n in (1, 2, 5, 9):
            seen = [len(set(np.concatenate([rng.choice(shape.n_expert, shape.top_k,
                                                       replace=False) for _ in range(n)])))
                    for _ in range(4000)]
            want = shape.n_moe_layers * float(np.mean(seen))
            assert shape.experts_read(n) == pytest.approx(want, rel=0.02)
    assert MoEShape(0, 0, 0).experts_read(5) == 0.0


def test_expected_accepted_matches_a_simulation_of_the_longest_agreeing_prefix() -> None:
    rng = np.random.default_rng(1)
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (1, 3, 6):
            keep = rng.random((20000, k)) < alpha
            run = np.cumprod(keep, axis=1).sum(axis=1)  # drafts kept before the first miss
            assert expected_accepted(alpha, k) == pytest.approx(run.mean(), abs=0.05)


def test_low_acceptance_drafts_nothing() -> None:
    assert _k(BOUND, MIXTRAL, alpha=0.1) == 0
    assert _k(BOUND, FINE, alpha=0.05) == 0


def test_high_acceptance_with_resident_small_experts_drafts() -> None:
    small = StepCost(step_s=1e-3, expert_s=1e-5, token_s=2e-5)
    k = _k(small, FINE, alpha=0.9)
    assert k > 0
    assert speedup(small, FINE, 0.9, k) > 1.5


def test_a_large_batch_drafts_nothing() -> None:
    # small resident experts and a compute cost per token: one sequence gains from drafts;
    # 64 sequences already read every expert, so a draft there costs its compute (0.3 ms) for
    # 0.7 of a token, more than the 0.37 ms a token of the step costs on average
    cpu = StepCost(step_s=2e-3, expert_s=1e-5, token_s=3e-4)
    assert _k(cpu, FINE, alpha=0.7, n_running=64) == 0
    assert _k(cpu, FINE, alpha=0.7, n_running=1) > 0


def test_experts_the_cache_lacks_make_drafts_dearer() -> None:
    resident = _k(BOUND, MIXTRAL, alpha=0.7)
    missing = _k(BOUND, MIXTRAL, alpha=0.7, resident=0.5, miss_s=5e-3)
    assert resident > 0 and missing < resident


def test_more_acceptance_never_gives_fewer_drafts() -> None:
    for cost, shape in ((BOUND, MIXTRAL), (StepCost(1e-3, 1e-5, 2e-5), FINE),
                        (StepCost(2e-4, 1e-6, 3e-4), FINE)):
        for n_running in (1, 4):
            ks = [_k(cost, shape, a, n_running=n_running) for a in np.linspace(0, 1, 41)]
            assert ks == sorted(ks), (cost, n_running, ks)
            assert ks[0] == 0


def test_never_more_drafts_than_offered_and_the_batch_counts_the_choice() -> None:
    batch = BatchPlan(1.0, 1.0)
    k = choose_k(StepCost(1e-3, 0.0, 0.0), MIXTRAL, 1.0, 3, batch)
    assert k == 3  # free drafts that are always kept: all of them
    assert (batch.n_tokens, batch.n_yield) == (4.0, 4.0)
    assert choose_k(BOUND, MIXTRAL, 1.0, 0, BatchPlan(1, 1)) == 0


def test_the_meter_recovers_a_known_cost() -> None:
    """Steps whose parts follow a known cost: expert products 50 us per expert, attention
    0.2 ms and the rest 0.1 ms per token, 2 ms per step; prompt chunks are left out."""
    meter = StepCostMeter()
    rng = np.random.default_rng(2)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        experts = MIXTRAL.experts_read(n) * rng.uniform(0.8, 1.0)
        t_exp, t_att = 5e-5 * experts, 2e-4 * n
        meter.observe(n, experts, 2e-3 + 1e-4 * n + t_exp + t_att, t_exp, t_att)
    meter.observe(300, 128.0, 1.0, 0.5, 0.3)  # a prompt chunk: not a step drafts change
    got = meter.cost()
    assert got is not None
    assert got.step_s == pytest.approx(2e-3, rel=0.02)
    assert got.expert_s == pytest.approx(5e-5, rel=1e-6)
    assert got.token_s == pytest.approx(3e-4, rel=0.02)


def test_the_meter_answers_from_one_step_and_never_below_zero() -> None:
    assert StepCostMeter().cost() is None
    meter = StepCostMeter()
    meter.observe(1, 32.0, 3e-3, 1.6e-3, 2e-4)  # one step: its rest is all per step
    c = meter.cost()
    assert c == StepCost(pytest.approx(1.2e-3), pytest.approx(5e-5), pytest.approx(2e-4))
    # steps that cost less with more tokens would fit a negative part: it is held at 0
    for n in range(1, 30):
        meter.observe(n, 32.0, 4e-3 - 1e-4 * n)
    c = meter.cost()
    assert c is not None and min(c.step_s, c.expert_s, c.token_s) >= 0
    pinned = StepCostMeter(StepCost(1e-3, 2e-5, 3e-4), prior_weight=float("inf"))
    pinned.observe(5, 60.0, 1.0, 0.5, 0.2)
    c = pinned.cost()
    assert c == StepCost(pytest.approx(1e-3), pytest.approx(2e-5), pytest.approx(3e-4))


def test_acceptance_follows_the_request_and_drifts_back_to_the_prior() -> None:
    acc = Acceptance()
    assert acc.rate == 0.5
    for _ in range(20):
        acc.observe(4, 4)
    assert acc.rate > 0.95
    for _ in range(20):
        acc.observe(4, 0)
    assert acc.rate < 0.1
    low = acc.rate
    for _ in range(200):
        acc.idle()
    assert low < acc.rate == pytest.approx(0.5, abs=0.01)


def test_acceptance_takes_the_prior_of_the_step_until_its_own_steps_outweigh_it() -> None:
    acc = Acceptance()
    assert acc.rate_given(0.9) == pytest.approx(0.9)  # nothing seen: the prior alone
    assert acc.rate_given(0.2) == pytest.approx(0.2)
    for _ in range(3):
        acc.observe(4, 0)
    # three rejected verify steps: even a confident prior is outweighed
    assert acc.rate_given(0.95) < 0.3
    for _ in range(300):
        acc.idle()
    assert acc.rate_given(0.95) == pytest.approx(0.95, abs=0.01)


def test_match_prior_starts_from_the_match_length_and_learns_by_bucket() -> None:
    mp = MatchPrior()
    assert [mp.bucket(n) for n in (None, 0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 10**6)] == \
        [0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 6]
    rates = [mp.rate(b) for b in range(1, 7)]
    assert rates == sorted(rates) and rates[0] < 0.5 < rates[-1]  # longer: likelier kept
    long = mp.bucket(40)
    for _ in range(100):  # long matches that are never kept (a model that does not copy)
        mp.observe(long, 8, 0)
    assert mp.rate(long) < 0.1
    assert mp.rate(mp.bucket(3)) == pytest.approx(MatchPrior().rate(mp.bucket(3)))  # unaffected
    for _ in range(200):
        mp.observe(long, 8, 8)
    assert mp.rate(long) > 0.95


def test_match_prior_is_optimistic_only_while_little_is_known() -> None:
    """upper: a short match's prior says drafts do not pay, its optimism tries them; the
    optimism shrinks as its drafts are tested, so a bucket whose drafts are rejected stops."""
    cost = StepCost(step_s=2e-3, expert_s=1.8e-4, token_s=1e-5)
    union = UnionMeter(MIXTRAL)
    for n in range(1, 6):
        union.observe(n, MIXTRAL.experts_read(n) * (1.0 if n == 1 else 0.9))
    mp = MatchPrior()
    b = mp.bucket(1)
    assert mp.rate(b) < mp.upper(b) <= 1.0
    assert _k(cost, union, mp.rate(b)) == 0 < _k(cost, union, mp.upper(b))
    gaps = []
    for _ in range(40):
        mp.observe(b, 1, 0)
        gaps.append(mp.upper(b) - mp.rate(b))
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0] / 2
    assert _k(cost, union, mp.upper(b)) == 0


def test_a_long_match_drafts_where_the_even_prior_would_not() -> None:
    """Before any verify step: at the even prior the uniform bound says drafts do not pay on
    the benchmark-like profile, a match of 40 tokens says they do."""
    cost = StepCost(step_s=2e-3, expert_s=1.8e-4, token_s=1e-5)
    mp = MatchPrior()
    assert _k(cost, MIXTRAL, Acceptance().rate) == 0
    assert _k(cost, MIXTRAL, Acceptance().rate_given(mp.rate(mp.bucket(40)))) >= 4
    assert _k(cost, MIXTRAL, Acceptance().rate_given(mp.rate(mp.bucket(1)))) == 0


def test_union_meter_uses_what_it_measured_and_the_bound_before() -> None:
    union = UnionMeter(MIXTRAL)
    for n in (1, 3, 5, 9):
        assert union.experts_read(n) == pytest.approx(MIXTRAL.experts_read(n))
    assert union.experts_read(0) == 0.0
    # steps of one token read top_k experts per layer; verify steps of five read 7 of the 16
    # (drafts of one sequence share experts), fewer than the uniform bound's 12.2
    for _ in range(10):
        union.observe(1, 32.0)
        union.observe(5, 8 * 7.0)
    assert union.experts_read(1) == pytest.approx(32.0)
    assert union.experts_read(5) == pytest.approx(56.0)
    # not measured: the bound scaled as at the nearest measured count, between its neighbours
    scaled3 = MIXTRAL.experts_read(3) * 56.0 / MIXTRAL.experts_read(5)
    assert union.experts_read(3) == pytest.approx(scaled3)
    assert 32.0 < union.experts_read(3) < 56.0
    nine = union.experts_read(9)
    assert 56.0 < nine < MIXTRAL.experts_read(9)
    assert union.experts_read(40) <= MIXTRAL.n_moe_layers * MIXTRAL.n_expert
    # prompt chunks (more than max_tokens) and steps that read nothing are left out
    union.observe(500, 128.0)
    union.observe(7, 0.0)
    assert union.measured(500) is None and union.measured(7) is None
    # it follows the recent steps
    for _ in range(60):
        union.observe(5, 8 * 9.0)
    assert union.experts_read(5) == pytest.approx(72.0, rel=0.01)


def test_a_measured_union_below_the_bound_makes_drafts_pay() -> None:
    """The same acceptance and cost: by the uniform bound a draft does not pay, by a measured
    union where the drafts of one sequence read few experts more than its token, it does."""
    cost = StepCost(step_s=2e-3, expert_s=1.8e-4, token_s=1e-5)
    union = UnionMeter(MIXTRAL)
    assert _k(cost, union, 0.5) == 0
    for n in range(1, 9):
        for _ in range(3):
            union.observe(n, 32.0 + 4.0 * (n - 1))  # half an expert more per layer a token
    assert _k(cost, union, 0.5) > 0


def test_the_meter_separates_the_experts_read_from_the_tokens_they_multiply() -> None:
    """Expert products that cost 40 us per expert read and 0.6 ms per token (a batch whose
    experts are mostly read already computes more per draft): both parts come back, the token
    part in token_s; and at eight sequences a draft that is kept half the time does not pay,
    where the ratio of expert seconds to experts read alone would say it does."""
    meter = StepCostMeter()
    rng = np.random.default_rng(4)
    for _ in range(400):
        n = int(rng.integers(1, 20))
        experts = MIXTRAL.experts_read(n) * rng.uniform(0.7, 1.0)
        t_exp = 4e-5 * experts + 6e-4 * n
        meter.observe(n, experts, 1e-3 + t_exp, t_exp, 0.0)
    got = meter.cost()
    assert got is not None
    assert got.expert_s == pytest.approx(4e-5, rel=1e-2)
    assert got.token_s == pytest.approx(6e-4, rel=1e-2)
    assert got.step_s == pytest.approx(1e-3, rel=1e-2)
    assert _k(got, MIXTRAL, alpha=0.5, n_running=8) == 0
    ratio_only = StepCost(got.step_s, meter._te / meter._e, 0.0)
    assert _k(ratio_only, MIXTRAL, alpha=0.5, n_running=8) > 0
