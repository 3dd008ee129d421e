"""Routed experts of one MoE layer split between the torch device and the C core, and the GPU
tier that moves them between the two by heat.

A layer the placement puts on the torch device keeps some of its routed experts there (their
weights uploaded) and leaves the others to the C core. A step routes once (on the device);
the C core then computes its experts' rows (clb_moe_experts, on a worker thread: the call
releases the GIL) while torch computes the device experts' rows, and the two partial sums are
added in one fixed order (the device's, then the C core's), so the result never depends on
which side finishes first. Between steps, never inside one, `ExpertSplit.after_step` counts
the step's selections, decays the heat and swaps a cold device expert for a hotter C one when
the heat says so, with hysteresis and at most `TierConfig.max_uploads` uploads per step.
Where an expert runs changes its float rounding only (the torch and C products of one weight
type), never which experts a token chooses from the same hidden state.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri.engine.executor.torch_backend import ffn
from colibri.engine.executor.torch_backend.weights import ModelWeights, load_expert
from colibri.engine.format.wfile import read_wfile
from colibri.engine.models.config import ModelConfig


@dataclass(frozen=True)
class TierConfig:
    """How the GPU tier moves experts: heat is each expert's selections, decayed by half every
    `half_life_steps` steps; a C expert replaces a device one when its heat exceeds the
    device one's by `margin` (relative) and by `min_gap` selections (absolute), at most
    `max_uploads` swaps per step (0: the placement never changes)."""

    half_life_steps: float = 32.0
    margin: float = 0.5
    min_gap: float = 2.0
    max_uploads: int = 2


@dataclass
class TierCounters:
    hits: int = 0  # (token, expert) selections computed by a device expert
    misses: int = 0  # selections computed by the C core
    uploads: int = 0  # experts copied to the device by the tier
    upload_bytes: int = 0
    evictions: int = 0  # experts dropped from the device to make room
    steps: int = 0


class ExpertSplit:
    """Which routed experts of the torch layers live on the device, and a step's experts run
    across the device and the C core (see the module's docstring)."""

    def __init__(self, folder: Path, cfg: ModelConfig, c: Any, weights: ModelWeights,
                 device: torch.device, layers: set[int], tier: TierConfig | None = None
                 ) -> None:
        self.folder = folder
        self.cfg = cfg
        self.c = c  # engine._core.CoreModel: runs the experts left on the CPU
        self.w = weights
        self.device = device
        self.tier = tier or TierConfig()
        L, E = cfg.n_layer, cfg.n_expert
        self.layers = sorted(il for il in layers if il in set(cfg.moe_layers))
        self.on_device = np.zeros((L, E), dtype=bool)
        for il in self.layers:
            self.on_device[il] = [w is not None for w in weights.layers[il].experts]
        self.tracked = np.zeros((L, E), dtype=bool)
        self.tracked[self.layers] = True
        self.heat = np.zeros((L, E), dtype=np.float64)
        self.counters = TierCounters()
        self._sel = torch.zeros((L, max(E, 1)), dtype=torch.int64, device=device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-c-experts")
        self._lock = threading.Lock()  # the counters and masks, read by other threads
        self._expert_bytes = {il: self._bytes_of(il) for il in self.layers}

    def _bytes_of(self, il: int) -> int:
        """Device bytes of one expert of layer il (every expert of a layer has one shape)."""
        f = self.folder / "experts" / f"layer_{il}_expert_0.bin"
        return sum(int(t.nbytes) for t in read_wfile(f).tensors.values())

    # ---- the step ---------------------------------------------------------------------------

    def run(self, il: int, xn: torch.Tensor, r: ffn.Routing) -> torch.Tensor:
        """Layer il's routed experts for the step: [T, D], device share + C share."""
        cfg = self.cfg
        ws = self.w.layers[il].experts
        self._sel[il] += torch.bincount(r.ids.reshape(-1), minlength=cfg.n_expert)
        here = self.on_device[il]
        if here.all():
            return ffn.experts(cfg, ws, xn, r)
        ids = r.ids.cpu().numpy().astype(np.int32)
        mine = ~here
        if not mine[ids].any():  # every chosen expert is on the device
            return ffn.experts(cfg, ws, xn, r, lambda e: bool(here[e]))
        x = np.ascontiguousarray(xn.float().cpu().numpy())
        wt = np.ascontiguousarray(r.weights.float().cpu().numpy())
        c_out = np.empty_like(x)
        job = self._pool.submit(self.c.moe_experts, il, x, ids, wt, mine, c_out)
        try:
            y = ffn.experts(cfg, ws, xn, r, lambda e: bool(here[e]))
        except BaseException:
            job.exception()  # the C core is still using its scratch: wait for it first
            raise
        job.result()
        return y + torch.from_numpy(c_out).to(y.device)

    # ---- between steps ----------------------------------------------------------------------

    def after_step(self) -> None:
        """Counts the step's selections as device hits or C misses, updates the heat, and lets
        the tier move experts."""
        sel = self._sel.cpu().numpy()[:, :self.cfg.n_expert].astype(np.float64)
        self._sel.zero_()
        decay = 0.5 ** (1.0 / self.tier.half_life_steps)
        with self._lock:
            self.counters.hits += int(sel[self.on_device].sum())
            self.counters.misses += int(sel[self.tracked & ~self.on_device].sum())
            self.counters.steps += 1
            self.heat = self.heat * decay + sel
        self.rebalance()

    def rebalance(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Swaps the hottest C experts for the coldest device ones while the heat says so
        (the margin and gap of TierConfig), at most max_uploads of them; returns the swaps as
        ((layer, expert) uploaded, (layer, expert) evicted)."""
        t = self.tier
        if t.max_uploads <= 0:
            return []
        cold_side = self.tracked & ~self.on_device
        hot = sorted(((-self.heat[il, e], il, e) for il, e in zip(*np.nonzero(cold_side),
                                                                   strict=True)))
        cold = sorted(((self.heat[il, e], il, e) for il, e in zip(*np.nonzero(self.on_device),
                                                                   strict=True)))
        swaps: list[tuple[tuple[int, int], tuple[int, int]]] = []
        j = 0
        for neg, hl, he in hot:
            if len(swaps) >= t.max_uploads or j >= len(cold):
                break
            h = -neg
            c, cl, ce = cold[j]
            if not h > c * (1.0 + t.margin) + t.min_gap:
                break
            if self._expert_bytes[int(hl)] > self._expert_bytes[int(cl)]:
                continue  # it would not fit where the cold one was
            self._evict(int(cl), int(ce))
            self._upload(int(hl), int(he))
            swaps.append(((int(hl), int(he)), (int(cl), int(ce))))
            j += 1
        return swaps

    def _upload(self, il: int, e: int) -> None:
        lw = self.w.layers[il]
        ew = load_expert(self.folder, self.cfg, il, e, self.device, lw.router)
        lw.experts[e] = ew
        with self._lock:
            self.on_device[il, e] = True
            self.counters.uploads += 1
            self.counters.upload_bytes += ew.nbytes

    def _evict(self, il: int, e: int) -> None:
        self.w.layers[il].experts[e] = None
        with self._lock:
            self.on_device[il, e] = False
            self.counters.evictions += 1

    # ---- what it reports --------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters (hits, misses, uploads, upload_bytes, evictions, steps), the experts on
        the device and their bytes, and per layer and expert where each is ([layer][expert]:
        1 on the device, 0 on the CPU) and its heat."""
        with self._lock:
            on = self.on_device.copy()
            out: dict[str, Any] = asdict(self.counters)
            heat = self.heat.copy()
        out["experts_on_device"] = int(on.sum())
        out["device_expert_bytes"] = int(sum(self._expert_bytes[il] * int(on[il].sum())
                                             for il in self.layers))
        out["layers"] = list(self.layers)
        out["on_device"] = on.astype(np.int8)
        out["heat"] = heat
        return out
