"""Verifying a drafted token for a sampled sequence: the speculative sampling rule.

The drafter is deterministic (its distribution q is a point mass on the draft d), so the rule
of Leviathan et al. and Chen et al. (accept d with probability min(1, p(d) / q(d)), else draw
from the normalised max(0, p - q)) becomes: keep d with probability p(d), else draw from p with
d removed. Either way the token has exactly the distribution p that Sampler draws from (after
bias, penalties, temperature, top_k, top_p and min_p), whatever the draft: the output of a
sampled request follows the model's distribution with or without speculation, though a given
seed gives other tokens. Greedy sequences take the argmax, as Sampler does. A request's
constraint masks the adjusted logits first, as in the batched sampler; logprobs are the
log-softmax of the adjusted (and masked) logits, as there.
"""

from __future__ import annotations

import numpy as np

from colibri.engine.sample.sampler import Sampler, SampleResult


def sample_with_draft(sampler: Sampler, logits: np.ndarray, history: list[int],
                      draft: int) -> SampleResult:
    """The next token of a sequence whose next drafted token is `draft`, from its logits row
    [vocab] and its history (prompt + generated ids): `draft` itself when the rule keeps it.
    Advances the sampler's counts and generator as Sampler.sample does."""
    x = sampler.adjusted_logits(logits, history)
    if sampler.params.constraint is not None:
        sampler.params.constraint.apply(x)  # as the batched sampler does: the grammar's mask first

    def keep_or_redraw(z: np.ndarray) -> int:
        cand, weights = sampler.candidates(z)
        at = np.flatnonzero(cand == draft)
        p_draft = float(weights[at[0]] / np.sum(weights)) if at.size else 0.0
        if sampler.coin(p_draft):
            return int(draft)
        rest = cand != draft  # p(draft) < 1 here, so some other candidate has weight
        return sampler.draw_from(cand[rest], weights[rest])

    return sampler.pick(x, keep_or_redraw)
