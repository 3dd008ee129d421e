"""The cost model that decides how many drafts a sequence verifies per step (engine.spec.cost):
its decisions on made-up profiles, its expectations against simulations in numpy, its fit of
a step's cost against known coefficients, and the smoothed acceptance rate."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.engine.spec.cost import (
    Acceptance,
    BatchPlan,
    MoEShape,
    StepCost,
    StepCostMeter,
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
