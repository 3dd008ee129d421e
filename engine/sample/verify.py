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

from colibri.engine.sample.sampler import (
    GREEDY_TEMPERATURE,
    Sampler,
    SampleResult,
    _log_softmax,
    _top_indices,
)


def sample_with_draft(sampler: Sampler, logits: np.ndarray, history: list[int],
                      draft: int) -> SampleResult:
    """The next token of a sequence whose next drafted token is `draft`, from its logits row
    [vocab] and its history (prompt + generated ids): `draft` itself when the rule keeps it.
    Advances the sampler's counts and generator as Sampler.sample does."""
    p = sampler.params
    x = sampler.adjusted_logits(logits, history)
    if p.constraint is not None:
        p.constraint.apply(x)  # as the batched sampler does: the grammar's mask first
    m = np.max(x)
    if not np.isfinite(m):
        raise ValueError("logits have no finite maximum")
    if p.temperature < GREEDY_TEMPERATURE:
        token = int(np.argmax(x))  # first maximum: ties go to the lowest id
    else:
        cand, weights = sampler.candidates(x)
        at = np.flatnonzero(cand == draft)
        p_draft = float(weights[at[0]] / np.sum(weights)) if at.size else 0.0
        if sampler._rng.random() < p_draft:
            token = int(draft)
        else:  # p(draft) < 1 here, so some other candidate has weight
            rest = cand != draft
            token = sampler.draw_from(cand[rest], weights[rest])
    if p.logprobs is None:
        return SampleResult(token)
    logp = _log_softmax(x, float(m))
    k = min(p.logprobs, sampler.vocab_size)
    idx = _top_indices(logp, k) if k > 0 else np.empty(0, dtype=np.int64)
    return SampleResult(token, float(logp[token]), [(int(i), float(logp[i])) for i in idx])
