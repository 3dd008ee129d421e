"""Routers, routed experts, shared experts and dense FFNs on a torch device, following
csrc/forward.c: the softmax router (group-limited with n_group > 1), the grouped sigmoid
router with its selection bias, Llama 4's sigmoid top-k; experts grouped by expert, each run
once over its rows, combined in expert order (route -> group -> run -> combine).

Shape legend: T tokens, D n_embd, E experts, K used, F expert ff.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from colibri.engine.executor.torch_backend.weights import FFNWeights, linear
from colibri.engine.models.config import ModelConfig


def _top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest of each row (ties: the lower id first, as C's top_k)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]


def _keep_groups(gs: torch.Tensor, cfg: ModelConfig, score: torch.Tensor) -> torch.Tensor:
    """score with the experts outside the topk_group best groups (by gs [T, G]) at -inf."""
    T, E, G = score.shape[0], cfg.n_expert, cfg.n_group
    keep = torch.zeros(T, G, dtype=torch.bool, device=score.device)
    keep.scatter_(1, _top(gs, cfg.topk_group), True)
    mask = keep.repeat_interleave(E // G, dim=1)
    return score.masked_fill(~mask, float("-inf"))


@dataclass
class Routing:
    ids: torch.Tensor  # [T, K] int64
    weights: torch.Tensor  # [T, K] float32


def route(cfg: ModelConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> Routing:
    """One step's choice of experts from router logits [T, E] (bias: the grouped sigmoid
    router's selection bias [E])."""
    K, G = cfg.n_expert_used, cfg.n_group
    T, E = logits.shape
    if cfg.router == "sigmoid_topk":
        ids = _top(logits, K)
        return Routing(ids, torch.sigmoid(logits.gather(1, ids)))
    if cfg.router == "sigmoid_grouped":
        s = torch.sigmoid(logits)
        c = s + bias if bias is not None else s
        if G > 1:
            two = torch.sort(c.view(T, G, E // G), dim=-1, descending=True).values[..., :2]
            c = _keep_groups(two.sum(-1), cfg, c)
        ids = _top(c, K)
        w = s.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return Routing(ids, w * cfg.routed_scale)
    p = torch.softmax(logits, dim=-1)
    sel = p
    if G > 1:
        sel = _keep_groups(p.view(T, G, E // G).max(-1).values, cfg, p)
    ids = _top(sel, K)
    w = p.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    if cfg.routed_scale != 1.0:
        w = w * cfg.routed_scale
    return Routing(ids, w)


def glu(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if cfg.glu == "swiglu_clamp":
        lim, alpha = cfg.glu_limit, cfg.glu_alpha

        def clamped(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
            g = g.clamp(max=lim)
            return g * torch.sigmoid(alpha * g) * (u.clamp(-lim, lim) + 1.0)
        return clamped
    return lambda g, u: torch.nn.functional.silu(g) * u


def ffn(cfg: ModelConfig, w: FFNWeights, x: torch.Tensor) -> torch.Tensor:
    """w2 @ glu(w1 @ x + b1, w3 @ x + b3) + b2 for rows x [n, D]."""
    h = glu(cfg)(linear(x, w.w1, w.b1), linear(x, w.w3, w.b3))
    return linear(h, w.w2, w.b2)


def experts(cfg: ModelConfig, ws: list[FFNWeights | None], xn: torch.Tensor, r: Routing,
            only: Callable[[int], bool] | None = None,
            fetch: Callable[[int], FFNWeights] | None = None) -> torch.Tensor:
    """The routed experts' combined output [T, D]: each chosen expert once over its rows, in
    expert order; with route_input the weight scales the expert's input instead of its output.
    only(e) False: expert e's rows are left out (another backend computes them). fetch(e):
    the weights of an expert not in ws (None there), called just before its rows run, so it
    may reuse one buffer for several experts in turn."""
    out = torch.zeros_like(xn)
    flat = r.ids.reshape(-1)
    chosen = torch.unique(flat).tolist()
    for e in chosen:
        if only is not None and not only(e):
            continue
        w = ws[e]
        if w is None and fetch is not None:
            w = fetch(e)
        assert w is not None, f"expert {e} is not on this device"
        tok, k = (r.ids == e).nonzero(as_tuple=True)
        wt = r.weights[tok, k][:, None]
        dev = w.w1.data.device
        x = xn[tok].to(dev)
        if cfg.route_input:
            y = ffn(cfg, w, x * wt.to(dev)).to(out.device)
        else:
            y = ffn(cfg, w, x).to(out.device) * wt
        out.index_add_(0, tok, y)
    return out


def shared(cfg: ModelConfig, w: FFNWeights, gate: torch.Tensor | None,
           xn: torch.Tensor) -> torch.Tensor:
    """The shared expert on xn [T, D], scaled by sigmoid(gate @ xn) when gated."""
    y = ffn(cfg, w, xn)
    if gate is not None:
        y = y * torch.sigmoid(xn @ gate.T)
    return y
