"""Tiny random Hugging Face checkpoints for tests (a helper module, not a test file).

`make_checkpoint` builds a real transformers model of one of the architectures in ALL_ARCHS
with small dimensions, re-initialises every weight with a seeded generator
(norm weights and biases too, so a norm or bias bug changes the output), trains a real
byte-level BPE tokenizer of exactly the model's vocabulary size, and saves it all with
`save_pretrained`. Deterministic for a seed; needs torch and transformers (test extras).
`TinyCheckpoints` (the session's `checkpoints` fixture in tests/conftest.py) makes each
(architecture, seed, overrides) once per session, with its conversions and its transformers
model, for every test file that reads it, and each derived checkpoint (a folder a test's
builder writes, such as a model with an MTP layer) once too.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# families added since, on the same helper: dense models and grouped-router MoE
DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
GROUPED_ARCHS = ("glm4_moe", "deepseek_v3", "deepseek_v2")
# attention sinks, sliding-window layers, biased experts with the clamped SwiGLU
SINK_ARCHS = ("gpt_oss",)
# q/k norms over the whole projection, partial rotary, sigmoid routing with a selection bias
MINIMAX_ARCHS = ("minimax_m2",)
# gated DeltaNet linear-attention layers between gated full-attention ones
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe")
# chunked and NoPE layers, dense and MoE layers, experts fed inputs scaled by the router
CHUNKED_ARCHS = ("llama4",)
ALL_ARCHS = (ARCHS + DENSE_ARCHS + GROUPED_ARCHS + SINK_ARCHS + MINIMAX_ARCHS
             + HYBRID_ARCHS + CHUNKED_ARCHS)

VOCAB_SIZE = 320
EOS_ID = 2  # <|im_end|> in engine.text.bpe.SPECIAL_TOKENS
PAD_ID = 0  # <|endoftext|>

_TEXT = """\
The quick brown fox jumps over the lazy dog. A small bird sings in the morning light,
and the river runs softly past the old stone mill. Children walk to school along the road,
talking about numbers, letters, colours and the names of the stars they saw last night.
Once upon a time there was a little hummingbird who lived in a garden full of red flowers.
Every day she visited the flowers, drank their sweet nectar and told stories to the bees.
The weather today is sunny with a light breeze from the west; tomorrow it may rain.
Mixture of experts models route each token to a few experts chosen by a small router.
Hello! How are you? I am fine, thank you. What is your name? My name is Colibri.
One, two, three, four, five, six, seven, eight, nine, ten. 1 2 3 4 5 6 7 8 9 10 100 2024.
Question: what is the capital of France? Answer: the capital of France is Paris.
The teacher wrote a long sentence on the blackboard, and the students copied it carefully.
Water boils at one hundred degrees and freezes at zero degrees on the Celsius scale.
"""

_BASE: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    ),
    "qwen2_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, qkv_bias=True,
        use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
        decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "olmoe": dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, clip_qkv=None,
    ),
    # head dims unlike hidden / heads, biases and norms on, so a wrong shape or a missing
    # tensor shows in the logits
    "llama": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-5,
        attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    ),
    "mistral": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        sliding_window=8, rope_theta=1e6,
    ),
    "qwen2": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, use_sliding_window=False,
    ),
    "qwen3": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=1e6, use_sliding_window=False,
    ),
    # two dense layers, then grouped routing with n_group > 1, two shared experts, q/k norms,
    # q/k/v biases and half the head rotated
    "glm4_moe": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True, max_position_embeddings=256, rms_norm_eps=1e-5,
        partial_rotary_factor=0.5, rope_theta=10000.0, num_nextn_predict_layers=1,
    ),
    # MLA with every width different: q_lora 96, kv_lora 64, 32 plain + 16 rotary query dims,
    # values of 24; YaRN with mscale; two dense layers, grouped routing, two shared experts
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    ),
    # DeepSeek-V2-Lite's shape: no q_lora, softmax routing (here group-limited), one dense layer
    "deepseek_v2": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, topk_method="group_limited_greedy",
        n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=1.5,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    # sliding (window 8, shorter than the test prompts), full, sliding; head_dim 24 != 64 / 4;
    # YaRN that changes the angles from position 16 on; swiglu_limit 1.5, low enough that the
    # clamp cuts gate and up values on both sides
    "gpt_oss": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=256, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=1.5, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False},
    ),
    # head_dim 24 != 64 / 4, the released checkpoints' legacy rotary_dim (10 of 24 rotated:
    # neither half nor all), three layers of 8 experts top-2
    "minimax_m2": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, num_local_experts=8, num_experts_per_tok=2,
        rotary_dim=10, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    # linear, full, linear (dense FFN), linear: two key heads of 16 serving four value heads
    # of 24 (so a transposed state or a wrong head map shows), conv width 4 (shorter than the
    # prompts), head_dim 24 != 64 / 4 with half of it rotary. rms_norm_eps 1e-3 (which an
    # ignored eps would show more than 1e-6): the gated norm scales each head's output to unit
    # size, so where a random query is nearly orthogonal to the keys a tiny eps lets q8
    # rounding flip that head's whole output
    "qwen3_next": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-3,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4, mlp_only_layers=[2],
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
    ),
    # Qwen3.5's text model: the same mix with four input projections per linear layer and
    # experts on every layer; its multi-axis RoPE sections on (plain RoPE for text)
    "qwen3_5_moe": dict(
        hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-3,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention",
                     "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [2, 2, 2],
                         "mrope_interleaved": True},
    ),
    # layers: chunked RoPE + dense, global NoPE + MoE, chunked RoPE + MoE, global NoPE + dense
    # (moe_layers given, so the two mixes cross); chunks of 8 positions, shorter than the test
    # prompts; floor_scale 4, so query temperatures change from position 3 on; llama3 rope
    # scaling with Llama 4 Scout's equal low and high frequency factors; q/k L2 norm and
    # attention biases on; expert and dense widths differ
    "llama4": dict(
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_local_experts=6,
        num_experts_per_tok=1, moe_layers=[1, 2], no_rope_layers=[1, 0, 1, 0],
        attention_chunk_size=8, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        use_qk_norm=True, attention_bias=True, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 16},
    ),
}


def _classes(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    table = {
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "minimax_m2": (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
        "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM),
    }
    if arch not in table:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ALL_ARCHS}")
    return table[arch]


def _randomize(model: Any, seed: int) -> None:
    """Re-initialise every parameter so that each one matters to the output."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            if name.endswith("norm.weight") or "layernorm" in name or name.endswith("_norm.weight"):
                # around 1 but clearly not 1: a missing or misplaced norm weight shows; a norm
                # the model initialised to zeros multiplies by (1 + weight) (Qwen3-Next): its
                # weight goes around 0, so the norm still scales by about 1
                base = 0.0 if not bool(p.any()) else 1.0
                val = base + 0.3 * torch.randn(shape, generator=g)
            elif name.endswith(".bias"):
                val = 0.2 * torch.randn(shape, generator=g)
            elif "embed_tokens" in name:
                val = torch.randn(shape, generator=g)
            elif ((name.endswith("gate.weight") and "proj" not in name)
                  or name.endswith("router.weight")):
                # router and shared-expert gate: large enough for decisive routing
                val = 2.0 * torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            else:
                val = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            p.copy_(val.to(p.dtype))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                # the grouped router's selection bias: large enough to change choices
                b.copy_((0.1 * torch.randn(tuple(b.shape), generator=g)).to(b.dtype))


def make_checkpoint(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    shards: int = 1,
    fused: bool = False,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint (safetensors + tokenizer) to out_dir.

    dtype: "float32", "bfloat16" or "float16" for the saved weights. shards > 1 splits the
    weights over several files with a model.safetensors.index.json. fused=True saves the
    transformers 5 fused expert tensors (experts.gate_up_proj / experts.down_proj) instead
    of the legacy per-expert names that save_pretrained writes by default. overrides go to
    the transformers config (e.g. tie_word_embeddings=True, sliding_window=8).
    """
    import torch

    from colibri.engine.text.bpe import train_bpe_tokenizer

    config_cls, model_cls = _classes(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    kwargs = dict(_BASE[arch])
    kwargs.update(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  bos_token_id=None, tie_word_embeddings=False)
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomize(model, seed)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16}[dtype]
    model = model.to(torch_dtype)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = PAD_ID

    save_kwargs: dict[str, Any] = {"save_original_format": not fused}
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(1, math.ceil(total / shards))
    model.save_pretrained(str(out), **save_kwargs)

    tok = train_bpe_tokenizer([_TEXT] * 4, VOCAB_SIZE, out)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n")
    return out


class TinyCheckpoint:
    """One tiny checkpoint in a folder of its own, its conversions and its transformers model,
    each made on first use. Shared: a test reads them and writes what it derives elsewhere."""

    def __init__(self, root: Path, arch: str, seed: int, overrides: dict[str, Any]) -> None:
        self.arch = arch
        self.root = root
        self.hf_dir = make_checkpoint(arch, root / "hf", seed=seed, **overrides)
        self._converted: dict[str, Path] = {}
        self._hf: Any = None

    def converted(self, preset: str) -> Path:
        """The checkpoint converted with a quantization preset ("f32", "q8", "q4", ...)."""
        if preset not in self._converted:
            from colibri.engine.format.convert import convert

            self._converted[preset] = convert(self.hf_dir, self.root / preset, quant=preset,
                                              progress=False)
        return self._converted[preset]

    @property
    def hf(self) -> Any:
        """The checkpoint in transformers (float32, eager attention), loaded once."""
        if self._hf is None:
            from tests.parity_helpers import hf_model

            self._hf = hf_model(self.hf_dir)
        return self._hf


class TinyCheckpoints:
    """Tiny checkpoints under one folder, one per (architecture, seed, config overrides):
    building and converting a checkpoint takes seconds, and many test files want the same."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[str, TinyCheckpoint] = {}
        self._derived: dict[str, Path] = {}

    def get(self, arch: str, seed: int = 0, **overrides: Any) -> TinyCheckpoint:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in self._made:
            name = f"{arch}-{seed}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
            self._made[key] = TinyCheckpoint(self.root / name, arch, seed, overrides)
        return self._made[key]

    def folders(self, seed: int) -> dict[str, Path]:
        """Architecture -> the Hugging Face folder of get(arch, seed), made on first lookup."""
        return _Folders(self, seed)

    def derived(self, name: str, build: Callable[[Path], Path]) -> Path:
        """The checkpoint build(folder) writes into a new folder (one that no architecture,
        seed and overrides describe, such as a model with an extra layer), made once per
        session under name."""
        if name not in self._derived:
            self._derived[name] = build(self.root / "derived" / name)
        return self._derived[name]


class _Folders(dict[str, Path]):
    """TinyCheckpoints.folders: a dict that makes a missing architecture's checkpoint."""

    def __init__(self, checkpoints: TinyCheckpoints, seed: int) -> None:
        super().__init__()
        self.checkpoints = checkpoints
        self.seed = seed

    def __missing__(self, arch: str) -> Path:
        self[arch] = self.checkpoints.get(arch, seed=self.seed).hf_dir
        return self[arch]


def make_scripted_checkpoint(out_dir: str | Path, chat_template: str, prompt_tail: str,
                             reply: str) -> Path:
    """A tiny dense checkpoint whose greedy reply, after any prompt that ends with
    prompt_tail (text the template writes between its last special token and the reply), is
    exactly `reply` followed by end-of-sequence; its tokenizer carries chat_template.

    Real weights, rigged: attention and MLP outputs are zero, so each position's logits
    depend on its own token only; the reply's tokens (all distinct, as is the prompt's last
    token) get orthonormal embeddings, and lm_head maps each one to the next. Any other
    token leads somewhere into the chain, so the reply after another prompt is not `reply`.
    """
    import torch

    from colibri.engine.text.bpe import train_bpe_tokenizer

    out = Path(out_dir)
    tok = train_bpe_tokenizer([_TEXT] * 4, VOCAB_SIZE, out)
    start = tok.encode(prompt_tail).ids[-1]
    chain = [start, *tok.encode(reply).ids, EOS_ID]
    if len(set(chain)) != len(chain) or tok.decode(chain[1:-1]) != reply:
        raise ValueError(f"reply tokens must be distinct and decode back: {chain}")
    config_cls, model_cls = _classes("qwen2")
    kwargs = dict(_BASE["qwen2"])
    kwargs.update(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                  bos_token_id=None, tie_word_embeddings=False)
    hidden = int(kwargs["hidden_size"])
    if len(chain) > hidden:
        raise ValueError(f"a reply of at most {hidden - 2} tokens")
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    _randomize(model, 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".o_proj." in name or ".down_proj." in name:
                p.zero_()  # no layer adds anything to the residual: logits see the token
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for i, (cur, nxt) in enumerate(zip(chain, chain[1:], strict=False)):
            emb[cur].zero_()
            emb[cur, i] = 1.0
            head[nxt, i] = 10.0
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n")
    return out


def retokenize_with_specials(out_dir: str | Path, specials: list[str]) -> Path:
    """Replace a tiny checkpoint's tokenizer by one of the same size whose last ids are the
    given special tokens (as real vocabularies mark their tool-call markers special)."""
    from tokenizers import AddedToken, Tokenizer

    from colibri.engine.text.bpe import train_bpe_tokenizer

    out = Path(out_dir)
    template = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    train_bpe_tokenizer([_TEXT] * 4, VOCAB_SIZE - len(specials), out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return out
