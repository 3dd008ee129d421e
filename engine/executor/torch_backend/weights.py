"""A converted Colibri folder's weights as torch tensors on one device.

Matrices keep their file type where the product can use it: q8 as int8 values with their f16
block scales, q4 as its packed nibbles with their scales, f16 / bf16 as themselves; each is
widened to float32 on use (weight-only quantization: the activations stay float32). q6 and
MXFP4 are widened to float32 at load. Norms, routers and biases are float32, as in the files.
Reads every file through engine.format.wfile, which checks each header before a byte of data.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from colibri.engine.format import quant
from colibri.engine.format.wfile import WFile, read_wfile
from colibri.engine.models.config import ModelConfig

QK = quant.QK
KEEP_QUANTIZED = ("q8", "q4")


class TorchWeight:
    """One matrix [n_out, n_in] in its stored form; `dense()` is it as float32."""

    def __init__(self, type_name: str, shape: tuple[int, ...], data: torch.Tensor,
                 scale: torch.Tensor | None = None) -> None:
        self.type_name = type_name
        self.shape = shape
        # f32 / f16 / bf16 [*shape]; q8 int8 [rows, nb, 32]; q4 packed uint8 [rows, nb, 16]
        self.data = data
        self.scale = scale  # q8 / q4: f16 [rows, nb]

    @classmethod
    def from_file(cls, f: WFile, name: str, device: torch.device) -> TorchWeight:
        shape = tuple(int(d) for d in f.tensors[name].shape)
        type_name, data_rows = f.rows(name)
        raw = np.frombuffer(data_rows, dtype=np.uint8)
        if type_name in KEEP_QUANTIZED:
            dt = quant.Q8_DTYPE if type_name == "q8" else quant.Q4_DTYPE
            blocks = raw.view(dt).reshape(int(np.prod(shape[:-1])), shape[-1] // QK)
            data = torch.from_numpy(np.ascontiguousarray(blocks["qs"])).to(device)
            scale = torch.from_numpy(np.ascontiguousarray(blocks["d"])).to(device)
            return cls(type_name, shape, data, scale)
        if type_name in ("f16", "bf16"):
            bits = torch.from_numpy(raw.view("<i2").copy()).reshape(shape)
            dtype = torch.float16 if type_name == "f16" else torch.bfloat16
            return cls(type_name, shape, bits.view(dtype).to(device))
        arr = quant.decode(raw, type_name, shape)
        return cls("f32", shape, torch.from_numpy(np.ascontiguousarray(arr)).to(device))

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * 2)

    def dense(self) -> torch.Tensor:
        """The matrix as float32, dequantized exactly as engine.format.quant.decode does."""
        if self.type_name == "q8":
            q = self.data.float() * self.scale.float()[..., None]
            return q.reshape(self.shape)
        if self.type_name == "q4":
            lo = (self.data & 15).to(torch.int8) - 8
            hi = (self.data >> 4).to(torch.int8) - 8
            q = torch.cat([lo, hi], dim=-1).float() * self.scale.float()[..., None]
            return q.reshape(self.shape)
        return self.data.float()

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """Rows [r0, r1) as float32 (a head's slice of a per-head matrix)."""
        if self.type_name in KEEP_QUANTIZED:
            n_in = self.shape[-1]
            sub = TorchWeight(self.type_name, (r1 - r0, n_in), self.data[r0:r1],
                              self.scale[r0:r1])
            return sub.dense()
        return self.data[r0:r1].float()

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids (an embedding lookup) as float32 [len(ids), n_in]."""
        if self.type_name in KEEP_QUANTIZED:
            sub = TorchWeight(self.type_name, (int(ids.numel()), self.shape[-1]),
                              self.data[ids], self.scale[ids])
            return sub.dense()
        return self.data[ids].float()

    def to(self, device: torch.device) -> TorchWeight:
        return TorchWeight(self.type_name, self.shape, self.data.to(device),
                           None if self.scale is None else self.scale.to(device))

    def copy_(self, src: TorchWeight) -> None:
        """src's values into this matrix's storage (one type and shape; any devices)."""
        assert (src.type_name, src.shape) == (self.type_name, self.shape)
        self.data.copy_(src.data)
        if self.scale is not None:
            assert src.scale is not None
            self.scale.copy_(src.scale)

    @property
    def form(self) -> tuple[str, tuple[int, ...]]:
        """(type, shape): matrices of one form fit one buffer."""
        return self.type_name, self.shape


class _Scratch(threading.local):
    """Per thread and device, one float32 buffer that a quantized matrix is widened into
    just before its product: no allocation (on the CPU: no fresh pages to fault in) per
    matrix and step. It grows to the largest matrix widened so far."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def get(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        n = int(np.prod(shape))
        buf = self.bufs.get(str(device))
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=torch.float32, device=device)
            self.bufs[str(device)] = buf
        return buf[:n].view(shape)


_SCRATCH = _Scratch()


def linear(x: torch.Tensor, w: TorchWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, n_in] @ w^T (+ bias): [T, n_out] in float32. A q8 matrix is widened into the
    thread's scratch buffer (int8 copied in, then scaled in place by its f32 block scales:
    quant.decode's values, a few times faster on the CPU than a fresh widened copy times the
    scales, which allocates twice), then multiplied."""
    if w.type_name == "q8":
        assert w.scale is not None
        buf = _SCRATCH.get(tuple(w.data.shape), w.data.device)
        buf.copy_(w.data)
        buf.mul_(w.scale.float()[..., None])
        wd = buf.view(w.shape)
    else:
        wd = w.dense()
    y = x @ wd.T
    return y if bias is None else y + bias


@dataclass
class FFNWeights:
    w1: TorchWeight  # [F, D] gate
    w3: TorchWeight  # [F, D] up
    w2: TorchWeight  # [D, F] down
    b1: torch.Tensor | None = None
    b3: torch.Tensor | None = None
    b2: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.w1.nbytes + self.w3.nbytes + self.w2.nbytes

    def to(self, device: torch.device) -> FFNWeights:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return FFNWeights(self.w1.to(device), self.w3.to(device), self.w2.to(device),
                          mv(self.b1), mv(self.b3), mv(self.b2))


@dataclass
class LayerWeights:
    """One layer's tensors by their file names (docs/INTERNALS.md, "Model folder")."""

    attn: dict[str, TorchWeight | torch.Tensor] = field(default_factory=dict)
    router: dict[str, torch.Tensor] = field(default_factory=dict)
    experts: list[FFNWeights | None] = field(default_factory=list)  # None: not on this device
    shared: FFNWeights | None = None
    dense: FFNWeights | None = None
    ffn_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """None / empty for what another backend runs (a split placement's other layers)."""

    tok_embd: TorchWeight | None
    output_norm: torch.Tensor | None
    output: TorchWeight | None
    layers: list[LayerWeights]


def _vector(f: WFile, name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(f.array(name))).to(device)


def _matrix_names(f: WFile) -> set[str]:
    return {n for n, t in f.tensors.items() if len(t.shape) == 2}


def _ffn(f: WFile, device: torch.device) -> FFNWeights:
    return FFNWeights(*(TorchWeight.from_file(f, n, device) for n in ("w1", "w3", "w2")))


# tensors read as float32 vectors / small matrices even when they have two dimensions
_F32_TENSORS = {"lin_conv", "gate_inp", "shared_gate"}


def _attention(f: WFile, device: torch.device) -> dict[str, TorchWeight | torch.Tensor]:
    out: dict[str, TorchWeight | torch.Tensor] = {}
    mats = _matrix_names(f) - _F32_TENSORS
    for name in f.tensors:
        out[name] = (TorchWeight.from_file(f, name, device) if name in mats
                     else _vector(f, name, device))
    return out


def expert_matrices(folder: Path, il: int, e: int, device: torch.device) -> FFNWeights:
    """Routed expert e of layer il's three matrices on device, without biases."""
    return _ffn(read_wfile(folder / "experts" / f"layer_{il}_expert_{e}.bin"), device)


def set_expert_bias(cfg: ModelConfig, ew: FFNWeights, e: int,
                    router: dict[str, torch.Tensor], device: torch.device) -> None:
    """Expert e's biases (models with expert biases keep them in the layer's router file)."""
    if cfg.expert_bias:
        ew.b1 = router["exp_b1"][e].to(device)
        ew.b3 = router["exp_b3"][e].to(device)
        ew.b2 = router["exp_b2"][e].to(device)


def load_expert(folder: Path, cfg: ModelConfig, il: int, e: int, device: torch.device,
                router: dict[str, torch.Tensor]) -> FFNWeights:
    """Routed expert e of layer il on device (its biases from the layer's router tensors)."""
    ew = expert_matrices(folder, il, e, device)
    set_expert_bias(cfg, ew, e, router, device)
    return ew


def load_layer(folder: Path, cfg: ModelConfig, il: int, device: torch.device,
               expert_device: torch.device | None = None,
               experts: set[int] | None = None) -> LayerWeights:
    """Layer il's weights; routed experts on expert_device (None: device), all of them or
    those of `experts` (the others None: another backend runs them)."""
    lw = LayerWeights(attn=_attention(read_wfile(folder / "attention" / f"layer_{il}.bin"),
                                      device))
    if cfg.layer_ffn and cfg.layer_ffn[il] == "dense":
        f = read_wfile(folder / "dense" / f"layer_{il}.bin")
        lw.ffn_norm = _vector(f, "ffn_norm", device)
        lw.dense = _ffn(f, device)
        return lw
    r = read_wfile(folder / "router" / f"layer_{il}.bin")
    lw.router = {n: _vector(r, n, device) for n in r.tensors}
    lw.ffn_norm = lw.router.pop("ffn_norm")
    edev = expert_device or device
    lw.experts = [load_expert(folder, cfg, il, e, edev, lw.router)
                  if experts is None or e in experts else None for e in range(cfg.n_expert)]
    if cfg.n_ff_shared > 0:
        lw.shared = _ffn(read_wfile(folder / "shared" / f"layer_{il}.bin"), device)
    return lw


def load_weights(folder: str | Path, cfg: ModelConfig, device: torch.device,
                 expert_device: torch.device | None = None,
                 layers: set[int] | None = None,
                 experts: dict[int, set[int]] | None = None) -> ModelWeights:
    """The folder's weights on device (routed experts on expert_device, None: device): every
    layer's, or those of `layers` only, with the embeddings when layer 0 is among them and
    the final norm and lm_head when the last layer is. experts: per layer, the routed experts
    to load when not all of them (a layer it does not name loads all)."""
    p = Path(folder)
    mine = set(range(cfg.n_layer)) if layers is None else layers
    some = experts or {}
    emb = read_wfile(p / "embeddings.bin")
    tok = out = norm = None
    if 0 in mine or (cfg.tie_embeddings and cfg.n_layer - 1 in mine):
        tok = TorchWeight.from_file(emb, "tok_embd", device)
    if cfg.n_layer - 1 in mine:
        out = tok if cfg.tie_embeddings else TorchWeight.from_file(emb, "output", device)
        norm = _vector(emb, "output_norm", device)
    lw = [load_layer(p, cfg, il, device, expert_device, some.get(il)) if il in mine
          else LayerWeights() for il in range(cfg.n_layer)]
    return ModelWeights(tok, norm, out, lw)
