"""Qwen3-Next (Qwen3NextForCausalLM): hybrid layers, most of them gated DeltaNet linear
attention (a causal conv1d and a recurrent state per sequence, engine side in
csrc/linear_attn.c), every full_attention_interval-th one gated full attention (q_proj gives
each head's query and a sigmoid gate on its output, per-head q/k RMSNorm, partial rotary);
softmax top-k routing plus a shared expert scaled by its own sigmoid gate. Its RMSNorms
multiply by (1 + weight): the converter stores 1 + weight. The multi-token-prediction module
(mtp.*) is converted as a model of its own (mtp_plan, for --speculative mtp); a checkpoint
whose module is incomplete has it skipped.

Defaults and semantics follow transformers' configuration_qwen3_next.py /
modeling_qwen3_next.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import (
    BIAS,
    DENSE,
    NORM,
    ROUTER,
    VOCAB,
    HFConfig,
    Plan,
    Source,
    Target,
    UnsupportedModel,
    base_config,
    per_expert_names,
    rope_parameters,
)
from colibri.engine.models.rope import rope_config

NAME = "qwen3_next"
HF_CLASSES = ("Qwen3NextForCausalLM",)
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
    num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
    num_experts=512, norm_topk_prob=True, mlp_only_layers=None, layer_types=None,
    full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10000.0,
    bos_token_id=None, eos_token_id=None,
)
_MIXERS = {"linear_attention": "linear", "full_attention": "attention"}
MTP = "mtp."  # where Qwen3-Next and Qwen3.5 checkpoints keep the multi-token-prediction module


def layer_mixer(hf: HFConfig, n_layer: int) -> list[str]:
    """Per layer "linear" or "attention", from layer_types or full_attention_interval."""
    types = hf.get("layer_types")
    if types is None:
        every = hf.pos_int("full_attention_interval")
        types = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer:
        raise UnsupportedModel(f"config.json: layer_types must list {n_layer} layer types, "
                               f"got {types!r}")
    bad = sorted({str(t) for t in types if t not in _MIXERS})
    if bad:
        raise UnsupportedModel(f"config.json: layer_types value {bad[0]!r} is not supported "
                               f"(supported: {', '.join(_MIXERS)})")
    if "full_attention" not in types:
        raise UnsupportedModel("config.json: layer_types has no full_attention layer")
    return [_MIXERS[t] for t in types]


def layer_ffn(hf: HFConfig, n_layer: int) -> list[str]:
    """transformers' rule: a layer is MoE unless listed in mlp_only_layers, when there are
    experts and (i + 1) is a multiple of decoder_sparse_step; else a dense MLP."""
    dense = hf.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise UnsupportedModel(f"config.json: bad mlp_only_layers {dense!r}")
    step, n_expert = hf.pos_int("decoder_sparse_step"), hf.nonneg_int("num_experts")
    return ["moe" if i not in dense and n_expert > 0 and (i + 1) % step == 0 else "dense"
            for i in range(n_layer)]


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    hf = HFConfig(raw, DEFAULTS)
    cfg = base_config(hf, NAME, hf_arch, gen)
    cfg.update(hybrid_config(hf, cfg, layer_ffn(hf, cfg["n_layer"]),
                             bool(hf.get("norm_topk_prob"))))
    return cfg


def hybrid_config(hf: HFConfig, cfg: dict[str, Any], ffn: list[str],
                  norm_topk_prob: bool) -> dict[str, Any]:
    """What Qwen3-Next and Qwen3.5 share past base_config: gated attention with partial
    rotary, the linear-attention layers, softmax routing with a gated shared expert."""
    if hf.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias true is not supported (Qwen3-Next "
                               "checkpoints have none)")
    params = rope_parameters(hf)
    prf = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor")))
    rd = int(cfg["head_dim"] * prf)
    if not 0 < rd <= cfg["head_dim"] or rd % 2:
        raise UnsupportedModel(f"config.json: partial_rotary_factor {prf} gives rotary dims "
                               f"{rd} of head_dim {cfg['head_dim']}")
    n = cfg["n_layer"]
    nk, nv = hf.pos_int("linear_num_key_heads"), hf.pos_int("linear_num_value_heads")
    if nv % nk:
        raise UnsupportedModel(f"config.json: linear_num_value_heads {nv} is not a multiple of "
                               f"linear_num_key_heads {nk}")
    conv = hf.pos_int("linear_conv_kernel_dim")
    if conv < 2:
        raise UnsupportedModel(f"config.json: linear_conv_kernel_dim {conv} must be >= 2")
    moe = "moe" in ffn
    n_expert, n_used = (hf.pos_int("num_experts"), hf.pos_int("num_experts_per_tok")) \
        if moe else (0, 0)
    if n_used > n_expert:
        raise UnsupportedModel(f"config.json: num_experts_per_tok {n_used} exceeds num_experts "
                               f"{n_expert}")
    return dict(
        n_ff=hf.pos_int("moe_intermediate_size") if moe else 0, n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_shared=hf.pos_int("shared_expert_intermediate_size") if moe else 0,
        shared_gate=moe, norm_topk_prob=norm_topk_prob, router="softmax",
        n_ff_dense=hf.pos_int("intermediate_size") if "dense" in ffn else 0, layer_ffn=ffn,
        rotary_dim=rd, rope=rope_config(params, cfg["max_position_embeddings"]),
        qk_norm="head", qkv_bias=False, o_bias=False, clip_qkv=None, sliding_window=None,
        attn_gate=True, layer_mixer=layer_mixer(hf, n), lin_n_k_heads=nk, lin_n_v_heads=nv,
        lin_k_dim=hf.pos_int("linear_key_head_dim"),
        lin_v_dim=hf.pos_int("linear_value_head_dim"), lin_conv=conv,
    )


def _norm(p: str) -> Source:
    """A Qwen3-Next RMSNorm weight, stored as the 1 + weight it multiplies by."""
    return Source(p, transform="plus_one")


def linear_layer(pl: Plan, i: int, p: str, split: bool) -> None:
    """A gated DeltaNet layer's tensors; split: Qwen3.5's in_proj_qkv / _z / _b / _a (else
    Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head)."""
    c = pl.cfg
    D, nk, nv = c["n_embd"], c["lin_n_k_heads"], c["lin_n_v_heads"]
    dk, dv, K = c["lin_k_dim"], c["lin_v_dim"], c["lin_conv"]
    C = 2 * nk * dk + nv * dv
    a, la = f"attention/layer_{i}.bin", p + "linear_attn."
    if split:
        for ours, hf, rows in (("lin_qkv", "qkv", C), ("lin_z", "z", nv * dv),
                               ("lin_b", "b", nv), ("lin_a", "a", nv)):
            pl.add(a, ours, DENSE, (rows, D), Source(f"{la}in_proj_{hf}.weight"))
    else:
        pl.add(a, "lin_qkvz", DENSE, (C + nv * dv, D),
               Source(la + "in_proj_qkvz.weight", transform="qkvz", params=(nk, dk, nv, dv)))
        pl.add(a, "lin_ba", DENSE, (2 * nv, D),
               Source(la + "in_proj_ba.weight", transform="ba", params=(nk, nv)))
    pl.add(a, "lin_conv", BIAS, (C, K),
           Source(la + "conv1d.weight", transform="squeeze1", src_shape=(C, 1, K)))
    pl.add(a, "lin_dt_bias", BIAS, (nv,), Source(la + "dt_bias"))
    pl.add(a, "lin_a_log", BIAS, (nv,), Source(la + "A_log"))
    pl.add(a, "lin_norm", NORM, (dv,), Source(la + "norm.weight"))
    pl.add(a, "lin_out", DENSE, (D, nv * dv), Source(la + "out_proj.weight"))


def gated_attention(pl: Plan, i: int, p: str) -> None:
    c = pl.cfg
    D, H, Hkv, hd = c["n_embd"], c["n_head"], c["n_head_kv"], c["head_dim"]
    a, sa = f"attention/layer_{i}.bin", p + "self_attn."
    pl.add(a, "wq", DENSE, (2 * H * hd, D), Source(sa + "q_proj.weight"))  # query, gate per head
    pl.add(a, "wk", DENSE, (Hkv * hd, D), Source(sa + "k_proj.weight"))
    pl.add(a, "wv", DENSE, (Hkv * hd, D), Source(sa + "v_proj.weight"))
    pl.add(a, "wo", DENSE, (D, H * hd), Source(sa + "o_proj.weight"))
    pl.add(a, "q_norm", NORM, (hd,), _norm(sa + "q_norm.weight"))
    pl.add(a, "k_norm", NORM, (hd,), _norm(sa + "k_norm.weight"))


def ffn(pl: Plan, i: int, p: str, names: set[str]) -> None:
    c = pl.cfg
    D = c["n_embd"]
    post = _norm(p + "post_attention_layernorm.weight")
    if c["layer_ffn"][i] == "dense":
        F, f = c["n_ff_dense"], f"dense/layer_{i}.bin"
        pl.add(f, "ffn_norm", NORM, (D,), post)
        pl.add(f, "w1", DENSE, (F, D), Source(p + "mlp.gate_proj.weight"))
        pl.add(f, "w3", DENSE, (F, D), Source(p + "mlp.up_proj.weight"))
        pl.add(f, "w2", DENSE, (D, F), Source(p + "mlp.down_proj.weight"))
        return
    moe, r = p + "mlp.", f"router/layer_{i}.bin"
    pl.add(r, "ffn_norm", NORM, (D,), post)
    pl.add(r, "gate_inp", ROUTER, (c["n_expert"], D), Source(moe + "gate.weight"))
    pl.add(r, "shared_gate", ROUTER, (1, D), Source(moe + "shared_expert_gate.weight"))
    pl.experts(i, moe, per_expert_names(names, moe))
    pl.shared(i, moe + "shared_expert.")


def mtp_tensor(name: str) -> bool:
    """The multi-token-prediction module's tensors (mtp.*), which decoding does not use, and
    a multimodal checkpoint's vision encoder (model.visual.*), which text does not use."""
    return name.startswith((MTP, "model.visual."))



def mtp_plan(cfg: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], list[Target]] | None:
    """Qwen3-Next's multi-token-prediction module as a one-layer model (hybrid_mtp_plan)."""
    return hybrid_mtp_plan(cfg, names, "model.")


def hybrid_mtp_plan(cfg: dict[str, Any], names: set[str],
                    prefix: str) -> tuple[dict[str, Any], list[Target]] | None:
    """The mtp.* module of a Qwen3-Next-shaped checkpoint as a one-layer model: its config and
    tensor plan, or None when the checkpoint lacks a tensor of it or holds one it does not
    expect (the module is then skipped, and said). prefix: where the main model's embeddings
    are. As vLLM's qwen3_next_mtp runs it: x = fc @ [pre_fc_norm_embedding(embed(next
    token)); pre_fc_norm_hidden(h)] (the embedding first, not zeroed at position 0, unlike
    DeepSeek's), one full-attention decoder layer (mtp.layers.0: gated attention and the MoE
    of the model's layers), mtp.norm and the main model's lm_head; the embeddings are the
    main model's too. Its output after mtp.norm is what a chained draft reads. Only the first
    of several mtp.layers is kept: every chained draft runs it."""
    p = MTP + "layers.0."
    if MTP + "fc.weight" not in names:
        return None
    if p + "mlp.gate.weight" in names:
        kind = "moe"
    elif cfg["n_ff_dense"]:
        kind = "dense"
    else:
        return None
    mcfg = dict(cfg, n_layer=1, layer_ffn=[kind], layer_mixer=["attention"], mtp_input=True,
                mtp_keep_first=True, mtp_chain_normed=True)
    V, D = cfg["n_vocab"], cfg["n_embd"]
    pl = Plan(mcfg)
    emb = "embeddings.bin"
    pl.add(emb, "tok_embd", VOCAB, (V, D), Source(prefix + "embed_tokens.weight"))
    pl.add(emb, "output_norm", NORM, (D,), _norm(MTP + "norm.weight"))
    if not cfg["tie_embeddings"]:
        pl.add(emb, "output", VOCAB, (V, D), Source("lm_head.weight"))
    pl.add(emb, "mtp_enorm", NORM, (D,), _norm(MTP + "pre_fc_norm_embedding.weight"))
    pl.add(emb, "mtp_hnorm", NORM, (D,), _norm(MTP + "pre_fc_norm_hidden.weight"))
    pl.add(emb, "mtp_eh_proj", DENSE, (D, 2 * D), Source(MTP + "fc.weight"))
    pl.add("attention/layer_0.bin", "attn_norm", NORM, (D,), _norm(p + "input_layernorm.weight"))
    gated_attention(pl, 0, p)
    ffn(pl, 0, p, names)
    if any(t.source.hf_name not in names for t in pl.out):
        return None

    def later_layer(name: str) -> bool:
        return name.startswith(MTP + "layers.") and not name.startswith(p)
    try:
        return mcfg, pl.done({n for n in names if n.startswith(MTP)}, cfg["architecture"],
                             skipped=later_layer)
    except UnsupportedModel:
        return None


def plan(cfg: dict[str, Any], names: set[str]) -> list:
    return hybrid_plan(cfg, names, split=False)


def hybrid_plan(cfg: dict[str, Any], names: set[str], split: bool,
                prefix: str = "model.") -> list:
    """The whole plan of a Qwen3-Next-shaped model (split: Qwen3.5's input projections;
    prefix: where the text model's tensors are, model.language_model. in a multimodal
    checkpoint)."""
    pl = Plan(cfg)
    V, D = cfg["n_vocab"], cfg["n_embd"]
    emb = "embeddings.bin"
    pl.add(emb, "tok_embd", VOCAB, (V, D), Source(prefix + "embed_tokens.weight"))
    pl.add(emb, "output_norm", NORM, (D,), _norm(prefix + "norm.weight"))
    if not cfg["tie_embeddings"]:
        pl.add(emb, "output", VOCAB, (V, D), Source("lm_head.weight"))
    for i in range(cfg["n_layer"]):
        p = f"{prefix}layers.{i}."
        pl.add(f"attention/layer_{i}.bin", "attn_norm", NORM, (D,),
               _norm(p + "input_layernorm.weight"))
        if cfg["layer_mixer"][i] == "linear":
            linear_layer(pl, i, p, split)
        else:
            gated_attention(pl, i, p)
        ffn(pl, i, p, names)
    return pl.done(names, cfg["architecture"], skipped=mtp_tensor)
