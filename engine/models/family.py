"""What every architecture family module shares: the tensor plan's vocabulary and the blocks
most families are made of.

A family module (engine/models/<family>.py) turns a Hugging Face config.json into Colibri's
config fields (`config`) and lists where each of our tensors comes from (`plan`). The pieces
here are the common ones: reading config values with the family's defaults, RoPE parameters,
and plans for the embeddings, GQA attention, a dense FFN and a routed-expert block. Nothing
here knows a particular family; refusals name the key that is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# tensor kinds decide the stored type (see engine/format/convert.py)
NORM, BIAS, ROUTER, DENSE, EXPERT, SHARED = "norm", "bias", "router", "dense", "expert", "shared"
VOCAB = "vocab"  # the token embeddings and the lm_head: one row per vocabulary entry
MXFP4 = "mxfp4"  # experts a checkpoint ships in MXFP4: kept in MXFP4 whatever the preset


class UnsupportedModel(ValueError):
    """A config or checkpoint the converter or the forward pass cannot handle."""


@dataclass(frozen=True)
class Source:
    """Where a tensor comes from: hf_name, optionally [index] then rows [row0:row1], then a
    layout change (TRANSFORMS) with its parameters; src_shape is then the checkpoint's shape.
    scales: an MXFP4 tensor's *_scales, hf_name then being its *_blocks (uint8, copied as
    they are: transform "rows" with (start, step) picks every step-th row from start)."""

    hf_name: str
    index: int | None = None
    rows: tuple[int, int] | None = None
    transform: str | None = None
    params: tuple[int, ...] = ()
    src_shape: tuple[int, ...] | None = None
    scales: str | None = None


def _rope_rows(n_rows: int, block: int, offset: int, dr: int) -> np.ndarray:
    """Row order that turns, within each block of rows, the dr rows from offset laid out as
    interleaved rotary pairs (0,1), (2,3), ... into the rotate-half layout (0, 2, 4, ..., 1, 3,
    ...): the product then rotates by the same angles, in the order our RoPE reads."""
    order = np.arange(n_rows)
    pair = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
    for b0 in range(0, n_rows, block):
        order[b0 + offset:b0 + offset + dr] = b0 + offset + pair
    return order


def _kv_b(a: np.ndarray, H: int, dn: int, dv: int, part: str) -> np.ndarray:
    """DeepSeek's kv_b_proj [H*(dn+dv), kl] split per head: "k" gives each head's key
    up-projection transposed, stacked [H*kl, dn]; "v" its value up-projection [H*dv, kl]."""
    heads = a.reshape(H, dn + dv, a.shape[1])
    if part == "k":
        return np.ascontiguousarray(heads[:, :dn, :].transpose(0, 2, 1)).reshape(-1, dn)
    return np.ascontiguousarray(heads[:, dn:, :]).reshape(-1, a.shape[1])


def cols(src: Source) -> slice:
    """The columns a "cols" / "cols_t" source takes: params (start, step[, stop])."""
    p = src.params
    return slice(p[0], p[2] if len(p) > 2 else None, p[1])


def _grouped_rows(nk: int, widths: tuple[int, ...]) -> np.ndarray:
    """Row order that turns nk groups of rows, each holding parts of the given widths in
    turn, into the parts one after another (part 0 of every group, then part 1, ...): Qwen3-
    Next's in_proj_qkvz / in_proj_ba, grouped by key head, into q, k, v, z / b, a."""
    step = sum(widths)
    starts = np.cumsum((0,) + widths[:-1])
    return np.concatenate([np.arange(g * step + s0, g * step + s0 + w)
                           for s0, w in zip(starts, widths, strict=True) for g in range(nk)])


def _group_order(src: Source) -> np.ndarray:
    if src.transform == "qkvz":  # (nk, dk, nv, dv): per key head q, k, then r heads of v, z
        nk, dk, nv, dv = src.params
        return _grouped_rows(nk, (dk, dk, nv // nk * dv, nv // nk * dv))
    nk, nv = src.params  # "ba": per key head r values of b, then r of a
    return _grouped_rows(nk, (nv // nk, nv // nk))


def transform(a: np.ndarray, src: Source) -> np.ndarray:
    """The checkpoint array a laid out as our tensor (src.transform: None, "rope_rows" with
    (block, offset, dr), "kv_b_k" / "kv_b_v" with (H, dn, dv), "t" (transposed), "cols" /
    "cols_t" with (start, step[, stop]): every step-th column from start, up to stop (then
    transposed); "plus_one": 1 + a in float32, for the norms that multiply by (1 + weight);
    "qkvz" with (nk, dk, nv, dv) / "ba" with (nk, nv): rows grouped by key head regrouped by
    part; "squeeze1": a [C, 1, K] depthwise conv weight as [C, K])."""
    if src.transform is None:
        return a
    if src.transform == "plus_one":
        return np.float32(1.0) + a.astype(np.float32)
    if src.transform in ("qkvz", "ba"):
        return np.ascontiguousarray(a[_group_order(src)])
    if src.transform == "squeeze1":
        return np.ascontiguousarray(a[:, 0, :])
    if src.transform == "t":
        return np.ascontiguousarray(a.T)
    if src.transform == "cols":
        return np.ascontiguousarray(a[..., cols(src)])
    if src.transform == "cols_t":
        return np.ascontiguousarray(a[:, cols(src)].T)
    if src.transform == "rope_rows":
        return a[_rope_rows(a.shape[0], *src.params)]
    if src.transform in ("kv_b_k", "kv_b_v"):
        return _kv_b(a, *src.params, part=src.transform[-1])
    raise ValueError(f"unknown tensor transform {src.transform!r}")


def untransform(a: np.ndarray, src: Source) -> np.ndarray:
    """transform's inverse: our tensor back in the checkpoint's layout (tests compare against
    transformers run on weights quantized in our layout); for kv_b_k / kv_b_v, that part's
    rows per head [H, dn or dv, kl], which concatenate into kv_b_proj; for cols / cols_t,
    the columns cols(src) of the checkpoint's array."""
    if src.transform is None or src.transform == "cols":
        return a
    if src.transform == "plus_one":
        return a.astype(np.float32) - np.float32(1.0)
    if src.transform in ("qkvz", "ba"):
        out = np.empty_like(a)
        out[_group_order(src)] = a
        return out
    if src.transform == "squeeze1":
        return np.ascontiguousarray(a[:, None, :])
    if src.transform in ("t", "cols_t"):
        return np.ascontiguousarray(a.T)
    if src.transform == "rope_rows":
        out = np.empty_like(a)
        out[_rope_rows(a.shape[0], *src.params)] = a
        return out
    H, dn, dv = src.params
    if src.transform == "kv_b_k":  # [H*kl, dn] -> the key rows of [H*(dn+dv), kl]
        kl = a.shape[0] // H
        return np.ascontiguousarray(a.reshape(H, kl, dn).transpose(0, 2, 1))
    if src.transform == "kv_b_v":
        return a.reshape(H, dv, -1)
    raise ValueError(f"unknown tensor transform {src.transform!r}")


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


class HFConfig:
    """A Hugging Face config.json read with a family's defaults (transformers' class
    defaults for keys a config.json may leave out)."""

    def __init__(self, raw: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.raw = raw
        self.defaults = defaults

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str) -> Any:
        return self.raw[key] if key in self.raw else self.defaults.get(key)

    def pos_int(self, key: str) -> int:
        v = self.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UnsupportedModel(f"config.json: {key} must be a positive integer, got {v!r}")
        return v

    def nonneg_int(self, key: str) -> int:
        v = self.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UnsupportedModel(f"config.json: {key} must be an integer >= 0, got {v!r}")
        return v

    def number(self, key: str) -> float:
        v = self.get(key)
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise UnsupportedModel(f"config.json: {key} must be a number, got {v!r}")
        return float(v)

    def first(self, *keys: str) -> str:
        """The first of keys the config.json holds (transformers' attribute_map aliases), else
        the last one, whose default then applies."""
        return next((k for k in keys if k in self.raw), keys[-1])


def token_ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    raise UnsupportedModel(f"bad token id {v!r}")


def rope_parameters(hf: HFConfig) -> dict[str, Any]:
    """transformers 5's rope_parameters, or an older config's rope_theta + rope_scaling."""
    params = hf.raw.get("rope_scaling") or hf.raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise UnsupportedModel(f"config.json: bad rope parameters {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("config.json: per-layer-type rope parameters are not supported")
    return params


def rope_theta(hf: HFConfig, params: dict[str, Any]) -> float:
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise UnsupportedModel(f"config.json: bad rope_theta {theta!r}")
    return float(theta)


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def check_silu(hf: HFConfig) -> None:
    act = hf.raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config.json: hidden_act {act!r} is not supported (only silu)")


def base_config(hf: HFConfig, family: str, hf_arch: str,
                gen: dict[str, Any] | None) -> dict[str, Any]:
    """The fields every family fills the same way: dimensions, norms, tokens, plain RoPE
    (a family with another rope type or partial rotary replaces rope fields after this)."""
    check_silu(hf)
    n_embd = hf.pos_int("hidden_size")
    n_head = hf.pos_int("num_attention_heads")
    n_head_kv = hf.get("num_key_value_heads") or n_head
    head_dim = hf.get("head_dim") or n_embd // n_head
    if n_head % n_head_kv:
        raise UnsupportedModel(
            f"config.json: {n_head} heads is not a multiple of {n_head_kv} kv heads"
        )
    if head_dim % 2:
        raise UnsupportedModel(f"config.json: odd head_dim {head_dim}")
    gen = gen or {}
    eos = token_ids(gen.get("eos_token_id")) + token_ids(hf.get("eos_token_id"))
    bos = gen["bos_token_id"] if "bos_token_id" in gen else hf.get("bos_token_id")
    params = rope_parameters(hf)
    return {
        "format": "colibri", "format_version": 2,
        "architecture": family, "hf_architecture": hf_arch,
        "n_vocab": hf.pos_int("vocab_size"), "n_embd": n_embd,
        "n_layer": hf.pos_int("num_hidden_layers"),
        "n_head": n_head, "n_head_kv": n_head_kv, "head_dim": head_dim,
        "rope_theta": rope_theta(hf, params), "rotary_dim": head_dim,
        "rms_eps": hf.number("rms_norm_eps"),
        "tie_embeddings": bool(hf.get("tie_word_embeddings")),
        "max_position_embeddings": hf.pos_int("max_position_embeddings"),
        "bos_token_id": token_ids(bos)[0] if token_ids(bos) else None,
        "eos_token_ids": list(dict.fromkeys(eos)),
    }


def no_experts() -> dict[str, Any]:
    """The expert fields of a model whose layers are all dense."""
    return {"n_ff": 0, "n_expert": 0, "n_expert_used": 0, "n_ff_shared": 0,
            "shared_gate": False, "norm_topk_prob": True}


class Plan:
    """The list of our tensors under construction, with the common blocks."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out: list[Target] = []

    def add(self, file: str, name: str, kind: str, shape: tuple[int, ...], src: Source) -> None:
        self.out.append(Target(file, name, kind, shape, src))

    def embeddings(self, prefix: str = "model.", head: str = "lm_head.weight") -> None:
        c = self.cfg
        V, D = c["n_vocab"], c["n_embd"]
        emb = "embeddings.bin"
        self.add(emb, "tok_embd", VOCAB, (V, D), Source(prefix + "embed_tokens.weight"))
        self.add(emb, "output_norm", NORM, (D,), Source(prefix + "norm.weight"))
        if not c["tie_embeddings"]:
            self.add(emb, "output", VOCAB, (V, D), Source(head))

    def attention(self, i: int, p: str) -> None:
        """GQA attention of layer i (p: its HF prefix): norm, q/k/v/o, biases, q/k norms."""
        c = self.cfg
        D, H, Hkv, hd = c["n_embd"], c["n_head"], c["n_head_kv"], c["head_dim"]
        a = f"attention/layer_{i}.bin"
        self.add(a, "attn_norm", NORM, (D,), Source(p + "input_layernorm.weight"))
        proj = (("q", "q_proj", H * hd), ("k", "k_proj", Hkv * hd), ("v", "v_proj", Hkv * hd))
        for ours, hf, rows in proj:
            self.add(a, "w" + ours, DENSE, (rows, D), Source(f"{p}self_attn.{hf}.weight"))
        self.add(a, "wo", DENSE, (D, H * hd), Source(p + "self_attn.o_proj.weight"))
        if c["qkv_bias"]:
            for ours, hf, rows in proj:
                self.add(a, "b" + ours, BIAS, (rows,), Source(f"{p}self_attn.{hf}.bias"))
        if c.get("o_bias"):
            self.add(a, "bo", BIAS, (D,), Source(p + "self_attn.o_proj.bias"))
        if c["qk_norm"] != "none":
            full = c["qk_norm"] == "full"
            self.add(a, "q_norm", NORM, (H * hd,) if full else (hd,),
                     Source(p + "self_attn.q_norm.weight"))
            self.add(a, "k_norm", NORM, (Hkv * hd,) if full else (hd,),
                     Source(p + "self_attn.k_norm.weight"))

    def dense_ffn(self, i: int, p: str, mlp: str = "mlp.") -> None:
        """A dense layer's FFN (gate/up/down) and its norm, into dense/layer_i.bin."""
        D, F = self.cfg["n_embd"], self.cfg["n_ff_dense"]
        f = f"dense/layer_{i}.bin"
        self.add(f, "ffn_norm", NORM, (D,), Source(p + "post_attention_layernorm.weight"))
        self.add(f, "w1", DENSE, (F, D), Source(f"{p}{mlp}gate_proj.weight"))
        self.add(f, "w3", DENSE, (F, D), Source(f"{p}{mlp}up_proj.weight"))
        self.add(f, "w2", DENSE, (D, F), Source(f"{p}{mlp}down_proj.weight"))

    def router(self, i: int, p: str, moe: str, gate_bias: str | None = None,
               shared_gate: str | None = None) -> None:
        """The FFN norm and router of MoE layer i (moe: the HF prefix of its MoE block)."""
        D, E = self.cfg["n_embd"], self.cfg["n_expert"]
        r = f"router/layer_{i}.bin"
        self.add(r, "ffn_norm", NORM, (D,), Source(p + "post_attention_layernorm.weight"))
        self.add(r, "gate_inp", ROUTER, (E, D), Source(moe + "gate.weight"))
        if gate_bias:
            self.add(r, "gate_bias", ROUTER, (E,), Source(moe + gate_bias))
        if shared_gate:
            self.add(r, "shared_gate", ROUTER, (1, D), Source(moe + shared_gate))

    def experts(self, i: int, moe: str,
                per_expert: Callable[[int], list[Source]] | None) -> None:
        """Routed experts of layer i: per-expert HF tensors (per_expert(j) -> [w1, w3, w2]) or
        transformers 5's fused gate_up_proj [E, 2F, D] (gate rows first) / down_proj [E, D, F]."""
        D, F = self.cfg["n_embd"], self.cfg["n_ff"]
        for j in range(self.cfg["n_expert"]):
            e = f"experts/layer_{i}_expert_{j}.bin"
            if per_expert is not None:
                s1, s3, s2 = per_expert(j)
            else:
                s1 = Source(moe + "experts.gate_up_proj", j, (0, F))
                s3 = Source(moe + "experts.gate_up_proj", j, (F, 2 * F))
                s2 = Source(moe + "experts.down_proj", j)
            self.add(e, "w1", EXPERT, (F, D), s1)
            self.add(e, "w3", EXPERT, (F, D), s3)
            self.add(e, "w2", EXPERT, (D, F), s2)

    def shared(self, i: int, prefix: str) -> None:
        """Shared expert(s) of layer i, one FFN of width n_ff_shared (prefix: its HF prefix)."""
        D, Fs = self.cfg["n_embd"], self.cfg["n_ff_shared"]
        s = f"shared/layer_{i}.bin"
        self.add(s, "w1", SHARED, (Fs, D), Source(prefix + "gate_proj.weight"))
        self.add(s, "w3", SHARED, (Fs, D), Source(prefix + "up_proj.weight"))
        self.add(s, "w2", SHARED, (D, Fs), Source(prefix + "down_proj.weight"))

    def done(self, names: set[str], family: str,
             skipped: Callable[[str], bool] | None = None) -> list[Target]:
        """The plan, after checking that the checkpoint holds no tensor it leaves unused
        (skipped(name): tensors the family drops on purpose, such as MTP layers)."""
        used = {t.source.hf_name for t in self.out} | {t.source.scales for t in self.out
                                                         if t.source.scales}
        ignorable = {"lm_head.weight"} if self.cfg["tie_embeddings"] else set()
        extra = sorted(n for n in names - used - ignorable
                       if not n.endswith("rotary_emb.inv_freq")
                       and not (skipped and skipped(n)))
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise UnsupportedModel(
                f"checkpoint has tensors the {family} layout does not use: "
                f"{', '.join(extra[:5])}{more}"
            )
        return self.out


def build_plan(cfg: dict[str, Any], names: set[str],
               ffn: Callable[[Plan, int, str], None],
               attention: Callable[[Plan, int, str], None] | None = None,
               skipped: Callable[[str], bool] | None = None) -> list[Target]:
    """A family's whole plan: the embeddings, then per layer i (HF prefix p) its attention
    (GQA unless given) and ffn(plan, i, p); checked with Plan.done."""
    pl = Plan(cfg)
    pl.embeddings()
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        (attention or Plan.attention)(pl, i, p)
        ffn(pl, i, p)
    return pl.done(names, cfg["architecture"], skipped)


def routed_ffn(names: set[str]) -> Callable[[Plan, int, str], None]:
    """The FFN of a softmax-routed family without shared experts: router and experts under
    `mlp.`."""
    def ffn(pl: Plan, i: int, p: str) -> None:
        pl.router(i, p, p + "mlp.")
        pl.experts(i, p + "mlp.", per_expert_names(names, p + "mlp."))
    return ffn


def per_expert_names(names: set[str], moe: str) -> Callable[[int], list[Source]] | None:
    """Per-expert sources [w1, w3, w2] under the MoE prefix moe when the checkpoint has the
    legacy per-expert layout (gate_proj/up_proj/down_proj), else None (fused)."""
    if f"{moe}experts.0.gate_proj.weight" in names:
        return lambda j: [Source(f"{moe}experts.{j}.{w}_proj.weight")
                          for w in ("gate", "up", "down")]
    return None


def fused_shape(cfg: dict[str, Any], hf_name: str) -> tuple[int, ...] | None:
    """The expected full shape of a fused expert tensor, or None for other tensors."""
    E, D, F = cfg["n_expert"], cfg["n_embd"], cfg["n_ff"]
    if hf_name.endswith("experts.gate_up_proj"):
        return (E, 2 * F, D)
    if hf_name.endswith("experts.down_proj"):
        return (E, D, F)
    return None
