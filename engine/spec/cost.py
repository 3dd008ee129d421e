"""When to speculate: the number of drafts k per sequence and step that maximises expected
tokens per second, from a measured cost of a step and the measured acceptance of each request.

A step costs step_s (whatever it carries: the weights every token reads once, Python's share)
plus expert_s per distinct routed expert it reads (a verify step reads the union of its tokens'
experts: E(1 - (1 - top_k/E)^T) per MoE layer for T tokens) plus token_s per token (compute:
attention over its context, products, sampling its row). Drafting k tokens for a sequence
yields alpha + alpha^2 + ... + alpha^k more tokens on average (alpha: that request's smoothed
acceptance rate). k is the one maximising (tokens the step yields) / (its cost), 0 when none
beats decoding one token. StepCostMeter measures the three parts on the engine's own steps
(the expert products and attention as the C core times them, the rest fitted), weighted
toward recent ones, so the model follows what this machine, this context length and this
expert cache (its loads fall in the expert products' time) actually cost. Guarantees: never
more drafts than offered; k = 0 whenever drafts do not pay by the model. Refuses nothing; it
only decides speed, never tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
        holds (1 without an expert budget); each one it lacks costs miss_s more to load (for
        a profile made by hand: a measured expert_s already holds the loads)."""
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
    """Measures StepCost on the engine's own steps. The C core times the expert products and
    attention over the KV cache in place, so two parts are ratios of measured sums: expert_s
    = expert seconds / experts read, and attention's share of token_s = attention seconds /
    tokens. What remains of a step's seconds (other weights, norms, Python, sampling) is
    fitted as step_s + rest_s * tokens by least squares, pulled gently toward rest_s = 0 so
    that it answers while every step has one token. Sums are weighted toward recent steps
    (a forgetting factor), so the costs follow the context growing and the machine's load.
    Steps of more than `max_tokens` tokens (prompt chunks) are not what drafts change and
    are left out. A prior, when given, counts as `prior_weight` steps of its own; an infinite
    weight pins the cost to it (a profile measured elsewhere)."""

    def __init__(self, prior: StepCost | None = None, forget: float = 0.97,
                 prior_weight: float = 0.0, max_tokens: int = 64) -> None:
        self.forget = forget
        self.max_tokens = max_tokens
        self.n_obs = 0
        # forgetting sums: experts, expert seconds, tokens, attention seconds, and for the
        # rest's fit: steps, sum n, sum n^2, sum r, sum n r
        self._e = self._te = self._n = self._ta = 0.0
        self._w = self._sn = self._snn = self._sr = self._snr = 0.0
        self._prior = prior
        self._pinned = prior is not None and prior_weight == float("inf")
        if prior is not None and 0 < prior_weight < float("inf"):
            w = prior_weight
            self._e, self._te = w, w * prior.expert_s
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
        expert_s = self._te / self._e if self._e > 0 else 0.0
        attention_s = self._ta / self._n if self._n > 0 else 0.0
        # least squares of r = step_s + rest_s n, with a ridge of one step's weight on rest_s
        mean_n, mean_r = self._sn / self._w, self._sr / self._w
        var_n = self._snn / self._w - mean_n * mean_n
        cov = self._snr / self._w - mean_n * mean_r
        rest_s = max(cov / (var_n + 1.0 / self._w), 0.0) if var_n > 0 else 0.0
        step_s = max(mean_r - rest_s * mean_n, 0.0)
        return StepCost(step_s, max(expert_s, 0.0), attention_s + rest_s)
