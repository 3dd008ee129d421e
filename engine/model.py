"""Model: a converted Colibri folder loaded into the C core, with its KV cache.

`Model.load(dir)` reads config.json (engine.config), maps and validates every weight file
(C loader), and allocates a KV cache for n_seq sequences; `forward` runs one batched step
with the GIL released and returns float32 logits.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from engine import _core
from engine.config import ModelConfig
from engine.errors import ContextOverflowError, InputError, ModelFaultError, WeightFileChangedError
from engine.model_check import check_tensor_types

log = logging.getLogger("colibri.engine")


class Model:
    """A loaded model plus one KV cache of n_seq sequences x n_ctx positions."""

    def __init__(self, path: Path, config: ModelConfig, core: _core.CoreModel,
                 kv: _core.KVCache) -> None:
        self.path = path
        self.config = config
        self.core = core
        self.kv = kv
        # why the model can no longer be trusted (a weight file changed under it, non-finite
        # outputs); None while it is healthy. Once set, every forward raises ModelFaultError.
        self.fault: str | None = None

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, n_ctx: int | None = None,
             n_seq: int = 1) -> Model:
        """Load a Colibri folder. threads None: physical cores; n_ctx None:
        min(max_position_embeddings, 4096)."""
        p = Path(path)
        cfg = ModelConfig.from_dir(p)
        ctx = cfg.default_n_ctx() if n_ctx is None else n_ctx
        core = _core.CoreModel.load(str(p), cfg.to_hparams(ctx), threads or 0)
        check_tensor_types(p, cfg.tensor_types)
        return cls(p, cfg, core, core.new_kv(n_seq))

    @property
    def n_ctx(self) -> int:
        return int(self.core.n_ctx)

    @property
    def n_vocab(self) -> int:
        return int(self.config.n_vocab)

    @property
    def n_seq(self) -> int:
        return int(self.kv.n_seq)

    @property
    def n_threads(self) -> int:
        return int(self.core.n_threads)

    def seq_len(self, seq_id: int) -> int:
        """Positions the cache holds for seq_id."""
        return int(self.kv.seq_len(seq_id))

    def forward(self, tokens: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray,
                want_logits: np.ndarray | None = None) -> np.ndarray:
        """One step over a batch: token i of sequence seq_ids[i] at positions[i].

        Returns float32 logits [n_out, n_vocab] for the rows with want_logits (all rows when
        None), in order. Raises InputError / ContextOverflowError (ValueErrors) for bad ids or
        positions; nothing is computed and the cache is unchanged in that case.
        """
        tok = np.asarray(tokens)
        pos = np.asarray(positions)
        # checked here too, so the error names Python's view of the problem before C sees it
        if tok.size and (tok.min() < 0 or tok.max() >= self.n_vocab):
            bad = int(tok[(tok < 0) | (tok >= self.n_vocab)].reshape(-1)[0])
            raise InputError(f"token id {bad} is not in 0..{self.n_vocab - 1}")
        if pos.size and pos.max() >= self.n_ctx:
            raise ContextOverflowError(
                f"position {int(pos.max())} is past the context (n_ctx {self.n_ctx})")
        if self.fault is not None:
            raise ModelFaultError(self.fault)
        try:
            out = self.core.forward(self.kv, tok, seq_ids, pos, want_logits)
        except WeightFileChangedError as e:
            self._mark_faulty(str(e))
            raise
        # one vectorised sum finds NaN and inf; the exact test runs only when it is not finite
        if out.size and not math.isfinite(float(out.sum(dtype=np.float64))):
            if not np.isfinite(out).all():
                self._mark_faulty(f"{self.path}: the model produced non-finite logits (NaN or "
                                  "inf weights?); check it with `colibri verify`")
                raise ModelFaultError(self.fault)
        return out

    def _mark_faulty(self, why: str) -> None:
        if self.fault is None:
            self.fault = why
            log.error("model marked unhealthy: %s", why)

    def reset(self, seq_id: int = 0) -> None:
        """Forget sequence seq_id's cached positions."""
        self.kv.clear_seq(seq_id)
