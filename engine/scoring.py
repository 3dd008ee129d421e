"""Prompt logprobs: each prompt token's log-probability under the model, from the logits of a
forward pass that kept every position (the first token has none: nothing predicts it).

Computed in float64 over blocks of rows, so a long prompt never holds a [T, vocab] float64
array at once. Logprobs are of the raw model distribution (no bias, penalty or constraint).
"""

from __future__ import annotations

import numpy as np

_ROWS = 256

# (logprob of the prompt token, [(token id, logprob) of the top k]) per position; None first
PromptLogprobs = list[tuple[float, list[tuple[int, float]]] | None]


def prompt_logprobs(logits: np.ndarray, prompt: list[int], k: int) -> PromptLogprobs:
    """logits [T, V] of prompt (T tokens): row i predicts prompt[i + 1]."""
    n = len(prompt)
    if logits.shape[0] != n:
        raise ValueError(f"logits have {logits.shape[0]} rows for {n} prompt tokens")
    out: PromptLogprobs = [None]
    targets = np.asarray(prompt[1:], dtype=np.int64)
    for lo in range(0, n - 1, _ROWS):
        hi = min(lo + _ROWS, n - 1)
        x = logits[lo:hi].astype(np.float64)
        x -= x.max(axis=1, keepdims=True)
        x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
        chosen = x[np.arange(hi - lo), targets[lo:hi]]
        if k > 0:
            kk = min(k, x.shape[1])
            part = np.argpartition(-x, kk - 1, axis=1)[:, :kk]
            for r in range(hi - lo):
                row = x[r]
                # best first, ties to the lower id (as the sampler orders its top logprobs)
                idx = part[r][np.lexsort((part[r], -row[part[r]]))]
                out.append((float(chosen[r]), [(int(i), float(row[i])) for i in idx]))
        else:
            out.extend((float(c), []) for c in chosen)
    return out
