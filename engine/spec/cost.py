"""When to speculate: the number of drafts k per sequence and step that maximises expected
tokens per second, from a measured cost of a step and the measured acceptance of each request.

A step costs step_s (whatever it carries: the weights every token reads once, Python's share)
plus expert_s per distinct routed expert it reads (a verify step reads the union of its tokens'
experts: E(1 - (1 - top_k/E)^T) per MoE layer for T tokens) plus token_s per token (compute:
attention over its context, products, sampling its row). Drafting k tokens for a sequence
yields alpha + alpha^2 + ... + alpha^k more tokens on average (alpha: that request's smoothed
acceptance rate). k is the one maximising (tokens the step yields) / (its cost), 0 when none
beats decoding one token. The cost's three parts are fitted to the engine's own steps
(exponentially weighted least squares), so the model follows what this machine and this
context length actually cost. Guarantees: never more drafts than offered; k = 0 whenever
drafts do not pay by the model. Refuses nothing; it only decides speed, never tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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

    def seconds(self, shape: MoEShape, n_tokens: float, resident: float = 1.0,
                miss_s: float = 0.0) -> float:
        """Expected seconds of a step of n_tokens. resident: the share of experts the cache
        holds (1 without an expert budget); each one it lacks costs miss_s more to load."""
        per_expert = self.expert_s + (1.0 - resident) * miss_s
        return (self.step_s + per_expert * shape.experts_read(n_tokens)
                + self.token_s * n_tokens)


def expected_accepted(alpha: float, k: int) -> float:
    """Mean drafts kept of k when each is kept with probability alpha once those before it
    were (the longest agreeing prefix): alpha + alpha^2 + ... + alpha^k."""
    if k <= 0 or alpha <= 0.0:
        return 0.0
    if alpha >= 1.0:
        return float(k)
    return alpha * (1.0 - alpha ** k) / (1.0 - alpha)


@dataclass
class BatchPlan:
    """The step being planned: tokens it carries so far and tokens it yields on average."""

    n_tokens: float
    n_yield: float


def choose_k(cost: StepCost, shape: MoEShape, alpha: float, k_max: int, batch: BatchPlan,
             resident: float = 1.0, miss_s: float = 0.0) -> int:
    """Drafts (0..k_max) for one more sequence of `batch` that maximise the step's expected
    tokens per second; updates batch with the choice. Ties go to fewer drafts."""
    base_s = cost.seconds(shape, batch.n_tokens, resident, miss_s)
    best_k, best_rate = 0, batch.n_yield / base_s if base_s > 0 else 0.0
    for k in range(1, max(k_max, 0) + 1):
        s = cost.seconds(shape, batch.n_tokens + k, resident, miss_s)
        rate = (batch.n_yield + expected_accepted(alpha, k)) / s if s > 0 else 0.0
        if rate > best_rate * (1.0 + 1e-9):
            best_k, best_rate = k, rate
    batch.n_tokens += best_k
    batch.n_yield += expected_accepted(alpha, best_k)
    return best_k


def speedup(cost: StepCost, shape: MoEShape, alpha: float, k: int,
            resident: float = 1.0, miss_s: float = 0.0) -> float:
    """One sequence alone: E[accepted + 1] / (cost of a step with k drafts / one token's)."""
    one = cost.seconds(shape, 1, resident, miss_s)
    return (1.0 + expected_accepted(alpha, k)) / (cost.seconds(shape, 1 + k, resident,
                                                                miss_s) / one)


@dataclass
class Acceptance:
    """A request's smoothed acceptance rate: drafts kept over drafts tested (the first
    rejected one is tested, those after it are not), older steps weighing less. Starts at
    the prior; drifts back to it while the request does not speculate, so a request that
    stopped paying is tried again now and then."""

    prior: float = 0.5
    weight: float = 2.0  # the prior counts as this many tested drafts
    decay: float = 0.8  # per verify step: a request's last ~5 steps count most
    relax: float = 0.97  # per step without drafts: back toward the prior
    kept: float = field(init=False)
    tested: float = field(init=False)

    def __post_init__(self) -> None:
        self.kept = self.prior * self.weight
        self.tested = self.weight

    @property
    def rate(self) -> float:
        return self.kept / self.tested if self.tested > 0 else self.prior

    def observe(self, n_drafts: int, n_accepted: int) -> None:
        """A verify step that carried n_drafts drafts kept n_accepted of them."""
        if n_drafts <= 0:
            return
        self.kept = self.decay * self.kept + n_accepted
        self.tested = self.decay * self.tested + n_accepted + (n_accepted < n_drafts)

    def idle(self) -> None:
        """A step in which the request could have drafted but did not."""
        r = self.relax
        self.kept = r * self.kept + (1 - r) * self.prior * self.weight
        self.tested = r * self.tested + (1 - r) * self.weight


class StepCostMeter:
    """Fits StepCost to observed steps: seconds = step_s + expert_s * experts + token_s *
    tokens, by least squares weighted toward recent steps (a forgetting factor), pulled toward
    a prior so that it answers before the data can tell the three parts apart. The prior is
    set from the first step seen that reads experts (a third each to the step, its experts
    and its tokens) unless given."""

    def __init__(self, prior: StepCost | None = None, forget: float = 0.98,
                 prior_weight: float = 2.0) -> None:
        self.forget = forget
        self.prior_weight = prior_weight
        self._a = np.zeros((3, 3))  # sum of w x x^T
        self._b = np.zeros(3)  # sum of w x y
        self._prior: np.ndarray | None = None
        self._scale = np.ones(3)
        self.n_obs = 0
        if prior is not None:
            self._set_prior(prior, 1.0, 1.0)

    def _set_prior(self, prior: StepCost, experts: float, tokens: float) -> None:
        # features are scaled to a typical step so the ridge weighs the parts alike
        self._scale = np.array([1.0, max(experts, 1.0), max(tokens, 1.0)])
        self._prior = np.array([prior.step_s, prior.expert_s, prior.token_s]) * self._scale

    def observe(self, n_tokens: int, n_experts: float, seconds: float) -> None:
        """One step: its tokens, the distinct experts its products read, its seconds."""
        if n_tokens <= 0 or seconds <= 0 or not np.isfinite(seconds):
            return
        if self._prior is None:
            third = seconds / 3.0
            self._set_prior(StepCost(third, third / n_experts if n_experts > 0 else 0.0,
                                     third / n_tokens), n_experts, n_tokens)
        x = np.array([1.0, n_experts, float(n_tokens)]) / self._scale
        self._a = self.forget * self._a + np.outer(x, x)
        self._b = self.forget * self._b + x * seconds
        self.n_obs += 1

    def cost(self) -> StepCost | None:
        """The fitted cost (each part at least 0); None before any observation or prior."""
        if self._prior is None:
            return None
        lam = self.prior_weight
        c = self._prior.copy()
        # non-negative least squares by active set: a part fitted below 0 is held at 0
        free = np.ones(3, dtype=bool)
        for _ in range(3):
            a = self._a[np.ix_(free, free)] + lam * np.eye(int(free.sum()))
            rhs = self._b[free] + lam * self._prior[free]  # held parts are 0: no term
            c = np.zeros(3)
            c[free] = np.linalg.solve(a, rhs)
            if (c >= 0).all():
                break
            free &= c > 0
        c = np.maximum(c, 0.0) / self._scale
        return StepCost(float(c[0]), float(c[1]), float(c[2]))
