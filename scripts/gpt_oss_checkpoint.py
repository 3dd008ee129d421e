"""A random gpt-oss checkpoint whose experts are MXFP4, stored as the released ones store them.

Written tensor by tensor, one safetensors shard per layer (with model.safetensors.index.json),
so a gpt-oss-20b-sized model (hidden 2880, 32 experts of width 2880, 24 layers: about 11 GB)
never has to exist in memory as floats: the experts are drawn directly as MXFP4 blocks (random
e2m1 nibbles, one e8m0 exponent per block of 32) in the checkpoints' layout, `*_blocks`
[E, rows, in / 32, 16] and `*_scales` [E, rows, in / 32] with rows the output features (gate
and up rows alternating in gate_up_proj), and the config carries quantization_config
{"quant_method": "mxfp4"}: what transformers, llama.cpp's convert_hf_to_gguf.py and
`colibri convert` read as MXFP4. Other matrices are f16 N(0, 1 / fan_in), embeddings N(0, 1),
norms 1, biases and attention sinks 0. Used by scripts/compare_llamacpp.py --arch gpt_oss; the
tokenizer is the caller's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QK = 32  # values per MXFP4 block
# root mean square of a uniformly random e2m1 nibble: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)


@dataclass(frozen=True)
class GptOssShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 128
    bos_id: int = 1
    eos_id: int = 2


def expert_exponent(fan_in: int) -> int:
    """The e8m0 exponent e whose scale 2^(e - 127) gives random nibbles a root mean square near
    1 / sqrt(fan_in), like the other matrices (activations keep their size through layers)."""
    return 127 + round(math.log2(fan_in ** -0.5 / E2M1_RMS))


def random_mxfp4(rng: np.random.Generator, lead: tuple[int, ...], n_in: int,
                 e: int) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 rows of n_in values: blocks [*lead, n_in / 32, 16] (uint8, two nibbles
    each) and scales [*lead, n_in / 32] (uint8 exponents e - 1, e, e + 1 at random)."""
    if n_in % QK:
        raise ValueError(f"MXFP4 rows need a multiple of {QK} values, got {n_in}")
    nb = n_in // QK
    blocks = rng.integers(0, 256, (*lead, nb, QK // 2), dtype=np.uint8)
    scales = (e - 1 + rng.integers(0, 3, (*lead, nb), dtype=np.uint8)).astype(np.uint8)
    return blocks, scales


def config(s: GptOssShape) -> dict[str, Any]:
    """config.json: transformers' GptOssConfig for the shape, sliding and full attention
    layers alternating (sliding first), with the MXFP4 quantization_config."""
    import transformers as tf

    cfg = tf.GptOssConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim, num_local_experts=s.experts, num_experts_per_tok=s.top_k,
        sliding_window=s.window, max_position_embeddings=131072, tie_word_embeddings=False,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(s.layers)],
        bos_token_id=s.bos_id, eos_token_id=s.eos_id, pad_token_id=None)
    raw = cfg.to_dict()
    raw["architectures"] = ["GptOssForCausalLM"]
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    return raw


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float16)


def layer_tensors(rng: np.random.Generator, s: GptOssShape, i: int) -> dict[str, np.ndarray]:
    """Layer i's tensors under their checkpoint names."""
    D, F, E, hd = s.hidden, s.intermediate, s.experts, s.head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    p = f"model.layers.{i}."
    t: dict[str, np.ndarray] = {
        p + "input_layernorm.weight": np.ones(D, np.float16),
        p + "post_attention_layernorm.weight": np.ones(D, np.float16),
        p + "self_attn.q_proj.weight": _normal(rng, (q, D), D ** -0.5),
        p + "self_attn.k_proj.weight": _normal(rng, (kv, D), D ** -0.5),
        p + "self_attn.v_proj.weight": _normal(rng, (kv, D), D ** -0.5),
        p + "self_attn.o_proj.weight": _normal(rng, (D, q), q ** -0.5),
        p + "self_attn.q_proj.bias": np.zeros(q, np.float16),
        p + "self_attn.k_proj.bias": np.zeros(kv, np.float16),
        p + "self_attn.v_proj.bias": np.zeros(kv, np.float16),
        p + "self_attn.o_proj.bias": np.zeros(D, np.float16),
        p + "self_attn.sinks": np.zeros(s.heads, np.float16),
        p + "mlp.router.weight": _normal(rng, (E, D), D ** -0.5),
        p + "mlp.router.bias": np.zeros(E, np.float16),
        p + "mlp.experts.gate_up_proj_bias": np.zeros((E, 2 * F), np.float16),
        p + "mlp.experts.down_proj_bias": np.zeros((E, D), np.float16),
    }
    for name, rows, n_in in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
        blocks, scales = random_mxfp4(rng, (E, rows), n_in, expert_exponent(n_in))
        t[p + f"mlp.experts.{name}_blocks"] = blocks
        t[p + f"mlp.experts.{name}_scales"] = scales
    return t


def write_checkpoint(out: Path, s: GptOssShape, seed: int) -> Path:
    """config.json, one shard per layer plus one for the embeddings, final norm and lm_head,
    and the index; the tokenizer files are left to the caller."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config(s), indent=2) + "\n")
    rng = np.random.default_rng(seed)
    n_files = s.layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(n_files):
        name = f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"
        if k < s.layers:
            tensors = layer_tensors(rng, s, k)
        else:
            tensors = {
                "model.embed_tokens.weight": _normal(rng, (s.vocab, s.hidden), 1.0),
                "model.norm.weight": np.ones(s.hidden, np.float16),
                "lm_head.weight": _normal(rng, (s.vocab, s.hidden), s.hidden ** -0.5),
            }
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for t_name, arr in tensors.items():
            weight_map[t_name] = name
            total += arr.nbytes
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=2) + "\n")
    return out
