"""The backend seam: a step's forward pass as a sequence of per-layer operations, each bound
to a backend.

`step_ops(cfg)` lists the operations of one step in the order they run, from the family's
layer mix (config.json's layer_ffn / layer_mixer / n_ff_shared); every backend runs exactly
these. The C core runs them all in one call (`StepCore.forward`, the CPU backend, bit-exact);
the torch backend (engine/executor/torch_backend) binds each to a function on a torch device.
A `Placement` says which backend holds each operation (and, for routed experts, each expert).
This module imports neither torch nor the C extension.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from colibri.engine.models.config import ModelConfig


class Op(StrEnum):
    """One kind of per-layer work (EMBED and LM_HEAD are the step's first and last)."""

    EMBED = "embed"
    ATTENTION = "attention"  # norm, q/k/v, RoPE, the paged KV, attention, output projection
    LINEAR_ATTENTION = "linear_attention"  # gated DeltaNet with a recurrent state
    ROUTER = "router"  # ffn norm and the router's choice of experts
    EXPERTS = "experts"  # the routed experts of the layer, combined by their weights
    SHARED = "shared"  # the shared expert(s), gated where the family gates them
    DENSE = "dense"  # a dense layer's FFN (its own norm)
    LM_HEAD = "lm_head"  # final norm and the vocabulary projection


# what runs every token, whatever the routing: placed first by the cost model
ALWAYS_USED = (Op.EMBED, Op.ATTENTION, Op.LINEAR_ATTENTION, Op.ROUTER, Op.SHARED, Op.DENSE,
               Op.LM_HEAD)
BACKENDS = ("c", "torch")


@dataclass(frozen=True)
class LayerOp:
    """Operation `op` of layer `layer` (-1 for EMBED and LM_HEAD)."""

    layer: int
    op: Op


def step_ops(cfg: ModelConfig) -> list[LayerOp]:
    """The operations of one forward step of cfg's family, in the order they run."""
    ops = [LayerOp(-1, Op.EMBED)]
    moe = set(cfg.moe_layers)
    for il in range(cfg.n_layer):
        linear = bool(cfg.layer_mixer) and cfg.layer_mixer[il] == "linear"
        ops.append(LayerOp(il, Op.LINEAR_ATTENTION if linear else Op.ATTENTION))
        if il in moe:
            ops += [LayerOp(il, Op.ROUTER), LayerOp(il, Op.EXPERTS)]
            if cfg.n_ff_shared > 0:
                ops.append(LayerOp(il, Op.SHARED))
        else:
            ops.append(LayerOp(il, Op.DENSE))
    ops.append(LayerOp(-1, Op.LM_HEAD))
    return ops


@dataclass
class Placement:
    """Which backend runs each operation: `default` unless `ops` names another; routed
    experts by (layer, expert) in `experts`, else where their layer's EXPERTS op runs."""

    default: str = "c"
    ops: dict[LayerOp, str] = field(default_factory=dict)
    experts: dict[tuple[int, int], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for b in (self.default, *self.ops.values(), *self.experts.values()):
            if b not in BACKENDS:
                raise ValueError(f"unknown backend {b!r}; choose one of {', '.join(BACKENDS)}")

    def of(self, lop: LayerOp) -> str:
        return self.ops.get(lop, self.default)

    def of_expert(self, layer: int, expert: int) -> str:
        return self.experts.get((layer, expert), self.of(LayerOp(layer, Op.EXPERTS)))

    def backends(self, ops: Iterable[LayerOp]) -> set[str]:
        """Every backend some operation of ops (or one of their experts) runs on."""
        used = {self.of(o) for o in ops}
        return used | set(self.experts.values())

    @classmethod
    def all_on(cls, backend: str) -> Placement:
        return cls(default=backend)


class StepCore(Protocol):
    """What Model (engine/executor/model.py) needs of a backend that runs a whole step: the C
    core's CoreModel and the torch backend's TorchCore both are one."""

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_threads(self) -> int: ...

    def forward(self, kv: Any, tokens: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray,
                want_logits: np.ndarray | None, block_tables: np.ndarray, *,
                routes: np.ndarray | None = None,
                state_slots: np.ndarray | None = None) -> np.ndarray: ...

    def kv_block_bytes(self, kv_type: str) -> int: ...

    def product_stats(self) -> dict[str, float]: ...


DEVICES_HELP = "auto, cpu, cuda, cuda:N or torch-cpu"
TORCH_KV_TYPES = ("f32", "f16")


def torch_unsupported(cfg: ModelConfig, kv_type: str = "f32") -> list[str]:
    """What of cfg (and a KV cache of kv_type) the torch backend does not run yet."""
    out = []
    if kv_type not in TORCH_KV_TYPES:
        out.append(f"a {kv_type} KV cache (f32 and f16 only)")
    return out


def check_device(name: str) -> str:
    """name if it is a device Colibri knows (auto, cpu, cuda, cuda:N, torch-cpu), lowercased;
    ValueError otherwise."""
    d = name.strip().lower()
    if d in ("auto", "cpu", "cuda", "torch-cpu"):
        return d
    if d.startswith("cuda:") and d[5:].isdigit():
        return d
    raise ValueError(f"unknown device {name!r}; choose one of {DEVICES_HELP}")


# device files a GPU driver creates on Linux (NVIDIA, WSL's GPU, ROCm): without any of them
# torch sees no CUDA device, and the second or so that importing torch takes is saved
GPU_DEVICE_FILES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


def gpu_driver_absent() -> bool:
    """True where this is Linux and no GPU driver's device file exists (torch would see no
    CUDA device); False where one exists or on another system (torch is asked then)."""
    return sys.platform.startswith("linux") and not any(os.path.exists(f)
                                                        for f in GPU_DEVICE_FILES)


def torch_cuda_count() -> int:
    """CUDA devices torch sees (0 without torch, with a CPU-only torch, or on a Linux machine
    with no GPU driver, where torch is not imported at all)."""
    if gpu_driver_absent():
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def resolve_device(name: str) -> str:
    """The device a --device value means here: "cpu" (the C core), "torch-cpu", or a CUDA
    device ("cuda:N"). auto: cuda:0 when torch sees a GPU, else cpu. ValueError for a CUDA
    device this machine does not have."""
    d = check_device(name)
    if d == "auto":
        return "cuda:0" if torch_cuda_count() > 0 else "cpu"
    if d.startswith("cuda"):
        n = torch_cuda_count()
        idx = int(d[5:]) if ":" in d else 0
        if idx >= n:
            raise ValueError(f"device {d}: torch sees {n} CUDA device(s) here; install "
                             "colibri[cuda] with a CUDA build of torch, or use --device cpu")
        return f"cuda:{idx}"
    return d


def torch_device_name(device: str) -> str:
    """The torch device of a resolved device ("torch-cpu" -> "cpu")."""
    return "cpu" if device == "torch-cpu" else device
