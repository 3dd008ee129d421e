"""SplitCore: one step with some layers on the torch backend and the rest on the C core.

The layers run in order in runs of one backend: a C run is one clb_forward_span call over the
hidden states, a torch run is TorchCore's operations for its layers; the hidden states move
between them as float32 [T, n_embd]. The embeddings run where layer 0 runs, the final norm
and lm_head where the last layer runs. Each backend keeps the KV rows and the recurrent-state
slots of its own layers (both index one slot per sequence; each layer counts what it absorbed,
so a step's layers may run in several calls). A torch layer may keep only some of its routed
experts on the device: the C core runs the others beside it (expert_split.py), unless the
cost model says a step's rows repay uploading one; between steps the GPU tier moves experts
by heat. On
torch's CPU device this gives the all-C tokens (the same math; float32 rounding aside); on a
GPU the hidden states cross PCIe once per run (and a split layer's inputs once per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri.engine import _core
from colibri.engine.executor.backend import LayerOp, Op, Placement, step_ops
from colibri.engine.executor.costmodel import DeviceProfile
from colibri.engine.executor.torch_backend.attention import TorchKV
from colibri.engine.executor.torch_backend.core import TorchCore
from colibri.engine.executor.torch_backend.expert_split import ExpertSplit, TierConfig
from colibri.engine.executor.torch_backend.linear import seq_layout as linear_state_layout
from colibri.engine.models.config import ModelConfig


def layer_backends(cfg: ModelConfig, placement: Placement) -> list[str]:
    """Per layer the backend running its work; a layer on the torch backend may leave some of
    its routed experts to the C core (an expert split), but a layer on the C core runs whole:
    ValueError when it places some of its work, or one of its experts, on the torch device."""
    out: list[str] = []
    ops = step_ops(cfg)
    for il in range(cfg.n_layer):
        used = {placement.of(o) for o in ops if o.layer == il and o.op != Op.EXPERTS}
        if len(used) != 1:
            raise ValueError(f"layer {il} is placed on {sorted(used)}: a split step runs a "
                             "layer's attention, router, shared and dense work on one backend")
        b = used.pop()
        if b == "c" and il in cfg.moe_layers:
            mine = {placement.of(LayerOp(il, Op.EXPERTS))}
            mine |= {b_ for (l_, _e), b_ in placement.experts.items() if l_ == il}
            if mine != {"c"}:
                raise ValueError(f"layer {il} is placed on {sorted(mine | {'c'})}: routed "
                                 "experts run on the torch device only in a layer whose other "
                                 "work runs there")
        out.append(b)
    return out


def device_experts(cfg: ModelConfig, placement: Placement,
                   backends: list[str]) -> dict[int, set[int]]:
    """Per MoE layer on the torch backend, the routed experts it keeps on the device."""
    return {il: {e for e in range(cfg.n_expert) if placement.of_expert(il, e) == "torch"}
            for il in cfg.moe_layers if backends[il] == "torch"}


def runs(backends: list[str]) -> list[tuple[str, int, int]]:
    """(backend, first layer, one past the last) of each run of one backend, in order."""
    out: list[tuple[str, int, int]] = []
    for il, b in enumerate(backends):
        if out and out[-1][0] == b:
            out[-1] = (b, out[-1][1], il + 1)
        else:
            out.append((b, il, il + 1))
    return out


@dataclass
class SplitKV:
    """The C core's KV cache and the torch backend's, each used for its own layers."""

    c: Any  # engine._core.KVCache
    t: TorchKV

    @property
    def kv_type(self) -> str:
        return str(self.c.kv_type)

    @property
    def n_blocks(self) -> int:
        return int(self.c.n_blocks)

    @property
    def n_state_slots(self) -> int:
        return int(self.c.n_state_slots)

    def copy_block(self, dst: int, src: int) -> None:
        self.c.copy_block(dst, src)
        self.t.copy_block(dst, src)

    def copy_state(self, dst: int, src: int) -> None:
        """State slot src into dst on both backends (a fork, or a saved state restored)."""
        self.c.copy_state(dst, src)
        if self.t.state is not None:
            self.t.copy_state(dst, src)

    def state_len(self, slot: int) -> int:
        c = int(self.c.state_len(slot))
        return c if self.t.state is None else min(c, self.t.state_len(slot))


class SplitCore:
    """A step over the C core and a TorchCore, by layer runs (see the module's docstring)."""

    def __init__(self, c: Any, t: TorchCore, cfg: ModelConfig, backends: list[str]) -> None:
        self.c = c
        self.t = t
        self.cfg = cfg
        self.backends = backends
        self.runs = runs(backends)
        self.ops = step_ops(cfg)

    @classmethod
    def load(cls, path: Path, cfg: ModelConfig, n_ctx: int, threads: int, device: str,
             placement: Placement, tier: TierConfig | None = None,
             profile: DeviceProfile | None = None) -> SplitCore:
        """The C core and a TorchCore holding the placement's torch layers, with only their
        device experts; the experts of those layers are split between the two (moved by heat
        as `tier` says, and uploaded for a step when `profile` predicts it pays)."""
        backends = layer_backends(cfg, placement)
        c = _core.CoreModel.load(str(path), cfg.to_hparams(n_ctx), threads)
        mine = {il for il, b in enumerate(backends) if b == "torch"}
        on_dev = device_experts(cfg, placement, backends)
        t = TorchCore.load(path, cfg, n_ctx, device, layers=mine, experts=on_dev)
        if on_dev:
            t.split = ExpertSplit(Path(path), cfg, c, t.w, t.device, set(on_dev), tier,
                                   profile)
        return cls(c, t, cfg, backends)

    @property
    def expert_split(self) -> ExpertSplit | None:
        """The routed experts split between the device and the C core (None: no MoE layer
        on the device)."""
        return self.t.split

    @property
    def n_ctx(self) -> int:
        return int(self.c.n_ctx)

    @property
    def n_threads(self) -> int:
        return int(self.c.n_threads)

    def kv_block_bytes(self, kv_type: str) -> int:
        return int(self.c.kv_block_bytes(kv_type))

    def product_stats(self) -> dict[str, float]:
        return dict(self.c.product_stats())

    def new_kv(self, n_blocks: int, kv_type: str, n_state_slots: int = 0) -> SplitKV:
        """Each backend's cache; with linear-attention layers n_state_slots state slots in
        each (the C core's cache keeps a slot for every linear layer, its own or not)."""
        n = n_state_slots if self.cfg.hybrid else 0
        return SplitKV(_core.KVCache(self.c, n_blocks, kv_type, n_state_slots=n),
                       self.t.new_kv(n_blocks, kv_type, n))

    def forward(self, kv: SplitKV, tokens: Any, seq_ids: Any, positions: Any, want_logits: Any,
                block_tables: Any, *, routes: np.ndarray | None = None,
                state_slots: np.ndarray | None = None) -> np.ndarray:
        tok = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        seq = np.ascontiguousarray(seq_ids, dtype=np.int32).reshape(-1)
        pos = np.ascontiguousarray(positions, dtype=np.int32).reshape(-1)
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        n, L = tok.size, self.cfg.n_layer
        want = None if want_logits is None else np.asarray(want_logits).reshape(-1).astype(bool)
        if n == 0:
            return np.empty((0, self.cfg.n_vocab), np.float32)
        self.t.check(kv.t, tok.astype(np.int64), seq.astype(np.int64), pos.astype(np.int64),
                     tables.astype(np.int64))
        if self.t.linear_layers():  # the torch layers' state slots, before any run changes one
            with torch.inference_mode():
                lay = linear_state_layout(seq, pos, state_slots, self.t.device)
                self.t.state_check(kv.t, lay, self.t.linear_layers())
        h = np.zeros((n, self.cfg.n_embd), np.float32)
        logits = np.empty((0, self.cfg.n_vocab), np.float32)
        if self.t.split is not None:
            self.t.split.begin_step()
        for backend, a, b in self.runs:
            if backend == "c":
                out = self.c.forward(kv.c, tok, seq, pos, want_logits, tables, routes=routes,
                                     state_slots=state_slots, span=(a, b), hidden=h)
            else:
                out = self._torch_run(kv.t, tok, seq, pos, tables, routes, want, a, b, h,
                                      state_slots)
            if b == L:
                logits = out
        if self.t.split is not None:  # between steps: heat, counters and the GPU tier
            self.t.split.after_step()
        return logits

    def _torch_run(self, kv: TorchKV, tok: np.ndarray, seq: np.ndarray, pos: np.ndarray,
                   tables: np.ndarray, routes: np.ndarray | None, want: np.ndarray | None,
                   a: int, b: int, h: np.ndarray,
                   state_slots: np.ndarray | None) -> np.ndarray:
        t = self.t
        with torch.inference_mode():
            st = t.start(tok.astype(np.int64), seq.astype(np.int64), pos.astype(np.int64),
                         tables.astype(np.int64), routes, want, state_slots)
            if a > 0:
                st.x = torch.from_numpy(h).to(t.device)
            t.run_layers(st, kv, [lop for lop in self.ops if a <= lop.layer < b
                                  or (lop.op == Op.EMBED and a == 0)], t.linear_layers(a, b))
            if b == self.cfg.n_layer:
                t.run_op(LayerOp(-1, Op.LM_HEAD), st, kv)
                return (st.logits.cpu().numpy() if st.logits is not None
                        else np.empty((0, self.cfg.n_vocab), np.float32))
            h[:] = st.x.cpu().numpy()
        return np.empty((0, self.cfg.n_vocab), np.float32)
