"""What the parity tests share (a helper module, not a test file): transformers' reference
model, Colibri's prompt forward and greedy decode, the error measures and the paged
batch-invariance check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from colibri.engine.executor.model import Model


def hf_model(path: Path) -> Any:
    """The checkpoint in transformers, float32, eager attention."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()


def prefill(m: Model, ids: np.ndarray, seq: int = 0, start: int = 0) -> np.ndarray:
    """Logits of ids run as one call in sequence slot seq from position start."""
    n = ids.size
    return m.forward(ids, np.full(n, seq, np.int32), np.arange(start, start + n, dtype=np.int32))


def rel_max(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def assert_paged_batch_invariant(both: Model, alone: Model,
                                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two random prompts (20 and 9 tokens, from seed) in one paged call of `both` (blocks of
    one shared pool, through block tables) give the logits each gives alone in sequence slot 0
    of `alone`, within 1e-5 of each one's largest logit. The first prompt and its logits
    alone, for further checks."""
    rng = np.random.default_rng(seed)
    vocab = both.config.n_vocab
    a = rng.integers(0, vocab, 20).astype(np.int32)
    b = rng.integers(0, vocab, 9).astype(np.int32)
    tables = np.array([[5, 2, -1, -1], [7, -1, -1, -1]], np.int32)
    logits = both.forward_paged(np.concatenate([a, b]), np.r_[np.zeros(20), np.ones(9)],
                                np.r_[np.arange(20), np.arange(9)], tables)
    ra = prefill(alone, a)
    alone.reset(0)
    rb = prefill(alone, b)
    np.testing.assert_allclose(logits[:20], ra, rtol=0, atol=1e-5 * np.abs(ra).max())
    np.testing.assert_allclose(logits[20:], rb, rtol=0, atol=1e-5 * np.abs(rb).max())
    return a, ra


def greedy_decode(m: Model, prompt: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill prompt as a fresh sequence in slot 0, then n greedy steps: the tokens and the
    last logits of every call."""
    m.reset(0)
    lg = m.forward(prompt, np.zeros(prompt.size, np.int32),
                   np.arange(prompt.size, dtype=np.int32))
    logits = [lg[-1].copy()]
    tok, pos, out = int(np.argmax(lg[-1])), prompt.size, []
    for _ in range(n):
        out.append(tok)
        lg = m.forward(np.array([tok], np.int32), np.zeros(1, np.int32),
                       np.array([pos], np.int32))
        logits.append(lg[-1].copy())
        tok, pos = int(np.argmax(lg[-1])), pos + 1
    return out, logits
