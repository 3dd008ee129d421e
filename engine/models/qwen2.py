"""Dense Qwen2 and Qwen3 (Qwen2ForCausalLM, Qwen3ForCausalLM): GQA attention, with q/k/v
biases (Qwen2) or per-head q/k RMSNorm (Qwen3), a SiLU-gated FFN in every layer; the sliding
window only when every layer uses it.

Defaults and semantics follow transformers' configuration_qwen2.py / modeling_qwen2.py and
configuration_qwen3.py / modeling_qwen3.py.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.models.family import HFConfig, UnsupportedModel
from colibri.engine.models.llama import dense_config
from colibri.engine.models.llama import plan as plan
from colibri.engine.models.qwen2_moe import qwen_window

NAME = "qwen2"
HF_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
    sliding_window=4096, max_window_layers=28, bos_token_id=None, eos_token_id=None,
    rope_theta=10000.0,
)
QWEN3_DEFAULTS: dict[str, Any] = dict(DEFAULTS, head_dim=128, attention_bias=False)


def config(raw: dict[str, Any], hf_arch: str, gen: dict[str, Any] | None) -> dict[str, Any]:
    qwen3 = hf_arch == "Qwen3ForCausalLM"
    hf = HFConfig(raw, QWEN3_DEFAULTS if qwen3 else DEFAULTS)
    if qwen3 and hf.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias (with an o_proj bias) is not supported")
    cfg = dense_config(hf, NAME, hf_arch, gen)
    types = raw.get("layer_types")
    if types is None and hf.get("use_sliding_window"):
        mwl = hf.get("max_window_layers")
        types = ["sliding_attention" if i >= mwl else "full_attention"
                 for i in range(cfg["n_layer"])]
    cfg.update(qkv_bias=not qwen3, qk_norm="head" if qwen3 else "none",
               sliding_window=qwen_window(hf, types))
    return cfg

