"""MiniMax-M2 (MiniMaxM2ForCausalLM): GQA with RMSNorm over the whole q and k
projections and partial rotary (the first rotary_dim dims of each head); every layer routed
experts, chosen by sigmoid scores plus a selection bias (e_score_correction_bias) and weighed by
the plain sigmoid scores renormalised over the chosen ones; no shared expert, no scaling.
That is the grouped sigmoid router with one group: its + 1e-20 in the renormalising sum, which
transformers' MiniMax-M2 router leaves out, changes no f32 result unless the k chosen scores
sum below about 1e-13 (logits all below about -30).
Checkpoints ship in FP8 with block scales, read as DeepSeek's are. Multi-token-prediction
layers (numbered from num_hidden_layers on) are skipped at conversion.

Defaults and semantics follow transformers' configuration_minimax_m2.py / modeling_minimax_m2.py.
The released config.json also carries the original remote code's switches, which transformers
ignores; each is accepted at the value that computes what transformers computes and refused,
by name, at any other.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    HFConfig,
    Plan,
    Source,
    UnsupportedModel,
    base_config,
    build_plan,
    per_expert_names,
    rope_parameters,
)
from colibri.engine.models.glm4_moe import mtp_layer
from colibri.engine.models.mixtral import moe_counts
from colibri.engine.models.rope import rope_config

NAME = "minimax_m2"
HF_CLASSES = ("MiniMaxM2ForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
    num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=196608,
    rms_norm_eps=1e-6, bos_token_id=200034, eos_token_id=200020, tie_word_embeddings=False,
    num_experts_per_tok=8, num_local_experts=256, rope_theta=5000000.0,
)
# remote-code switches of the released config.json: the value transformers' forward pass
# amounts to (None: the key may also be null)
_FIXED: dict[str, tuple[Any, ...]] = {
    "use_qk_norm": (True,), "qk_norm_type": ("per_layer",), "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,), "shared_intermediate_size": (0, None),
    "routed_scaling_factor": (1, None), "num_expert_group": (1, None), "topk_group": (1, None),
    "sliding_window": (None,), "attn_window_size": (None,),
    "layernorm_full_attention_alpha": (1, None), "layernorm_full_attention_beta": (1, None),
    "layernorm_mlp_alpha": (1, None), "layernorm_mlp_beta": (1, None),
}


def _matches(v: Any, allowed: tuple[Any, ...]) -> bool:
    """v is one of allowed, booleans and None by identity (True is not 1)."""
    return any(v is a if a is None or isinstance(a, bool) or isinstance(v, bool) else v == a
               for a in allowed)


def _check_switches(hf: HFConfig, n_layer: int) -> None:
    for key, ok in _FIXED.items():
        if key in hf.raw and not _matches(hf.raw[key], ok):
            raise UnsupportedModel(f"config.json: {key} {hf.raw[key]!r} is not supported "
                                   f"(MiniMax-M2 runs with {ok[0]!r})")
    kinds = hf.raw.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(k != 1 for k in kinds)):
        raise UnsupportedModel(f"config.json: attn_type_list {kinds!r} is not supported (only "
                               "softmax attention, 1, on every layer)")
    types = hf.raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n_layer
                              or any(t != "full_attention" for t in types)):
        raise UnsupportedModel(f"config.json: layer_types {types!r} is not supported (only "
                               "full_attention)")
    q = hf.raw.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else q
    if method not in (None, "fp8"):
        raise UnsupportedModel(f"config.json: quantization_config.quant_method {method!r} is "
                               "not supported (MiniMax-M2: fp8 or none)")


def _rotary_dim(hf: HFConfig, params: dict[str, Any], head_dim: int) -> int:
    """transformers' rotary width: the rope parameters' partial_rotary_factor, else a top-level
    one, else the released configs' rotary_dim / head_dim; int(head_dim * factor)."""
    if params.get("partial_rotary_factor") is not None:
        prf = params["partial_rotary_factor"]
    elif hf.raw.get("partial_rotary_factor") is not None:
        prf = hf.raw["partial_rotary_factor"]
    elif hf.raw.get("rotary_dim") is not None:
        rd = hf.raw["rotary_dim"]
        if not isinstance(rd, int) or isinstance(rd, bool):
            raise UnsupportedModel(f"config.json: rotary_dim must be an integer, got {rd!r}")
        prf = rd / head_dim
    else:
        prf = 1.0
    if not isinstance(prf, int | float) or isinstance(prf, bool):
        raise UnsupportedModel(f"config.json: bad partial_rotary_factor {prf!r}")
    rd = int(head_dim * prf)
    if not 0 < rd <= head_dim or rd % 2:
        raise UnsupportedModel(f"config.json: rotary_dim {rd} (partial_rotary_factor {prf}) "
                               f"must be even and within head_dim {head_dim}")
    return rd


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    _check_switches(hf, cfg["n_layer"])
    params = rope_parameters(hf)
    cfg.update(moe_counts(hf, "intermediate_size"))
    cfg.update(
        n_ff_shared=0, shared_gate=False, norm_topk_prob=True, router="sigmoid_grouped",
        n_group=1, topk_group=1, routed_scale=1.0, layer_ffn=["moe"] * cfg["n_layer"],
        rotary_dim=_rotary_dim(hf, params, cfg["head_dim"]),
        rope=rope_config(params, cfg["max_position_embeddings"]),
        qk_norm="full", qkv_bias=False, o_bias=False, clip_qkv=None, sliding_window=None,
        n_mtp_layers=(hf.nonneg_int("num_mtp_modules")
                      if hf.raw.get("use_mtp") and "num_mtp_modules" in hf.raw else 0),
    )
    return cfg


def _ffn(pl: Plan, i: int, p: str, names: set[str]) -> None:
    """Router with its selection bias and the experts, under the released checkpoints'
    block_sparse_moe. (experts.j.w1/w3/w2) or transformers 5's mlp. (fused experts)."""
    moe = p + ("block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else "mlp.")
    pl.router(i, p, moe, gate_bias="e_score_correction_bias")
    if f"{moe}experts.0.w1.weight" in names:
        pl.experts(i, moe, lambda j: [Source(f"{moe}experts.{j}.{w}.weight")
                                      for w in ("w1", "w3", "w2")])
    else:
        pl.experts(i, moe, per_expert_names(names, moe))


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names, lambda pl, i, p: _ffn(pl, i, p, names),
                      skipped=mtp_layer(cfg["n_layer"]))
