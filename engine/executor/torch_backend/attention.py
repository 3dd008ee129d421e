"""Attention on a torch device over a paged KV cache kept in torch tensors: the GQA block
(norms, biases, q/k norms, clip, RoPE, sliding / chunked windows, sinks, NoPE layers with
query temperature, output gates) and MLA in its absorbed form, following csrc/attention.c and
csrc/mla.c (docs/INTERNALS.md states the math both follow).

Shape legend: T tokens, D n_embd, H / Hkv heads, hd head_dim, L keys a query reads, kd / vd a
cached key / value row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from colibri.engine.errors import InputError
from colibri.engine.executor.torch_backend.weights import TorchWeight, linear
from colibri.engine.models.config import ModelConfig

if TYPE_CHECKING:
    from colibri.engine.executor.torch_backend.linear import LinearState

KV_BLOCK = 16
KV_TYPES = {"f32": torch.float32, "f16": torch.float16}


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim (the mean in float64, as C sums)."""
    ms = (x.double() * x.double()).mean(dim=-1, keepdim=True).float()
    y = x * (1.0 / torch.sqrt(ms + eps))
    return y if w is None else w * y


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2 * cos.shape[-1] dims of x [T, n, hd]; cos, sin [T, rd/2]."""
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s, rest], dim=-1)


class TorchKV:
    """Paged K/V per attention layer: rows [n_blocks * 16, n_kv_heads, width], slot
    block * 16 + pos % 16 (the C cache's addressing through the same block tables).
    MLA keeps one latent row per position (values are its first kv_lora_rank elements).
    layers: the attention layers it holds (None: all; a split placement keeps its own).
    state: the linear-attention layers' recurrent-state slots (linear.LinearState), if any."""

    def __init__(self, cfg: ModelConfig, n_blocks: int, kv_type: str, device: torch.device,
                 n_state_slots: int = 0, layers: list[int] | None = None,
                 state: LinearState | None = None) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"the torch backend keeps its KV cache as {' or '.join(KV_TYPES)}, "
                             f"not {kv_type!r}")
        self.kv_type = kv_type
        self.n_blocks = n_blocks
        self.n_state_slots = n_state_slots
        self.state = state
        dt = KV_TYPES[kv_type]
        self.mla = cfg.attn == "mla"
        rd = cfg.rotary_dim or cfg.head_dim
        rows = n_blocks * KV_BLOCK
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for il in cfg.attention_layers if layers is None else layers:
            if self.mla:
                self.k[il] = torch.zeros(rows, 1, cfg.kv_lora_rank + rd, dtype=dt, device=device)
            else:
                self.k[il] = torch.zeros(rows, cfg.n_head_kv, cfg.head_dim, dtype=dt,
                                         device=device)
                self.v[il] = torch.zeros(rows, cfg.n_head_kv, cfg.head_dim, dtype=dt,
                                         device=device)

    @staticmethod
    def block_bytes(cfg: ModelConfig, kv_type: str) -> int:
        """Bytes of one block (16 positions, every attention layer) of kv_type."""
        per = 4 if kv_type == "f32" else 2
        rd = cfg.rotary_dim or cfg.head_dim
        width = (cfg.kv_lora_rank + rd if cfg.attn == "mla"
                 else 2 * cfg.n_head_kv * cfg.head_dim)
        return KV_BLOCK * len(cfg.attention_layers) * width * per

    def copy_block(self, dst: int, src: int) -> None:
        """Block src's rows into block dst, every layer (a forked prefix's last block)."""
        for rows in (*self.k.values(), *self.v.values()):
            rows[dst * KV_BLOCK:(dst + 1) * KV_BLOCK] = rows[src * KV_BLOCK:(src + 1) * KV_BLOCK]

    def copy_state(self, dst: int, src: int) -> None:
        """Make state slot dst what slot src is (a forked sequence, a saved state restored)."""
        if self.state is None:
            raise InputError("this cache keeps no recurrent-state slots")
        self.state.copy(int(dst), int(src))

    def state_len(self, slot: int) -> int:
        """Positions state slot `slot` has absorbed (-1: none usable)."""
        return -1 if self.state is None else self.state.positions(int(slot))

    def store(self, il: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> None:
        self.k[il][slots] = k.to(self.k[il].dtype)
        if v is not None:
            self.v[il][slots] = v.to(self.v[il].dtype)


@dataclass
class StepIndex:
    """Where a step's tokens sit: their cache slots and, per query, the slots of the keys
    it may read (masked where it reads fewer than L)."""

    slots: torch.Tensor  # [T] int64
    pos: torch.Tensor  # [T] int64
    seq: torch.Tensor  # [T] int64
    tables: torch.Tensor  # [n_seq, max_blocks] int64


def step_index(tables: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> StepIndex:
    blk = tables[seq, pos // KV_BLOCK]
    return StepIndex(blk * KV_BLOCK + pos % KV_BLOCK, pos, seq, tables)


def key_slots(ix: StepIndex, window: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query its readable positions as cache slots [T, L] and a validity mask [T, L]:
    [max(0, p - window + 1), p] with a window, [p - p % chunk, p] in a chunked layer."""
    p = ix.pos
    lo = torch.zeros_like(p)
    if window > 0:
        lo = torch.clamp(p - window + 1, min=0)
    if chunk > 0:
        lo = p - p % chunk
    n = p - lo + 1
    L = int(n.max())
    j = lo[:, None] + torch.arange(L, device=p.device)[None, :]  # [T, L]
    valid = j <= p[:, None]
    j = torch.where(valid, j, lo[:, None])
    blk = ix.tables[ix.seq[:, None], j // KV_BLOCK]
    return blk * KV_BLOCK + j % KV_BLOCK, valid


def attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, valid: torch.Tensor,
           scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, Hkv, G, kd] against keys [T, L, Hkv, kd], values [T, L, Hkv, vd]: [T, Hkv, G, vd].
    A sink adds exp(sink - max) to each head's denominator and weighs no value."""
    s = torch.einsum("thgd,tlhd->thgl", q, keys) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        T, Hkv, G, _ = s.shape
        sk = sinks.view(1, Hkv, G, 1).expand(T, Hkv, G, 1)
        p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("thgl,tlhd->thgd", p, vals)


@dataclass(frozen=True)
class LayerAttn:
    """A layer's attention options (from config.json's per-layer lists)."""

    window: int
    chunk: int
    rope: bool
    qk_l2: bool
    temp: bool


def layer_attn(cfg: ModelConfig, il: int) -> LayerAttn:
    kind = cfg.layer_attn[il] if cfg.layer_attn else "sliding"
    rope = il not in cfg.nope_layers
    return LayerAttn(window=(cfg.sliding_window or 0) if kind == "sliding" else 0,
                     chunk=(cfg.attn_chunk or 0) if kind == "chunked" else 0,
                     rope=rope, qk_l2=cfg.qk_norm == "l2" and rope,
                     temp=cfg.attn_temp_floor > 0 and not rope)


def _scale(cfg: ModelConfig) -> float:
    return cfg.attn_scale if cfg.attn_scale > 0 else 1.0 / math.sqrt(cfg.head_dim)


def gqa(cfg: ModelConfig, w: dict, x: torch.Tensor, kv: TorchKV, il: int, ix: StepIndex,
        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The GQA block of layer il on x [T, D]; returns what it adds to x."""
    T = x.shape[0]
    H, Hkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    opt = layer_attn(cfg, il)
    xn = rmsnorm(x, w["attn_norm"], cfg.rms_eps)
    q = linear(xn, w["wq"], w.get("bq"))  # [T, H*hd] or, with attn_gate, [T, H*2hd]
    k = linear(xn, w["wk"], w.get("bk")).view(T, Hkv, hd)
    v = linear(xn, w["wv"], w.get("bv")).view(T, Hkv, hd)
    gate = None
    if cfg.attn_gate:
        qg = q.view(T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
    q = q.reshape(T, H, hd)
    if cfg.qk_norm == "head":
        q = rmsnorm(q, w["q_norm"], cfg.rms_eps)
        k = rmsnorm(k, w["k_norm"], cfg.rms_eps)
    elif cfg.qk_norm == "full":
        q = rmsnorm(q.reshape(T, -1), w["q_norm"], cfg.rms_eps).view(T, H, hd)
        k = rmsnorm(k.reshape(T, -1), w["k_norm"], cfg.rms_eps).view(T, Hkv, hd)
    if cfg.clip_qkv is not None:
        c = cfg.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    if opt.rope:
        q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
    if opt.qk_l2:
        q, k = rmsnorm(q, None, cfg.rms_eps), rmsnorm(k, None, cfg.rms_eps)
    if opt.temp:
        p = ix.pos.float()
        s = torch.log1p(torch.floor((p + 1.0) / cfg.attn_temp_floor)) * cfg.attn_temp_scale + 1
        q = q * s[:, None, None]
    kv.store(il, ix.slots, k, v)
    slots, valid = key_slots(ix, opt.window, opt.chunk)
    keys = kv.k[il][slots].float()
    vals = kv.v[il][slots].float()
    sinks = w.get("sinks")
    o = attend(q.reshape(T, Hkv, H // Hkv, hd), keys, vals, valid, _scale(cfg), sinks)
    o = o.reshape(T, H, hd)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return linear(o.reshape(T, H * hd), w["wo"], w.get("bo"))


def _per_head(w: TorchWeight, H: int, x: torch.Tensor) -> torch.Tensor:
    """y_h = W_h x_h for W [H * n_out, n_in] split by head, x [T, H, n_in]: [T, H, n_out]."""
    n_out = w.shape[0] // H
    wh = w.dense().view(H, n_out, w.shape[1])
    return torch.einsum("hoi,thi->tho", wh, x)


def mla(cfg: ModelConfig, w: dict, x: torch.Tensor, kv: TorchKV, il: int, ix: StepIndex,
        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Multi-head latent attention of layer il (absorbed form) on x [T, D]."""
    T = x.shape[0]
    H, hd = cfg.n_head, cfg.head_dim
    dr = cfg.rotary_dim or hd
    dn, kl = hd - dr, cfg.kv_lora_rank
    xn = rmsnorm(x, w["attn_norm"], cfg.rms_eps)
    if cfg.q_lora_rank > 0:
        ql = rmsnorm(linear(xn, w["wq_a"]), w["q_a_norm"], cfg.rms_eps)
        q = linear(ql, w["wq_b"])
    else:
        q = linear(xn, w["wq"])
    q = q.view(T, H, hd)
    kva = linear(xn, w["wkv_a"])  # [T, kl + dr]
    c = rmsnorm(kva[:, :kl], w["kv_a_norm"], cfg.rms_eps)
    k_pe = rope_half(kva[:, None, kl:], cos, sin)[:, 0]
    q_pe = rope_half(q[..., dn:], cos, sin)
    kv.store(il, ix.slots, torch.cat([c, k_pe], dim=-1)[:, None, :], None)
    qabs = torch.cat([_per_head(w["wk_b"], H, q[..., :dn]), q_pe], dim=-1)  # [T, H, kl + dr]
    slots, valid = key_slots(ix, 0, 0)
    rows = kv.k[il][slots].float()  # [T, L, 1, kl + dr]
    ctx = attend(qabs.view(T, 1, H, kl + dr), rows, rows[..., :kl], valid, _scale(cfg), None)
    att = _per_head(w["wv_b"], H, ctx.view(T, H, kl))  # [T, H, dv]
    return linear(att.reshape(T, -1), w["wo"], w.get("bo"))
