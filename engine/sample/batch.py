"""The batched sampler: one call samples every row of a step's logits [B, V], each row with its
own request's parameters, penalties, constraint and random generator.

Guarantees: a row's token and logprobs depend only on that row's logits and its request's
state, never on the other rows (batch invariance: per-row generators, per-row reductions);
the work is vectorised over [B, V] where rows share it (bias/penalties applied as arrays,
log-softmax and greedy argmax for all rows at once) and no Python loop runs over the
vocabulary. Refuses: NaN logits (that row's request fails, the others go on).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sample.sampler import Sampler, SampleResult, _top_indices


@dataclass
class RowResult:
    """A sampled row, or the error that failed its request."""

    result: SampleResult | None
    error: BaseException | None = None


def _log_softmax_rows(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row; rows without a finite maximum come back as NaN."""
    z = x.astype(np.float64)
    m = np.max(z, axis=1, keepdims=True)
    bad = ~np.isfinite(m[:, 0])
    m[bad] = 0.0
    z -= m
    out = z - np.log(np.sum(np.exp(z), axis=1, keepdims=True))
    out[bad] = np.nan
    return out


def sample_rows(logits: np.ndarray, samplers: list[Sampler],
                histories: list[list[int]]) -> list[RowResult]:
    """Sample one token per row. logits: float32 [B, V]; samplers[i] and histories[i] (prompt +
    generated ids) belong to row i. The samplers' penalty counts advance as in Sampler."""
    n_rows = logits.shape[0]
    adjusted = np.empty_like(logits, dtype=np.float32)
    errors: list[BaseException | None] = [None] * n_rows
    for i, s in enumerate(samplers):
        try:
            # bias and penalties touch a few entries or one vectorised pass per row; a row's
            # constraint masks its row in place (disallowed tokens -> -inf)
            adjusted[i] = s.adjusted_logits(logits[i], histories[i])
            constraint = getattr(s.params, "constraint", None)
            if constraint is not None:
                constraint.apply(adjusted[i])
        except Exception as exc:  # noqa: BLE001 - this row's request fails alone
            errors[i] = exc
            adjusted[i] = 0.0
    logp = _log_softmax_rows(adjusted)
    greedy = np.argmax(adjusted, axis=1)  # first maximum: ties go to the lowest id
    out: list[RowResult] = []
    for i, s in enumerate(samplers):
        if errors[i] is not None:
            out.append(RowResult(None, errors[i]))
            continue
        row = logp[i]
        if np.isnan(row[0]):
            out.append(RowResult(None, ValueError("logits have no finite maximum")))
            continue
        p = s.params
        try:
            token = int(greedy[i]) if p.temperature == 0.0 else s._draw(adjusted[i])
        except Exception as exc:  # noqa: BLE001
            out.append(RowResult(None, exc))
            continue
        top = None
        if p.logprobs is not None:
            k = min(p.logprobs, row.shape[0])
            idx = _top_indices(row, k) if k > 0 else np.empty(0, dtype=np.int64)
            # a constraint's masked tokens (-inf) have no logprob to report
            top = [(int(j), float(row[j])) for j in idx if row[j] > -np.inf]
        out.append(RowResult(SampleResult(token, float(row[token]), top)))
    return out


def prompt_logprobs(logits: np.ndarray, targets: np.ndarray, k: int) -> list[tuple[float, list]]:
    """For each row r: logprob of targets[r] under logits[r] and the top-k (id, logprob)."""
    logp = _log_softmax_rows(logits.astype(np.float32, copy=False))
    res = []
    for r in range(logp.shape[0]):
        row = logp[r]
        idx = _top_indices(row, k) if k > 0 else np.empty(0, dtype=np.int64)
        res.append((float(row[int(targets[r])]), [(int(j), float(row[j])) for j in idx]))
    return res
