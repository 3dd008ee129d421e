"""Which sequences speculate and what they draft; the counters of drafted and accepted tokens.

A decoding sequence drafts. Greedy ones keep a draft exactly when it is the argmax, so their
output is token for token what decoding one token at a time gives; sampled ones keep it by the
speculative sampling rule (engine.sample.verify), so their output follows the same
distribution. A sequence with a grammar drafts only the tokens the grammar would accept, and
each token is chosen under the grammar's mask of the tokens before it. Drafts never run past
the sequence's token budget, so a verify step never writes past its context.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri.engine.core.options import default
from colibri.engine.core.request import Request
from colibri.engine.spec import SPECULATIVE_METHODS
from colibri.engine.spec.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N, NgramDrafter


@dataclass
class SpeculativeConfig:
    """How the step engine speculates (options speculative, num_speculative_tokens)."""

    method: str = default("speculative")
    num_tokens: int = default("num_speculative_tokens")  # drafts per sequence and step, at most
    ngram_min: int = DEFAULT_MIN_N
    ngram_max: int = DEFAULT_MAX_N

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_tokens}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


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


def propose(req: Request, config: SpeculativeConfig) -> list[int]:
    """Prompt-lookup drafts for req's next step (draft_budget of them at most, none past what
    its grammar accepts)."""
    k = draft_budget(req, config)
    if k <= 0:
        return []
    if not hasattr(req.drafter, "propose"):  # none yet, or the MTP layer's progress
        req.drafter = NgramDrafter(config.ngram_min, config.ngram_max)
    return allowed(req, req.drafter.propose(req.tokens, k))
