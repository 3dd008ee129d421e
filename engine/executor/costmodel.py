"""The cost model: a device profile, a predicted time for every operation of a step on each
device (with its transfers), and a placement under a GPU memory budget.

A profile holds the CPU's read GB/s and GMAC/s per weight type (what `colibri bench` and the C
probes measure) and, when there is one, the GPU's memory GB/s, product GMAC/s, memory,
host-to-device GB/s and launch / sync latency. An operation costs, on either device,
max(bytes it reads / GB/s, multiply-adds / GMAC/s), plus launches on the GPU; moving the
hidden states between devices costs their bytes over the link plus a sync.

The plan places, in a fixed order, what runs every token (each layer's attention with its
share of the KV cache, norms, router, shared and dense FFNs; then the lm_head), then routed
experts hottest first (the expert cache's routing history). Each prefix of that order is a
candidate; a budget takes the fastest candidate that fits, so more memory never predicts a
slower step. Experts left on the CPU run while the GPU runs the rest of their layer. A cold
expert's step choice (compute on the CPU, or upload and compute on the GPU) is
`cold_expert_choice`. No torch, no C: plain arithmetic over the folder's weight headers.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from colibri.engine.format import quant
from colibri.engine.format.wfile import read_wfile
from colibri.engine.models.config import ModelConfig

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
ROUTING_FILE = "expert_routing.json"  # engine/executor/expert_cache.py keeps it
# weights the torch backend keeps in their file form on the GPU; others it widens to f32
GPU_KEEPS = ("f32", "f16", "bf16", "q8", "q4")


@dataclass(frozen=True)
class CpuProfile:
    read_gb_s: float  # memory read bandwidth, all threads
    gmacs: dict[str, float]  # multiply-adds per second (1e9) of a batched product, per type

    def rate(self, wtype: str) -> float:
        return self.gmacs.get(wtype) or min(self.gmacs.values())


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_mb: int
    hbm_gb_s: float
    gmacs: float  # weight-only products (dequantize, then f32 / tensor-core products)
    h2d_gb_s: float  # host-to-device (pinned) GB/s
    launch_us: float  # one kernel launch
    sync_us: float  # a device-to-host round trip (a stream sync)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    source: str  # "measured" or "spec" (published figures, not measured here)
    cpu: CpuProfile
    gpu: GpuProfile | None = None
    note: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        try:
            cpu = CpuProfile(float(d["cpu"]["read_gb_s"]),
                             {str(k): float(v) for k, v in d["cpu"]["gmacs"].items()})
            g = d.get("gpu")
            gpu = None if g is None else GpuProfile(
                str(g["name"]), int(g["memory_mb"]), float(g["hbm_gb_s"]), float(g["gmacs"]),
                float(g["h2d_gb_s"]), float(g["launch_us"]), float(g["sync_us"]))
            prof = cls(str(d["name"]), str(d["source"]), cpu, gpu, str(d.get("note", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a device profile: {e!r}") from None
        nums = [cpu.read_gb_s, *cpu.gmacs.values()]
        if gpu:
            nums += [gpu.hbm_gb_s, gpu.gmacs, gpu.h2d_gb_s, gpu.memory_mb]
        if not cpu.gmacs or not all(math.isfinite(v) and v > 0 for v in nums):
            raise ValueError("a device profile needs positive, finite rates")
        return prof

    @classmethod
    def load(cls, spec: str | Path) -> DeviceProfile:
        """A profile from a JSON file, or a profile kept with Colibri by name (e.g. "h200")."""
        p = Path(spec)
        if not p.is_file() and (PROFILE_DIR / f"{spec}.json").is_file():
            p = PROFILE_DIR / f"{spec}.json"
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            known = ", ".join(sorted(q.stem for q in PROFILE_DIR.glob("*.json")))
            raise ValueError(f"no profile file {spec!r} (kept with Colibri: {known})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: a profile is a JSON object")
        return cls.from_dict(raw)


@dataclass(frozen=True)
class Item:
    """Something the plan places: a layer's always-used work, the lm_head, or one expert."""

    kind: str  # "layer", "lm_head" or "expert"
    layer: int
    expert: int
    cpu_bytes: int  # bytes its weights read per step (and its KV share, for a layer)
    gpu_bytes: int  # bytes it takes in GPU memory
    macs: int  # multiply-adds per token
    wtype: str  # its main weight type
    kernels: int  # GPU launches per step


def _tensor_bytes(f: Any, on_gpu: bool) -> tuple[int, int, str]:
    """(bytes, multiply-adds per token, main type) of a weight file's tensors."""
    nbytes = macs = 0
    types: dict[str, int] = {}
    for t in f.tensors.values():
        n = int(np.prod(t.shape))
        ty = quant.row_type(t.type_name)  # a device holds the rows
        keep = ty in GPU_KEEPS
        nbytes += t.nbytes if (keep or not on_gpu) else 4 * n
        if len(t.shape) >= 2:
            macs += n
            types[ty] = types.get(ty, 0) + n
    return nbytes, macs, max(types, key=types.__getitem__) if types else "f32"


@dataclass
class ModelCosts:
    """A model's items: the always-used ones in placement order, then its experts."""

    cfg: ModelConfig
    always: list[Item]
    experts: dict[int, Item]  # the one expert shape of each MoE layer
    heat: np.ndarray  # [n_layer, n_expert] selection shares (per token, sum K per layer)
    kv_bytes: int
    hidden_bytes_per_token: int = field(init=False)

    def __post_init__(self) -> None:
        self.hidden_bytes_per_token = 4 * self.cfg.n_embd


def _heat(folder: Path, cfg: ModelConfig) -> np.ndarray:
    """Per layer and expert the share of tokens that choose it (K per layer in all), from the
    routing history (a row per MoE layer, or per layer as the expert cache keeps it, dense
    layers' rows empty); uniform without one."""
    E, K = max(cfg.n_expert, 1), cfg.n_expert_used
    heat = np.zeros((cfg.n_layer, E))
    moe = cfg.moe_layers
    heat[moe] = K / E
    try:
        sel = np.asarray(json.loads((folder / ROUTING_FILE).read_text())["selections"], float)
    except (OSError, ValueError, KeyError, TypeError):
        return heat
    if sel.shape == (cfg.n_layer, E):  # the expert cache's history: a row for every layer
        sel = sel[list(moe)]
    if sel.shape != (len(moe), E):
        return heat
    for row, il in zip(sel, moe, strict=True):
        if row.sum() > 0:
            heat[il] = row / row.sum() * K
    return np.minimum(heat, 1.0)


def model_costs(folder: str | Path, cfg: ModelConfig, context: int = 1024,
                n_seq: int = 1) -> ModelCosts:
    """The items of a converted folder, from its weight headers (one expert file per layer:
    every expert of a layer has one shape); KV shares for n_seq sequences of `context`, and a
    linear-attention layer's recurrent state for n_seq sequences."""
    p = Path(folder)
    kv_pos = _kv_bytes_per_position(cfg)
    always: list[Item] = []
    experts: dict[int, Item] = {}
    for il in range(cfg.n_layer):
        files = [p / "attention" / f"layer_{il}.bin"]
        if il in cfg.moe_layers:
            files.append(p / "router" / f"layer_{il}.bin")
            if cfg.n_ff_shared > 0:
                files.append(p / "shared" / f"layer_{il}.bin")
            experts[il] = expert_item(p, il)
        else:
            files.append(p / "dense" / f"layer_{il}.bin")
        parts = [read_wfile(x) for x in files]
        cpu = [_tensor_bytes(f, False) for f in parts]
        kv = (kv_pos * context * n_seq if il in cfg.attention_layers
              else _state_bytes_per_sequence(cfg) * n_seq)  # a linear layer's state slots
        wt = max(cpu, key=lambda c: c[1])[2]
        always.append(Item("layer", il, -1, sum(c[0] for c in cpu) + kv,
                           sum(_tensor_bytes(f, True)[0] for f in parts) + kv,
                           sum(c[1] for c in cpu), wt, 12))
    emb = read_wfile(p / "embeddings.bin")
    head = "tok_embd" if cfg.tie_embeddings else "output"
    t = emb.tensors[head]
    n = int(np.prod(t.shape))
    gb = t.nbytes if t.type_name in GPU_KEEPS else 4 * n
    always.append(Item("lm_head", -1, -1, t.nbytes, gb, n, t.type_name, 2))
    return ModelCosts(cfg, always, experts, _heat(p, cfg),
                      kv_pos * context * n_seq * len(cfg.attention_layers))


def expert_item(folder: str | Path, il: int) -> Item:
    """The item of one routed expert of MoE layer il (every expert of a layer has one shape:
    expert 0's header stands for all of them)."""
    f = read_wfile(Path(folder) / "experts" / f"layer_{il}_expert_0.bin")
    cb, macs, wt = _tensor_bytes(f, False)
    return Item("expert", il, -1, cb, _tensor_bytes(f, True)[0], macs, wt, 3)


def _state_bytes_per_sequence(cfg: ModelConfig) -> int:
    """f32 recurrent-state bytes of one sequence in one linear-attention layer: its conv
    window and its DeltaNet state (read and written every token, whatever the context)."""
    C = 2 * cfg.lin_n_k_heads * cfg.lin_k_dim + cfg.lin_n_v_heads * cfg.lin_v_dim
    return 4 * ((cfg.lin_conv - 1) * C + cfg.lin_n_v_heads * cfg.lin_k_dim * cfg.lin_v_dim)


def _kv_bytes_per_position(cfg: ModelConfig) -> int:
    """f32 KV bytes of one position in one attention layer."""
    rd = cfg.rotary_dim or cfg.head_dim
    if cfg.attn == "mla":
        return 4 * (cfg.kv_lora_rank + rd)
    return 4 * 2 * cfg.n_head_kv * cfg.head_dim


# ---- times ------------------------------------------------------------------------------

def cpu_time(prof: DeviceProfile, it: Item, rows: float) -> float:
    """Seconds of item it over `rows` tokens on the CPU."""
    if rows <= 0:
        return 0.0
    return max(it.cpu_bytes / (prof.cpu.read_gb_s * 1e9),
               rows * it.macs / (prof.cpu.rate(it.wtype) * 1e9))


def gpu_time(prof: DeviceProfile, it: Item, rows: float) -> float:
    """Seconds of item it over `rows` tokens on the GPU (its weights resident there)."""
    g = prof.gpu
    if g is None or rows <= 0:
        return 0.0 if rows <= 0 else math.inf
    return (max(it.gpu_bytes / (g.hbm_gb_s * 1e9), rows * it.macs / (g.gmacs * 1e9))
            + it.kernels * g.launch_us * 1e-6)


def upload_time(prof: DeviceProfile, it: Item) -> float:
    g = prof.gpu
    return math.inf if g is None else it.gpu_bytes / (g.h2d_gb_s * 1e9)


def move_time(prof: DeviceProfile, nbytes: float) -> float:
    """Hidden states across the link and a sync."""
    g = prof.gpu
    return 0.0 if g is None else nbytes / (g.h2d_gb_s * 1e9) + g.sync_us * 1e-6


def cold_expert_choice(prof: DeviceProfile, it: Item, rows: float) -> str:
    """Where a step computes an expert that is not in GPU memory: "cpu", or "upload" (copy
    it over and compute it there) when that is predicted faster for `rows` tokens."""
    up = upload_time(prof, it) + gpu_time(prof, it, rows)
    return "upload" if up < cpu_time(prof, it, rows) else "cpu"


@dataclass
class Plan:
    """What runs on the GPU, and the predicted times."""

    budget_mb: float
    gpu_layers: list[int]
    lm_head_on_gpu: bool
    gpu_experts: dict[int, list[int]]  # layer -> experts held on the GPU, hottest first
    gpu_bytes: int
    decode_ms: float  # one token
    prefill_ms: float  # 512 tokens
    cpu_decode_ms: float  # the same model all on the CPU
    cpu_prefill_ms: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpu_experts"] = {str(k): v for k, v in self.gpu_experts.items()}
        return d


def _used(p: float, T: int) -> float:
    """Probability an expert chosen by share p of tokens is used by a step of T tokens."""
    return 1.0 - (1.0 - min(p, 1.0)) ** T


def step_time(prof: DeviceProfile, mc: ModelCosts, T: int, gpu_layers: set[int],
              lm_gpu: bool, gpu_experts: dict[int, set[int]]) -> float:
    """Predicted seconds of a step of T tokens under a placement."""
    total, on_gpu = 0.0, False
    hid = T * mc.hidden_bytes_per_token
    for it in mc.always:
        here = it.layer in gpu_layers if it.kind == "layer" else lm_gpu
        if here != on_gpu:
            total += move_time(prof, hid)
            on_gpu = here
        total += gpu_time(prof, it, T) if here else cpu_time(prof, it, T)
        ex = mc.experts.get(it.layer) if it.kind == "layer" else None
        if ex is None:
            continue
        g_side = c_side = 0.0
        for e, p in enumerate(mc.heat[it.layer]):
            if p <= 0:
                continue
            use = _used(p, T)
            rows = T * p / use
            if here and e in gpu_experts.get(it.layer, ()):
                g_side += use * gpu_time(prof, ex, rows)
            elif here and cold_expert_choice(prof, ex, rows) == "upload":
                g_side += use * (upload_time(prof, ex) + gpu_time(prof, ex, rows))
            else:
                c_side += use * cpu_time(prof, ex, rows)
        if here and c_side > 0:  # CPU experts run beside the GPU's, one round trip
            total += max(g_side, c_side + 2 * move_time(prof, hid))
        else:
            total += g_side + c_side
    return total + (move_time(prof, hid) if on_gpu else 0.0)


def make_plan(prof: DeviceProfile, mc: ModelCosts, budget_mb: float) -> Plan:
    """The fastest prefix of the placement order (always-used work by layer, the lm_head,
    then experts hottest first) that fits budget_mb, judged on a decode step."""
    budget = budget_mb * 1e6 if prof.gpu is not None else 0.0
    order: list[Item] = list(mc.always)
    hot = [(float(mc.heat[il, e]), il, e) for il in mc.experts
           for e in range(mc.cfg.n_expert)]
    hot.sort(key=lambda h: (-h[0], h[1], h[2]))
    order += [Item("expert", il, e, mc.experts[il].cpu_bytes, mc.experts[il].gpu_bytes,
                   mc.experts[il].macs, mc.experts[il].wtype, 3) for _h, il, e in hot]
    layers: set[int] = set()
    lm = False
    experts: dict[int, set[int]] = {}
    used = 0
    best = (step_time(prof, mc, 1, set(), False, {}), 0, set(), False, {})
    for it in order:
        if used + it.gpu_bytes > budget:
            break
        used += it.gpu_bytes
        if it.kind == "layer":
            layers.add(it.layer)
        elif it.kind == "lm_head":
            lm = True
        elif it.layer in layers:
            experts.setdefault(it.layer, set()).add(it.expert)
        t = step_time(prof, mc, 1, layers, lm, experts)
        if t <= best[0]:
            best = (t, used, set(layers), lm, {k: set(v) for k, v in experts.items()})
    _t, nbytes, bl, blm, bex = best
    ranked = {il: [e for _h, l_, e in hot if l_ == il and e in bex.get(il, ())]
              for il in sorted(bex)}
    return Plan(budget_mb, sorted(bl), blm, ranked, nbytes,
                1e3 * step_time(prof, mc, 1, bl, blm, bex),
                1e3 * step_time(prof, mc, 512, bl, blm, bex),
                1e3 * step_time(prof, mc, 1, set(), False, {}),
                1e3 * step_time(prof, mc, 512, set(), False, {}))
