"""The cost model that decides how many drafts a sequence verifies per step (engine.spec.cost):
its decisions on made-up profiles, its expectations against simulations in numpy, its fit of
a step's cost against known coefficients, the measured union of experts, the smoothed
acceptance rate, the acceptance learned by each draft's evidence, the draft cap and the
exploration rules, these last through auto's planner and prompt lookup decoding known
outputs (a long copy, text whose matches are never kept, matches of one token)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri.engine import SamplingParams
from colibri.engine.core.request import Request
from colibri.engine.core.speculative import DraftPlanner, SpeculativeConfig
from colibri.engine.spec.cost import (
    CAP_MIN,
    EXPLORE_MIN_MATCH,
    EXPLORE_WAIT,
    Acceptance,
    BatchPlan,
    MatchPrior,
    MoEShape,
    RequestAcceptance,
    StepCost,
    StepCostMeter,
    UnionMeter,
    choose_k,
    draft_cap,
    expected_accepted,
    speedup,
)
from colibri.engine.spec.ngram import NgramDrafter

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
    for _ in range(800):
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
    for _ in range(800):
        acc.idle()
    assert acc.rate_given(0.95) == pytest.approx(0.95, abs=0.01)


def test_a_lucky_run_of_a_request_counts_less_than_the_rate_it_shows() -> None:
    """A copy that slips one token in ten at random: a request whose last steps kept every
    draft is drafted on below its own rate (one standard error less), by less the more it
    has measured, and never above the rate or below 0."""
    lucky, steady = Acceptance(), Acceptance()
    lucky.observe(4, 4)
    for _ in range(40):
        steady.observe(10, 9)
    assert lucky.rate_given(0.9) > 0.95 and lucky.lower_given(0.9) < 0.93
    gaps = [a.rate_given(0.9) - a.lower_given(0.9) for a in (lucky, steady)]
    assert 0.0 < gaps[1] < gaps[0]
    never = Acceptance()
    for _ in range(5):
        never.observe(4, 0)
    assert 0.0 <= never.lower_given(0.9) <= never.rate_given(0.9)


def test_a_batch_that_nobody_waits_to_join_drafts_on_the_cautious_rate() -> None:
    """A request whose last verify steps kept every draft: alone it drafts on its rate, in a
    batch with nobody waiting (where drafts pay by a thin margin) on that rate less one
    standard error."""
    planner = _planner()
    rng = np.random.default_rng(3)
    prompt = _tokens(rng, 200)
    req = Request("r", 0, list(prompt), SamplingParams(max_tokens=64, temperature=0.0), None,
                  None, None, 64, frozenset())  # type: ignore[arg-type]
    req.output += prompt[:12]
    req.num_computed = len(prompt) + 11
    req.drafts = prompt[12:20]
    req.drafter = NgramDrafter()
    req.drafter.find(req.prompt, req.output)
    bold, cap = planner._chances(req)
    for _ in range(3):
        req.acceptance.of(planner.match_prior.bucket(req.acceptance.evidence)).observe(4, 4)
    bold, _ = planner._chances(req)
    cautious, cap2 = planner._chances(req, cautious=True)
    assert cap == cap2 and len(bold) == len(cautious) > 0
    assert all(c < b for b, c in zip(bold, cautious, strict=True))


def test_match_prior_starts_from_the_match_length_and_learns_by_bucket() -> None:
    mp = MatchPrior()
    assert [mp.bucket(n) for n in (None, 0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 64, 10**6)] == \
        [0, 0, 1, 2, 2, 3, 3, 4, 5, 5, 6, 6, 6]
    rates = [mp.rate(b) for b in range(1, 7)]
    assert rates == sorted(rates) and rates[0] < 0.5 < rates[-1]  # longer: likelier kept
    long = mp.bucket(40)
    for _ in range(100):  # long matches that are never kept (a model that does not copy)
        mp.observe(40, 8, 0)
    assert mp.rate(long) < 0.1
    assert mp.rate(mp.bucket(3)) == pytest.approx(MatchPrior().rate(mp.bucket(3)))  # unaffected
    for _ in range(200):
        mp.observe(40, 8, 8)
    assert mp.rate(long) > 0.95


def measured_union() -> UnionMeter:
    """A union meter that saw verify steps of 1..5 tokens, the several-token ones reading 10%
    fewer experts than the uniform bound."""
    union = UnionMeter(MIXTRAL)
    for n in range(1, 6):
        union.observe(n, MIXTRAL.experts_read(n) * (1.0 if n == 1 else 0.9))
    return union


def test_match_prior_is_optimistic_only_while_little_is_known() -> None:
    """upper: a short match's prior says drafts do not pay, its optimism tries them; the
    optimism shrinks as its drafts are tested, so a bucket whose drafts are rejected stops."""
    cost = StepCost(step_s=2e-3, expert_s=1.8e-4, token_s=1e-5)
    union = measured_union()
    mp = MatchPrior()
    b = mp.bucket(1)
    assert mp.rate(b) < mp.upper(b) <= 1.0
    assert _k(cost, union, mp.rate(b)) == 0 < _k(cost, union, mp.upper(b))
    gaps = []
    for _ in range(40):
        mp.observe(1, 1, 0)
        gaps.append(mp.upper(b) - mp.rate(b))
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0] / 2
    assert _k(cost, union, mp.upper(b)) == 0


def test_match_prior_bounds_close_in_on_the_rate_as_drafts_are_tested() -> None:
    """lower and upper sit one standard error of the rate either side of it, sqrt(r (1 - r) /
    n) for n tested drafts and the prior's weight. A bucket at even odds, untested, drafts on
    upper and not on lower; once many of its drafts were tested and 60% kept, lower drafts."""
    cost = StepCost(step_s=2e-3, expert_s=1.8e-4, token_s=1e-5)
    union = measured_union()
    mp = MatchPrior()
    b = mp.bucket(2)
    err = np.sqrt(0.5 * 0.5 / mp.weight)
    assert (mp.lower(b), mp.rate(b), mp.upper(b)) == \
        pytest.approx((0.5 - err, 0.5, 0.5 + err))
    assert _k(cost, union, mp.lower(b)) == 0 < _k(cost, union, mp.upper(b))
    widths = []
    for i in range(100):
        mp.observe(2, 1, int(i % 5 < 3))  # three of every five kept
        widths.append(mp.upper(b) - mp.lower(b))
        assert mp.lower(b) <= mp.rate(b) <= mp.upper(b)
    assert widths[-1] < widths[0] / 2
    assert mp.rate(b) == pytest.approx(0.6, abs=0.03)
    assert _k(cost, union, mp.lower(b)) > 0
    assert MatchPrior().upper(1) > MatchPrior().rate(1) > MatchPrior().lower(1) >= 0.0


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


def test_expected_accepted_per_draft_matches_a_simulation() -> None:
    """One keep probability per draft (each once those before it were kept): the mean of the
    longest kept prefix in numpy; a constant list gives the geometric sum."""
    rng = np.random.default_rng(5)
    for alphas in ([0.3, 0.5, 0.5, 0.7], [0.9, 0.2, 0.95], [1.0, 1.0, 0.0, 1.0]):
        keep = rng.random((20000, len(alphas))) < np.array(alphas)
        run = np.cumprod(keep, axis=1).sum(axis=1)
        assert expected_accepted(alphas, len(alphas)) == pytest.approx(run.mean(), abs=0.05)
        assert expected_accepted(alphas, 10) == expected_accepted(alphas, len(alphas))
    for a in (0.2, 0.7):
        assert expected_accepted([a] * 6, 6) == pytest.approx(expected_accepted(a, 6))
        for k_max in (3, 6):
            assert choose_k(BOUND, MIXTRAL, [a] * 6, k_max, BatchPlan(1, 1)) == \
                choose_k(BOUND, MIXTRAL, a, k_max, BatchPlan(1, 1))
    # never more drafts than it has probabilities for
    assert choose_k(StepCost(1e-3, 0.0, 0.0), MIXTRAL, [1.0, 1.0], 8, BatchPlan(1, 1)) == 2


def test_match_prior_counts_each_draft_at_its_own_evidence() -> None:
    """A proposal on a match of m tokens drafts its draft i on m + i tokens of evidence; the
    first rejected draft is tested, those after it are not; no evidence stays none."""
    mp = MatchPrior()

    def reference(m: int, n: int, a: int) -> dict[int, tuple[int, int]]:
        out: dict[int, list[int]] = {}
        for i in range(n):
            if i > a:
                break
            b = mp.bucket(m + i) if m else 0
            out.setdefault(b, [0, 0])
            out[b][0] += i < a
            out[b][1] += 1
        return {b: (k, t) for b, (k, t) in out.items()}

    for m in (0, 1, 2, 3, 7, 14, 40):
        for n in (1, 4, 16):
            for a in range(n + 1):
                assert mp.outcomes(m, n, a) == reference(m, n, a), (m, n, a)
    assert mp.outcomes(3, 6, 4) == {2: (1, 1), 3: (3, 4)}  # kept at 3..6, rejected at 7
    mp.observe(3, 6, 4)
    fresh = MatchPrior()
    w = fresh.weight  # the prior counts as w tested drafts
    assert mp.rate(2) == pytest.approx((1 + w * fresh.rate(2)) / (1 + w))
    assert mp.rate(3) == pytest.approx((3 + w * fresh.rate(3)) / (4 + w))
    assert mp.rate(4) == fresh.rate(4)  # draft 6 (evidence 8) was not tested


def test_draft_cap_grows_with_the_match_and_with_what_was_kept() -> None:
    assert [draft_cap(m, 0, 16) for m in (0, 1, 2, 3, 5, 8, 40)] == [2, 2, 4, 6, 10, 16, 16]
    assert draft_cap(1, 5, 16) == 10  # the last verify step kept five
    assert draft_cap(40, 0, 4) == 4 and draft_cap(0, 0, 1) == 1 and draft_cap(3, 3, 0) == 0
    # a copy whose every draft is kept: its match grows by the drafts and the model's token,
    # so the cap doubles (and more) from step to step up to the maximum
    m, caps = 1, []
    for _ in range(4):
        caps.append(draft_cap(m, 0, 16))
        m += caps[-1] + 1
    assert caps == [CAP_MIN, 8, 16, 16]


# a step-cost profile like the benchmark Mixtral's on two cores (9.6 ms a token, a verify step
# of 5 tokens 1.8 times that) and the experts its verify steps of copied drafts read (measured:
# tokens -> distinct experts over its 8 MoE layers of 16)
BENCH = StepCost(step_s=4.8e-3, expert_s=1.4e-4, token_s=2.85e-4)
BENCH_UNION = {1: 32.0, 2: 50.6, 3: 63.6, 4: 72.6, 5: 76.9, 7: 86.3, 9: 90.7, 13: 97.3,
               17: 99.4}


def _planner() -> DraftPlanner:
    planner = DraftPlanner(MIXTRAL, StepCostMeter(BENCH, prior_weight=float("inf")))
    for n, experts in BENCH_UNION.items():
        planner.union.observe(n, experts)
    return planner


def _decode(planner: DraftPlanner, prompt: list[int], output: list[int],
            k_max: int = 16) -> list[tuple[int, int, int]]:
    """Greedy decoding whose tokens are known (output) with auto's planner and prompt lookup,
    one request: per step where prompt lookup offered drafts, (match length, drafts verified,
    drafts kept)."""
    req = Request("r", 0, list(prompt), SamplingParams(max_tokens=len(output), temperature=0.0),
                  None, None, None, len(output), frozenset())  # type: ignore[arg-type]
    req.output.append(output[0])  # the prompt's step gave the first token
    req.num_computed = len(prompt)
    config = SpeculativeConfig("auto", k_max)
    steps = []
    while len(req.output) < len(output):
        planner.plan([req], config)
        at, k = len(req.output), len(req.drafts)
        kept = 0
        while kept < k and req.drafts[kept] == output[at + kept]:
            kept += 1
        n = 1 + k
        planner.observe_step(n, planner.union.experts_read(n), BENCH.seconds(planner.union, n))
        if k:
            planner.observe_verify(req, k, kept)
        if req.drafter.match_len:
            steps.append((req.drafter.match_len, k, kept))
        new = output[at:at + kept + 1]
        req.output += new
        req.num_computed += len(new)
    return steps


def _tokens(rng: np.random.Generator, n: int, low: int = 1000) -> list[int]:
    return [int(t) for t in rng.choice(np.arange(low, low + 20 * n), n, replace=False)]


def test_a_long_copy_drafts_up_to_the_cap_and_the_cap_bounds_every_step() -> None:
    """Five new tokens, then 120 copied from the prompt: drafting starts small on the fresh
    match and doubles as the copy is confirmed, up to 16 drafts a step, every one kept; each
    step's drafts stay within draft_cap of its match and of what the step before kept; with
    num_speculative_tokens 4, never more than 4."""
    rng = np.random.default_rng(6)
    prompt = _tokens(rng, 300)
    output = _tokens(rng, 5, low=100) + prompt[100:220]
    steps = _decode(_planner(), prompt, output)
    ks = [k for _, k, _ in steps]
    assert max(ks) == 16 and all(kept == k for _, k, kept in steps)
    first = next(i for i, k in enumerate(ks) if k)
    assert ks[first] <= 2 * steps[first][0]  # a fresh match: a short verify step
    assert ks[first:ks.index(16)] == sorted(ks[first:ks.index(16)])  # growing to 16
    last_kept = 0
    for match, k, kept in steps:
        assert k <= draft_cap(match, last_kept, 16)
        last_kept = kept if k else last_kept
    assert len(steps) < len(output) / 6  # a copy of 120 tokens in well under 20 steps
    assert max(k for _, k, _ in _decode(_planner(), prompt, output, k_max=4)) == 4


def test_rejected_matches_stop_drafting_and_tries_back_off() -> None:
    """Text whose every match is followed by something else than in the prompt (x y z and
    later x q earlier, x y w now): after the first rejections the cost model drafts no more,
    and what optimism tries is one draft at a time."""
    rng = np.random.default_rng(7)
    triples = [_tokens(rng, 3, low=1000 + 100 * i) for i in range(200)]
    decoys = iter(_tokens(rng, 200, low=300000))
    prompt = [t for tr in triples for t in tr] + [t for x, _, _ in triples
                                                  for t in (x, next(decoys))]
    novel = iter(_tokens(rng, 200, low=500000))
    output = [t for x, y, _ in triples for t in (x, y, next(novel))]
    steps = _decode(_planner(), prompt, output)
    tried = [i for i, (_, k, _) in enumerate(steps) if k]
    assert sum(m >= EXPLORE_MIN_MATCH for m, _, _ in steps) >= 190
    assert all(kept == 0 for _, _, kept in steps)
    # the drafts of the steps that verify none are scored too, so a few steps teach what
    # these matches are worth: a try or two at the start, none after
    assert 1 <= len(tried) <= 3 and max(tried) < 20, tried
    assert all(steps[i][1] == 1 for i in tried[1:])  # tries on optimism: one draft each


def test_matches_never_drafted_are_learned_from_the_tokens_their_steps_gave() -> None:
    """One-token matches start below what the cost model drafts on, and optimism never tries
    them; where they are always right (x y z earlier, x y w now: x is followed by y), the first
    draft each step was offered is scored against the token the step gave, so after a few
    steps the request drafts on them, and keeps what it drafts."""
    rng = np.random.default_rng(7)
    triples = [_tokens(rng, 3, low=1000 + 100 * i) for i in range(200)]
    prompt = [t for tr in triples for t in tr]
    novel = iter(_tokens(rng, 200, low=500000))
    output = [t for x, y, _ in triples for t in (x, y, next(novel))]
    steps = _decode(_planner(), prompt, output)
    one = [(k, kept) for m, k, kept in steps if m == 1]
    assert one[0][0] == 0 and len(one) > 150
    assert all(k >= 1 and kept >= 1 for k, kept in one[10:]), one[:20]


def test_exploration_waits_longer_after_each_failed_try() -> None:
    """RequestAcceptance's tries: none below EXPLORE_MIN_MATCH; after a try that keeps
    nothing, EXPLORE_WAIT steps without drafts before the next, then twice as many each time;
    a kept draft resets the wait; drafts the cost model chose never start a wait."""
    ra = RequestAcceptance()
    assert not ra.may_explore(EXPLORE_MIN_MATCH - 1) and ra.may_explore(EXPLORE_MIN_MATCH)
    waits = []
    for _ in range(4):
        ra.exploring = True
        ra.verified(1, 0)
        n = 0
        while not ra.may_explore(5):
            ra.no_drafts()
            n += 1
        waits.append(n)
    assert waits == [EXPLORE_WAIT, 2 * EXPLORE_WAIT, 4 * EXPLORE_WAIT, 8 * EXPLORE_WAIT]
    ra.exploring = True
    ra.verified(1, 1)  # a kept draft
    ra.exploring = True
    ra.verified(1, 0)
    assert ra.explore.wait == EXPLORE_WAIT and ra.last_kept == 0
    ra.explore.wait = 0
    ra.verified(4, 0)  # the cost model's choice, not a try
    assert ra.may_explore(5)


def test_no_draft_on_one_token_matches_until_they_are_known_to_be_kept() -> None:
    """Output tokens that each occur once in the prompt, never after the one before them:
    every match is of one token, below the length optimism tries, and the prior of such
    matches says drafts do not pay: no verify step. Where such matches were kept over other
    requests, the same request drafts."""
    rng = np.random.default_rng(8)
    prompt = _tokens(rng, 400)
    picks = rng.choice(np.arange(0, 400, 3), 100, replace=False)
    output = [prompt[int(j)] for j in picks]
    steps = _decode(_planner(), prompt, output)
    assert len(steps) > 90 and {m for m, _, _ in steps} == {1}
    assert all(k == 0 for _, k, _ in steps)
    planner = _planner()
    for _ in range(50):
        planner.match_prior.observe(1, 1, 1)
    assert any(k for _, k, _ in _decode(planner, prompt, output))


def test_without_waiting_requests_a_draft_is_worth_what_its_token_adds_to_a_step() -> None:
    """Eight sequences and none waiting: one that finishes sooner saves only what its token
    adds to the steps the others run anyway, so a draft kept half the time does not pay where
    it would with requests waiting (its place then goes to one of them). Alone, a sequence's
    share is the whole step either way; a draft almost surely kept pays in every case."""
    for alpha in (0.5, 0.7):
        assert choose_k(BOUND, MIXTRAL, alpha, 8, BatchPlan(8, 8, refill=True)) > 0
        assert choose_k(BOUND, MIXTRAL, alpha, 8, BatchPlan(8, 8, refill=False)) == 0
    for alpha in (0.3, 0.6, 0.9):
        assert choose_k(BOUND, MIXTRAL, alpha, 8, BatchPlan(1, 1, refill=False)) == \
            choose_k(BOUND, MIXTRAL, alpha, 8, BatchPlan(1, 1, refill=True))
    assert choose_k(BOUND, MIXTRAL, 0.97, 8, BatchPlan(8, 8, refill=False)) > 0


class _DipBelow:
    """MIXTRAL's union, but a step of seven tokens measured reading 10 experts fewer (steps
    of that size come from other tokens, at the end of a batch)."""

    def experts_read(self, n_tokens: float) -> float:
        return MIXTRAL.experts_read(n_tokens) - (10.0 if round(n_tokens) == 7 else 0.0)


def test_a_noisy_union_below_the_batch_does_not_make_drafts_look_cheap() -> None:
    """Without waiting requests a sequence's token is valued at what one more token adds to
    the step, the drafts' own margin: steps of one token fewer that happened to read fewer
    experts do not make its own token look dearer than drafts, so drafts kept three or four
    times in five still do not pay at eight streams."""
    for alpha in (0.6, 0.8):
        assert choose_k(BOUND, _DipBelow(), alpha, 8, BatchPlan(8, 8, refill=False)) == 0
        assert choose_k(BOUND, _DipBelow(), alpha, 8, BatchPlan(8, 8, refill=True)) > 0


def _verify(planner: DraftPlanner, req: Request, output: list[int]) -> None:
    """One verify step of req against the greedy output it must give: the drafts that match
    are kept, the planner hears how many, and the next token is appended."""
    at, k = len(req.output), len(req.drafts)
    kept = 0
    while kept < k and req.drafts[kept] == output[at + kept]:
        kept += 1
    if k:
        planner.observe_verify(req, k, kept)
    new = output[at:at + kept + 1]
    req.output += new
    req.num_computed += len(new)
    req.drafts = []


def _decode_batch(planner: DraftPlanner, prompts: list[list[int]], outputs: list[list[int]],
                  waiting: bool) -> list[tuple[int, int]]:
    """_decode for requests decoded together (requests waiting to join or not): per step,
    (sequences that verified drafts, drafts verified)."""
    reqs = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        req = Request(f"r{i}", 0, list(prompt), SamplingParams(max_tokens=len(output)), None,
                      None, None, len(output), frozenset())  # type: ignore[arg-type]
        req.output.append(output[0])
        req.num_computed = len(prompt)
        reqs.append((req, output))
    config = SpeculativeConfig("auto", 16)
    steps = []
    while running := [(r, o) for r, o in reqs if len(r.output) < len(o)]:
        planner.plan([r for r, _ in running], config, waiting=waiting)
        n = sum(1 + len(r.drafts) for r, _ in running)
        planner.observe_step(n, planner.union.experts_read(n), BENCH.seconds(planner.union, n))
        steps.append((sum(bool(r.drafts) for r, _ in running),
                      sum(len(r.drafts) for r, _ in running)))
        for req, output in running:
            _verify(planner, req, output)
    return steps


def test_a_batch_of_copies_drafts_together_with_requests_waiting() -> None:
    """Eight requests decoded together, each copying its prompt, with requests waiting to
    join (a sequence that finishes sooner gives its place to one of them): they draft
    together, up to 16 drafts a sequence; with none waiting, each drafts only once its copy is
    long confirmed, and the batch takes more steps."""
    rng = np.random.default_rng(9)
    prompts, copies = [], []
    for i in range(8):
        prompt = _tokens(rng, 150, low=1000 + 20000 * i)
        prompts.append(prompt)
        copies.append(_tokens(rng, 3, low=800000 + 1000 * i) + prompt[10:130])
    together = _decode_batch(_planner(), prompts, copies, waiting=True)
    assert sum(n >= 6 for n, _ in together) >= 8, together
    assert max(d for _, d in together) >= 8 * 12 and len(together) < 123 / 4
    alone = _decode_batch(_planner(), prompts, copies, waiting=False)
    first = next(i for i, (n, _) in enumerate(alone) if n)
    assert first > next(i for i, (n, _) in enumerate(together) if n)
    assert len(alone) > len(together)


def test_one_copy_among_free_text_drafts_late_with_no_request_waiting() -> None:
    """The copy of the test above decoded beside seven requests of new text, none waiting:
    the others keep the batch running as long as before, so a draft of the copy saves only
    what its token adds to a step, about what a draft costs: it drafts only once its copy is
    long confirmed (its drafts then nearly sure, and sharing their experts)."""
    rng = np.random.default_rng(9)
    prompts, outputs = [], []
    for i in range(8):
        prompt = _tokens(rng, 150, low=1000 + 20000 * i)
        prompts.append(prompt)
        outputs.append(_tokens(rng, 3, low=800000 + 1000 * i) + prompt[10:130] if i == 0
                       else _tokens(rng, 123, low=900000 + 1000 * i))
    steps = _decode_batch(_planner(), prompts, outputs, waiting=False)
    drafting = [i for i, (n, _) in enumerate(steps) if n]
    assert len(steps) == 122 and all(n <= 1 for n, _ in steps)
    assert drafting and drafting[0] >= 15, drafting


def test_a_batch_makes_one_try_a_step_and_waits_as_one_after_it_fails() -> None:
    """Eight requests at their first step, each with a two-token match, on a cost where a
    draft pays only if it is kept more than 57% of the time: nothing is measured yet, so
    only the optimism about such matches pays, and one request tries, with one draft; once
    that try is rejected, no request of the batch tries for EXPLORE_WAIT steps, and then one
    does again (a try teaches the prior all of them share, so eight sequences of free text pay
    for the tries of one)."""
    rng = np.random.default_rng(12)
    # requests waiting: a step's worth is its tokens; 8 tokens cost 48 ms, a ninth 1 ms more
    planner = DraftPlanner(MIXTRAL, StepCostMeter(StepCost(40e-3, 0.0, 1e-3),
                                                  prior_weight=float("inf")))
    reqs = []
    for i in range(8):
        prompt = _tokens(rng, 40, low=1000 + 2000 * i)
        req = Request(f"r{i}", 0, list(prompt), SamplingParams(max_tokens=50), None, None,
                      None, 50, frozenset())  # type: ignore[arg-type]
        req.output += [prompt[10], prompt[11]]  # a match of two tokens
        req.num_computed = len(prompt) + 1
        reqs.append(req)
    config = SpeculativeConfig("auto", 16)
    planner.plan(reqs, config, waiting=True)
    drafting = [r for r in reqs if r.drafts]
    assert len(drafting) == 1 and len(drafting[0].drafts) == 1
    assert drafting[0].acceptance.exploring
    planner.observe_verify(drafting[0], 1, 0)
    for _ in range(EXPLORE_WAIT):
        planner.plan(reqs, config, waiting=True)
        assert not any(r.drafts for r in reqs)
    planner.plan(reqs, config, waiting=True)
    assert sum(bool(r.drafts) for r in reqs) == 1


class _PlainLookup:
    """Prompt lookup behind the plain drafter protocol (propose and match_len only): the
    planner then joins the token list and takes every draft the budget allows."""

    def __init__(self) -> None:
        self.lookup = NgramDrafter()

    @property
    def match_len(self) -> int:
        return self.lookup.match_len

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return self.lookup.propose(list(tokens), k)


class _PlainUnion(UnionMeter):
    def experts_read(self, n_tokens: float) -> float:
        n = int(round(n_tokens))
        if n <= 0:
            return 0.0
        got = self.measured(n)
        return got if got is not None else self._estimate(n)


def _plain_planner() -> DraftPlanner:
    """auto's planner on BENCH with a union of experts estimated afresh at each question."""
    planner = DraftPlanner(MIXTRAL, StepCostMeter(BENCH, prior_weight=float("inf")))
    planner.union = _PlainUnion(MIXTRAL)
    for n, experts in BENCH_UNION.items():
        planner.union.observe(n, experts)
    return planner


def _lockstep(prompts: list[list[int]], outputs: list[list[int]],
              waiting: list[bool]) -> tuple[int, int]:
    """Decode requests whose outputs are known with auto's planner and with _plain_planner
    over _PlainLookup side by side, asserting the same drafts at every step (waiting[step]:
    whether requests wait); (steps with drafts, steps without)."""
    planners = (_planner(), _plain_planner())
    runs = []
    for planner in planners:
        reqs = []
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            req = Request(f"r{i}", 0, list(prompt), SamplingParams(max_tokens=len(output)),
                          None, None, None, len(output), frozenset())  # type: ignore[arg-type]
            req.output.append(output[0])
            req.num_computed = len(prompt)
            if planner is planners[1]:
                req.drafter = _PlainLookup()
            reqs.append(req)
        runs.append(reqs)
    config = SpeculativeConfig("auto", 16)
    n_drafted = n_plain = 0
    for step, wait in enumerate(waiting):
        running = [[r for r in reqs if len(r.output) < r.max_new] for reqs in runs]
        if not running[0]:
            break
        for planner, reqs in zip(planners, running, strict=True):
            planner.plan(reqs, config, waiting=wait)
        assert [r.drafts for r in running[0]] == [r.drafts for r in running[1]], step
        n_drafted += any(r.drafts for r in running[0])
        n_plain += not any(r.drafts for r in running[0])
        n = sum(1 + len(r.drafts) for r in running[0])
        for planner, reqs in zip(planners, running, strict=True):
            planner.observe_step(n, planner.union.experts_read(n),
                                 BENCH.seconds(planner.union, n))
            for req in reqs:
                _verify(planner, req, outputs[int(req.request_id[1:])])
    return n_drafted, n_plain


def test_the_planner_drafts_what_the_plain_protocol_and_fresh_estimates_give() -> None:
    """Requests copying their prompt with mistakes and requests writing text of a small
    vocabulary (many short matches), alone and eight together, with requests waiting and
    not: the planner (prompt lookup given the prompt and output apart, as many drafts as the
    cap allows, the union of experts remembered between steps) drafts at every step exactly
    what it gives with the plain drafter protocol (the joined token list, every draft the
    budget allows) and the union estimated afresh at each question."""
    rng = np.random.default_rng(11)

    def copy(i: int) -> tuple[list[int], list[int]]:
        prompt = _tokens(rng, 200, low=1000 + 20000 * i)
        output = list(prompt[20:170])
        for j in rng.choice(150, 6, replace=False):
            output[int(j)] = int(rng.integers(500, 600))
        return prompt, output

    def small_vocab() -> tuple[list[int], list[int]]:
        return ([int(t) for t in rng.integers(0, 6, 40)],
                [int(t) for t in rng.integers(0, 6, 150)])

    counts = []
    for pairs, waiting in (([copy(0)], [False] * 400),
                           ([copy(i) if i % 2 else small_vocab() for i in range(8)],
                            [step % 3 == 0 for step in range(400)]),
                           ([copy(i) for i in range(8)], [True] * 400)):
        counts.append(_lockstep([p for p, _ in pairs], [o for _, o in pairs], waiting))
    assert all(n_drafted >= 5 for n_drafted, _ in counts) and counts[1][1] >= 5, counts
