"""Hugging Face MoE architectures -> Colibri config fields and tensor layout (one place each).

For each supported architecture: how its config.json (plus generation_config.json) maps to
the config of docs/INTERNALS.md, and where each of our tensors comes from in the checkpoint
(legacy per-expert names or transformers 5 fused `experts.gate_up_proj` / `down_proj`).
Defaults and semantics follow transformers 5.24's configuration_*.py and modeling_*.py.
Refuses, with a message, anything the forward pass would compute differently from
transformers: other rope types, dense layers inside an MoE stack, output-projection biases,
per-layer sliding windows, activations other than SiLU, unknown architectures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}

# transformers' class defaults for the keys a config.json may leave out (n_experts: the
# default of num_local_experts / num_experts)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, n_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1,
                    eos_token_id=2, sliding_window=None, rope_theta=1e6),
    "qwen2_moe": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=32768, rms_norm_eps=1e-6,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                      n_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, decoder_sparse_step=1, qkv_bias=True,
                      bos_token_id=None, eos_token_id=None, rope_theta=10000.0),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4,
                      max_position_embeddings=32768, rms_norm_eps=1e-6,
                      moe_intermediate_size=768, n_experts=128, num_experts_per_tok=8,
                      norm_topk_prob=False, tie_word_embeddings=False, use_sliding_window=False,
                      sliding_window=4096, decoder_sparse_step=1, attention_bias=False,
                      bos_token_id=None, eos_token_id=None, rope_theta=10000.0),
    "olmoe": dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048,
                  num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=None,
                  max_position_embeddings=4096, rms_norm_eps=1e-5, n_experts=64,
                  num_experts_per_tok=8, norm_topk_prob=False, tie_word_embeddings=False,
                  attention_bias=False, clip_qkv=None, bos_token_id=None, eos_token_id=50279,
                  rope_theta=10000.0),
}

# tensor kinds decide the stored type (see engine/format/convert.py)
NORM, BIAS, ROUTER, DENSE, EXPERT, SHARED = "norm", "bias", "router", "dense", "expert", "shared"
VOCAB = "vocab"  # the token embeddings and the lm_head: one row per vocabulary entry


class UnsupportedModel(ValueError):
    """A config or checkpoint the converter or the forward pass cannot handle."""


@dataclass(frozen=True)
class Source:
    """Where a tensor comes from: hf_name, optionally [index] then rows [row0:row1]."""

    hf_name: str
    index: int | None = None
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Target:
    """One tensor of ours: file (relative), name, kind, expected shape and its source."""

    file: str
    name: str
    kind: str
    shape: tuple[int, ...]
    source: Source

    @property
    def group(self) -> str:
        """The tensor_types key prefix: the file's folder, or its stem at top level."""
        return self.file.split("/")[0] if "/" in self.file else self.file.rsplit(".", 1)[0]


def _get(cfg: dict[str, Any], arch: str, key: str) -> Any:
    return cfg[key] if key in cfg else _DEFAULTS[arch].get(key)


def _int(cfg: dict[str, Any], arch: str, key: str) -> int:
    v = _get(cfg, arch, key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise UnsupportedModel(f"config.json: {key} must be a positive integer, got {v!r}")
    return v


def _token_ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    raise UnsupportedModel(f"bad token id {v!r}")


def _rope_theta(cfg: dict[str, Any], arch: str) -> float:
    """transformers 5: rope_parameters; older configs: rope_theta + rope_scaling."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UnsupportedModel(f"config.json: bad rope parameters {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("config.json: per-layer-type rope parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModel(
            f"config.json: rope type {rope_type!r} is not supported (only the default RoPE)"
        )
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        # transformers' default RoPE for these architectures ignores the factor, so the
        # intended rotation is ambiguous; refuse rather than guess
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} is not supported")
    theta = params.get("rope_theta", cfg.get("rope_theta", _DEFAULTS[arch]["rope_theta"]))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise UnsupportedModel(f"config.json: bad rope_theta {theta!r}")
    return float(theta)


def _sliding_window(cfg: dict[str, Any], arch: str, n_layer: int) -> int | None:
    if arch == "olmoe":
        return None  # transformers builds a plain causal mask for OLMoE
    if arch == "mixtral":
        w = cfg.get("sliding_window")
    else:
        if not _get(cfg, arch, "use_sliding_window"):
            return None
        w = _get(cfg, arch, "sliding_window")
        if arch == "qwen2_moe":
            types = cfg.get("layer_types")
            if types is None:
                mwl = _get(cfg, arch, "max_window_layers")
                types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention"
                         for i in range(n_layer)]
            if "full_attention" in types:
                if "sliding_attention" in types:
                    raise UnsupportedModel(
                        "config.json: a sliding window on some layers only is not supported"
                    )
                return None
    if w is None:
        return None
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        raise UnsupportedModel(f"config.json: bad sliding_window {w!r}")
    return w


def colibri_config(hf: dict[str, Any], gen: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Colibri config fields (docs/INTERNALS.md) for a Hugging Face config.json."""
    archs = hf.get("architectures") or []
    hf_arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if hf_arch not in SUPPORTED:
        raise UnsupportedModel(
            f"config.json: architecture {archs!r} is not supported; supported: "
            f"{', '.join(sorted(SUPPORTED))}"
        )
    arch = SUPPORTED[hf_arch]
    # auto_map (remote code) is never imported: only the plain fields below are read
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config.json: hidden_act {act!r} is not supported (only silu)")
    if arch in ("qwen2_moe", "qwen3_moe"):
        if hf.get("mlp_only_layers"):
            raise UnsupportedModel("config.json: dense layers (mlp_only_layers) are not supported")
        if _get(hf, arch, "decoder_sparse_step") != 1:
            raise UnsupportedModel("config.json: decoder_sparse_step other than 1 is not supported")
    if arch in ("qwen3_moe", "olmoe") and _get(hf, arch, "attention_bias"):
        raise UnsupportedModel("config.json: attention_bias (with an o_proj bias) is not supported")

    n_embd = _int(hf, arch, "hidden_size")
    n_head = _int(hf, arch, "num_attention_heads")
    n_layer = _int(hf, arch, "num_hidden_layers")
    n_head_kv = _get(hf, arch, "num_key_value_heads") or n_head
    head_dim = hf.get("head_dim") or n_embd // n_head
    if n_head % n_head_kv:
        raise UnsupportedModel(
            f"config.json: {n_head} heads is not a multiple of {n_head_kv} kv heads"
        )
    if arch == "olmoe" and head_dim * n_head != n_embd:
        raise UnsupportedModel("config.json: OLMoE with head_dim * heads != hidden_size")
    if head_dim % 2:
        raise UnsupportedModel(f"config.json: odd head_dim {head_dim}")
    ff_key = {"mixtral": "intermediate_size", "olmoe": "intermediate_size"}.get(
        arch, "moe_intermediate_size")
    # either name may appear: transformers' attribute_map aliases one to the other
    key = next((k for k in ("num_local_experts", "num_experts") if k in hf), "n_experts")
    n_expert = _int(hf, arch, key)
    n_used = _int(hf, arch, "num_experts_per_tok")
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: top-{n_used} of {n_expert} experts")
    n_ff_shared = _int(hf, arch, "shared_expert_intermediate_size") if arch == "qwen2_moe" else 0
    clip = hf.get("clip_qkv") if arch == "olmoe" else None
    gen = gen or {}
    eos = _token_ids(gen.get("eos_token_id")) + _token_ids(_get(hf, arch, "eos_token_id"))
    bos = gen["bos_token_id"] if "bos_token_id" in gen else _get(hf, arch, "bos_token_id")
    return {
        "format": "colibri", "format_version": 1,
        "architecture": arch, "hf_architecture": hf_arch,
        "n_vocab": _int(hf, arch, "vocab_size"), "n_embd": n_embd, "n_layer": n_layer,
        "n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim,
        "n_ff": _int(hf, arch, ff_key), "n_expert": n_expert, "n_expert_used": n_used,
        "n_ff_shared": n_ff_shared, "shared_gate": n_ff_shared > 0,
        "norm_topk_prob": True if arch == "mixtral" else bool(_get(hf, arch, "norm_topk_prob")),
        "qk_norm": {"qwen3_moe": "head", "olmoe": "full"}.get(arch, "none"),
        "qkv_bias": bool(_get(hf, arch, "qkv_bias")) if arch == "qwen2_moe" else False,
        "clip_qkv": float(clip) if clip is not None else None,
        "rope_theta": _rope_theta(hf, arch), "rotary_dim": head_dim,
        "rms_eps": float(_get(hf, arch, "rms_norm_eps")),
        "sliding_window": _sliding_window(hf, arch, n_layer),
        "tie_embeddings": bool(_get(hf, arch, "tie_word_embeddings")),
        "max_position_embeddings": _int(hf, arch, "max_position_embeddings"),
        "bos_token_id": _token_ids(bos)[0] if _token_ids(bos) else None,
        "eos_token_ids": list(dict.fromkeys(eos)),
    }


def _expert_names(arch: str, names: set[str], i: int) -> Callable[[int], list[Source]] | None:
    """Per-expert sources [w1, w3, w2] for layer i, legacy or fused layout."""
    p = f"model.layers.{i}."
    if arch == "mixtral" and f"{p}block_sparse_moe.experts.0.w1.weight" in names:
        return lambda j: [Source(f"{p}block_sparse_moe.experts.{j}.{w}.weight")
                          for w in ("w1", "w3", "w2")]
    if f"{p}mlp.experts.0.gate_proj.weight" in names:
        return lambda j: [Source(f"{p}mlp.experts.{j}.{w}_proj.weight")
                          for w in ("gate", "up", "down")]
    return None


def plan(cfg: dict[str, Any], names: set[str]) -> list[Target]:
    """Every tensor of the Colibri layout with its source, in file order.

    names: the checkpoint's tensor names (to tell legacy from fused experts and find
    Mixtral's `block_sparse_moe` prefix). Raises UnsupportedModel if the checkpoint holds
    tensors this layout does not use (e.g. biases the forward pass would ignore).
    """
    arch = cfg["architecture"]
    D, V, F, Fs = cfg["n_embd"], cfg["n_vocab"], cfg["n_ff"], cfg["n_ff_shared"]
    H, Hkv, hd = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    out: list[Target] = []

    def add(file: str, name: str, kind: str, shape: tuple[int, ...], src: Source) -> None:
        out.append(Target(file, name, kind, shape, src))

    emb = "embeddings.bin"
    add(emb, "tok_embd", VOCAB, (V, D), Source("model.embed_tokens.weight"))
    add(emb, "output_norm", NORM, (D,), Source("model.norm.weight"))
    if not cfg["tie_embeddings"]:
        add(emb, "output", VOCAB, (V, D), Source("lm_head.weight"))

    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        a = f"attention/layer_{i}.bin"
        add(a, "attn_norm", NORM, (D,), Source(p + "input_layernorm.weight"))
        for ours, hf, rows in (("q", "q_proj", H * hd), ("k", "k_proj", Hkv * hd),
                               ("v", "v_proj", Hkv * hd)):
            add(a, "w" + ours, DENSE, (rows, D), Source(f"{p}self_attn.{hf}.weight"))
        add(a, "wo", DENSE, (D, H * hd), Source(p + "self_attn.o_proj.weight"))
        if cfg["qkv_bias"]:
            for ours, hf, rows in (("q", "q_proj", H * hd), ("k", "k_proj", Hkv * hd),
                                   ("v", "v_proj", Hkv * hd)):
                add(a, "b" + ours, BIAS, (rows,), Source(f"{p}self_attn.{hf}.bias"))
        if cfg["qk_norm"] != "none":
            full = cfg["qk_norm"] == "full"
            add(a, "q_norm", NORM, (H * hd,) if full else (hd,),
                Source(p + "self_attn.q_norm.weight"))
            add(a, "k_norm", NORM, (Hkv * hd,) if full else (hd,),
                Source(p + "self_attn.k_norm.weight"))

        moe = p + ("block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else "mlp.")
        r = f"router/layer_{i}.bin"
        add(r, "ffn_norm", NORM, (D,), Source(p + "post_attention_layernorm.weight"))
        add(r, "gate_inp", ROUTER, (cfg["n_expert"], D), Source(moe + "gate.weight"))
        if cfg["shared_gate"]:
            add(r, "shared_gate", ROUTER, (1, D), Source(moe + "shared_expert_gate.weight"))

        per_expert = _expert_names(arch, names, i)
        for j in range(cfg["n_expert"]):
            e = f"experts/layer_{i}_expert_{j}.bin"
            if per_expert is not None:
                s1, s3, s2 = per_expert(j)
            else:  # fused: gate_up_proj [E, 2F, D] (gate rows first), down_proj [E, D, F]
                s1 = Source(moe + "experts.gate_up_proj", j, (0, F))
                s3 = Source(moe + "experts.gate_up_proj", j, (F, 2 * F))
                s2 = Source(moe + "experts.down_proj", j)
            add(e, "w1", EXPERT, (F, D), s1)
            add(e, "w3", EXPERT, (F, D), s3)
            add(e, "w2", EXPERT, (D, F), s2)

        if Fs > 0:
            s = f"shared/layer_{i}.bin"
            add(s, "w1", SHARED, (Fs, D), Source(moe + "shared_expert.gate_proj.weight"))
            add(s, "w3", SHARED, (Fs, D), Source(moe + "shared_expert.up_proj.weight"))
            add(s, "w2", SHARED, (D, Fs), Source(moe + "shared_expert.down_proj.weight"))

    used = {t.source.hf_name for t in out}
    ignorable = {"lm_head.weight"} if cfg["tie_embeddings"] else set()
    extra = sorted(n for n in names - used - ignorable if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise UnsupportedModel(
            f"checkpoint has tensors the {arch} layout does not use: {', '.join(extra[:5])}{more}"
        )
    return out


def fused_shape(cfg: dict[str, Any], hf_name: str) -> tuple[int, ...] | None:
    """The expected full shape of a fused expert tensor, or None for other tensors."""
    E, D, F = cfg["n_expert"], cfg["n_embd"], cfg["n_ff"]
    if hf_name.endswith("experts.gate_up_proj"):
        return (E, 2 * F, D)
    if hf_name.endswith("experts.down_proj"):
        return (E, D, F)
    return None
