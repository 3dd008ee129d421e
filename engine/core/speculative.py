"""Which sequences speculate and what they draft; the counters of drafted and accepted tokens.

A decoding sequence drafts. Greedy ones keep a draft exactly when it is the argmax, so their
output is token for token what decoding one token at a time gives; sampled ones keep it by the
speculative sampling rule (engine.sample.verify), so their output follows the same
distribution. A sequence with a grammar drafts only the tokens the grammar would accept, and
each token is chosen under the grammar's mask of the tokens before it. Drafts never run past
the sequence's token budget, so a verify step never writes past its context. With method auto,
DraftPlanner cuts each sequence's drafts to the k the cost model (engine.spec.cost) expects to
pay in this step, 0 included.

A drafter is any object with `propose(tokens, k) -> list[int]`: up to k tokens to follow
`tokens` (the sequence's prompt and accepted output, which only ever grows between calls). One
that also has `find(prompt, output) -> match length` and `drafts(k)` (prompt lookup) is given
the prompt and output as they are, without joining them, and (auto) asked for no more drafts
than the cap the cost model allows, so a step in which nothing is drafted copies nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibri.engine.core.options import default
from colibri.engine.core.request import Request
from colibri.engine.spec import SPECULATIVE_METHODS, default_num_tokens
from colibri.engine.spec.cost import (
    MIN_GAIN,
    BatchPlan,
    Exploration,
    MatchPrior,
    MoEShape,
    RequestAcceptance,
    StepCost,
    StepCostMeter,
    UnionMeter,
    choose_k,
    draft_cap,
)
from colibri.engine.spec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramDrafter


@dataclass
class SpeculativeConfig:
    """How the step engine speculates (options speculative, num_speculative_tokens)."""

    method: str = default("speculative")
    # drafts per sequence and step, at most (None: the method's default_num_tokens)
    num_tokens: int = default("num_speculative_tokens")
    ngram_min: int = DEFAULT_MIN_N
    ngram_max: int = DEFAULT_MAX_N

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if self.num_tokens is None:
            self.num_tokens = default_num_tokens(self.method)
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_tokens}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def adaptive(self) -> bool:
        """k per sequence and step from the cost model, rather than always num_tokens."""
        return self.method == "auto"


@dataclass
class SpecStats:
    """Counters for /metrics and `colibri bench` (vLLM's spec_decode names where exported)."""

    n_drafts: int = 0  # sequence steps that carried drafts
    n_draft_tokens: int = 0  # tokens drafted and scored
    n_accepted: int = 0  # of which the model agreed with

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per sequence step that carried drafts (0 before any)."""
        return self.n_accepted / self.n_drafts if self.n_drafts else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"spec_drafts": self.n_drafts, "spec_draft_tokens": self.n_draft_tokens,
                "spec_accepted_tokens": self.n_accepted, "spec_mean_accepted": self.mean_accepted}


def new_drafter(config: SpeculativeConfig) -> Any:
    """The drafter a sequence gets under config (prompt lookup for ngram and auto)."""
    return NgramDrafter(config.ngram_min, config.ngram_max)


def draft_budget(req: Request, config: SpeculativeConfig) -> int:
    """How many tokens req may draft for its next step: 0 unless it decodes one token now; at
    most num_tokens, fewer than the tokens it may still generate."""
    if not req.prefill_done or req.num_tokens - req.num_computed != 1:
        return 0
    return max(0, min(config.num_tokens, req.max_new - len(req.output) - 1))


def allowed(req: Request, drafts: list[int]) -> list[int]:
    """drafts cut where req's grammar would refuse one (a draft it forbids is lost)."""
    constraint = getattr(req.params, "constraint", None)
    if drafts and constraint is not None:
        del drafts[constraint.valid_prefix(drafts):]
    return drafts


def propose(req: Request, config: SpeculativeConfig, capped: bool = False) -> list[int]:
    """Drafts for req's next step ([] unless it decodes one token now): draft_budget of them
    at most, none past what its grammar accepts. capped: no more than draft_cap allows for
    the match the drafter found and what req's last verify step kept (auto verifies no
    more), where the drafter can say its match before drafting."""
    k = draft_budget(req, config)
    if k <= 0:
        return []
    drafter = req.drafter
    if not hasattr(drafter, "propose"):  # none yet, or the MTP layer's progress
        req.drafter = drafter = new_drafter(config)
    find = getattr(drafter, "find", None)
    if find is None:
        return allowed(req, drafter.propose(req.tokens, k))
    match = find(req.prompt, req.output)
    if capped:
        ra = req.acceptance
        k = draft_cap(match, ra.last_kept if ra is not None else 0, k)
    return allowed(req, drafter.drafts(k))


def spare_state_slots(max_num_seqs: int) -> int:
    """Recurrent-state slots a model with linear-attention layers keeps to undo rejected
    drafts: one per sequence that may draft in a step. A quarter of the batch (at least one):
    a slot is a whole recurrent state (tens of MB on a large model), and in a full batch
    drafts rarely pay."""
    return max(1, max_num_seqs // 4)


def moe_shape(model_config: Any) -> MoEShape:
    """The MoEShape of a ModelConfig (engine.models.config)."""
    n_expert = int(getattr(model_config, "n_expert", 0) or 0)
    layers = model_config.moe_layers if n_expert else []
    return MoEShape(len(layers), n_expert, int(getattr(model_config, "n_expert_used", 0) or 0))


class DraftPlanner:
    """Drafts for every running sequence before a step: as many as config allows (ngram), or
    (auto) as many as the cost model finds worth their verify cost, sequence after sequence in
    scheduling order, each one's choice counting the tokens the step already carries. Learns
    the step's cost and the experts steps of each size read from the steps the engine
    reports (observe_step), and acceptance from verify steps (observe_verify): each
    request's own, and over all requests by each draft's evidence (the match length before
    it), which is each request's prior at the step — so a request whose match is long drafts
    at its first step, a copy that goes on drafts longer each step (up to draft_cap), and one
    whose drafts keep being rejected stops. A sequence that drafts nothing though it was
    offered drafts has its first draft scored against the token its step gave (see
    RequestAcceptance), so what is never drafted is learned too. Tries on optimism alone
    teach MatchPrior, which every request shares, so a batch makes one at most per step and
    waits after a failed one as a request does (Exploration): eight sequences of free text
    pay for the tries of one."""

    def __init__(self, shape: MoEShape, meter: StepCostMeter | None = None) -> None:
        self.shape = shape
        self.meter = meter or StepCostMeter()
        self.union = UnionMeter(shape)
        self.match_prior = MatchPrior()
        self.explore = Exploration()  # the batch's tries, beside each request's
        self._tried = False  # whether a sequence makes a try in the step being planned
        self.last_ks: list[int] = []  # the k chosen for each drafting sequence, last step

    def plan(self, running: list[Request], config: SpeculativeConfig,
             max_drafting: int | None = None, waiting: bool = False) -> None:
        """Set req.drafts of every running request (empty where it does not draft); at most
        max_drafting of them draft (None: any number). waiting: whether requests wait for a
        place (a sequence that finishes sooner then makes room: see BatchPlan)."""
        self.last_ks = []
        if not config.adaptive:
            n_drafting = 0
            for req in running:
                full = max_drafting is not None and n_drafting >= max_drafting
                req.drafts = [] if full else propose(req, config)
                n_drafting += bool(req.drafts)
            return
        offered: list[tuple[Request, list[float], int]] = []
        n = float(len(running))
        batch = BatchPlan(n, n, waiting)
        # where a token saved is worth only what it adds to a step, drafts pay by a thin
        # margin, which a request's lucky run of kept copies would overstate
        cautious = batch.marginal
        for req in running:
            if req.acceptance is not None and req.acceptance.unverified is not None:
                self._score_unverified(req)
            req.drafts = propose(req, config, capped=True)
            if req.drafts:
                offered.append((req, *self._chances(req, cautious)))
        if not offered:  # nothing to choose (free text, mostly): no more work this step
            return
        cost = self.meter.cost()
        self._tried = False
        n_drafting = 0
        for req, alphas, cap in offered:
            if max_drafting is not None and n_drafting >= max_drafting:
                req.drafts = []
                continue
            k = self._choose(req, cost, batch, alphas, cap)
            del req.drafts[k:]
            self.last_ks.append(k)
            n_drafting += k > 0
        if not self._tried:
            self.explore.tick()

    def _chances(self, req: Request, cautious: bool = False) -> tuple[list[float], int]:
        """The chance that each of req's drafts is kept once those before it were (the
        request's own rate at the draft's evidence, MatchPrior.lower its prior; cautious: less
        one standard error of it), as many as draft_cap allows."""
        if req.acceptance is None:
            req.acceptance = RequestAcceptance()
        ra = req.acceptance
        match = int(getattr(req.drafter, "match_len", 0) or 0)
        ra.evidence, ra.exploring = match, False
        mp = self.match_prior
        cap = draft_cap(match, ra.last_kept, len(req.drafts))
        alphas, rates = [], {}  # type: ignore[var-annotated]
        for b in mp.buckets(match, cap):
            if b not in rates:
                acc = ra.of(b)
                rates[b] = (acc.lower_given(mp.lower(b)) if cautious
                            else acc.rate_given(mp.lower(b)))
            alphas.append(rates[b])
        return alphas, cap

    def _choose(self, req: Request, cost: StepCost | None, batch: BatchPlan,
                alphas: list[float], cap: int) -> int:
        """How many of req's drafts to verify: what the cost model finds best for their
        chances (at most cap, and only where drafts beat none by MIN_GAIN), else one draft
        where only the optimism about little-tested evidence pays for it and both the request
        and the batch may try (no other sequence tries in this step: see RequestAcceptance,
        Exploration); 0 before any step was measured (the first steps measure one token)."""
        if cost is None:
            return 0
        ra, mp = req.acceptance, self.match_prior
        match = ra.evidence
        b = mp.bucket(match)
        k = choose_k(cost, self.union, alphas, cap, batch, min_gain=MIN_GAIN)
        if k == 0 and ra.may_explore(match) and self.explore.ready and not self._tried:
            k = choose_k(cost, self.union, [ra.of(b).rate_given(mp.upper(b))], 1, batch,
                         min_gain=MIN_GAIN)
            ra.exploring = self._tried = k > 0
        if k == 0:
            ra.of(b).idle()
            ra.no_drafts()
            ra.unverified = (len(req.output), req.drafts[0], b)
        return k

    def _score_unverified(self, req: Request) -> None:
        """The first draft req was offered in a step that verified none, against the token
        that step gave: kept or not, as a verify step of that one draft would have said."""
        ra = req.acceptance
        at, draft, bucket = ra.unverified
        ra.unverified = None
        if len(req.output) > at:
            kept = float(req.output[at] == draft)
            ra.of(bucket).add(kept, 1.0)
            self.match_prior.add(bucket, kept, 1.0)

    def observe_step(self, n_tokens: int, n_experts: float, seconds: float,
                     expert_seconds: float = 0.0, attention_seconds: float = 0.0) -> None:
        self.meter.observe(n_tokens, n_experts, seconds, expert_seconds, attention_seconds)
        self.union.observe(n_tokens, n_experts)

    def observe_verify(self, req: Request, n_drafts: int, n_accepted: int) -> None:
        ra = req.acceptance
        if ra is None:
            return
        for b, (kept, tested) in self.match_prior.outcomes(ra.evidence, n_drafts,
                                                           n_accepted).items():
            ra.of(b).add(kept, tested)
            self.match_prior.add(b, kept, tested)
        self.explore.outcome(n_accepted > 0, ra.exploring)
        ra.verified(n_drafts, n_accepted)
