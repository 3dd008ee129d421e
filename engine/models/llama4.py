"""Llama 4 text (Llama4ForCausalLM): GQA whose RoPE layers rotate interleaved pairs, attend
within chunks of attention_chunk_size positions and L2-normalise each q and k head after RoPE
(use_qk_norm), while every no_rope_layer_interval-th layer (no_rope_layers) has no RoPE,
attends globally and scales its queries by 1 + attn_scale * log1p(floor((p + 1) / floor_scale))
(attn_temperature_tuning); MoE on moe_layers (every interleave_moe_layer_step-th layer), dense
FFNs of width intermediate_size_mlp on the others. The MoE routes each token to its top-k
experts by logit, multiplies the expert's *input* by sigmoid(logit), and adds an always-on
shared expert of width intermediate_size (as the experts).

The text model of a Llama4ForConditionalGeneration checkpoint (text_config, tensors under
language_model.) is read the same way; its vision encoder and projector are left out.

Experts are stored fused as transformers keeps them: gate_up_proj [E, D, 2F] (gate columns
first, then up), down_proj [E, F, D]. q/k rows are reordered at conversion so the core's
rotate-half RoPE rotates the pairs Llama 4 rotates (dot products and per-head norms do not
change under the same permutation of q and k).

Defaults and semantics follow transformers' configuration_llama4.py / modeling_llama4.py
(Llama4TextConfig, Llama4Config).
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    BIAS,
    DENSE,
    EXPERT,
    NORM,
    ROUTER,
    HFConfig,
    Plan,
    Source,
    UnsupportedModel,
    base_config,
    build_plan,
    no_experts,
    rope_parameters,
)
from colibri.engine.models.rope import rope_config

NAME = "llama4"
MULTIMODAL = "Llama4ForConditionalGeneration"
HF_CLASSES = ("Llama4ForCausalLM", MULTIMODAL)
_VISION = ("vision_model.", "multi_modal_projector.")  # a multimodal checkpoint's other parts
DEFAULTS: dict[str, Any] = dict(
    vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, num_experts_per_tok=1, num_local_experts=16, moe_layers=None,
    interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layers=None,
    no_rope_layer_interval=4, attention_chunk_size=8192, layer_types=None,
    attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1, attention_bias=False,
    rope_theta=500000.0,
)
_LAYER_TYPES = {"chunked_attention": "chunked", "full_attention": "full"}


def _rope_layers(hf: HFConfig, n: int) -> list[bool]:
    """Per layer whether it uses RoPE: no_rope_layers (1: RoPE, 0: NoPE), or when it is
    absent or empty a NoPE layer every no_rope_layer_interval layers, as transformers."""
    flags = hf.raw.get("no_rope_layers")
    if not flags:
        interval = hf.pos_int("no_rope_layer_interval")
        return [(i + 1) % interval != 0 for i in range(n)]
    if (not isinstance(flags, list) or len(flags) < n
            or not all(isinstance(f, int) and f in (0, 1) for f in flags)):
        raise UnsupportedModel(f"config.json: no_rope_layers must list 0 or 1 for each of the "
                               f"{n} layers, got {flags!r}")
    return [bool(f) for f in flags[:n]]


def _layer_attn(hf: HFConfig, rope: list[bool]) -> tuple[list[str], int | None]:
    """Per layer "chunked" or "full" (layer_types, by default chunked where a layer has RoPE
    and attention_chunk_size is set), and the chunk length."""
    n = len(rope)
    chunk = hf.get("attention_chunk_size")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool)
                              or chunk <= 0):
        raise UnsupportedModel(f"config.json: attention_chunk_size must be a positive integer "
                               f"or null, got {chunk!r}")
    types = hf.raw.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention"
                 for r in rope]
    if not isinstance(types, list) or len(types) != n:
        raise UnsupportedModel(f"config.json: layer_types must list {n} layer types, "
                               f"got {types!r}")
    bad = sorted({t for t in types if t not in _LAYER_TYPES}, key=str)
    if bad:
        raise UnsupportedModel(f"config.json: layer_types value {bad[0]!r} is not supported "
                               f"(supported: {', '.join(_LAYER_TYPES)})")
    kinds = [_LAYER_TYPES[t] for t in types]
    if "chunked" in kinds and chunk is None:
        raise UnsupportedModel("config.json: layer_types has chunked_attention layers but "
                               "attention_chunk_size is null")
    return kinds, chunk if "chunked" in kinds else None


def _moe_layers(hf: HFConfig, n: int) -> set[int]:
    """The MoE layers: moe_layers, else every interleave_moe_layer_step-th layer."""
    moe = hf.raw.get("moe_layers")
    if moe is None:
        step = hf.pos_int("interleave_moe_layer_step")
        return set(range(step - 1, n, step))
    if not isinstance(moe, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in moe):
        raise UnsupportedModel(f"config.json: moe_layers must list layer indices, got {moe!r}")
    return {i for i in moe if 0 <= i < n}


def _experts(hf: HFConfig, moe: set[int], n: int) -> dict[str, Any]:
    """The FFN fields: routed and shared experts on the MoE layers, dense FFNs elsewhere."""
    kinds = ["moe" if i in moe else "dense" for i in range(n)]
    dense = hf.pos_int("intermediate_size_mlp") if "dense" in kinds else 0
    if not moe:
        return {**no_experts(), "n_ff_dense": dense, "layer_ffn": kinds}
    n_expert = hf.pos_int("num_local_experts")
    n_used = hf.pos_int("num_experts_per_tok")
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: num_experts_per_tok {n_used} exceeds "
                               f"num_local_experts {n_expert}")
    ff = hf.pos_int("intermediate_size")
    return {"n_ff": ff, "n_expert": n_expert, "n_expert_used": n_used, "n_ff_shared": ff,
            "shared_gate": False, "norm_topk_prob": False, "router": "sigmoid_topk",
            "route_input": True, "n_ff_dense": dense, "layer_ffn": kinds}


def text_config(raw: dict[str, Any], hf_arch: str) -> dict[str, Any]:
    """The Llama4TextConfig keys: config.json itself, or a multimodal one's text_config."""
    if raw.get("quantization_config") is not None:
        raise UnsupportedModel("config.json: quantization_config is not supported for Llama 4; "
                               "convert the bfloat16 checkpoint")
    if hf_arch != MULTIMODAL:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModel(f"config.json: {MULTIMODAL} without a text_config object")
    if raw.get("tie_word_embeddings") or text.get("tie_word_embeddings"):
        raise UnsupportedModel("config.json: tie_word_embeddings is not supported for "
                               f"{MULTIMODAL}")
    return text


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    raw = text_config(raw, hf_arch)
    hf = HFConfig(raw, DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    n = cfg["n_layer"]
    rope = _rope_layers(hf, n)
    kinds, chunk = _layer_attn(hf, rope)
    cfg.update(_experts(hf, _moe_layers(hf, n), n))
    tuning = bool(hf.get("attn_temperature_tuning")) and not all(rope)
    floor, scale = (hf.number("floor_scale"), hf.number("attn_scale")) if tuning else (0.0, 0.0)
    if tuning and floor <= 0:
        raise UnsupportedModel(f"config.json: floor_scale must be positive, got {floor}")
    bias = bool(hf.get("attention_bias"))
    params = rope_parameters(hf)
    prf = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if prf is not None and prf != 1:
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} is not supported")
    cfg.update(
        rope=rope_config(params, cfg["max_position_embeddings"]),
        qk_norm="l2" if hf.get("use_qk_norm") and any(rope) else "none",
        qkv_bias=bias, o_bias=bias, clip_qkv=None, sliding_window=None,
        layer_attn=kinds, attn_chunk=chunk, nope_layers=[i for i in range(n) if not rope[i]],
        attn_temp_floor=floor, attn_temp_scale=scale,
    )
    return cfg


def _attention(pl: Plan, i: int, p: str) -> None:
    """GQA attention; on RoPE layers the q and k rows (and biases) of each head reordered from
    interleaved pairs to the rotate-half layout."""
    c = pl.cfg
    D, H, Hkv, hd = c["n_embd"], c["n_head"], c["n_head_kv"], c["head_dim"]
    rope = i not in c["nope_layers"]
    a, att = f"attention/layer_{i}.bin", p + "self_attn."
    pl.add(a, "attn_norm", NORM, (D,), Source(p + "input_layernorm.weight"))
    proj = (("q", "q_proj", H * hd, True), ("k", "k_proj", Hkv * hd, True),
            ("v", "v_proj", Hkv * hd, False))
    for ours, hf, rows, rotated in proj:
        how: dict[str, Any] = (dict(transform="rope_rows", params=(hd, 0, hd))
                               if rope and rotated else {})
        pl.add(a, "w" + ours, DENSE, (rows, D), Source(f"{att}{hf}.weight", **how))
        if c["qkv_bias"]:
            pl.add(a, "b" + ours, BIAS, (rows,), Source(f"{att}{hf}.bias", **how))
    pl.add(a, "wo", DENSE, (D, H * hd), Source(att + "o_proj.weight"))
    if c["o_bias"]:
        pl.add(a, "bo", BIAS, (D,), Source(att + "o_proj.bias"))


def _ffn(pl: Plan, i: int, p: str) -> None:
    c = pl.cfg
    if c["layer_ffn"][i] == "dense":
        pl.dense_ffn(i, p, mlp="feed_forward.")
        return
    D, E, F = c["n_embd"], c["n_expert"], c["n_ff"]
    moe, r = p + "feed_forward.", f"router/layer_{i}.bin"
    pl.add(r, "ffn_norm", NORM, (D,), Source(p + "post_attention_layernorm.weight"))
    pl.add(r, "gate_inp", ROUTER, (E, D), Source(moe + "router.weight"))
    gu, dn = moe + "experts.gate_up_proj", moe + "experts.down_proj"
    for j in range(E):  # gate_up_proj [E, D, 2F]: gate columns [0, F), up columns [F, 2F)
        e = f"experts/layer_{i}_expert_{j}.bin"
        for name, c0 in (("w1", 0), ("w3", F)):
            pl.add(e, name, EXPERT, (F, D), Source(gu, j, transform="cols_t",
                                                   params=(c0, 1, c0 + F),
                                                   src_shape=(E, D, 2 * F)))
        pl.add(e, "w2", EXPERT, (D, F), Source(dn, j, transform="t", src_shape=(E, F, D)))
    pl.shared(i, moe + "shared_expert.")


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    if cfg["hf_architecture"] != MULTIMODAL:
        return build_plan(cfg, names, _ffn, attention=_attention)
    pl = Plan(cfg)  # the text model under language_model.
    pl.embeddings("language_model.model.", head="language_model.lm_head.weight")
    for i in range(cfg["n_layer"]):
        p = f"language_model.model.layers.{i}."
        _attention(pl, i, p)
        _ffn(pl, i, p)
    return pl.done(names, NAME, skipped=lambda n: n.startswith(_VISION))
