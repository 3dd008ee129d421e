"""TorchCore: a whole forward step on a torch device, one bound function per operation of
engine.executor.backend.step_ops, over a paged KV cache in torch tensors.

It stands where the C core's CoreModel stands under engine.executor.model.Model (the same
forward signature, block tables and logits), so every caller of Model runs on it unchanged.
"cpu" runs exactly the code a CUDA device runs; it is how the suite checks this path against
the C core without a GPU. Linear-attention layers keep their recurrent state in the cache's
state slots (engine/executor/torch_backend/linear.py). Refuses (ValueError at load) a q8 KV
cache, which it does not implement yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri.engine.errors import ContextOverflowError, FormatError, InputError
from colibri.engine.executor.backend import LayerOp, Op, step_ops, torch_unsupported
from colibri.engine.executor.torch_backend import attention as att
from colibri.engine.executor.torch_backend import ffn
from colibri.engine.executor.torch_backend import linear as lin
from colibri.engine.executor.torch_backend.expert_split import ExpertSplit
from colibri.engine.executor.torch_backend.weights import ModelWeights, linear, load_weights
from colibri.engine.models.config import ModelConfig
from colibri.engine.models.rope import rope_frequencies


@dataclass
class StepState:
    """What the operations of one step share: the residual stream and where tokens sit."""

    x: torch.Tensor  # [T, D]
    ix: att.StepIndex
    cos: torch.Tensor  # [T, rd/2]
    sin: torch.Tensor
    tokens: torch.Tensor  # [T]
    routing: ffn.Routing | None = None
    xn: torch.Tensor | None = None  # the normed FFN input of the current layer
    moe_out: torch.Tensor | None = None
    routes: np.ndarray | None = None  # [T, n_layer, K] out
    logits: torch.Tensor | None = None
    want: np.ndarray | None = None
    by_seq: lin.SeqLayout | None = None  # the tokens by sequence (linear-attention layers)


class TorchCore:
    """A converted model's weights on a torch device and the step that runs on them."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 n_ctx: int, layers: set[int] | None = None) -> None:
        self.cfg = cfg
        self.mine = set(range(cfg.n_layer)) if layers is None else set(layers)
        self.w = weights
        self.device = device
        self._n_ctx = n_ctx
        rd = cfg.rotary_dim or cfg.head_dim
        freqs, self.rope_scale = rope_frequencies(cfg.rope, cfg.rope_theta, rd)
        if freqs is None:  # 1 / theta^(2i/rd) in float32, as csrc/model.c computes it
            e = torch.arange(0, rd, 2, dtype=torch.float32) / float(rd)
            inv = 1.0 / torch.pow(torch.tensor(cfg.rope_theta, dtype=torch.float32), e)
        else:
            inv = torch.tensor(freqs, dtype=torch.float32)
        self.inv_freq = inv.to(device)
        self.ops = step_ops(cfg)
        self.bound: dict[Op, Callable[[StepState, int], None]] = {
            Op.EMBED: self._embed, Op.ATTENTION: self._attention, Op.ROUTER: self._router,
            Op.EXPERTS: self._experts, Op.SHARED: self._shared, Op.DENSE: self._dense,
            Op.LM_HEAD: self._lm_head,
        }
        self.forward_ns = 0
        self.n_forward = 0
        # routed experts split between this device and the C core (a split placement)
        self.split: ExpertSplit | None = None

    @classmethod
    def load(cls, path: str | Path, cfg: ModelConfig, n_ctx: int,
             device: str | torch.device = "cpu", layers: set[int] | None = None,
             experts: dict[int, set[int]] | None = None) -> TorchCore:
        """The folder's weights on device: all, or only those of `layers` (a split), with per
        layer named in `experts` only those routed experts."""
        why = torch_unsupported(cfg)
        if why:
            raise FormatError(f"{path}: the torch backend does not run {', '.join(why)} yet; "
                              "use --device cpu")
        dev = torch.device(device)
        return cls(cfg, load_weights(path, cfg, dev, layers=layers, experts=experts), dev,
                   n_ctx, layers)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def n_threads(self) -> int:
        return int(torch.get_num_threads())

    def kv_block_bytes(self, kv_type: str) -> int:
        return att.TorchKV.block_bytes(self.cfg, kv_type)

    def product_stats(self) -> dict[str, float]:
        return {"forward_calls": float(self.n_forward), "forward_s": self.forward_ns / 1e9}

    def linear_layers(self, a: int = 0, b: int | None = None) -> list[int]:
        """Its linear-attention layers among layers [a, b) (b None: the last)."""
        b = self.cfg.n_layer if b is None else b
        mix = self.cfg.layer_mixer
        return [il for il in sorted(self.mine) if a <= il < b and mix and mix[il] == "linear"]

    def new_kv(self, n_blocks: int, kv_type: str, n_state_slots: int = 0) -> att.TorchKV:
        """A paged KV cache for its attention layers and, with linear-attention layers,
        n_state_slots recurrent-state slots for them."""
        attn = [il for il in self.cfg.attention_layers if il in self.mine]
        linear = self.linear_layers()
        state = (lin.LinearState(self.cfg, n_state_slots, linear, self.device)
                 if linear and n_state_slots > 0 else None)
        return att.TorchKV(self.cfg, n_blocks, kv_type, self.device,
                           n_state_slots if state else 0, attn, state)

    def state_check(self, kv: att.TorchKV, lay: lin.SeqLayout | None,
                    layers: list[int]) -> None:
        """InputError, changing nothing, unless the step's sequences may run `layers` from
        their state slots (linear.LinearState.check)."""
        if not layers:
            return
        if kv.state is None:
            raise InputError("this model has linear-attention layers: the call needs state "
                             "slots (the cache has none)")
        assert lay is not None
        kv.state.check(lay, layers)

    def run_layers(self, st: StepState, kv: att.TorchKV, ops: list[LayerOp],
                   layers: list[int]) -> None:
        """ops in order, the linear layers `layers` among them starting, advancing and
        recording their state slots (unusable after an error midway)."""
        if layers:
            assert kv.state is not None and st.by_seq is not None
            kv.state.begin(st.by_seq, layers)
        ok = False
        try:
            for lop in ops:
                self.run_op(lop, st, kv)
            ok = True
        finally:
            if layers:
                assert kv.state is not None and st.by_seq is not None
                kv.state.end(st.by_seq, layers, ok)

    # ---- the step -----------------------------------------------------------------------

    def check(self, kv: att.TorchKV, tok: np.ndarray, seq: np.ndarray, pos: np.ndarray,
               tables: np.ndarray) -> None:
        if tok.size and (tok.min() < 0 or tok.max() >= self.cfg.n_vocab):
            raise InputError(f"token ids must be in 0..{self.cfg.n_vocab - 1}")
        if seq.size and (seq.min() < 0 or seq.max() >= tables.shape[0]):
            raise InputError(f"sequence ids must be in 0..{tables.shape[0] - 1}")
        if pos.size and pos.min() < 0:
            raise InputError("positions must be >= 0")
        if pos.size and pos.max() >= self.n_ctx:
            raise ContextOverflowError(f"position {int(pos.max())} is past the context "
                                       f"(n_ctx {self.n_ctx})")
        if pos.size and pos.max() // att.KV_BLOCK >= tables.shape[1]:
            raise InputError("a position needs a block table entry past the rows' end")
        for s in np.unique(seq).tolist():
            last = int(pos[seq == s].max()) // att.KV_BLOCK
            row = tables[s, :last + 1]
            if row.min() < 0 or row.max() >= kv.n_blocks:
                raise InputError(f"sequence {s}: block table names a block outside "
                                 f"0..{kv.n_blocks - 1}")

    def forward(self, kv: att.TorchKV, tokens: Any, seq_ids: Any, positions: Any,
                want_logits: Any, block_tables: Any, *, routes: np.ndarray | None = None,
                state_slots: np.ndarray | None = None) -> np.ndarray:
        """One step, as engine._core.CoreModel.forward: float32 logits [n_out, n_vocab]."""
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        seq = np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        tables = np.asarray(block_tables, dtype=np.int64)
        if tables.ndim != 2:
            raise InputError("block_tables must be 2-D [n_seq, max_blocks]")
        if seq.size != tok.size or pos.size != tok.size:
            raise InputError(f"tokens ({tok.size}), seq_ids ({seq.size}) and positions "
                             f"({pos.size}) differ in length")
        want = None if want_logits is None else np.asarray(want_logits).reshape(-1).astype(bool)
        n_out = tok.size if want is None else int(want.sum())
        if tok.size == 0:
            return np.empty((0, self.cfg.n_vocab), np.float32)
        self.check(kv, tok, seq, pos, tables)
        t0 = time.perf_counter_ns()
        with torch.inference_mode():
            st = self.start(tok, seq, pos, tables, routes, want, state_slots)
            layers = self.linear_layers()
            self.state_check(kv, st.by_seq, layers)
            self.run_layers(st, kv, self.ops, layers)
            out = (st.logits.cpu().numpy() if st.logits is not None
                   else np.empty((0, self.cfg.n_vocab), np.float32))
        self.forward_ns += time.perf_counter_ns() - t0
        self.n_forward += 1
        assert out.shape[0] == n_out
        return np.ascontiguousarray(out, dtype=np.float32)

    def start(self, tok: np.ndarray, seq: np.ndarray, pos: np.ndarray, tables: np.ndarray,
              routes: np.ndarray | None, want: np.ndarray | None,
              state_slots: np.ndarray | None = None) -> StepState:
        dev = self.device
        lay = (lin.seq_layout(seq, pos, state_slots, dev) if self.linear_layers() else None)
        p = torch.from_numpy(pos).to(dev)
        ang = p.float()[:, None] * self.inv_freq[None, :]
        ix = att.step_index(torch.from_numpy(tables).to(dev), torch.from_numpy(seq).to(dev), p)
        return StepState(x=torch.empty(0), ix=ix, cos=torch.cos(ang) * self.rope_scale,
                         sin=torch.sin(ang) * self.rope_scale,
                         tokens=torch.from_numpy(tok).to(dev), routes=routes, want=want,
                         by_seq=lay)

    def run_op(self, lop: LayerOp, st: StepState, kv: att.TorchKV) -> None:
        """One operation of the step (the split placement drives the step op by op)."""
        if lop.op == Op.ATTENTION:
            self._attention(st, lop.layer, kv)
        elif lop.op == Op.LINEAR_ATTENTION:
            assert kv.state is not None and st.by_seq is not None
            st.x = st.x + lin.gated_delta_net(self.cfg, self.w.layers[lop.layer].attn, st.x,
                                              kv.state, lop.layer, st.by_seq)
        else:
            self.bound[lop.op](st, lop.layer)

    def _embed(self, st: StepState, _il: int) -> None:
        assert self.w.tok_embd is not None
        st.x = self.w.tok_embd.gather(st.tokens)

    def _attention(self, st: StepState, il: int, kv: att.TorchKV | None = None) -> None:
        assert kv is not None
        block = att.mla if self.cfg.attn == "mla" else att.gqa
        st.x = st.x + block(self.cfg, self.w.layers[il].attn, st.x, kv, il, st.ix, st.cos,
                            st.sin)

    def _router(self, st: StepState, il: int) -> None:
        lw = self.w.layers[il]
        st.xn = att.rmsnorm(st.x, lw.ffn_norm, self.cfg.rms_eps)
        logits = st.xn @ lw.router["gate_inp"].T
        if "gate_inp_bias" in lw.router:
            logits = logits + lw.router["gate_inp_bias"]
        st.routing = ffn.route(self.cfg, logits, lw.router.get("gate_bias"))
        if st.routes is not None:
            st.routes[:, il, :] = st.routing.ids.cpu().numpy().astype(np.int32)

    def _experts(self, st: StepState, il: int) -> None:
        assert st.xn is not None and st.routing is not None
        if self.split is not None and il in self.split.layers:
            st.moe_out = self.split.run(il, st.xn, st.routing)
        else:
            st.moe_out = ffn.experts(self.cfg, self.w.layers[il].experts, st.xn, st.routing)
        if self.cfg.n_ff_shared == 0:
            st.x = st.x + st.moe_out

    def _shared(self, st: StepState, il: int) -> None:
        lw = self.w.layers[il]
        assert st.xn is not None and st.moe_out is not None and lw.shared is not None
        y = ffn.shared(self.cfg, lw.shared, lw.router.get("shared_gate"), st.xn)
        st.x = st.x + (st.moe_out + y)

    def _dense(self, st: StepState, il: int) -> None:
        lw = self.w.layers[il]
        assert lw.dense is not None
        xn = att.rmsnorm(st.x, lw.ffn_norm, self.cfg.rms_eps)
        st.x = st.x + ffn.ffn(self.cfg, lw.dense, xn)
        if st.routes is not None:
            st.routes[:, il, :] = -1

    def _lm_head(self, st: StepState, _il: int) -> None:
        x = st.x if st.want is None else st.x[torch.from_numpy(st.want).to(self.device)]
        if x.shape[0] == 0:
            return
        assert self.w.output is not None and self.w.output_norm is not None
        xn = att.rmsnorm(x, self.w.output_norm, self.cfg.rms_eps)
        st.logits = linear(xn, self.w.output)
