"""What the multi-token-prediction tests share (a helper module, not a test file): the tiny
checkpoints with an MTP layer, made on first use under the session's tiny checkpoints; the
layer silenced so that it repeats the last token; one paged forward call that returns hidden
states; an engine with MTP drafts watched step by step, and the check that each draft is a
torch reference layer's (tests/test_mtp.py for DeepSeek-V3 and GLM-4.5,
tests/test_mtp_qwen3_next.py for Qwen3-Next and Qwen3.5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tests.test_speculative import _run
from tests.tiny_models import TinyCheckpoints

N_CTX = 256
TOL = 1e-4


def silence_layer(tensors: dict[str, Any], prefix: str) -> None:
    """Zero the output and down projections of the decoder layer whose tensors start with
    prefix, in place: the layer then adds nothing to the residual stream."""
    import torch

    for name in tensors:
        if name.startswith(prefix) and name.endswith(("o_proj.weight", "down_proj.weight",
                                                      "experts.down_proj")):
            tensors[name] = torch.zeros_like(tensors[name])


class MtpCheckpoints:
    """Per family a random MTP layer (`arch`) and one that repeats the last token
    (`arch_rep`), each written by make(arch, folder, repeat=...) on first use and kept for
    the session: a test reads them and writes what it derives elsewhere."""

    def __init__(self, checkpoints: TinyCheckpoints, make: Callable[..., Path]) -> None:
        self.checkpoints = checkpoints
        self.make = make

    def __getitem__(self, name: str) -> Path:
        arch, repeat = name.removesuffix("_rep"), name.endswith("_rep")
        return self.checkpoints.derived(f"{self.make.__name__}-{name}",
                                        lambda out: self.make(arch, out, repeat=repeat))


def paged(model: Any, tokens: list[int], start: int, hidden_in: np.ndarray | None = None,
          normed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One call over tokens at positions start.. of sequence slot 0 (state slot 0 in a model
    with linear-attention layers): logits and the hidden states before the final norm (after
    it when normed)."""
    n = len(tokens)
    hidden = np.empty((n, model.config.n_embd), np.float32)
    slots = np.zeros(1, np.int32) if model.config.hybrid else None
    logits = model.forward_paged(np.asarray(tokens, np.int32), np.zeros(n, np.int32),
                                 np.arange(start, start + n, dtype=np.int32),
                                 model.slot_tables[:1], None, state_slots=slots,
                                 hidden_in=hidden_in, hidden_out=hidden, hidden_normed=normed)
    return logits, hidden


def mtp_llm(hf: Path, **cfg: Any) -> Any:
    """The step engine on hf (f32, no prefix cache unless asked) with cfg's settings."""
    from colibri.engine import LLM, EngineConfig

    cfg.setdefault("max_num_seqs", 8)
    cfg.setdefault("max_num_batched_tokens", 64)
    cfg.setdefault("prefix_cache", False)
    return LLM(hf, threads=2, quant="f32", n_ctx=N_CTX, config=EngineConfig(**cfg))


def watch_drafts(core: Any) -> list[tuple[list[int], list[int]]]:
    """Each step's MTP drafts with the tokens they follow, as the engine proposes them."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = core._mtp_propose

    def watched(mtp: Any) -> None:
        propose(mtp)
        seen.extend((list(r.drafts), list(r.tokens)) for r in core.scheduler.running
                    if r.drafts)

    core._mtp_propose = watched
    return seen


class Reference(Protocol):
    """A torch reference of an MTP layer: its input rows for the tokens that follow and the
    hidden states they follow (from position first), and its logits and hidden states."""

    def inputs(self, next_tokens: list[int], hidden: Any, first: int) -> Any: ...

    def run(self, x: Any) -> tuple[np.ndarray, np.ndarray]: ...


def assert_drafts_are_the_references(llm: Any, prompts: list[list[int]], params: Any,
                                     hf: Any, ref: Reference,
                                     min_steps: int) -> list[tuple[list[int], list[int]]]:
    """Run prompts together on llm (which drafts with its MTP layer) and check, for each
    request, that at every step (at least min_steps) its first draft is what ref gives over
    its tokens so far (every position from the main model's outputs, transformers' hf), and
    that at its first two steps the chained drafts are ref's chained on its own hidden state
    and drafts; each draft a largest reference logit within TOL. Every step's drafts."""
    import torch

    seen = watch_drafts(llm.core)
    _run(llm, prompts, params)
    captured: list[Any] = []
    hf.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out))

    def is_top(logits: np.ndarray, d: int) -> bool:
        return bool(logits[d] >= logits.max() - TOL * np.abs(logits).max())

    for prompt in prompts:
        mine = [(d, t) for d, t in seen if t[:len(prompt)] == prompt]
        assert len(mine) >= min_steps
        full = max((t for _, t in mine), key=len)
        with torch.no_grad():  # causal: one pass gives every prefix's rows
            hf(torch.tensor([full[:-1]]))
        x_full = ref.inputs(full[1:], captured[-1][0], 0)
        first, _ = ref.run(x_full)
        for n_step, (drafts, tokens) in enumerate(mine):
            c = len(tokens) - 1
            assert is_top(first[c - 1], drafts[0]), (prompt, c)
            if n_step >= 2:
                continue
            x = x_full[:c]
            for d in drafts:
                logits, h = ref.run(x)
                assert is_top(logits[-1], d), (prompt, c, drafts)
                x = torch.cat([x, ref.inputs([d], torch.from_numpy(h[-1:]), len(x))])
    return seen
