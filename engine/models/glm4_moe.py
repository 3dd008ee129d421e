"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): GQA attention with partial rotary (the first
partial_rotary_factor of each head), optional q/k/v biases and per-head q/k RMSNorm; the first
first_k_dense_replace layers dense, the others grouped sigmoid routing (scores + a correction
bias pick the experts, within the best topk_group of n_group groups) plus shared experts.
The first multi-token-prediction layer past num_hidden_layers is converted as a model of its
own (mtp_plan, for drafting with --speculative mtp); further ones are skipped.

Defaults and semantics follow transformers' configuration_glm4_moe.py / modeling_glm4_moe.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colibri.engine.models.family import (
    DENSE,
    NORM,
    VOCAB,
    HFConfig,
    Plan,
    Source,
    Target,
    UnsupportedModel,
    base_config,
    build_plan,
    no_experts,
    per_expert_names,
    rope_parameters,
)
from colibri.engine.models.rope import rope_config

NAME = "glm4_moe"
HF_CLASSES = ("Glm4MoeForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072,
    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
    moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
    n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
    first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, bos_token_id=None,
    eos_token_id=None, num_nextn_predict_layers=1, partial_rotary_factor=0.5,
    rope_theta=10000.0,
)


def grouped_router(hf: HFConfig, n_layer: int) -> dict[str, Any]:
    """Routed and shared experts, grouped sigmoid routing and the dense first layers, as
    DeepSeek-V3 and GLM-4.5 name them."""
    k_dense = min(hf.nonneg_int("first_k_dense_replace"), n_layer)
    if k_dense == n_layer:  # every layer dense: a model without routed experts
        return {**no_experts(), "n_ff_dense": hf.pos_int("intermediate_size"),
                "layer_ffn": ["dense"] * n_layer}
    n_expert = hf.pos_int(hf.first("n_routed_experts", "num_local_experts"))
    n_used = hf.pos_int("num_experts_per_tok")
    n_group, topk_group = hf.pos_int("n_group"), hf.pos_int("topk_group")
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: top-{n_used} of {n_expert} experts")
    if n_expert % n_group or topk_group > n_group:
        raise UnsupportedModel(f"config.json: {n_expert} experts in n_group {n_group} groups, "
                               f"topk_group {topk_group}")
    if n_group > 1 and (n_expert // n_group < 2 or topk_group * (n_expert // n_group) < n_used):
        raise UnsupportedModel(f"config.json: groups of {n_expert // n_group} experts cannot "
                               f"hold top-{n_used} in {topk_group} groups")
    scale = hf.number("routed_scaling_factor")
    if scale <= 0:
        raise UnsupportedModel(f"config.json: routed_scaling_factor {scale} must be positive")
    n_shared = hf.nonneg_int("n_shared_experts")
    ff = hf.pos_int("moe_intermediate_size")
    return {
        "n_ff": ff, "n_expert": n_expert, "n_expert_used": n_used,
        "n_ff_shared": ff * n_shared, "shared_gate": False,
        "norm_topk_prob": bool(hf.get("norm_topk_prob")),
        "router": "sigmoid_grouped", "n_group": n_group, "topk_group": topk_group,
        "routed_scale": scale,
        "n_ff_dense": hf.pos_int("intermediate_size") if k_dense else 0,
        "layer_ffn": ["dense"] * k_dense + ["moe"] * (n_layer - k_dense),
    }


def mtp_layer(n_layer: int) -> Any:
    """Whether a checkpoint tensor belongs to a multi-token-prediction layer (numbered from
    num_hidden_layers on), which decoding does not use."""
    def skipped(name: str) -> bool:
        parts = name.split(".")
        return (len(parts) > 2 and parts[0] == "model" and parts[1] == "layers"
                and parts[2].isdigit() and int(parts[2]) >= n_layer)
    return skipped


def nextn_plan(cfg: dict[str, Any], names: set[str],
               layer: Callable[[Plan, int, str], None]) -> tuple[dict[str, Any],
                                                                 list[Target]] | None:
    """The first multi-token-prediction layer (DeepSeek-V3 / GLM-4.5's nextn layer
    model.layers.{num_hidden_layers}.*) as a one-layer model: its config and tensor plan, or
    None when the checkpoint does not ship it. layer(plan, 0, prefix) adds the decoder layer
    (attention and FFN). The layer's input is eh_proj @ [enorm(embed(next token));
    hnorm(hidden state)]; shared_head.norm and the lm_head make its logits. Its own copies of
    the embeddings and lm_head are used where it ships them, the main model's otherwise. A
    layer that lacks any of its tensors gives None too."""
    L = cfg["n_layer"]
    p = f"model.layers.{L}."
    if p + "eh_proj.weight" not in names:
        return None
    kind = "moe" if cfg["n_expert"] else "dense"  # past first_k_dense_replace
    mcfg = dict(cfg, n_layer=1, layer_ffn=[kind], mtp_input=True, n_mtp_layers=0)
    for key in ("layer_attn", "layer_mixer"):
        if mcfg.get(key):
            mcfg[key] = mcfg[key][-1:]
    V, D = cfg["n_vocab"], cfg["n_embd"]
    pl = Plan(mcfg)
    emb = "embeddings.bin"
    own = p + "embed_tokens.weight"
    pl.add(emb, "tok_embd", VOCAB, (V, D),
           Source(own if own in names else "model.embed_tokens.weight"))
    pl.add(emb, "output_norm", NORM, (D,), Source(p + "shared_head.norm.weight"))
    if not cfg["tie_embeddings"]:
        own = p + "shared_head.head.weight"
        pl.add(emb, "output", VOCAB, (V, D), Source(own if own in names else "lm_head.weight"))
    pl.add(emb, "mtp_enorm", NORM, (D,), Source(p + "enorm.weight"))
    pl.add(emb, "mtp_hnorm", NORM, (D,), Source(p + "hnorm.weight"))
    pl.add(emb, "mtp_eh_proj", DENSE, (D, 2 * D), Source(p + "eh_proj.weight"))
    layer(pl, 0, p)
    if any(t.source.hf_name not in names for t in pl.out):
        return None  # an incomplete layer cannot draft: skipped like the others
    return mcfg, pl.done({n for n in names if n.startswith(p)}, cfg["architecture"])


def mtp_plan(cfg: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list[Target]] | None:
    """GLM-4.5's nextn layer as a one-layer model (nextn_plan)."""
    def layer(pl: Plan, i: int, p: str) -> None:
        pl.attention(i, p)
        grouped_ffn(pl, i, p, names, "gate.e_score_correction_bias")
    return nextn_plan(cfg, names, layer)


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    params = rope_parameters(hf)
    prf = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor")))
    rd = int(cfg["head_dim"] * prf)
    if not 0 < rd <= cfg["head_dim"] or rd % 2:
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} gives rotary dims "
                               f"{rd} of head_dim {cfg['head_dim']}")
    cfg.update(grouped_router(hf, cfg["n_layer"]))
    cfg.update(rotary_dim=rd, rope=rope_config(params, cfg["max_position_embeddings"]),
               qk_norm="head" if hf.get("use_qk_norm") else "none",
               qkv_bias=bool(hf.get("attention_bias")), o_bias=False, clip_qkv=None,
               sliding_window=None, n_mtp_layers=hf.nonneg_int("num_nextn_predict_layers"))
    return cfg


def grouped_ffn(pl: Plan, i: int, p: str, names: set[str], gate_bias: str | None) -> None:
    """A dense layer's FFN, or the router (with its selection bias), routed and shared
    experts, as DeepSeek and GLM lay them out."""
    if pl.cfg["layer_ffn"][i] == "dense":
        pl.dense_ffn(i, p)
        return
    moe = p + "mlp."
    pl.router(i, p, moe, gate_bias=gate_bias)
    pl.experts(i, moe, per_expert_names(names, moe))
    if pl.cfg["n_ff_shared"]:
        pl.shared(i, moe + "shared_experts.")


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names,
                      lambda pl, i, p: grouped_ffn(pl, i, p, names, "gate.e_score_correction_bias"),
                      skipped=mtp_layer(cfg["n_layer"]))
