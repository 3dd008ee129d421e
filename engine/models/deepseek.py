"""DeepSeek-V3 / R1 / V3.1 and Kimi K2 (DeepseekV3ForCausalLM), DeepSeek-V2 / V2-Lite
(DeepseekV2ForCausalLM): multi-head latent attention (queries through q_lora_rank or straight,
keys and values through a kv_lora_rank latent with a decoupled RoPE part), YaRN with DeepSeek's
mscale in the softmax scale, the first first_k_dense_replace layers dense, the others routed
experts (V3: grouped sigmoid routing with a correction bias; V2: softmax, greedy or
group-limited) plus shared experts. V3's first multi-token-prediction layer past
num_hidden_layers is converted as a model of its own (mtp_plan, for --speculative mtp).

The cache holds the latent row, and attention runs in the absorbed form (csrc/mla.c), so
kv_b_proj is split per head at conversion into the key part (transposed) and the value part.
Checkpoints with interleaved rotary pairs (V2, and V3's rope_interleave) get the rotary rows of
q and of the latent projection reordered to the rotate-half layout: q.k is unchanged.

Defaults and semantics follow transformers' configuration_deepseek_v3.py / modeling_deepseek_v3.py
and configuration_deepseek_v2.py / modeling_deepseek_v2.py.
"""

from __future__ import annotations

import math
from typing import Any

from colibri.engine.models.family import (
    DENSE,
    NORM,
    HFConfig,
    Plan,
    Source,
    UnsupportedModel,
    base_config,
    build_plan,
    rope_parameters,
)
from colibri.engine.models.glm4_moe import grouped_ffn, grouped_router, mtp_layer, nextn_plan
from colibri.engine.models.rope import rope_config, yarn_mscale

NAME = "deepseek"
HF_CLASSES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
    max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, rope_interleave=True, attention_bias=False,
    num_nextn_predict_layers=1, rope_theta=10000.0,
)
V2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, first_k_dense_replace=0, kv_lora_rank=512,
    q_lora_rank=1536, n_group=None, n_routed_experts=64, n_shared_experts=2,
    qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None,
    topk_method="greedy", norm_topk_prob=False, v_head_dim=128, num_experts_per_tok=None,
    moe_intermediate_size=1407, rope_theta=10000.0,
)


def _v2_router(hf: HFConfig, n_layer: int) -> dict[str, Any]:
    """DeepSeek-V2's softmax router: greedy top-k, or top-k within the topk_group groups with
    the best single score; weights times routed_scaling_factor, never renormalised."""
    method = hf.get("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModel(f"config.json: topk_method {method!r} is not supported")
    raw = dict(hf.raw)
    if method == "greedy":
        raw.update(n_group=1, topk_group=1)
    r = grouped_router(HFConfig(raw, hf.defaults), n_layer)
    r.update(router="softmax", norm_topk_prob=False)
    return r


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    v3 = hf_arch == "DeepseekV3ForCausalLM"
    hf = HFConfig(raw, V3_DEFAULTS if v3 else V2_DEFAULTS)
    if hf.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias is not supported with MLA")
    if not v3 and hf.get("mlp_bias"):
        raise UnsupportedModel("config.json: mlp_bias is not supported")
    dn, dr = hf.pos_int("qk_nope_head_dim"), hf.pos_int("qk_rope_head_dim")
    if dr % 2:
        raise UnsupportedModel(f"config.json: odd qk_rope_head_dim {dr}")
    ql = hf.get("q_lora_rank") or 0
    if not isinstance(ql, int) or ql < 0:
        raise UnsupportedModel(f"config.json: bad q_lora_rank {ql!r}")
    # the HF config's head_dim is the rotary width for these models; ours is the query head's
    cfg = base_config(HFConfig(dict(raw, head_dim=dn + dr), hf.defaults), NAME, hf_arch, gen)
    n_layer = cfg["n_layer"]
    params = rope_parameters(hf)
    rope = rope_config(params, cfg["max_position_embeddings"])
    scale = 1.0 / math.sqrt(dn + dr)
    if rope.get("type") == "yarn" and params.get("mscale_all_dim"):
        m = yarn_mscale(rope["factor"], float(params["mscale_all_dim"]))
        scale *= m * m
    cfg.update(grouped_router(hf, n_layer) if v3 else _v2_router(hf, n_layer))
    cfg.update(attn="mla", n_head_kv=1, head_dim=dn + dr, rotary_dim=dr, q_lora_rank=ql,
               kv_lora_rank=hf.pos_int("kv_lora_rank"), v_head_dim=hf.pos_int("v_head_dim"),
               attn_scale=scale, rope=rope, qk_norm="none", qkv_bias=False, o_bias=False,
               clip_qkv=None, sliding_window=None,
               rope_interleave=bool(hf.get("rope_interleave")) if v3 else True,
               n_mtp_layers=hf.nonneg_int("num_nextn_predict_layers") if v3 else 0)
    return cfg


def _mla(pl: Plan, i: int, p: str) -> None:
    """Layer i's MLA tensors (p: its HF prefix)."""
    c = pl.cfg
    D, H, hd, dr = c["n_embd"], c["n_head"], c["head_dim"], c["rotary_dim"]
    dn, ql, kl, dv = hd - dr, c["q_lora_rank"], c["kv_lora_rank"], c["v_head_dim"]
    a = f"attention/layer_{i}.bin"
    att = p + "self_attn."

    def rope(name: str, rows: int, cols: int, block: int, offset: int) -> Source:
        if not c["rope_interleave"]:
            return Source(att + name)
        return Source(att + name, transform="rope_rows", params=(block, offset, dr),
                      src_shape=(rows, cols))

    pl.add(a, "attn_norm", NORM, (D,), Source(p + "input_layernorm.weight"))
    if ql:
        pl.add(a, "wq_a", DENSE, (ql, D), Source(att + "q_a_proj.weight"))
        pl.add(a, "q_a_norm", NORM, (ql,), Source(att + "q_a_layernorm.weight"))
        pl.add(a, "wq_b", DENSE, (H * hd, ql), rope("q_b_proj.weight", H * hd, ql, hd, dn))
    else:
        pl.add(a, "wq", DENSE, (H * hd, D), rope("q_proj.weight", H * hd, D, hd, dn))
    pl.add(a, "wkv_a", DENSE, (kl + dr, D),
           rope("kv_a_proj_with_mqa.weight", kl + dr, D, kl + dr, kl))
    pl.add(a, "kv_a_norm", NORM, (kl,), Source(att + "kv_a_layernorm.weight"))
    kv_b = (H * (dn + dv), kl)
    pl.add(a, "wk_b", DENSE, (H * kl, dn), Source(att + "kv_b_proj.weight", transform="kv_b_k",
                                                  params=(H, dn, dv), src_shape=kv_b))
    pl.add(a, "wv_b", DENSE, (H * dv, kl), Source(att + "kv_b_proj.weight", transform="kv_b_v",
                                                  params=(H, dn, dv), src_shape=kv_b))
    pl.add(a, "wo", DENSE, (D, H * dv), Source(att + "o_proj.weight"))


def mtp_plan(cfg: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list] | None:
    """DeepSeek-V3's nextn layer (MLA attention, routed and shared experts) as a one-layer
    model (glm4_moe.nextn_plan)."""
    if cfg["hf_architecture"] != "DeepseekV3ForCausalLM":
        return None

    def layer(pl: Plan, i: int, p: str) -> None:
        _mla(pl, i, p)
        grouped_ffn(pl, i, p, names, "gate.e_score_correction_bias")
    return nextn_plan(cfg, names, layer)


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    bias = ("gate.e_score_correction_bias" if cfg["hf_architecture"] == "DeepseekV3ForCausalLM"
            else None)
    return build_plan(cfg, names, lambda pl, i, p: grouped_ffn(pl, i, p, names, bias),
                      attention=_mla, skipped=mtp_layer(cfg["n_layer"]))
