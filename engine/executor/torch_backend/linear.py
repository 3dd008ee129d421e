"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) on a torch device, following
csrc/linear_attn.c: q, k, v, z and b, a from the input projections; a causal depthwise conv
with SiLU over q, k, v (each sequence's last lin_conv - 1 inputs kept in its state slot); q and
k L2-normalised per head (q scaled by 1/sqrt(dk)); beta = sigmoid(b), decay =
exp(-exp(A_log) * softplus(a + dt_bias)); the delta rule on each value head's state [dk, dv];
an RMSNorm of each head's output times silu(z); the output projection.

The recurrence runs one position at a time over every sequence of the step at once (the
step's tokens laid out by sequence, padded; a pad leaves the state as it is), or, for long
prefill chunks, in the chunked form (the same sums regrouped per chunk of positions). State
slots follow the C core's rules: a sequence starting at position 0 starts from zero, any other
start must continue exactly what its slot absorbed; each layer counts its own positions, so a
split step may run its layers in several calls.

Shape legend: T tokens, S sequences of the step, L the longest one's tokens, nk / nv key /
value heads, dk / dv their widths, C = 2 nk dk + nv dv conv channels, K conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from colibri.engine.errors import InputError
from colibri.engine.executor.torch_backend.attention import rmsnorm
from colibri.engine.executor.torch_backend.weights import linear
from colibri.engine.models.config import ModelConfig

# prefill runs with more positions than this per sequence take the chunked form
CHUNKED_FROM = 64
CHUNK = 64


@dataclass
class SeqLayout:
    """A step's tokens laid out by sequence: row i of the [S, L] grid is sequence seqs[i]'s
    tokens in call order (their positions increase), T (a zero pad row) past its end."""

    seqs: np.ndarray  # [S] sequence ids
    first: np.ndarray  # [S] each one's first position in the call
    last: np.ndarray  # [S] its last
    slots: np.ndarray  # [S] its state slot
    grid: torch.Tensor  # [S, L] int64 token index, T past the end
    valid: torch.Tensor  # [S, L] bool
    n: torch.Tensor  # [S] int64 tokens of each sequence
    slots_t: torch.Tensor  # [S] int64 slots on the device


def seq_layout(seq: np.ndarray, pos: np.ndarray, state_slots: np.ndarray | None,
               device: torch.device) -> SeqLayout:
    """The layout of a step's tokens (seq, pos [T]) with their sequences' state slots
    (state_slots[s] for sequence s); InputError when slots are missing or out of range."""
    if state_slots is None:
        raise InputError("this model has linear-attention layers: the call needs state slots "
                         "(none given)")
    slots_all = np.asarray(state_slots, dtype=np.int64).reshape(-1)
    seqs, inv = np.unique(seq, return_inverse=True)
    if seqs.size and seqs.max() >= slots_all.size:
        raise InputError(f"state_slots names {slots_all.size} sequences; sequence "
                         f"{int(seqs.max())} has none")
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv, minlength=seqs.size)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(seq.size) - start[inv[order]]
    T, S, L = seq.size, seqs.size, int(counts.max())
    grid = np.full((S, L), T, np.int64)
    grid[inv[order], rank] = order
    first = pos[order[start]]
    last = pos[order[start + counts - 1]]
    return SeqLayout(seqs, first, last, slots_all[seqs], torch.from_numpy(grid).to(device),
                     torch.from_numpy(grid < T).to(device),
                     torch.from_numpy(counts.astype(np.int64)).to(device),
                     torch.from_numpy(slots_all[seqs]).to(device))


def _dims(cfg: ModelConfig) -> tuple[int, int, int, int, int, int]:
    nk, nv, dk, dv = cfg.lin_n_k_heads, cfg.lin_n_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    return nk, nv, dk, dv, 2 * nk * dk + nv * dv, cfg.lin_conv


class LinearState:
    """Recurrent-state slots of the linear layers `layers`: per layer the conv window
    [n_slots, K-1, C] and the DeltaNet state [n_slots, nv, dk, dv] (float32, on the device),
    and per slot and layer the positions it absorbed (host; -1: unusable until position 0)."""

    def __init__(self, cfg: ModelConfig, n_slots: int, layers: list[int],
                 device: torch.device) -> None:
        nk, nv, dk, dv, C, K = _dims(cfg)
        self.n_slots = n_slots
        self.layers = layers
        self.col = {il: i for i, il in enumerate(layers)}
        self.conv = {il: torch.zeros(n_slots, K - 1, C, device=device) for il in layers}
        self.S = {il: torch.zeros(n_slots, nv, dk, dv, device=device) for il in layers}
        self.length = np.full((n_slots, len(layers)), -1, np.int64)

    @staticmethod
    def slot_bytes(cfg: ModelConfig) -> int:
        """Bytes one slot keeps per linear layer."""
        nk, nv, dk, dv, C, K = _dims(cfg)
        return 4 * ((K - 1) * C + nv * dk * dv)

    def _cols(self, layers: list[int]) -> list[int]:
        return [self.col[il] for il in layers]

    def check(self, lay: SeqLayout, layers: list[int]) -> None:
        """InputError (changing nothing) unless each sequence has a slot of its own in range
        whose layers `layers` hold exactly the positions before its first one, or that
        position is 0 (csrc/linear_attn.c's clb_linear_check)."""
        if not layers:
            return
        cols = self._cols(layers)
        seen: dict[int, int] = {}
        for s, slot, p in zip(lay.seqs.tolist(), lay.slots.tolist(), lay.first.tolist(),
                              strict=True):
            if not 0 <= slot < self.n_slots:
                raise InputError(f"sequence {s}: state slot {slot} is not in "
                                 f"0..{self.n_slots - 1}")
            if slot in seen:
                raise InputError(f"state slot {slot} is used by sequences {seen[slot]} and {s} "
                                 "in one call")
            seen[slot] = s
            have = self.length[slot, cols]
            if p != 0 and np.any(have != p):
                raise InputError(
                    f"sequence {s} starts at position {p} but its state slot {slot} holds "
                    f"{int(have[have != p][0])} positions: a linear-attention state cannot be "
                    "rewound (start again at position 0)")

    def begin(self, lay: SeqLayout, layers: list[int]) -> None:
        """Zero layers' state of the sequences that start at position 0."""
        fresh = lay.slots_t[torch.from_numpy(lay.first == 0).to(lay.slots_t.device)]
        if fresh.numel():
            for il in layers:
                self.conv[il][fresh] = 0.0
                self.S[il][fresh] = 0.0

    def end(self, lay: SeqLayout, layers: list[int], ok: bool) -> None:
        """Record what layers absorbed (ok False: the call failed midway, unusable)."""
        cols = self._cols(layers)
        for slot, last in zip(lay.slots.tolist(), lay.last.tolist(), strict=True):
            self.length[slot, cols] = last + 1 if ok else -1

    def copy(self, dst: int, src: int) -> None:
        """Make slot dst what slot src is (a forked sequence, or a saved state restored)."""
        if not (0 <= dst < self.n_slots and 0 <= src < self.n_slots):
            raise InputError(f"state slots {dst} and {src} must be in 0..{self.n_slots - 1}")
        for il in self.layers:
            self.conv[il][dst] = self.conv[il][src]
            self.S[il][dst] = self.S[il][src]
        self.length[dst] = self.length[src]

    def positions(self, slot: int) -> int:
        """Positions every layer of slot absorbed (-1: none usable)."""
        if not 0 <= slot < self.n_slots:
            return -1
        return int(self.length[slot].min()) if self.layers else -1


def _l2norm(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) * scale over the last dim (the C core's l2norm)."""
    return x * (1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)) * scale


def _conv(w: torch.Tensor, win: torch.Tensor, x: torch.Tensor, n: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv with SiLU: w [C, K], windows win [S, K-1, C], inputs x
    [S, L, C] (zero past each sequence's n tokens): outputs [S, L, C] and the new windows
    (each sequence's last K-1 inputs)."""
    K = w.shape[1]
    L = x.shape[1]
    p = torch.cat([win, x], dim=1)  # [S, K-1+L, C]
    s = w[:, 0] * p[:, 0:L]
    for j in range(1, K):
        s = s + w[:, j] * p[:, j:j + L]
    idx = n[:, None] + torch.arange(K - 1, device=x.device)[None, :]  # [S, K-1]
    new = p.gather(1, idx[..., None].expand(-1, -1, p.shape[2]))
    return torch.nn.functional.silu(s), new


def _recurrent(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The delta rule one position at a time. S [S, nv, dk, dv] (updated in place); q, k
    [S, L, nv, dk]; v [S, L, nv, dv]; g (log decay), beta [S, L, nv]. Returns [S, L, nv, dv]."""
    out = torch.empty_like(v)
    decay = torch.exp(g)
    for t in range(q.shape[1]):
        S.mul_(decay[:, t, :, None, None])
        mem = torch.einsum("shij,shi->shj", S, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t, :, None]
        S.add_(k[:, t, :, :, None] * delta[:, :, None, :])
        out[:, t] = torch.einsum("shij,shi->shj", S, q[:, t])
    return out


def _chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """What _recurrent computes, chunk positions at a time (the UT form of the gated delta
    rule, as transformers' torch_chunk_gated_delta_rule): within a chunk the delta updates are
    one unit-triangular solve and a few products; the state is carried from chunk to chunk."""
    B, L, H, _dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % chunk  # pads leave the state as it is: g 0 (decay 1), beta 0
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2)
               for t in (q, k, v))  # [B, H, L + pad, d]
    g, beta = (torch.nn.functional.pad(t, (0, 0, 0, pad)).transpose(1, 2) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, t.shape[-1]) for t in (q, k, v))
    cum = g.reshape(B, H, n, chunk).cumsum(-1)
    beta = beta.reshape(B, H, n, chunk, 1)
    kb, vb = k * beta, v * beta
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (kb @ k.transpose(-1, -2)) * pair  # [B, H, n, c, c]
    intra = (q @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    kcum = torch.linalg.solve_triangular(ut, kb * cum.exp()[..., None], upper=False,
                                         unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    out = torch.empty(B, H, n, chunk, dv, device=v.device, dtype=v.dtype)
    for i in range(n):
        vnew = u[:, :, i] - kcum[:, :, i] @ S
        out[:, :, i] = q[:, :, i] @ S + intra[:, :, i] @ vnew
        S.mul_(last[:, :, i]).add_(k[:, :, i].transpose(-1, -2) @ vnew)
    return out.reshape(B, H, n * chunk, dv)[:, :, :L].transpose(1, 2)


def gated_delta_net(cfg: ModelConfig, w: dict, x: torch.Tensor, state: LinearState, il: int,
                    lay: SeqLayout, chunked: bool | None = None) -> torch.Tensor:
    """The linear-attention block of layer il on x [T, D] (normed here), advancing each
    sequence's conv window and state in its slot; returns what it adds to x. chunked None:
    the chunked form when a sequence brings more than CHUNKED_FROM positions."""
    nk, nv, dk, dv, C, K = _dims(cfg)
    T = x.shape[0]
    xn = rmsnorm(x, w["attn_norm"], cfg.rms_eps)
    if "lin_qkvz" in w:
        p = linear(xn, w["lin_qkvz"])  # [T, C + nv dv]: q, k, v, z
        ba = linear(xn, w["lin_ba"])  # [T, 2 nv]: b, a
        mixed, z, b, a = p[:, :C], p[:, C:], ba[:, :nv], ba[:, nv:]
    else:
        mixed, z = linear(xn, w["lin_qkv"]), linear(xn, w["lin_z"])
        b, a = linear(xn, w["lin_b"]), linear(xn, w["lin_a"])
    zero = x.new_zeros(1, 1)

    def grid(t: torch.Tensor) -> torch.Tensor:  # [T, F] -> [S, L, F], zeros past the end
        return torch.cat([t, zero.expand(1, t.shape[1])])[lay.grid]

    slots = lay.slots_t
    c, win = _conv(w["lin_conv"], state.conv[il][slots], grid(mixed), lay.n)
    state.conv[il][slots] = win
    Sq, Lq = c.shape[0], c.shape[1]
    r = nv // nk
    q = _l2norm(c[..., :nk * dk].reshape(Sq, Lq, nk, dk), 1.0 / float(dk) ** 0.5)
    k = _l2norm(c[..., nk * dk:2 * nk * dk].reshape(Sq, Lq, nk, dk), 1.0)
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # value head h: h // r
    v = c[..., 2 * nk * dk:].reshape(Sq, Lq, nv, dv)
    sp = torch.nn.functional.softplus(grid(a) + w["lin_dt_bias"], threshold=20.0)
    g = -torch.exp(w["lin_a_log"]) * sp  # log decay
    g = torch.where(lay.valid[..., None], g, 0.0)  # a pad leaves the state as it is
    beta = torch.where(lay.valid[..., None], torch.sigmoid(grid(b)), 0.0)
    S = state.S[il][slots]
    if chunked is None:
        chunked = Lq > CHUNKED_FROM
    o = (_chunked if chunked else _recurrent)(S, q, k, v, g, beta)  # [S, L, nv, dv]
    state.S[il][slots] = S
    zg = grid(z).reshape(Sq, Lq, nv, dv)
    inv = 1.0 / torch.sqrt((o * o).mean(-1, keepdim=True) + cfg.rms_eps)
    o = w["lin_norm"] * (o * inv) * torch.nn.functional.silu(zg)
    y = torch.empty(T, nv * dv, device=x.device, dtype=o.dtype)
    y[lay.grid[lay.valid]] = o.reshape(Sq, Lq, nv * dv)[lay.valid]
    return linear(y, w["lin_out"])
