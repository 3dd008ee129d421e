"""ModelConfig: the config.json of a converted Colibri folder, validated.

`ModelConfig.from_dir(path)` reads and checks config.json (see docs/INTERNALS.md);
`to_hparams(n_ctx)` gives the dict the C core (engine._core.CoreModel) takes. Unknown keys are
ignored so newer converters can add fields; missing or ill-typed keys raise FormatError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colibri.engine.errors import FormatError
from colibri.engine.format.jsonfile import read_json_object
from colibri.engine.models.registry import family_names
from colibri.engine.models.rope import rope_frequencies

QK_NORM_IDS = {"none": 0, "head": 1, "full": 2}
# "l2": each q and k head RMS-normalised without a weight after RoPE, on the layers with RoPE
# (Llama 4); a per-layer bit in C rather than a clb_qk_norm
QK_NORMS = (*QK_NORM_IDS, "l2")
ATTN_IDS = {"gqa": 0, "mla": 1}  # clb_attn_kind
ROUTER_IDS = {"softmax": 0, "sigmoid_grouped": 1, "sigmoid_topk": 2}  # clb_router_kind
FFN_IDS = {"moe": 0, "dense": 1}  # clb_ffn_kind
GLU_IDS = {"silu": 0, "swiglu_clamp": 1}  # clb_glu_kind
# per layer: over sliding_window positions, all, or the query's attn_chunk-aligned chunk;
# the values are the span bits of clb_layer_attn_bit
LAYER_ATTN = {"full": 0, "sliding": 1, "chunked": 2}
_NOPE, _QK_L2, _TEMP = 4, 8, 16  # the other clb_layer_attn_bit flags
MIXER_IDS = {"attention": 0, "linear": 1}  # clb_mixer_kind: what mixes tokens in a layer
QUANTS = ("f32", "f16", "bf16", "q8", "q4")
# 2: routed experts may be stored in the interleaved layouts (q8x8, q4x8, q6x8); folders of
# version 1 hold rows only and still load (their experts are repacked as they load)
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)

_POSITIVE_INTS = (
    "n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "max_position_embeddings",
)
# positive in a model with routed experts, 0 in a dense one
_EXPERT_INTS = ("n_ff", "n_expert", "n_expert_used")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters and metadata of a converted model (one field per config.json key)."""

    architecture: str
    quant: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    max_position_embeddings: int
    attn: str = "gqa"
    q_lora_rank: int = 0  # MLA (engine/models/deepseek.py): 0 = no low-rank query step
    kv_lora_rank: int = 0
    v_head_dim: int = 0
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    n_ff_shared: int = 0
    n_ff_dense: int = 0
    layer_ffn: tuple[str, ...] = ()  # per layer "moe" or "dense"; empty: every layer "moe"
    shared_gate: bool = False
    norm_topk_prob: bool = True
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    qk_norm: str = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    rope_theta: float = 10000.0
    rope: dict[str, Any] = field(default_factory=dict)  # scaled RoPE (engine/models/rope.py)
    rotary_dim: int = 0  # 0: head_dim
    rms_eps: float = 1e-6
    sliding_window: int | None = None
    layer_attn: tuple[str, ...] = ()  # per layer LAYER_ATTN; empty: every layer sliding
    attn_chunk: int | None = None  # the chunk of "chunked" layers
    nope_layers: tuple[int, ...] = ()  # layers without RoPE
    attn_temp_floor: float = 0.0  # > 0: queries of the NoPE layers scaled by position (Llama 4)
    attn_temp_scale: float = 0.0
    route_input: bool = False  # routing weights scale the experts' input (Llama 4)
    attn_sinks: bool = False  # a learned logit per head in every softmax's denominator
    router_bias: bool = False
    expert_bias: bool = False
    glu: str = "silu"  # the FFNs' gated activation (GLU_IDS)
    glu_alpha: float = 1.0
    glu_limit: float = 0.0
    # gated DeltaNet linear attention (engine/models/qwen3_next.py)
    layer_mixer: tuple[str, ...] = ()  # per layer MIXER_IDS; empty: every layer attention
    attn_gate: bool = False  # q_proj gives each head's query and a sigmoid gate on its output
    lin_n_k_heads: int = 0
    lin_n_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_conv: int = 0
    tie_embeddings: bool = False
    # multi-token prediction (engine/spec/mtp.py): mtp names the sub-folder holding the
    # model's MTP layer as a model of its own, whose config sets mtp_input (its input mixes
    # the next token's embedding with the main model's hidden state); mtp_keep_first: that
    # embedding is not zeroed at position 0 (Qwen3-Next's, as vLLM runs it; DeepSeek-V3's and
    # GLM-4.5's are); mtp_chain_normed: a chained draft reads the layer's own hidden state
    # after its final norm (Qwen3-Next) rather than before it
    mtp: str = ""
    mtp_input: bool = False
    mtp_keep_first: bool = False
    mtp_chain_normed: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hf_architecture: str = ""
    tensor_types: dict[str, str] = field(default_factory=dict)
    files: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json`; FileNotFoundError if absent, FormatError if invalid."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"missing file: {p}")
        return cls.from_dict(read_json_object(p, "model config", error=FormatError),
                             source=str(p))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "config.json") -> ModelConfig:
        """Validate a parsed config.json dict (see the schema in docs/INTERNALS.md)."""
        if not isinstance(raw, dict):
            raise FormatError(f"{source}: top level must be a JSON object")
        if raw.get("format") != "colibri":
            raise FormatError(f"{source}: 'format' is {raw.get('format')!r}, not 'colibri'")
        if raw.get("format_version") not in READABLE_VERSIONS:
            raise FormatError(
                f"{source}: format_version {raw.get('format_version')!r}, this engine reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))} (a newer Colibri converted it?)"
            )

        def get(key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            if key not in raw or raw[key] is None:
                if default is ...:
                    raise FormatError(f"{source}: missing key {key!r}")
                return default
            v = raw[key]
            # bool is an int in Python: refuse it where a number is wanted, and vice versa
            if isinstance(v, bool) != (kind is bool) or not isinstance(v, kind):
                raise FormatError(f"{source}: {key!r} = {v!r} has the wrong type")
            return v

        ints = {k: get(k, int) for k in _POSITIVE_INTS}
        for k, v in ints.items():
            if v <= 0:
                raise FormatError(f"{source}: {k!r} must be positive, got {v}")
        layer_ffn = get("layer_ffn", list, [])
        if layer_ffn and (len(layer_ffn) != ints["n_layer"]
                          or not all(k in FFN_IDS for k in layer_ffn)):
            raise FormatError(f"{source}: layer_ffn must list {ints['n_layer']} of "
                              f"{list(FFN_IDS)}")
        layer_attn = get("layer_attn", list, [])
        if layer_attn and (len(layer_attn) != ints["n_layer"]
                           or not all(k in LAYER_ATTN for k in layer_attn)):
            raise FormatError(f"{source}: layer_attn must list {ints['n_layer']} of "
                              f"{list(LAYER_ATTN)}")
        layer_mixer = get("layer_mixer", list, [])
        if layer_mixer and (len(layer_mixer) != ints["n_layer"]
                            or not all(k in MIXER_IDS for k in layer_mixer)):
            raise FormatError(f"{source}: layer_mixer must list {ints['n_layer']} of "
                              f"{list(MIXER_IDS)}")
        glu = get("glu", str, "silu")
        if glu not in GLU_IDS:
            raise FormatError(f"{source}: glu {glu!r} not in {list(GLU_IDS)}")
        has_moe = not layer_ffn or "moe" in layer_ffn
        for k in _EXPERT_INTS:
            ints[k] = get(k, int, None if has_moe else 0)
            if ints[k] is None:
                raise FormatError(f"{source}: missing key {k!r}")
            if (ints[k] <= 0) if has_moe else (ints[k] != 0):
                raise FormatError(f"{source}: {k!r} must be "
                                  f"{'positive' if has_moe else '0 in a model without experts'}, "
                                  f"got {ints[k]}")
        arch = get("architecture", str)
        if arch not in family_names():
            raise FormatError(f"{source}: unknown architecture {arch!r}; "
                              f"supported: {', '.join(family_names())}")
        router = get("router", str, "softmax")
        if router not in ROUTER_IDS:
            raise FormatError(f"{source}: router {router!r} not in {list(ROUTER_IDS)}")
        rope = get("rope", dict, {})
        attn = get("attn", str, "gqa")
        if attn not in ATTN_IDS:
            raise FormatError(f"{source}: attn {attn!r} not in {list(ATTN_IDS)}")
        quant = get("quant", str)
        if quant not in QUANTS:
            raise FormatError(f"{source}: unknown quant {quant!r}")
        qk_norm = get("qk_norm", str, "none")
        if qk_norm not in QK_NORMS:
            raise FormatError(f"{source}: qk_norm {qk_norm!r} not in {list(QK_NORMS)}")
        nope = get("nope_layers", list, [])
        if not all(isinstance(i, int) and not isinstance(i, bool)
                   and 0 <= i < ints["n_layer"] for i in nope) or len(set(nope)) != len(nope):
            raise FormatError(f"{source}: nope_layers must list distinct layers in "
                              f"0..{ints['n_layer'] - 1}")
        clip = get("clip_qkv", (int, float), None)
        window = get("sliding_window", int, None)
        eos = get("eos_token_ids", list, [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise FormatError(f"{source}: eos_token_ids must be a list of integers")
        for t in eos:
            if not 0 <= t < ints["n_vocab"]:
                raise FormatError(f"{source}: eos token id {t} is outside the vocabulary "
                                  f"(n_vocab {ints['n_vocab']})")
        cfg = cls(
            architecture=arch,
            quant=quant,
            **ints,
            attn=attn,
            q_lora_rank=get("q_lora_rank", int, 0),
            kv_lora_rank=get("kv_lora_rank", int, 0),
            v_head_dim=get("v_head_dim", int, 0),
            attn_scale=float(get("attn_scale", (int, float), 0.0)),
            n_ff_shared=get("n_ff_shared", int, 0),
            n_ff_dense=get("n_ff_dense", int, 0),
            layer_ffn=tuple(layer_ffn),
            shared_gate=get("shared_gate", bool, False),
            norm_topk_prob=get("norm_topk_prob", bool, True),
            router=router,
            n_group=get("n_group", int, 1),
            topk_group=get("topk_group", int, 1),
            routed_scale=float(get("routed_scale", (int, float), 1.0)),
            qk_norm=qk_norm,
            qkv_bias=get("qkv_bias", bool, False),
            o_bias=get("o_bias", bool, False),
            clip_qkv=None if clip is None else float(clip),
            rope_theta=float(get("rope_theta", (int, float), 10000.0)),
            rope=dict(rope),
            rotary_dim=get("rotary_dim", int, 0),
            rms_eps=float(get("rms_eps", (int, float), 1e-6)),
            sliding_window=window,
            layer_attn=tuple(layer_attn),
            attn_chunk=get("attn_chunk", int, None),
            nope_layers=tuple(nope),
            attn_temp_floor=float(get("attn_temp_floor", (int, float), 0.0)),
            attn_temp_scale=float(get("attn_temp_scale", (int, float), 0.0)),
            route_input=get("route_input", bool, False),
            attn_sinks=get("attn_sinks", bool, False),
            router_bias=get("router_bias", bool, False),
            expert_bias=get("expert_bias", bool, False),
            glu=glu,
            glu_alpha=float(get("glu_alpha", (int, float), 1.0)),
            glu_limit=float(get("glu_limit", (int, float), 0.0)),
            layer_mixer=tuple(layer_mixer),
            attn_gate=get("attn_gate", bool, False),
            lin_n_k_heads=get("lin_n_k_heads", int, 0),
            lin_n_v_heads=get("lin_n_v_heads", int, 0),
            lin_k_dim=get("lin_k_dim", int, 0),
            lin_v_dim=get("lin_v_dim", int, 0),
            lin_conv=get("lin_conv", int, 0),
            tie_embeddings=get("tie_embeddings", bool, False),
            mtp=get("mtp", str, ""),
            mtp_input=get("mtp_input", bool, False),
            mtp_keep_first=get("mtp_keep_first", bool, False),
            mtp_chain_normed=get("mtp_chain_normed", bool, False),
            bos_token_id=get("bos_token_id", int, None),
            eos_token_ids=tuple(eos),
            hf_architecture=get("hf_architecture", str, ""),
            tensor_types=dict(get("tensor_types", dict, {})),
            files=dict(get("files", dict, {})),
        )
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        def bad(msg: str) -> FormatError:
            return FormatError(f"{source}: {msg}")

        if self.mtp and not self.mtp.replace("_", "").replace("-", "").isalnum():
            raise bad(f"mtp {self.mtp!r} must name a sub-folder of the model folder")
        if self.n_head % self.n_head_kv:
            raise bad(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.n_expert_used > self.n_expert:
            raise bad(f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}")
        if self.n_ff_shared < 0:
            raise bad("n_ff_shared must be >= 0")
        if self.attn == "mla" and (self.kv_lora_rank <= 0 or self.v_head_dim <= 0
                                   or self.q_lora_rank < 0 or self.n_head_kv != 1):
            raise bad("MLA needs kv_lora_rank and v_head_dim > 0, q_lora_rank >= 0 and "
                      "n_head_kv 1")
        if not math.isfinite(self.attn_scale) or self.attn_scale < 0:
            raise bad(f"attn_scale must be >= 0, got {self.attn_scale}")
        if "dense" in self.layer_ffn and self.n_ff_dense <= 0:
            raise bad("dense layers need a positive n_ff_dense")
        if self.n_expert and (
                self.n_group <= 0 or self.n_expert % self.n_group
                or not 0 < self.topk_group <= self.n_group):
            raise bad(f"grouped routing: n_group {self.n_group} must divide n_expert "
                      f"{self.n_expert} and topk_group {self.topk_group} be in 1..n_group")
        if not math.isfinite(self.routed_scale) or self.routed_scale <= 0:
            raise bad(f"routed_scale must be a positive number, got {self.routed_scale}")
        if self.shared_gate and self.n_ff_shared == 0:
            raise bad("shared_gate is set but there is no shared expert (n_ff_shared 0)")
        rd = self.rotary_dim or self.head_dim
        if rd < 0 or rd % 2 or rd > self.head_dim:
            raise bad(f"rotary_dim {self.rotary_dim} must be even and <= head_dim")
        for k in ("rope_theta", "rms_eps"):
            v = getattr(self, k)
            if not math.isfinite(v) or v <= 0:
                raise bad(f"{k} must be a positive number, got {v}")
        if self.clip_qkv is not None and (not math.isfinite(self.clip_qkv) or self.clip_qkv <= 0):
            raise bad(f"clip_qkv must be positive or null, got {self.clip_qkv}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise bad(f"sliding_window must be positive or null, got {self.sliding_window}")
        if "sliding" in self.layer_attn and self.sliding_window is None:
            raise bad("layer_attn names sliding layers but sliding_window is null")
        if self.attn_chunk is not None and self.attn_chunk <= 0:
            raise bad(f"attn_chunk must be positive or null, got {self.attn_chunk}")
        if "chunked" in self.layer_attn and self.attn_chunk is None:
            raise bad("layer_attn names chunked layers but attn_chunk is null")
        if not (math.isfinite(self.attn_temp_floor) and self.attn_temp_floor >= 0
                and math.isfinite(self.attn_temp_scale)):
            raise bad(f"attn_temp_floor must be >= 0 and attn_temp_scale finite, got "
                      f"{self.attn_temp_floor} and {self.attn_temp_scale}")
        if self.attn != "gqa" and (self.nope_layers or self.qk_norm == "l2"
                                   or self.attn_temp_floor):
            raise bad("NoPE layers, the q/k L2 norm and query temperature need GQA attention")
        if self.glu == "swiglu_clamp" and not (math.isfinite(self.glu_alpha)
                                               and math.isfinite(self.glu_limit)
                                               and self.glu_limit > 0):
            raise bad(f"the clamped SwiGLU needs a finite glu_alpha and a positive glu_limit, "
                      f"got {self.glu_alpha} and {self.glu_limit}")
        if self.attn_sinks and self.attn != "gqa":
            raise bad("attention sinks need GQA attention")
        if self.hybrid:
            if "attention" not in self.layer_mixer:
                raise bad("layer_mixer needs at least one attention layer")
            dims = (self.lin_n_k_heads, self.lin_n_v_heads, self.lin_k_dim, self.lin_v_dim)
            if min(dims) <= 0 or self.lin_n_v_heads % self.lin_n_k_heads or self.lin_conv < 2:
                raise bad(f"linear attention needs positive heads and widths (value heads a "
                          f"multiple of key heads) and lin_conv >= 2, got {dims}, "
                          f"lin_conv {self.lin_conv}")

    @property
    def hybrid(self) -> bool:
        """Whether some layers mix tokens by linear attention (a recurrent state per
        sequence beside the paged KV cache)."""
        return "linear" in self.layer_mixer

    @property
    def attention_layers(self) -> list[int]:
        """The layers that attend over the KV cache (every layer but the linear ones)."""
        return [i for i in range(self.n_layer)
                if not self.layer_mixer or self.layer_mixer[i] == "attention"]

    @property
    def moe_layers(self) -> list[int]:
        """The layers with routed experts (every layer unless layer_ffn says otherwise)."""
        return [i for i in range(self.n_layer)
                if not self.layer_ffn or self.layer_ffn[i] == "moe"]

    def default_n_ctx(self) -> int:
        """The context used when the caller does not choose one."""
        return min(self.max_position_embeddings, 4096)

    def to_hparams(self, n_ctx: int) -> dict[str, Any]:
        """The clb_hparams fields for the C core, with KV capacity n_ctx per sequence."""
        if not isinstance(n_ctx, int) or isinstance(n_ctx, bool) or n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        rd = self.rotary_dim or self.head_dim
        freqs, scale = rope_frequencies(self.rope, self.rope_theta, rd)
        return {
            "n_vocab": self.n_vocab,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "head_dim": self.head_dim,
            "attn": ATTN_IDS[self.attn],
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "v_head_dim": self.v_head_dim or self.head_dim,
            "attn_scale": float(self.attn_scale),
            "n_ff": self.n_ff,
            "n_expert": self.n_expert,
            "n_expert_used": self.n_expert_used,
            "n_ff_shared": self.n_ff_shared,
            "n_ff_dense": self.n_ff_dense,
            "shared_gate": int(self.shared_gate),
            "norm_topk_prob": int(self.norm_topk_prob),
            "router": ROUTER_IDS[self.router],
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scale": float(self.routed_scale),
            "qk_norm": 0 if self.qk_norm == "l2" else QK_NORM_IDS[self.qk_norm],
            "qkv_bias": int(self.qkv_bias),
            "o_bias": int(self.o_bias),
            "tie_embeddings": int(self.tie_embeddings),
            "clip_qkv": 0.0 if self.clip_qkv is None else float(self.clip_qkv),
            "rope_theta": float(self.rope_theta),
            "rotary_dim": rd,
            "rope_scale": float(scale),
            "rms_eps": float(self.rms_eps),
            "sliding_window": self.sliding_window or 0,
            "attn_sinks": int(self.attn_sinks),
            "attn_chunk": self.attn_chunk or 0,
            "attn_temp_floor": float(self.attn_temp_floor),
            "attn_temp_scale": float(self.attn_temp_scale),
            "route_input": int(self.route_input),
            "router_bias": int(self.router_bias),
            "expert_bias": int(self.expert_bias),
            "glu": GLU_IDS[self.glu],
            "glu_alpha": float(self.glu_alpha),
            "glu_limit": float(self.glu_limit),
            "n_ctx": n_ctx,
            "rope_freqs": freqs,
            "layer_ffn": [FFN_IDS[k] for k in self.layer_ffn] if self.layer_ffn else None,
            "layer_attn": self.layer_attn_bits(),
            "layer_mixer": ([MIXER_IDS[k] for k in self.layer_mixer]
                            if self.layer_mixer else None),
            "attn_gate": int(self.attn_gate),
            "lin_n_k_heads": self.lin_n_k_heads,
            "lin_n_v_heads": self.lin_n_v_heads,
            "lin_k_dim": self.lin_k_dim,
            "lin_v_dim": self.lin_v_dim,
            "lin_conv": self.lin_conv,
            "mtp_input": int(self.mtp_input),
            "mtp_keep_first": int(self.mtp_keep_first),
        }

    def layer_attn_bits(self) -> list[int] | None:
        """Per layer its clb_layer_attn_bit flags; None (every layer sliding, the C default)
        for a model without per-layer attention options."""
        l2, temp = self.qk_norm == "l2", self.attn_temp_floor > 0
        if not (self.layer_attn or self.nope_layers or l2 or temp):
            return None
        kinds = self.layer_attn or ("sliding",) * self.n_layer
        out = []
        for i, kind in enumerate(kinds):
            rope = i not in self.nope_layers
            out.append(LAYER_ATTN[kind] | (0 if rope else _NOPE) | (_QK_L2 if l2 and rope else 0)
                       | (_TEMP if temp and not rope else 0))
        return out
