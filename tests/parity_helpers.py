"""What the parity tests share (a helper module, not a test file): transformers' reference
model, Colibri's prompt forward and the error measures."""

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
