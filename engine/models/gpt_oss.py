"""gpt-oss (GptOssForCausalLM): GQA with q/k/v/o biases and a learned sink logit per head in
every softmax's denominator, sliding-window layers alternating with full ones as layer_types
says, YaRN; softmax top-k routing with a router bias (the softmax over the k chosen logits);
experts with biases and the clamped SwiGLU (gate clamped above at swiglu_limit, up to
[-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)), stored fused as transformers keeps
them: gate_up_proj [E, D, 2F] with gate and up interleaved column by column, down_proj
[E, F, D]; or in MXFP4 as the released checkpoints ship them (gate_up_proj_blocks /
_scales [E, 2F, D / 32, 16 / -], down_proj_blocks / _scales [E, D, F / 32, 16 / -]), kept in
MXFP4 byte for byte.

Defaults and semantics follow transformers' configuration_gpt_oss.py / modeling_gpt_oss.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    BIAS,
    EXPERT,
    MXFP4,
    NORM,
    ROUTER,
    HFConfig,
    Plan,
    Source,
    UnsupportedModel,
    base_config,
    rope_parameters,
)
from colibri.engine.models.rope import rope_config

NAME = "gpt_oss"
HF_CLASSES = ("GptOssForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
    num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False, swiglu_alpha=1.702, swiglu_limit=7.0,
    attention_bias=True, bos_token_id=None, eos_token_id=None, layer_types=None,
    # transformers' rope_parameters when a config.json has none
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
)
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
QK = 32  # values per MXFP4 block


def check_quantization(hf: HFConfig, n_embd: int, n_ff: int) -> None:
    """A quantization_config must be MXFP4 (experts in blocks of 32 along their inputs)."""
    q = hf.raw.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method != "mxfp4":
        raise UnsupportedModel(f"config.json: quantization_config.quant_method {method!r} is "
                               f"not supported (gpt-oss: mxfp4 or none)")
    if n_embd % QK or n_ff % QK:
        raise UnsupportedModel(f"config.json: MXFP4 experts need hidden_size ({n_embd}) and "
                               f"intermediate_size ({n_ff}) in whole blocks of {QK}")


def layer_attn(hf: HFConfig, n_layer: int) -> list[str]:
    """Per layer "sliding" or "full" from layer_types (transformers' default: sliding on
    even layers, full on odd ones)."""
    types = hf.get("layer_types")
    if types is None:
        return ["sliding" if (i + 1) % 2 else "full" for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer:
        raise UnsupportedModel(f"config.json: layer_types must list {n_layer} layer types, "
                               f"got {types!r}")
    bad = sorted({t for t in types if t not in _LAYER_TYPES}, key=str)
    if bad:
        raise UnsupportedModel(f"config.json: layer_types value {bad[0]!r} is not supported "
                               f"(supported: {', '.join(_LAYER_TYPES)})")
    return [_LAYER_TYPES[t] for t in types]


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    raw = dict(raw)
    if "rope_parameters" not in raw and "rope_scaling" not in raw:
        raw["rope_parameters"] = DEFAULTS["rope_parameters"]
    hf = HFConfig(raw, DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    n_expert = hf.pos_int(hf.first("num_experts", "num_local_experts"))
    n_used = hf.pos_int("num_experts_per_tok")
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: num_experts_per_tok {n_used} exceeds "
                               f"num_local_experts {n_expert}")
    limit, alpha = hf.number("swiglu_limit"), hf.number("swiglu_alpha")
    if limit <= 0:
        raise UnsupportedModel(f"config.json: swiglu_limit {limit} must be positive")
    kinds = layer_attn(hf, cfg["n_layer"])
    check_quantization(hf, cfg["n_embd"], hf.pos_int("intermediate_size"))
    bias = bool(hf.get("attention_bias"))
    cfg.update(
        n_ff=hf.pos_int("intermediate_size"), n_expert=n_expert, n_expert_used=n_used,
        n_ff_shared=0, shared_gate=False, norm_topk_prob=True, router="softmax",
        layer_ffn=["moe"] * cfg["n_layer"],
        rope=rope_config(rope_parameters(hf), cfg["max_position_embeddings"]),
        qk_norm="none", qkv_bias=bias, o_bias=bias, clip_qkv=None,
        sliding_window=hf.pos_int("sliding_window") if "sliding" in kinds else None,
        layer_attn=kinds, attn_sinks=True, router_bias=True, expert_bias=True,
        glu="swiglu_clamp", glu_alpha=alpha, glu_limit=limit,
    )
    return cfg


def _layer(pl: Plan, i: int, p: str) -> None:
    c = pl.cfg
    D, F, E, H = c["n_embd"], c["n_ff"], c["n_expert"], c["n_head"]
    pl.attention(i, p)
    pl.add(f"attention/layer_{i}.bin", "sinks", BIAS, (H,), Source(p + "self_attn.sinks"))
    moe, r = p + "mlp.", f"router/layer_{i}.bin"
    pl.add(r, "ffn_norm", NORM, (D,), Source(p + "post_attention_layernorm.weight"))
    pl.add(r, "gate_inp", ROUTER, (E, D), Source(moe + "router.weight"))
    pl.add(r, "gate_inp_bias", ROUTER, (E,), Source(moe + "router.bias"))
    gub, db = moe + "experts.gate_up_proj_bias", moe + "experts.down_proj_bias"
    for name, part in (("exp_b1", 0), ("exp_b3", 1)):  # gate and up columns alternate
        pl.add(r, name, BIAS, (E, F), Source(gub, transform="cols", params=(part, 2),
                                             src_shape=(E, 2 * F)))
    pl.add(r, "exp_b2", BIAS, (E, D), Source(db))
    gu, dn = moe + "experts.gate_up_proj", moe + "experts.down_proj"
    mx = gu + "_blocks" in pl.names
    for j in range(E):
        e = f"experts/layer_{i}_expert_{j}.bin"
        if mx:  # *_blocks [E, rows, in / 32, 16] with *_scales [E, rows, in / 32]: rows kept
            for name, part in (("w1", 0), ("w3", 1)):
                pl.add(e, name, MXFP4, (F, D), Source(
                    gu + "_blocks", j, transform="rows", params=(part, 2),
                    src_shape=(E, 2 * F, D // QK, QK // 2), scales=gu + "_scales"))
            pl.add(e, "w2", MXFP4, (D, F), Source(dn + "_blocks", j,
                                                  src_shape=(E, D, F // QK, QK // 2),
                                                  scales=dn + "_scales"))
            continue
        for name, part in (("w1", 0), ("w3", 1)):
            pl.add(e, name, EXPERT, (F, D), Source(gu, j, transform="cols_t", params=(part, 2),
                                                   src_shape=(E, D, 2 * F)))
        pl.add(e, "w2", EXPERT, (D, F), Source(dn, j, transform="t", src_shape=(E, F, D)))


class _Plan(Plan):
    """Plan, knowing the checkpoint's names (MXFP4 or float experts)."""

    def __init__(self, cfg: dict[str, Any], names: set[str]) -> None:
        super().__init__(cfg)
        self.names = names


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    pl = _Plan(cfg, names)
    pl.embeddings()
    for i in range(cfg["n_layer"]):
        _layer(pl, i, f"model.layers.{i}.")
    return pl.done(names, NAME)
