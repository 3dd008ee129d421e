"""Routed experts of one MoE layer split between the torch device and the C core, and the GPU
tier that moves them between the two by heat.

A layer the placement puts on the torch device keeps some of its routed experts there (their
weights uploaded) and leaves the others to the C core. A step routes once (on the device).
Then, for each chosen expert that is not on the device, the cost model's `cold_expert_choice`
over the device profile decides for this step alone whether the C core computes its rows or
it is uploaded into a reused device buffer and computed there (a large prefill chunk repays
the copy, a decode token does not; no profile: every such expert stays on the C core). The C
core computes the remaining experts' rows (clb_moe_experts, on a worker thread: the call
releases the GIL) while torch computes the device experts' and the uploaded ones' rows, in
expert order, and the two partial sums are added in one fixed order (the device's, then the C
core's), so the result never depends on which side finishes first. Between steps, never
inside one, `ExpertSplit.after_step` counts the step's selections, decays the heat and swaps
a cold device expert for a hotter C one when the heat says so, with hysteresis and at most
`TierConfig.max_uploads` uploads per step; a step's transient uploads never change that
placement. Where an expert runs changes its float rounding only (the torch and C products of
one weight type), never which experts a token chooses from the same hidden state.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colibri.engine.executor.costmodel import DeviceProfile, Item, cold_expert_choice, expert_item
from colibri.engine.executor.torch_backend import ffn
from colibri.engine.executor.torch_backend.weights import (
    FFNWeights,
    ModelWeights,
    expert_matrices,
    load_expert,
    set_expert_bias,
)
from colibri.engine.format.wfile import read_wfile
from colibri.engine.models.config import ModelConfig


@dataclass(frozen=True)
class TierConfig:
    """How the GPU tier moves experts: heat is each expert's selections, decayed by half every
    `half_life_steps` steps; a C expert replaces a device one when its heat exceeds the
    device one's by `margin` (relative) and by `min_gap` selections (absolute), at most
    `max_uploads` swaps per step (0: the placement never changes). A step's transient
    uploads (the cost model's choice for a cold expert) go through a ring of `upload_buffers`
    device buffers of one expert each, reused expert after expert: GPU memory beyond the
    placement's budget, at most that many experts' worth."""

    half_life_steps: float = 32.0
    margin: float = 0.5
    min_gap: float = 2.0
    max_uploads: int = 2
    upload_buffers: int = 2


@dataclass
class TierCounters:
    hits: int = 0  # (token, expert) selections computed by a device expert
    misses: int = 0  # selections computed by the C core
    uploads: int = 0  # experts copied to the device by the tier
    upload_bytes: int = 0
    evictions: int = 0  # experts dropped from the device to make room
    steps: int = 0
    # the cost model's per-step choice: cold experts copied into a reused device buffer for
    # one step (not a tier change), their bytes, and the selections they computed (neither
    # hits nor misses: hits + misses + step_upload_rows is every selection)
    step_uploads: int = 0
    step_upload_bytes: int = 0
    step_upload_rows: int = 0


class UploadBuffers:
    """Rings of device buffers, one ring per expert shape, that a step's transient uploads
    fill in turn: at most `n` experts' weights per shape stay allocated (the most any `fill`
    asked for), however many experts a step uploads. Buffer i is refilled only after the
    expert that used it was issued: the step runs its experts one after another, and on a
    GPU the copy queues behind the product that read the buffer (one stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rings: dict[tuple[Any, ...], list[FFNWeights]] = {}
        self._next: dict[tuple[Any, ...], int] = {}
        self.nbytes = 0  # device bytes the rings hold (read by other threads: a plain int)

    def fill(self, host: FFNWeights, n: int) -> FFNWeights:
        """A device buffer holding host's matrices (no biases), from a ring of n."""
        key = (host.w1.form, host.w3.form, host.w2.form)
        ring = self._rings.setdefault(key, [])
        i = self._next.get(key, 0) % max(1, n)
        self._next[key] = i + 1
        if i == len(ring):
            ring.append(host.to(self.device))  # allocated once, refilled from now on
            self.nbytes += ring[i].nbytes
            return ring[i]
        buf = ring[i]
        buf.w1.copy_(host.w1)
        buf.w3.copy_(host.w3)
        buf.w2.copy_(host.w2)
        return buf


class ExpertSplit:
    """Which routed experts of the torch layers live on the device, and a step's experts run
    across the device and the C core (see the module's docstring)."""

    def __init__(self, folder: Path, cfg: ModelConfig, c: Any, weights: ModelWeights,
                 device: torch.device, layers: set[int], tier: TierConfig | None = None,
                 profile: DeviceProfile | None = None) -> None:
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
        self.selections = np.zeros((L, E), dtype=np.int64)  # since start, wherever computed
        self.counters = TierCounters()
        self._sel = torch.zeros((L, max(E, 1)), dtype=torch.int64, device=device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-c-experts")
        self._lock = threading.Lock()  # the counters and masks, read by other threads
        self._expert_bytes = {il: self._bytes_of(il) for il in self.layers}
        # the cost model's view of one expert of each layer, for the per-step choice
        self._items: dict[int, Item] = {il: expert_item(folder, il) for il in self.layers}
        # the profile the per-step choice predicts with (None: cold experts stay on the CPU)
        self.profile = profile
        self._buffers = UploadBuffers(device)
        self._step_rows = 0  # selections computed by this step's transient uploads
        self._step_log: list[tuple[int, int, int]] = []
        # (layer, expert, rows) of each transient upload of the last finished step
        self.last_step_uploads: list[tuple[int, int, int]] = []

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
        rows = np.bincount(ids.reshape(-1), minlength=cfg.n_expert)
        up = self.step_uploads(il, rows)
        dev = here | up
        mine = ~dev

        def fetch(e: int) -> FFNWeights:
            return self._upload_for_step(il, e, int(rows[e]))

        if not (mine & (rows > 0)).any():  # every chosen expert runs on the device
            return ffn.experts(cfg, ws, xn, r, lambda e: bool(dev[e]), fetch)
        x = np.ascontiguousarray(xn.float().cpu().numpy())
        wt = np.ascontiguousarray(r.weights.float().cpu().numpy())
        c_out = np.empty_like(x)
        job = self._pool.submit(self.c.moe_experts, il, x, ids, wt, mine, c_out)
        try:
            y = ffn.experts(cfg, ws, xn, r, lambda e: bool(dev[e]), fetch)
        except BaseException:
            job.exception()  # the C core is still using its scratch: wait for it first
            raise
        job.result()
        return y + torch.from_numpy(c_out).to(y.device)

    def step_uploads(self, il: int, rows: np.ndarray) -> np.ndarray:
        """[E] bool: the experts of layer il not on the device that this step uploads, by the
        cost model's choice for their rows (rows [E]: tokens routed to each)."""
        prof = self.profile
        out = np.zeros(self.cfg.n_expert, dtype=bool)
        if prof is None or prof.gpu is None:
            return out
        it = self._items[il]
        for e in np.nonzero(~self.on_device[il] & (rows > 0))[0]:
            out[e] = cold_expert_choice(prof, it, float(rows[e])) == "upload"
        return out

    def _upload_for_step(self, il: int, e: int, rows: int) -> FFNWeights:
        """Expert e of layer il in a reused device buffer for this step's `rows` rows."""
        host = expert_matrices(self.folder, il, e, torch.device("cpu"))
        buf = self._buffers.fill(host, self.tier.upload_buffers)
        set_expert_bias(self.cfg, buf, e, self.w.layers[il].router, self.device)
        self._step_rows += rows
        self._step_log.append((il, e, rows))
        with self._lock:
            self.counters.step_uploads += 1
            self.counters.step_upload_bytes += buf.nbytes
            self.counters.step_upload_rows += rows
        return buf

    # ---- between steps ----------------------------------------------------------------------

    def begin_step(self) -> None:
        """Forgets what a step that failed midway had counted (its after_step never ran)."""
        self._sel.zero_()
        self._step_rows = 0
        self._step_log = []

    def after_step(self) -> None:
        """Counts the step's selections as device hits or C misses, updates the heat, and lets
        the tier move experts."""
        sel = self._sel.cpu().numpy()[:, :self.cfg.n_expert].astype(np.float64)
        self._sel.zero_()
        decay = 0.5 ** (1.0 / self.tier.half_life_steps)
        with self._lock:
            self.counters.hits += int(sel[self.on_device].sum())
            self.counters.misses += (int(sel[self.tracked & ~self.on_device].sum())
                                     - self._step_rows)
            self.counters.steps += 1
            self.heat = self.heat * decay + sel
            self.selections += sel.astype(np.int64)
        self._step_rows = 0
        self.last_step_uploads, self._step_log = self._step_log, []
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
        """Counters (hits, misses, uploads, upload_bytes, evictions, steps, step_uploads,
        step_upload_bytes, step_upload_rows), the experts on the device and their bytes, the
        bytes of the step uploads' buffers, and per layer and expert where each is
        ([layer][expert]: 1 on the device, 0 on the CPU), its heat and its selections."""
        with self._lock:
            on = self.on_device.copy()
            out: dict[str, Any] = asdict(self.counters)
            heat = self.heat.copy()
            sel = self.selections.copy()
        out["experts_on_device"] = int(on.sum())
        out["device_expert_bytes"] = int(sum(self._expert_bytes[il] * int(on[il].sum())
                                             for il in self.layers))
        out["upload_buffer_bytes"] = self._buffers.nbytes
        out["layers"] = list(self.layers)
        out["on_device"] = on.astype(np.int8)
        out["heat"] = heat
        out["selections"] = sel
        return out
