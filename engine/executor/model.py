"""Model: a converted Colibri folder loaded into the C core, with its KV cache.

`Model.load(dir)` reads config.json (engine.models.config), maps and validates every weight file
(C loader), and allocates a paged KV cache (blocks of 16 positions shared by all sequences).
`forward_paged` is the raw step: the caller owns the block tables and sequence lengths.
`forward` / `reset` / `seq_len` keep a simple fixed layout on top of it: sequence slot s owns
blocks [s * nb, (s + 1) * nb), nb = ceil(n_ctx / 16), and its length is tracked here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from colibri.engine import _core
from colibri.engine.errors import (
    ContextOverflowError,
    InputError,
    ModelFaultError,
    StorageStalledError,
    WeightFileChangedError,
)
from colibri.engine.executor.backend import (
    Placement,
    resolve_device,
    step_ops,
    torch_device_name,
)
from colibri.engine.executor.step_inputs import NO_INPUTS, StepInputs
from colibri.engine.format.verify import check_tensor_types
from colibri.engine.models.config import ModelConfig

log = logging.getLogger("colibri.engine")


ISA_ENV = "COLIBRI_ISA"
STREAM_HINT_ENV = "COLIBRI_STREAM_HINT"


def _choose_from_env(variable: str, label: str, what: str, active: Callable[[], str],
                     choices: Sequence[str], force: Callable[[str], None],
                     picked: Callable[[], str]) -> None:
    """Force the choice `variable` names, when set and not already active; ValueError says it
    is not a `what` and lists the choices."""
    name = os.environ.get(variable, "").strip().lower()
    if not name or name == active():
        return
    if name not in choices:
        raise ValueError(f"{variable}={name!r} is not a {what}; choose one of "
                         f"{', '.join(choices)}")
    force(name)
    log.info("%s: %s, as %s asks (picked at start: %s)", label, name, variable, picked())


def kernels_from_env() -> str:
    """The kernel path every product takes: COLIBRI_ISA (ref, avx2, avxvnni, avx512) when set,
    to compare paths on one CPU or to keep off one; else the active one (the best this CPU runs,
    unless something forced another). COLIBRI_STREAM_HINT (l2, nta) likewise sets how the AVX-512
    products prefetch weights. Process-wide. ValueError names the paths this CPU and build
    support, or the hints there are."""
    _choose_from_env(ISA_ENV, "kernels", "kernel path this CPU runs", _core.isa_active,
                     _core.isa_supported(), _core.isa_force, _core.isa_best)
    _choose_from_env(STREAM_HINT_ENV, "stream hint", "stream hint", _core.stream_hint_active,
                     _core.STREAM_HINTS, _core.stream_hint_force, _core.stream_hint_best)
    return _core.isa_active()


def _i32(x: object, what: str) -> np.ndarray:
    """x as a 1-D int32 array; InputError for non-integers or values int32 cannot hold."""
    a = np.asarray(x)
    if a.dtype == np.int32:
        return a.reshape(-1)
    if a.size and a.dtype.kind not in "iu":
        raise InputError(f"{what} must be integers, got dtype {a.dtype}")
    a = a.reshape(-1)
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise InputError(f"{what} has values outside the int32 range")
    return a.astype(np.int32)


def _span(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty 1-D integer array, (0, -1) of an empty one; a single value
    without numpy's reductions, which cost tens of microseconds on the caches a step left."""
    if a.size == 1:
        v = int(a[0])
        return v, v
    if a.size == 0:
        return 0, -1
    return int(a.min()), int(a.max())


def check_kv_type(kv_type: str) -> None:
    """ValueError naming the KV cache types unless kv_type is one."""
    if kv_type not in _core.KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r}; choose one of "
                         f"{', '.join(_core.KV_TYPES)}")


def kv_block_bytes(config: ModelConfig, kv_type: str = "f32") -> int:
    """Bytes of one KV block (16 positions, K and V, every layer) for a model's config, before
    loading it: a memory budget divided by this is the kv_blocks to pass to Model.load."""
    check_kv_type(kv_type)
    return int(_core.kv_block_bytes(config.to_hparams(1), kv_type))


def kv_split_block_bytes(config: ModelConfig, kv_type: str = "f32") -> tuple[int, int] | None:
    """(full, windowed) bytes of one block of each KV pool when the model's sliding-window or
    chunked layers keep a pool of their own (Model.load's kv_win_blocks), before loading it;
    None when the model has no such layers beside full ones."""
    check_kv_type(kv_type)
    split = _core.kv_split_block_bytes(config.to_hparams(1), kv_type)
    return None if split is None else (int(split[0]), int(split[1]))


def slot_kv_blocks(n_seq: int, n_ctx: int, kv_blocks: int | None) -> int:
    """The KV blocks to allocate for n_seq fixed sequence slots of n_ctx positions each:
    kv_blocks, or just enough when None (at least one); ValueError when kv_blocks is fewer."""
    need = n_seq * -(-n_ctx // _core.KV_BLOCK)
    blocks = max(need, 1) if kv_blocks is None else int(kv_blocks)
    if blocks < need:
        raise ValueError(f"kv_blocks {blocks} cannot hold {n_seq} sequence slots of "
                         f"{n_ctx} positions ({need} blocks)")
    return blocks


class Model:
    """A loaded model plus one paged KV cache, with n_seq fixed sequence slots on top."""

    def __init__(self, path: Path, config: ModelConfig, core: _core.CoreModel,
                 kv: _core.KVCache, n_seq: int) -> None:
        self.path = path
        self.config = config
        self.core = core
        self.kv = kv
        # why the model can no longer be trusted (a weight file changed under it, non-finite
        # outputs); None while it is healthy. Once set, every forward raises ModelFaultError.
        self.fault: str | None = None
        nb = -(-core.n_ctx // _core.KV_BLOCK)
        # slot s owns blocks [s * nb, (s + 1) * nb): row s of this table
        self.slot_tables = np.arange(max(n_seq, 1) * nb, dtype=np.int32).reshape(-1, nb)[:n_seq]
        self._len = np.zeros(n_seq, np.int64)
        # "cpu": the C core; "torch-cpu" or "cuda:N": the torch backend (TorchCore)
        self.device = "cpu"

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, n_ctx: int | None = None,
             n_seq: int = 1, kv_type: str = "f32", kv_blocks: int | None = None,
             state_slots: int | None = None, kv_win_blocks: int = 0, device: str = "cpu",
             placement: Placement | None = None) -> Model:
        """Load a Colibri folder. threads None: physical cores; n_ctx None:
        min(max_position_embeddings, 4096) (the most positions one sequence may hold);
        kv_type: "f32", "f16" or "q8"; kv_blocks None: enough for n_seq slots of n_ctx
        positions. device: "cpu" (the C core), "torch-cpu", "cuda", "cuda:N" or "auto"
        (engine.executor.backend.resolve_device); placement (a torch device only): which
        operations run on "torch" and which on "c" (layers split between the two, and a torch
        layer's routed experts too).
        n_seq = 0 keeps no slots (only forward_paged is usable); otherwise
        kv_blocks must cover the n_seq slots. state_slots (models with linear-attention
        layers): recurrent-state slots for forward_paged's sequences; None: n_seq.
        kv_win_blocks > 0 (n_seq 0; models with sliding-window or chunked layers beside full
        ones): those layers cache in a pool of their own of that many blocks, addressed by
        forward_paged's win_tables, so a caller can give back the blocks that left every
        window (kv_split_block_bytes gives both pools' block sizes)."""
        if n_seq < 0:
            raise ValueError(f"n_seq must be >= 0, got {n_seq}")
        if kv_win_blocks and n_seq:
            raise ValueError("a windowed KV pool is for forward_paged's callers: n_seq must be 0")
        check_kv_type(kv_type)
        p = Path(path)
        cfg = ModelConfig.from_dir(p)
        ctx = cfg.default_n_ctx() if n_ctx is None else n_ctx
        dev = resolve_device(device)
        if dev != "cpu":
            return cls._load_torch(p, cfg, ctx, n_seq, kv_type, kv_blocks, state_slots, dev,
                                   placement, threads or 0)
        kernels_from_env()
        core = _core.CoreModel.load(str(p), cfg.to_hparams(ctx), threads or 0)
        check_tensor_types(p, cfg.tensor_types)
        blocks = slot_kv_blocks(n_seq, int(core.n_ctx), kv_blocks)
        n_state = n_seq if state_slots is None else state_slots
        kv = _core.KVCache(core, blocks, kv_type, n_state_slots=n_state if cfg.hybrid else 0,
                           n_win_blocks=kv_win_blocks)
        return cls(p, cfg, core, kv, n_seq)

    @classmethod
    def _load_torch(cls, p: Path, cfg: ModelConfig, ctx: int, n_seq: int, kv_type: str,
                    kv_blocks: int | None, state_slots: int | None, device: str,
                    placement: Placement | None, threads: int) -> Model:
        """The model on the torch backend (engine/executor/torch_backend) on device, or split
        between it and the C core (by layer, and by routed expert) when placement names both."""
        from colibri.engine.executor.torch_backend.core import TorchCore
        from colibri.engine.executor.torch_backend.split import SplitCore

        check_tensor_types(p, cfg.tensor_types)
        blocks = slot_kv_blocks(n_seq, ctx, kv_blocks)
        n_state = n_seq if state_slots is None else state_slots
        core: Any
        if placement is not None and "c" in placement.backends(step_ops(cfg)):
            kernels_from_env()
            core = SplitCore.load(p, cfg, ctx, threads, torch_device_name(device), placement)
            kv = core.new_kv(blocks, kv_type, n_state if cfg.hybrid else 0)
        else:
            core = TorchCore.load(p, cfg, ctx, torch_device_name(device))
            kv = core.new_kv(blocks, kv_type, n_state if cfg.hybrid else 0)
        model = cls(p, cfg, core, kv, n_seq)  # type: ignore[arg-type]
        model.device = device
        return model

    @property
    def kv_type(self) -> str:
        return str(self.kv.kv_type)

    @property
    def n_kv_blocks(self) -> int:
        return int(self.kv.n_blocks)

    @property
    def n_kv_win_blocks(self) -> int:
        """Blocks of the windowed KV pool (0: every layer caches in the one pool)."""
        return int(self.kv.n_win_blocks)

    def kv_block_bytes(self, kv_type: str | None = None) -> int:
        """Bytes of one KV block (16 positions, K and V, every layer) of kv_type (None: this
        cache's type); a memory budget divided by it gives a block count."""
        return int(self.core.kv_block_bytes(self.kv_type if kv_type is None else kv_type))

    @property
    def n_ctx(self) -> int:
        return int(self.core.n_ctx)

    @property
    def n_vocab(self) -> int:
        return int(self.config.n_vocab)

    @property
    def n_seq(self) -> int:
        return int(self._len.size)

    @property
    def n_threads(self) -> int:
        return int(self.core.n_threads)

    def product_stats(self) -> dict[str, float]:
        """The weight products of every forward call so far, timed in place: calls, seconds
        and weight bytes per phase, with attention over the KV cache and the forward calls
        whole (engine._core.CoreModel.product_stats)."""
        return dict(self.core.product_stats())

    def seq_len(self, seq_id: int) -> int:
        """Positions the cache holds for slot seq_id."""
        return int(self._len[self._slot(seq_id)])

    def _slot(self, seq_id: int) -> int:
        if not 0 <= seq_id < self.n_seq:
            raise InputError(f"sequence id {seq_id} not in 0..{self.n_seq - 1}")
        return int(seq_id)

    def _check_tokens(self, tok: np.ndarray) -> None:
        # checked here too, so the error names Python's view of the problem before C sees it
        lo, hi = _span(tok)
        if lo < 0 or hi >= self.n_vocab:
            bad = int(tok[(tok < 0) | (tok >= self.n_vocab)][0])
            raise InputError(f"token id {bad} is not in 0..{self.n_vocab - 1}")

    def forward(self, tokens: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray,
                want_logits: np.ndarray | None = None, routes: np.ndarray | None = None
                ) -> np.ndarray:
        """One step over a batch: token i of sequence slot seq_ids[i] at positions[i].

        A slot's tokens are consecutive positions; its first may sit below what the slot
        holds (rewinding it: later positions are dropped) but never past it. Returns float32
        logits [n_out, n_vocab] for the rows with want_logits (all rows when None), in order.
        Raises InputError / ContextOverflowError (ValueErrors) for bad ids or positions;
        nothing is computed and the cache is unchanged in that case. routes: None, or an
        int32 array [n_tokens, n_layer, n_expert_used] that receives each token's experts.
        """
        tok = _i32(tokens, "tokens")
        seq = _i32(seq_ids, "seq_ids")
        pos = _i32(positions, "positions")
        if seq.size != tok.size or pos.size != tok.size:
            raise InputError(f"tokens ({tok.size}), seq_ids ({seq.size}) and positions "
                             f"({pos.size}) differ in length")
        self._check_tokens(tok)
        s_lo, s_hi = _span(seq)
        if s_lo < 0 or s_hi >= self.n_seq:
            bad = int(seq[(seq < 0) | (seq >= self.n_seq)][0])
            raise InputError(f"sequence id {bad} not in 0..{self.n_seq - 1}")
        p_lo, p_hi = _span(pos)
        if p_lo < 0:
            raise InputError(f"position {p_lo} is negative")
        if p_hi >= self.n_ctx:
            raise ContextOverflowError(
                f"position {p_hi} is past the context (n_ctx {self.n_ctx})")
        # each slot's positions; a call of one slot (a decode step, one prompt) skips numpy's
        # grouping
        slots = ({s_lo: pos} if s_lo == s_hi
                 else {s: pos[seq == s] for s in np.unique(seq).tolist()})
        ends: dict[int, int] = {}
        for s, p in slots.items():
            if p[0] > self._len[s]:
                raise InputError(f"sequence {s}: position {int(p[0])} skips ahead: the cache "
                                 f"holds {int(self._len[s])} positions")
            if p.size > 1 and np.any(np.diff(p) != 1):
                raise InputError(f"sequence {s}: positions must be consecutive and increasing "
                                 "in a call")
            ends[s] = int(p[-1]) + 1
        out = self._core_forward(self.kv, tok, seq, pos, want_logits, self.slot_tables
                                 if self.n_seq else np.full((1, 1), -1, np.int32),
                                 StepInputs(routes=routes, state_slots=self._slot_states))
        for s, e in ends.items():
            self._len[s] = e
        return out

    def forward_paged(self, tokens: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray,
                      block_tables: np.ndarray, want_logits: np.ndarray | None = None,
                      inputs: StepInputs = NO_INPUTS, **named: Any) -> np.ndarray:
        """The raw paged step for a scheduler that owns block allocation and lengths.

        Token i of sequence seq_ids[i] (a row of block_tables, int32 [n_seq, max_blocks],
        entry [s, j] = block holding positions [16j, 16j+16) of s, -1: none) at positions[i]
        writes its K/V into its block and attends over positions [0, positions[i]] of its
        sequence; every earlier position must have been written by an earlier call. Blocks
        may be shared read-only between sequences; a block may be written by one sequence
        per call. Does not touch the slots of `forward` (using both on one cache is the
        caller's business). Refused calls (InputError / ContextOverflowError) change nothing.
        inputs: the step's optional inputs (StepInputs), below; named: any of them by name
        (`hidden_in=...`), over those of inputs.
        routes: as in `forward`. state_slots (models with linear-attention layers): int32
        [n_seq], each sequence's recurrent-state slot; a sequence starting at position 0
        starts a fresh state, any other start must continue its slot's state exactly.
        win_tables (a cache with a windowed pool: needed): int32 like block_tables, into that
        pool; entries below the lowest position a windowed layer lets the call's first token
        of a sequence see may be -1.
        hidden_in (a multi-token-prediction layer): float32 [T, n_embd], each token's previous
        hidden state; hidden_out: None or float32 [T, n_embd] that receives every token's
        hidden state after the last layer, before the final norm (after it with
        hidden_normed: what the lm_head reads).
        """
        tok = _i32(tokens, "tokens")
        self._check_tokens(tok)
        if named:
            inputs = replace(inputs, **named)
        return self._core_forward(self.kv, tok, seq_ids, positions, want_logits, block_tables,
                                  inputs)

    @property
    def _slot_states(self) -> np.ndarray | None:
        """forward's slot s keeps its recurrent state in state slot s."""
        return np.arange(max(self.n_seq, 1), dtype=np.int32) if self.config.hybrid else None

    def _core_forward(self, kv: Any, tok: np.ndarray, seq_ids: Any, positions: Any,
                      want_logits: Any, block_tables: Any, inputs: StepInputs) -> np.ndarray:
        """core.forward, refusing a faulty model and marking one that turns faulty."""
        if self.fault is not None:
            raise ModelFaultError(self.fault)
        try:
            # only the inputs given: the torch backend takes no win_tables or hidden states
            # (it keeps no windowed pool and runs no multi-token-prediction layer)
            out = self.core.forward(kv, tok, seq_ids, positions, want_logits, block_tables,
                                    **inputs.given())
        except (WeightFileChangedError, StorageStalledError) as e:
            self._mark_faulty(str(e))
            raise
        if not _core.all_finite(out):
            self._mark_faulty(f"{self.path}: the model produced non-finite logits (NaN or "
                              "inf weights?); check it with `colibri verify`")
            raise ModelFaultError(self.fault)
        return out

    def _mark_faulty(self, why: str) -> None:
        if self.fault is None:
            self.fault = why
            log.error("model marked unhealthy: %s", why)

    def reset(self, seq_id: int = 0) -> None:
        """Forget slot seq_id's cached positions."""
        self._len[self._slot(seq_id)] = 0
