"""Mixtral (MixtralForCausalLM): GQA attention with an optional sliding window, softmax top-k
routing renormalised over the chosen experts, no shared expert.

Defaults and semantics follow transformers' configuration_mixtral.py / modeling_mixtral.py.
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
    rope_type,
)

NAME = "mixtral"
HF_CLASSES = ("MixtralForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
    rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, sliding_window=None, rope_theta=1e6,
)


def check_plain_rope(hf: HFConfig) -> None:
    """Refuse rope types and partial rotary that these families' transformers code would
    compute differently from plain RoPE over the whole head."""
    params = rope_parameters(hf)
    if rope_type(params) != "default":
        raise UnsupportedModel(
            f"config.json: rope type {rope_type(params)!r} is not supported (only the default "
            "RoPE)"
        )
    prf = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        # transformers' default RoPE for these architectures ignores the factor, so the
        # intended rotation is ambiguous; refuse rather than guess
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} is not supported")


def window(v: Any) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise UnsupportedModel(f"config.json: bad sliding_window {v!r}")
    return v


def moe_counts(hf: HFConfig, ff_key: str) -> dict[str, Any]:
    """n_ff, n_expert and n_expert_used of a softmax-routed MoE family."""
    key = hf.first("num_local_experts", "num_experts")
    if key not in hf:  # transformers aliases the two names: the family's default names one
        key = next(k for k in ("num_local_experts", "num_experts") if k in hf.defaults)
    n_expert = hf.pos_int(key)
    n_used = hf.pos_int("num_experts_per_tok")
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: top-{n_used} of {n_expert} experts")
    return {"n_ff": hf.pos_int(ff_key), "n_expert": n_expert, "n_expert_used": n_used}


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    check_plain_rope(hf)
    cfg = base_config(hf, NAME, hf_arch, gen)
    cfg.update(moe_counts(hf, "intermediate_size"))
    cfg.update(n_ff_shared=0, shared_gate=False, norm_topk_prob=True, qk_norm="none",
               qkv_bias=False, clip_qkv=None, sliding_window=window(raw.get("sliding_window")))
    return cfg


def _ffn(pl: Plan, i: int, p: str, names: set[str]) -> None:
    moe = p + ("block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else "mlp.")
    pl.router(i, p, moe)
    if f"{moe}experts.0.w1.weight" in names:  # Mixtral's own per-expert names
        pl.experts(i, moe, lambda j: [Source(f"{moe}experts.{j}.{w}.weight")
                                      for w in ("w1", "w3", "w2")])
    else:
        pl.experts(i, moe, per_expert_names(names, moe))


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return build_plan(cfg, names, lambda pl, i, p: _ffn(pl, i, p, names))
