"""When to speculate: the number of drafts k per sequence and step that maximises expected
tokens per second, from a measured cost of a step and the measured acceptance of each request.

A step costs step_s (whatever it carries: the weights every token reads once, Python's share)
plus expert_s per distinct routed expert it reads (a verify step reads the union of its tokens'
experts: UnionMeter, what steps of as many tokens read here, measured; before that the bound
E(1 - (1 - top_k/E)^T) per MoE layer for T tokens) plus token_s per token (compute: attention
over its context, products, sampling its row). Drafting k tokens for a sequence yields
a_1 + a_1 a_2 + ... + a_1...a_k more tokens on average, a_i being the chance that draft i is
kept once those before it were: the request's smoothed acceptance (Acceptance) at draft i's
evidence, whose prior is what drafts with as much evidence were kept over all requests
(MatchPrior), less one standard error (a little-measured rate near break-even does not draft),
and in a batch that nobody waits to join the request's rate less one standard error too (a lucky
run of kept drafts does not draft long where drafts pay by a thin margin). A draft's evidence is
the prompt-lookup match length before it: the match the drafter reported plus the drafts before
it, so a match that keeps being confirmed drafts longer. k is the one maximising (tokens the
step yields) / (its cost) — in a batch with no request waiting, the sequence's tokens over its
share of the step (what one more token adds to it: BatchPlan) — 0 unless drafts beat decoding
one token by MIN_GAIN, and at most draft_cap: twice the match length or twice what the request's
last verify step kept, at least two, so a fresh match drafts a little and a confirmed copy
doubles its drafts step by step up to the configured maximum. Drafts that only optimism about a
little-tested evidence would pay for are tried one at a time, from a match of two tokens on, and
a request waits longer after each such try that fails (Exploration). The first draft of a step
that verified none is scored against the token the step gave, so evidence never drafted on is
learned too.
StepCostMeter measures the three parts on the engine's own steps (the expert products and
attention as the C core times them, the rest fitted), weighted toward recent ones, so the
model follows what this machine, this context length and this expert cache (its loads fall in
the expert products' time) actually cost. Guarantees: never more drafts than offered; k = 0
whenever drafts do not pay by the model. Refuses nothing; it only decides speed, never tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


class ExpertUnion(Protocol):
    """What the cost of a step's experts depends on: distinct experts read by n tokens."""

    def experts_read(self, n_tokens: float) -> float: ...


@dataclass(frozen=True)
class MoEShape:
    """What the union of experts depends on: MoE layers, experts per layer, experts per token.
    A dense model has n_moe_layers = 0."""

    n_moe_layers: int
    n_expert: int
    top_k: int

    def experts_read(self, n_tokens: float) -> float:
        """Expected distinct experts a step of n_tokens reads over all MoE layers, routing
        taken as independent and uniform (drafts of one sequence share more: a bound)."""
        if self.n_moe_layers == 0 or self.n_expert == 0 or n_tokens <= 0:
            return 0.0
        miss = (1.0 - self.top_k / self.n_expert) ** n_tokens
        return self.n_moe_layers * self.n_expert * (1.0 - miss)


@dataclass(frozen=True)
class StepCost:
    """Seconds of a step: per step, per distinct expert read, per token."""

    step_s: float
    expert_s: float
    token_s: float

    def seconds(self, shape: ExpertUnion, n_tokens: float, resident: float = 1.0,
                miss_s: float = 0.0) -> float:
        """Expected seconds of a step of n_tokens. resident: the share of experts the cache
        holds (1 without an expert budget); each one it lacks costs miss_s more to load (for
        a profile made by hand: a measured expert_s already holds the loads)."""
        per_expert = self.expert_s + (1.0 - resident) * miss_s
        return (self.step_s + per_expert * shape.experts_read(n_tokens)
                + self.token_s * n_tokens)


def standard_error(rate: float, n: float) -> float:
    """The standard error of a rate measured over n trials (n > 0)."""
    return math.sqrt(rate * (1.0 - rate) / n)


def expected_accepted(alpha: float | Sequence[float], k: int) -> float:
    """Mean drafts kept of k when each is kept once those before it were (the longest
    agreeing prefix): with probability alpha each, alpha + alpha^2 + ... + alpha^k; with one
    probability per draft (alpha[i] for draft i), a_0 + a_0 a_1 + ... (k at most len(alpha))."""
    if k <= 0:
        return 0.0
    if not isinstance(alpha, (int, float)):
        total, run = 0.0, 1.0
        for a in alpha[:k]:
            run *= a
            total += run
        return total
    if alpha <= 0.0:
        return 0.0
    if alpha >= 1.0:
        return float(k)
    return alpha * (1.0 - alpha ** k) / (1.0 - alpha)


TINY_S = 1e-12  # the least a step's share is counted as costing (a share of 0: free tokens)


@dataclass
class BatchPlan:
    """The step being planned: tokens it carries so far and tokens it yields on average, and
    whether a token saved is worth a whole token's share of a step. It is while requests wait
    (a sequence that finishes sooner frees its place for one of them: throughput) and for a
    sequence alone; otherwise a sequence that finishes sooner saves only what its token adds to
    the steps the others run anyway (the marginal cost, taken as what one more token adds: the
    drafts' own margin): the steps end only when every sequence's do, and on the benchmark
    models, at eight streams with nobody waiting, valuing a kept draft above that (by how many
    sequences drafted, or by the chance that all of them kept one) verified drafts that cost
    2-9% of the decode speed."""

    n_tokens: float
    n_yield: float
    refill: bool = True

    @property
    def marginal(self) -> bool:
        """Whether a token saved is worth only what it adds to a step (nobody waits, and the
        sequence is not alone)."""
        return not self.refill and self.n_tokens > 1


def choose_k(cost: StepCost, shape: ExpertUnion, alpha: float | Sequence[float], k_max: int,
             batch: BatchPlan, resident: float = 1.0, miss_s: float = 0.0,
             min_gain: float = 0.0) -> int:
    """Drafts (0..k_max) for one more sequence of `batch` that maximise the expected tokens per
    second: of the whole step where batch.refill (or the sequence is alone), else of the
    sequence, whose share of the step is what one more token adds to it. Updates batch with
    the choice. alpha: the chance each draft is kept once those before it were, one for all
    or one per draft (then at most len(alpha) drafts). Ties go to fewer drafts; drafts must beat
    none by the factor 1 + min_gain."""
    per_draft = not isinstance(alpha, (int, float))
    if per_draft:
        k_max = min(k_max, len(alpha))  # type: ignore[arg-type]
    base_s = cost.seconds(shape, batch.n_tokens, resident, miss_s)
    if not batch.marginal:
        n_yield, share = batch.n_yield, base_s
    else:  # the others' tokens, and the step without this sequence's own, are paid anyway
        n_yield = 1.0
        # what one more token adds to the step, measured at the same margin as the drafts: the
        # experts steps of one size fewer read were measured over other tokens, and their
        # noise would pass for drafts being cheaper than the sequence's own token
        share = cost.seconds(shape, batch.n_tokens + 1, resident, miss_s) - base_s
    share = max(share, TINY_S)  # a token that costs nothing: drafts are worth what they keep
    best_k, best_rate = 0, n_yield / share * (1.0 + min_gain)
    best_yield, gained, run = 0.0, 0.0, 1.0
    for k in range(1, max(k_max, 0) + 1):
        if per_draft:
            run *= alpha[k - 1]  # type: ignore[index]
            gained += run
        else:
            gained = expected_accepted(alpha, k)  # type: ignore[arg-type]
        s = max(share + cost.seconds(shape, batch.n_tokens + k, resident, miss_s) - base_s,
                TINY_S)
        rate = (n_yield + gained) / s
        if rate > best_rate * (1.0 + 1e-9):
            best_k, best_rate, best_yield = k, rate, gained
    batch.n_tokens += best_k
    batch.n_yield += best_yield
    return best_k


def speedup(cost: StepCost, shape: ExpertUnion, alpha: float, k: int,
            resident: float = 1.0, miss_s: float = 0.0) -> float:
    """One sequence alone: E[accepted + 1] / (cost of a step with k drafts / one token's)."""
    one = cost.seconds(shape, 1, resident, miss_s)
    return (1.0 + expected_accepted(alpha, k)) / (cost.seconds(shape, 1 + k, resident,
                                                                miss_s) / one)


@dataclass
class Acceptance:
    """A request's smoothed acceptance rate: drafts kept over drafts tested (the first
    rejected one is tested, those after it are not), older steps weighing less, beside a
    prior that counts as `weight` tested drafts. The prior may differ from step to step (what
    the drafter's evidence for this step's drafts predicts: MatchPrior); its weight fades as
    the request's own verify steps accumulate and comes back while the request does not
    draft, so a request that stopped paying is tried again now and then."""

    prior: float = 0.5
    weight: float = 2.0  # the prior counts as this many tested drafts
    decay: float = 0.8  # per verify step: a request's last ~5 steps count most
    relax: float = 0.99  # per step without drafts: back toward the prior
    kept: float = field(init=False, default=0.0)  # the request's own, decayed
    tested: float = field(init=False, default=0.0)
    prior_mass: float = field(init=False)

    def __post_init__(self) -> None:
        self.prior_mass = self.weight

    def rate_given(self, prior: float | None = None) -> float:
        """The rate with `prior` (default: the fixed one) standing for what is not known."""
        p = self.prior if prior is None else prior
        den = self.tested + self.prior_mass
        return (self.kept + self.prior_mass * p) / den if den > 0 else p

    @property
    def rate(self) -> float:
        return self.rate_given()

    def lower_given(self, prior: float) -> float:
        """rate_given(prior) less one standard error of it: a request's own steps are few,
        and a lucky run of them (copies slip at random) would draft long where the drafts
        are kept no more often than anyone's."""
        r = self.rate_given(prior)
        return max(0.0, r - standard_error(r, self.tested + self.prior_mass))

    def observe(self, n_drafts: int, n_accepted: int) -> None:
        """A verify step that carried n_drafts drafts kept n_accepted of them."""
        if n_drafts > 0:
            self.add(n_accepted, n_accepted + (n_accepted < n_drafts))

    def add(self, kept: float, tested: float) -> None:
        """Of one verify step's drafts, `tested` were tested and `kept` of those kept."""
        self.kept = self.decay * self.kept + kept
        self.tested = self.decay * self.tested + tested
        self.prior_mass *= self.decay

    def idle(self) -> None:
        """A step in which the request could have drafted but did not."""
        r = self.relax
        self.kept *= r
        self.tested *= r
        self.prior_mass = r * self.prior_mass + (1 - r) * self.weight


# what a draft's evidence (the prompt-lookup match before it, engine.spec.ngram) predicts
# before anything was measured: a long match is a copy, and copies are kept. Bucket 0: no
# evidence (a drafter that gives none); then match lengths 1, 2-3, 4-7, 8-15, 16-31, 32+.
MATCH_PRIORS = (0.5, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)


class MatchPrior:
    """Acceptance by a draft's evidence, learned over every request's verify steps: per
    bucket of match length, drafts kept over drafts tested (counted as in Acceptance) beside
    MATCH_PRIORS[bucket] counting as `weight` tested drafts, older steps weighing less. A
    proposal of match length m drafts its draft i on the evidence m + i (the drafts before it,
    once kept, extend the match), so the chance that a copy goes on is learned at every
    length it reaches. It is the prior of each request's Acceptance at the step: a request
    drafts at once and long where its match is long, and stops sooner where such matches are
    not kept (free text)."""

    def __init__(self, priors: tuple[float, ...] = MATCH_PRIORS, weight: float = 4.0,
                 decay: float = 0.98) -> None:
        self.priors = priors
        self.weight = weight
        self.decay = decay
        self._kept = [0.0] * len(priors)
        self._tested = [0.0] * len(priors)

    def bucket(self, match_len: int | None) -> int:
        """The bucket of a match length (None or 0: no evidence)."""
        if not match_len or match_len <= 0:
            return 0
        return min(int(match_len).bit_length(), len(self.priors) - 1)

    def buckets(self, match_len: int | None, k: int) -> list[int]:
        """The buckets of k drafts proposed on a match of match_len (no evidence stays none)."""
        if not match_len or match_len <= 0:
            return [0] * k
        if isinstance(match_len, int):  # bucket() of each, without a call per draft
            top = len(self.priors) - 1
            return [min(n.bit_length(), top) for n in range(match_len, match_len + k)]
        return [self.bucket(match_len + i) for i in range(k)]

    def outcomes(self, match_len: int | None, n_drafts: int,
                 n_accepted: int) -> dict[int, tuple[int, int]]:
        """Per bucket, (kept, tested) of one verify step's drafts."""
        out: dict[int, tuple[int, int]] = {}
        tested = min(n_accepted + 1, n_drafts)
        for i, b in enumerate(self.buckets(match_len, max(tested, 0))):
            kept, n = out.get(b, (0, 0))
            out[b] = (kept + (i < n_accepted), n + 1)
        return out

    def rate(self, bucket: int) -> float:
        return ((self._kept[bucket] + self.weight * self.priors[bucket])
                / (self._tested[bucket] + self.weight))

    def _error(self, bucket: int) -> float:
        return standard_error(self.rate(bucket), self._tested[bucket] + self.weight)

    def upper(self, bucket: int) -> float:
        """rate plus one standard error of it: optimism where little was tested, so a bucket
        whose prior says no is still tried, cheaply (one draft: RequestAcceptance), until
        enough verify steps say what its drafts are worth."""
        return min(1.0, self.rate(bucket) + self._error(bucket))

    def lower(self, bucket: int) -> float:
        """rate less one standard error of it: what the cost model drafts on, so that drafts
        whose worth is near break-even and little measured (short matches in free text) are
        left out, while well-measured copies are drafted at their rate."""
        return max(0.0, self.rate(bucket) - self._error(bucket))

    def add(self, bucket: int, kept: float, tested: float) -> None:
        """Of one verify step's drafts in bucket, `tested` were tested and `kept` kept."""
        self._kept[bucket] = self.decay * self._kept[bucket] + kept
        self._tested[bucket] = self.decay * self._tested[bucket] + tested

    def observe(self, match_len: int | None, n_drafts: int, n_accepted: int) -> None:
        """A verify step: n_drafts drafts proposed on a match of match_len, n_accepted kept."""
        for b, (kept, tested) in self.outcomes(match_len, n_drafts, n_accepted).items():
            self.add(b, kept, tested)


CAP_MIN = 2  # drafts a fresh match may verify at most, before the cap grows
CAP_GROWTH = 2  # the cap: this many times the match length, or what the last step kept


def draft_cap(match_len: int | None, last_kept: int, k_max: int) -> int:
    """The most drafts a sequence verifies this step: twice its match length or twice what its
    last verify step kept, at least CAP_MIN, at most k_max. A confirmed copy's match grows by
    every token kept, so its cap doubles from step to step: a long copy drafts long after a
    few steps, and a fresh match risks a short verify step only."""
    return max(0, min(k_max, max(CAP_MIN, CAP_GROWTH * (match_len or 0),
                                 CAP_GROWTH * last_kept)))


# how much faster than decoding alone the cost model must expect drafts to be: the step
# costs and acceptance it goes by are estimates, and a choice near break-even loses as often
# as it wins, while a copy worth drafting gains far more than this
MIN_GAIN = 0.05
EXPLORE_MIN_MATCH = 2  # a match this long at least before drafts are tried on optimism alone
EXPLORE_WAIT = 4  # steps a request waits after a failed try; doubled by each further one


@dataclass
class Exploration:
    """When drafts that only optimism pays for may be tried: at once at first; after a try
    that keeps nothing, EXPLORE_WAIT steps later, twice as long after each further failure; a
    kept draft resets the wait."""

    wait: int = 0  # steps before the next try may come
    backoff: int = EXPLORE_WAIT  # the wait after the next failed try

    @property
    def ready(self) -> bool:
        return self.wait <= 0

    def tick(self) -> None:
        """A step passed without a try."""
        self.wait -= 1

    def outcome(self, kept: bool, explored: bool) -> None:
        """A verify step: whether it kept a draft, and whether its drafts were a try."""
        if kept:
            self.backoff = EXPLORE_WAIT
        elif explored:
            self.wait, self.backoff = self.backoff, 2 * self.backoff


@dataclass
class RequestAcceptance:
    """A request's Acceptance per MatchPrior bucket (its copies and its guesses are kept at
    different rates: rejected short matches say little about its long ones), the evidence of
    the drafts it has in flight, what its last verify step kept, and its exploration: drafts
    that only the optimism of MatchPrior.upper pays for are one draft at a time, on a match
    of EXPLORE_MIN_MATCH at least, and waits after failed tries (Exploration), so free text
    pays for few tries. A step that verifies nothing still teaches: the first draft it was
    offered is scored against the token the step gave, which is what verifying that one draft
    would have kept (for a sampled request, with the same chance), so the rates of evidence
    the cost model never drafts on are learned without paying for drafts."""

    by_bucket: dict[int, Acceptance] = field(default_factory=dict)
    evidence: int = 0  # the match length of the drafts in flight
    exploring: bool = False  # whether they are a try on optimism alone
    last_kept: int = 0  # drafts the last verify step kept
    explore: Exploration = field(default_factory=Exploration)
    # a step that drafted nothing though prompt lookup offered drafts: the output's length
    # then, the first draft and its bucket, to be scored against the token the step gave
    unverified: tuple[int, int, int] | None = None

    def of(self, bucket: int) -> Acceptance:
        got = self.by_bucket.get(bucket)
        if got is None:
            self.by_bucket[bucket] = got = Acceptance()
        return got

    def may_explore(self, match_len: int | None) -> bool:
        return (match_len or 0) >= EXPLORE_MIN_MATCH and self.explore.ready

    def no_drafts(self) -> None:
        """A step in which the request had drafts offered and verified none."""
        self.explore.tick()

    def verified(self, n_drafts: int, n_accepted: int) -> None:
        """The verify step of the drafts in flight: n_accepted of n_drafts kept."""
        self.last_kept = n_accepted
        self.explore.outcome(n_accepted > 0, self.exploring)
        self.exploring = False


class UnionMeter:
    """Distinct experts a step of n tokens reads over all MoE layers, as measured on the
    engine's own steps (the products' expert bytes over one expert's): per token count, the
    mean of its steps, older ones weighing less. A token count not measured takes the
    uniform-routing bound (MoEShape.experts_read) scaled by what was measured at the nearest
    count, kept between its measured neighbours; before any measurement, the bound itself.
    Drafts of one sequence tend to pick the same experts, so the measured union is usually
    below the bound, and drafts cheaper than it says."""

    def __init__(self, shape: MoEShape, forget: float = 0.9, max_tokens: int = 64) -> None:
        self.shape = shape
        self.forget = forget
        self.max_tokens = max_tokens
        self._w: dict[int, float] = {}
        self._sum: dict[int, float] = {}
        self._known: dict[float, float] = {}  # answers since the last step (planning asks often)

    def observe(self, n_tokens: int, n_experts: float) -> None:
        if not 0 < n_tokens <= self.max_tokens or not n_experts > 0:
            return
        self._known.clear()
        f = self.forget
        self._w[n_tokens] = f * self._w.get(n_tokens, 0.0) + 1.0
        self._sum[n_tokens] = f * self._sum.get(n_tokens, 0.0) + float(n_experts)

    def measured(self, n_tokens: int) -> float | None:
        """The measured mean at exactly n_tokens, None if never measured."""
        w = self._w.get(n_tokens)
        return self._sum[n_tokens] / w if w else None

    def experts_read(self, n_tokens: float) -> float:
        got = self._known.get(n_tokens)
        if got is None:
            self._known[n_tokens] = got = self._experts_read(int(round(n_tokens)))
        return got

    def _experts_read(self, n: int) -> float:
        if n <= 0 or self.shape.n_moe_layers == 0:
            return 0.0
        got = self.measured(n)
        return got if got is not None else self._estimate(n)

    def _estimate(self, n: int) -> float:
        bound = self.shape.experts_read(n)
        if not self._w:
            return bound
        near = min(self._w, key=lambda m: (abs(m - n), -m))
        guess = bound * (self._sum[near] / self._w[near]) / self.shape.experts_read(near)
        below = [v for m in self._w if m < n and (v := self.measured(m)) is not None]
        above = [v for m in self._w if m > n and (v := self.measured(m)) is not None]
        lo = max(below, default=0.0)
        hi = min(above, default=float(self.shape.n_moe_layers * self.shape.n_expert))
        return max(lo, min(guess, hi))


class StepCostMeter:
    """Measures StepCost on the engine's own steps. The C core times the expert products and
    attention over the KV cache in place. Attention's share of token_s is a ratio of measured
    sums (attention seconds / tokens); the expert products' seconds are fitted as expert_s *
    experts read + a per-token part (their compute grows with the tokens each expert
    multiplies: in a large batch, where every step reads nearly every expert, that part is
    what a draft costs), and what remains of a step's seconds (other weights, norms, Python,
    sampling) as step_s + rest_s * tokens, both by least squares pulled gently toward no
    per-token part, so that they answer while every step has one token (expert_s is then the
    ratio of expert seconds to experts read). Sums are weighted toward recent steps
    (a forgetting factor), so the costs follow the context growing and the machine's load.
    Steps of more than `max_tokens` tokens (prompt chunks) are not what drafts change and
    are left out. A prior, when given, counts as `prior_weight` steps of its own; an infinite
    weight pins the cost to it (a profile measured elsewhere)."""

    def __init__(self, prior: StepCost | None = None, forget: float = 0.97,
                 prior_weight: float = 0.0, max_tokens: int = 64) -> None:
        self.forget = forget
        self.max_tokens = max_tokens
        self.n_obs = 0
        # forgetting sums: experts, expert seconds, tokens, attention seconds; for the expert
        # fit: sum e^2, sum e n, sum e t, sum n t (t: expert seconds); for the rest's fit:
        # steps, sum n, sum n^2, sum r, sum n r
        self._e = self._te = self._n = self._ta = 0.0
        self._see = self._sen = self._set = self._snt = 0.0
        self._w = self._sn = self._snn = self._sr = self._snr = 0.0
        self._prior = prior
        self._pinned = prior is not None and prior_weight == float("inf")
        if prior is not None and 0 < prior_weight < float("inf"):
            w = prior_weight
            self._e, self._te = w, w * prior.expert_s
            self._see, self._sen, self._set, self._snt = w, w, w * prior.expert_s, \
                w * prior.expert_s
            self._n, self._ta = w, w * prior.token_s
            self._w, self._sn, self._snn, self._sr, self._snr = w, w, w, w * prior.step_s, \
                w * prior.step_s

    def observe(self, n_tokens: int, n_experts: float, seconds: float,
                expert_seconds: float = 0.0, attention_seconds: float = 0.0) -> None:
        """One step: its tokens, the distinct experts its products read, its seconds, and of
        those the expert products' and attention's seconds (as the C core timed them)."""
        if not 0 < n_tokens <= self.max_tokens or not 0 < seconds < float("inf"):
            return
        f = self.forget
        n = float(n_tokens)
        r = seconds - expert_seconds - attention_seconds
        self._e = f * self._e + n_experts
        self._te = f * self._te + expert_seconds
        self._see = f * self._see + n_experts * n_experts
        self._sen = f * self._sen + n_experts * n
        self._set = f * self._set + n_experts * expert_seconds
        self._snt = f * self._snt + n * expert_seconds
        self._n = f * self._n + n
        self._ta = f * self._ta + attention_seconds
        self._w = f * self._w + 1.0
        self._sn = f * self._sn + n
        self._snn = f * self._snn + n * n
        self._sr = f * self._sr + r
        self._snr = f * self._snr + n * r
        self.n_obs += 1

    def cost(self) -> StepCost | None:
        """The measured cost (each part at least 0); None before any step or prior."""
        if self._w <= 0 or self._pinned:
            return self._prior
        expert_s, expert_token_s = self._expert_fit()
        attention_s = self._ta / self._n if self._n > 0 else 0.0
        # least squares of r = step_s + rest_s n, with a ridge of one step's weight on rest_s
        mean_n, mean_r = self._sn / self._w, self._sr / self._w
        var_n = self._snn / self._w - mean_n * mean_n
        cov = self._snr / self._w - mean_n * mean_r
        rest_s = max(cov / (var_n + 1.0 / self._w), 0.0) if var_n > 0 else 0.0
        step_s = max(mean_r - rest_s * mean_n, 0.0)
        return StepCost(step_s, expert_s, attention_s + rest_s + expert_token_s)

    def _expert_fit(self) -> tuple[float, float]:
        """(expert_s, per-token part) of the expert products' seconds: least squares of
        t = expert_s e + c n with a small ridge on c, each part at least 0."""
        if self._e <= 0:
            return 0.0, 0.0
        ratio = max(self._te / self._e, 0.0)
        see, sen, snn = self._see, self._sen, self._snn
        ridge = 1e-6 * snn
        det = see * (snn + ridge) - sen * sen
        if det <= 0:
            return ratio, 0.0
        a = (self._set * (snn + ridge) - sen * self._snt) / det
        c = (see * self._snt - sen * self._set) / det
        if c <= 0:
            return ratio, 0.0
        if a < 0:
            return 0.0, max(self._snt / snn, 0.0)
        return a, c
