"""The families added on the per-family layer plan, against transformers on tiny random
checkpoints: dense Llama (llama3 rope scaling, q/k/v/o biases, head_dim != hidden/heads),
Mistral (sliding window, one kv head), Qwen2 (q/k/v biases, tied embeddings), Qwen3 (per-head
q/k norms), GLM-4.5 (two dense layers, then grouped sigmoid routing with n_group > 1, a
selection bias, routed_scaling_factor, two shared experts, partial rotary, q/k norms, biases),
DeepSeek-V3 (MLA with q_lora 96 != kv_lora 64, 32 + 16 query dims, values of 24, YaRN with
mscale, interleaved rotary pairs; the same without q_lora and with rotate-half pairs) and
DeepSeek-V2-Lite's shape (no q_lora, softmax group-limited routing), gpt-oss, MiniMax-M2 (q/k
norms over the whole projection, 10 of 24 head dims rotated, sigmoid routing with a selection
bias, renormalised), Qwen3-Next / Qwen3.5 (gated DeltaNet linear-attention layers around
gated full-attention ones, a dense layer, softmax routing with a gated shared expert;
transformers' torch fallbacks of the delta rule and the conv as the reference) and Llama 4
(chunked RoPE layers with q/k L2 norm and global NoPE layers with query temperature, dense and
MoE layers, one routed expert fed its input scaled by a sigmoid weight, a shared expert,
llama3 rope scaling).

For each case and for the reference and best kernel ISA:
- f32: prompt logits within 1e-4 (max |diff| / max |ref|) of transformers float32 with the
  engine's default settings (Model.load's defaults); 16 greedy tokens through the KV cache
  equal `generate()`; each cached decode step equals the full forward over the same tokens;
  chunked prefill equals one call; two sequences in one call give, bit for bit, what each
  gives alone;
- q8: relative L2 of the logits <= 5e-2 against transformers float32; q4: <= 3e-2 against
  transformers run on the same fake-quantized weights. The grouped sigmoid router has many
  near-ties on tiny random models (18 of 24 prompt positions within 0.05 in some layer), so
  instead of leaving positions out, transformers' routers are made to pick the experts
  Colibri picked (their weights still come from transformers' own scores): every position is
  compared, and the test measures quantization error, not tie-breaking;
- every family with experts: every expert-cache budget gives the resident model's logits bit
  for bit.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.engine import _core  # noqa: E402
from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format import quant  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.models import archs  # noqa: E402
from colibri.engine.models.family import cols, transform, untransform  # noqa: E402
from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import hf_model as _hf_model  # noqa: E402
from tests.parity_helpers import prefill as _prefill  # noqa: E402
from tests.parity_helpers import rel_l2 as _rel_l2  # noqa: E402
from tests.parity_helpers import rel_max as _rel_max  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, TinyCheckpoints  # noqa: E402

PROMPT_LEN = 24
N_GEN = 16
N_CTX = 64
THREADS = 2

# name -> (tiny architecture, transformers config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-llama3-bias": ("llama", {}),
    "mistral-window": ("mistral", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe-one-group": ("glm4_moe", {"n_group": 1, "topk_group": 1, "use_qk_norm": False,
                                        "attention_bias": False, "norm_topk_prob": False,
                                        "first_k_dense_replace": 1, "n_shared_experts": 1}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False,
                                              "n_group": 1, "topk_group": 1,
                                              "first_k_dense_replace": 1}),
    "deepseek_v2-lite-shape": ("deepseek_v2", {}),
    "gpt_oss": ("gpt_oss", {}),
    "minimax_m2": ("minimax_m2", {}),
    "qwen3_next": ("qwen3_next", {}),
    # layer_types from full_attention_interval (full on every second layer), as many value
    # heads as key heads, no dense layer
    "qwen3_next-interval": ("qwen3_next", {"layer_types": None, "full_attention_interval": 2,
                                           "linear_num_value_heads": 2,
                                           "mlp_only_layers": []}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "llama4": ("llama4", {}),
}
# families with multi-token-prediction layers and dense first layers
MTP_ARCHS = ("glm4_moe", "deepseek_v3", "deepseek_v2")
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe")
MOE_ARCHS = MTP_ARCHS + ("gpt_oss", "minimax_m2", "llama4") + HYBRID_ARCHS


def _routers(model: Any) -> list[tuple[int, Any]]:
    """(layer, router module) of each MoE layer of a transformers model."""
    out = []
    for i, block in enumerate(model.model.layers):
        ffn = block.mlp if hasattr(block, "mlp") else block.feed_forward  # Llama 4
        gate = getattr(ffn, "gate", None)
        if hasattr(gate, "routed_scaling_factor"):
            out.append((i, gate))
        elif type(getattr(ffn, "router", None)).__name__ in ("GptOssTopKRouter",
                                                            "Llama4Router"):
            out.append((i, ffn.router))
        elif _minimax(gate) or type(gate).__name__ in ("Qwen3NextTopKRouter",
                                                        "Qwen3_5MoeTopKRouter"):
            out.append((i, gate))
    return out


def _minimax(gate: Any) -> bool:
    """MiniMax-M2's router: sigmoid scores, its selection bias held by the MoE block and
    passed in as the forward's second argument; weights always renormalised, never scaled."""
    return type(gate).__name__ == "MiniMaxM2TopKRouter"


def _selection_bias(model: Any, layer: int, gate: Any) -> Any:
    """The bias a sigmoid router adds to its scores to choose experts (None: no bias)."""
    if _minimax(gate):
        return model.model.layers[layer].mlp.e_score_correction_bias
    return getattr(gate, "e_score_correction_bias", None)


def _topk_softmax(gate: Any) -> bool:
    """gpt-oss's router: top-k of the logits, then a softmax over the k chosen."""
    return type(gate).__name__ == "GptOssTopKRouter"


def _topk_sigmoid(gate: Any) -> bool:
    """Llama 4's router: it returns the sigmoid of the top-k logits (0 for the other
    experts), then the logits."""
    return type(gate).__name__ == "Llama4Router"


def _router_logits(gate: Any, out: Any) -> Any:
    return out[1] if _topk_sigmoid(gate) else out[0]


def _scores(gate: Any, logits: Any) -> Any:
    """A router's scores: sigmoid for the sigmoid routers, softmax for DeepSeek-V2 and
    gpt-oss (whose weights are the softmax over the chosen logits: the same order)."""
    if hasattr(gate, "e_score_correction_bias") or _minimax(gate) or _topk_sigmoid(gate):
        return torch.sigmoid(logits.float())
    return torch.softmax(logits.float(), dim=-1)


def _router_scores(model: Any, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits, and per MoE layer the scores experts are chosen by (with the selection bias)."""
    found: list[np.ndarray] = []
    hooks = []
    for layer, gate in _routers(model):
        bias = _selection_bias(model, layer, gate)

        def hook(m: Any, args: Any, out: Any, bias: Any = bias) -> None:
            s = _scores(m, _router_logits(m, out)) + (0.0 if bias is None else bias)
            found.append(s.numpy())
        hooks.append(gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, found


def _forced_routing(model: Any, routes: np.ndarray) -> list[Any]:
    """Hooks that make each router of model choose routes[:, layer] (Colibri's choices,
    [T, n_layer, K]) and weigh them as transformers does: the chosen scores, renormalised when
    the router does, times routed_scaling_factor."""
    hooks = []
    for layer, gate in _routers(model):
        def hook(m: Any, args: Any, out: Any, layer: int = layer) -> Any:
            logits = _router_logits(m, out)
            idx = torch.tensor(routes[:, layer].astype(np.int64))
            if _topk_sigmoid(m):  # the chosen experts' sigmoid, 0 for the others
                chosen = torch.full_like(logits, float("-inf")).scatter(1, idx,
                                                                        logits.gather(1, idx))
                return torch.sigmoid(chosen), logits
            if _topk_softmax(m):
                return logits, torch.softmax(logits.gather(1, idx), dim=-1), idx
            w = _scores(m, logits).gather(1, idx)
            if _minimax(m):
                return logits, w / w.sum(dim=-1, keepdim=True), idx
            # Qwen3.5's router always renormalises (it has no norm_topk_prob)
            if getattr(m, "norm_topk_prob", type(m).__name__ == "Qwen3_5MoeTopKRouter"):
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            return logits, w * getattr(m, "routed_scaling_factor", 1.0), idx
        hooks.append(gate.register_forward_hook(hook))
    return hooks


def _reference(model: Any, ids: np.ndarray, routes: np.ndarray | None) -> np.ndarray:
    """transformers' logits, its routers forced to `routes` when given."""
    hooks = _forced_routing(model, routes) if routes is not None else []
    try:
        with torch.no_grad():
            return model(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()


def _ours_with_routes(path: Path, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Colibri's logits for ids and, for a model with experts, the experts it chose."""
    m = Model.load(path, threads=THREADS, n_ctx=N_CTX)
    cfg = m.config
    routes = (np.full((ids.size, cfg.n_layer, cfg.n_expert_used), -1, np.int32)
              if cfg.n_expert else None)
    return m.forward(ids, np.zeros(ids.size, np.int32), np.arange(ids.size, dtype=np.int32),
                     routes=routes), routes


class Case:
    """One tiny checkpoint of the session's (with its conversions and transformers model) and
    transformers' references."""

    def __init__(self, name: str, checkpoints: TinyCheckpoints) -> None:
        self.name = name
        self.arch, overrides = CASES[name]
        ckpt = checkpoints.get(self.arch, seed=11, **overrides)
        self.root = ckpt.root / "parity-families"  # what this file derives from it
        self.root.mkdir(exist_ok=True)
        self.hf_dir = ckpt.hf_dir
        self._ckpt = ckpt
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.prompt = rng.integers(0, VOCAB_SIZE, PROMPT_LEN).astype(np.int32)
        self.prompt2 = rng.integers(0, VOCAB_SIZE, 17).astype(np.int32)
        self.hf = ckpt.hf
        self.ref_logits, self.scores = _router_scores(self.hf, self.prompt)

    def converted(self, preset: str) -> Path:
        return self._ckpt.converted(preset)


_CACHE: dict[str, Case] = {}


def _case(name: str, checkpoints: TinyCheckpoints) -> Case:
    if name not in _CACHE:
        _CACHE[name] = Case(name, checkpoints)
    return _CACHE[name]


# the second case of a family (another router or attention shape) runs in the whole suite
VARIANTS = ("glm4_moe-one-group", "deepseek_v3-no-q-lora", "qwen3_next-interval")
QUICK = [n for n in CASES if n not in VARIANTS]


@pytest.fixture(scope="module", params=quick_params(CASES, QUICK))
def case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return _case(request.param, checkpoints)


@pytest.fixture(scope="module",
                params=quick_params([n for n, (a, _) in CASES.items() if a in MOE_ARCHS], QUICK))
def moe_case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    """The cases with routed experts."""
    return _case(request.param, checkpoints)


@pytest.fixture(scope="module",
                params=[n for n, (a, _) in CASES.items() if a in MTP_ARCHS + ("minimax_m2",)])
def mtp_case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    """The cases whose checkpoints may carry multi-token-prediction layers."""
    return _case(request.param, checkpoints)


def test_the_family_module_recognised_the_checkpoint(case: Case) -> None:
    cfg = json.loads((case.converted("f32") / "config.json").read_text())
    hf_cfg = json.loads((case.hf_dir / "config.json").read_text())
    assert archs.SUPPORTED[hf_cfg["architectures"][0]] == cfg["architecture"]
    if case.arch == "gpt_oss":
        assert cfg["layer_ffn"] == ["moe"] * hf_cfg["num_hidden_layers"]
        assert cfg["layer_attn"] == ["sliding", "full", "sliding"]
        assert cfg["sliding_window"] == hf_cfg["sliding_window"] < PROMPT_LEN
        assert cfg["attn_sinks"] and cfg["router_bias"] and cfg["expert_bias"]
        assert (cfg["glu"], cfg["glu_alpha"], cfg["glu_limit"]) == (
            "swiglu_clamp", hf_cfg["swiglu_alpha"], hf_cfg["swiglu_limit"])
        assert cfg["rope"]["type"] == "yarn" and cfg["rope"]["truncate"] is False
    elif case.arch == "minimax_m2":
        assert cfg["layer_ffn"] == ["moe"] * hf_cfg["num_hidden_layers"]
        assert (cfg["router"], cfg["n_group"], cfg["routed_scale"]) == ("sigmoid_grouped", 1, 1.0)
        assert cfg["norm_topk_prob"] and cfg["n_ff_shared"] == 0
        assert cfg["qk_norm"] == "full" and cfg["rotary_dim"] == hf_cfg["rotary_dim"] == 10
        assert cfg["n_expert"] == hf_cfg["num_local_experts"]
    elif case.arch == "llama4":
        assert cfg["layer_ffn"] == ["dense", "moe", "moe", "dense"]
        assert (cfg["n_ff"], cfg["n_ff_shared"], cfg["n_ff_dense"]) == (
            hf_cfg["intermediate_size"], hf_cfg["intermediate_size"],
            hf_cfg["intermediate_size_mlp"])
        assert cfg["router"] == "sigmoid_topk" and cfg["route_input"]
        assert cfg["layer_attn"] == ["chunked", "full", "chunked", "full"]
        assert cfg["nope_layers"] == [1, 3] and cfg["qk_norm"] == "l2"
        assert cfg["attn_chunk"] == hf_cfg["attention_chunk_size"] < PROMPT_LEN
        assert (cfg["attn_temp_floor"], cfg["attn_temp_scale"]) == (
            hf_cfg["floor_scale"], hf_cfg["attn_scale"])
        assert cfg["rope"]["type"] == "llama3"
    elif case.arch in HYBRID_ARCHS:
        types = case.hf.config.layer_types
        assert cfg["layer_mixer"] == [
            "linear" if t == "linear_attention" else "attention" for t in types]
        assert {"linear", "attention"} <= set(cfg["layer_mixer"])
        dense = hf_cfg.get("mlp_only_layers") or []
        assert cfg["layer_ffn"] == ["dense" if i in dense else "moe" for i in range(len(types))]
        assert cfg["attn_gate"] and cfg["shared_gate"] and cfg["qk_norm"] == "head"
        assert cfg["rotary_dim"] == hf_cfg["head_dim"] // 2
        assert (cfg["lin_n_k_heads"], cfg["lin_n_v_heads"], cfg["lin_conv"]) == (
            hf_cfg["linear_num_key_heads"], hf_cfg["linear_num_value_heads"],
            hf_cfg["linear_conv_kernel_dim"])
        assert hf_cfg["linear_conv_kernel_dim"] < PROMPT_LEN
    elif case.arch in MOE_ARCHS:
        k = hf_cfg["first_k_dense_replace"]
        assert cfg["layer_ffn"] == ["dense"] * k + ["moe"] * (hf_cfg["num_hidden_layers"] - k)
        assert cfg["router"] == ("softmax" if case.arch == "deepseek_v2" else "sigmoid_grouped")
        assert cfg["n_ff_shared"] == hf_cfg["moe_intermediate_size"] * hf_cfg["n_shared_experts"]
    else:
        assert cfg["n_expert"] == 0 and set(cfg["layer_ffn"]) == {"dense"}
    if case.arch == "glm4_moe":
        assert cfg["rotary_dim"] == hf_cfg["head_dim"] // 2
    if case.arch.startswith("deepseek"):
        assert cfg["attn"] == "mla" and cfg["rotary_dim"] == hf_cfg["qk_rope_head_dim"]
        assert cfg["head_dim"] == hf_cfg["qk_nope_head_dim"] + hf_cfg["qk_rope_head_dim"]


def test_mla_caches_the_latent(moe_case: Case) -> None:
    """An MLA model's KV cache holds kv_lora_rank + rope dims per token and layer, in f32
    4 bytes each: what the latent costs, not H * (k + v) head dims."""
    cfg = json.loads((moe_case.converted("f32") / "config.json").read_text())
    m = Model.load(moe_case.converted("f32"), threads=THREADS, n_ctx=N_CTX)
    per_token = m.kv_block_bytes() // _core.KV_BLOCK
    if cfg.get("attn") == "mla":
        assert per_token == cfg["n_layer"] * (cfg["kv_lora_rank"] + cfg["rotary_dim"]) * 4
    else:  # linear-attention layers cache nothing per position
        n_attn = cfg.get("layer_mixer", ["attention"] * cfg["n_layer"]).count("attention")
        assert per_token == n_attn * 2 * cfg["n_head_kv"] * cfg["head_dim"] * 4


def test_routing_is_exercised(moe_case: Case) -> None:
    """The prompt must route to most experts, and the selection bias must change choices
    (else a router that ignored it would pass)."""
    cfg = json.loads((moe_case.converted("f32") / "config.json").read_text())
    k, e = cfg["n_expert_used"], cfg["n_expert"]
    assert len(moe_case.scores) == cfg["layer_ffn"].count("moe")
    changed = 0
    gates = dict(_routers(moe_case.hf))
    for layer, c in zip(cfg["moe_layers"] if "moe_layers" in cfg else
                        [i for i, f in enumerate(cfg["layer_ffn"]) if f == "moe"],
                        moe_case.scores, strict=True):
        chosen = np.argsort(-c, axis=1)[:, :k]
        assert len(np.unique(chosen)) >= e - 2, (layer, np.unique(chosen))
        bias = _selection_bias(moe_case.hf, layer, gates[layer])
        if bias is not None:
            plain = np.argsort(-(c - bias.numpy()), axis=1)[:, :k]
            changed += int(np.sum(np.sort(plain, axis=1) != np.sort(chosen, axis=1)))
        else:
            changed += 1  # a softmax router has no selection bias
    assert changed > 0


def test_f32_logits_greedy_and_cached_decode(case: Case, isa: str) -> None:
    m = Model.load(case.converted("f32"), threads=THREADS, n_ctx=N_CTX)
    logits = _prefill(m, case.prompt)
    err = _rel_max(logits, case.ref_logits)
    print(f"{case.name}/{isa} f32: max|diff|/max|ref| {err:.3e}")
    assert err <= 1e-4, f"{case.name}/{isa}: prompt logits rel max error {err:.3g}"

    hf = case.hf
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ids = torch.tensor(case.prompt[None].astype(np.int64))
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_GEN,
                          do_sample=False, pad_token_id=0)
    ref_tokens = gen[0, PROMPT_LEN:].tolist()

    m.reset(0)
    last = _prefill(m, case.prompt)[-1]
    ours, steps = [], []
    tok = int(np.argmax(last))
    for i in range(N_GEN):
        ours.append(tok)
        if i == N_GEN - 1:
            break
        step = m.forward(np.array([tok], np.int32), np.zeros(1, np.int32),
                         np.array([PROMPT_LEN + i], np.int32))
        steps.append(step[0])
        tok = int(np.argmax(step[0]))
    assert ours == ref_tokens, f"{case.name}/{isa}: greedy decode differs"

    # the cached decode steps equal one full forward over the same tokens
    full = Model.load(case.converted("f32"), threads=THREADS, n_ctx=N_CTX)
    seq = np.concatenate([case.prompt, np.array(ours[:-1], np.int32)])
    whole = _prefill(full, seq)[PROMPT_LEN:]
    assert _rel_max(np.stack(steps), whole) <= 1e-5


def test_f32_chunked_and_batched(case: Case, isa: str) -> None:
    m = Model.load(case.converted("f32"), threads=THREADS, n_ctx=N_CTX, n_seq=3)
    whole = _prefill(m, case.prompt)
    alone2 = _prefill(m, case.prompt2, seq=2)
    m.reset(0)
    m.reset(2)
    a = _prefill(m, case.prompt[:10])
    b = _prefill(m, case.prompt[10:], start=10)
    assert _rel_max(np.concatenate([a, b]), whole) <= 1e-5
    m.reset(0)
    # both prompts interleaved in one call: each token's logits as when run alone, bit for bit
    p1, p2 = case.prompt, case.prompt2
    order = sorted([(i * 17, 0, i) for i in range(p1.size)]
                   + [(i * 24, 2, i) for i in range(p2.size)])
    toks = np.array([(p1 if s == 0 else p2)[i] for _, s, i in order], np.int32)
    seqs = np.array([s for _, s, _ in order], np.int32)
    poss = np.array([i for _, _, i in order], np.int32)
    out = m.forward(toks, seqs, poss)
    np.testing.assert_array_equal(out[seqs == 0], whole)
    np.testing.assert_array_equal(out[seqs == 2], alone2)


def test_f32_prompt_in_several_chunks(case: Case) -> None:
    """The prompt (longer than any sliding window or attention chunk of the cases) fed in
    four chunks of unequal lengths, each crossing window, chunk and KV block edges, equals one
    pass."""
    cfg = json.loads((case.converted("f32") / "config.json").read_text())
    assert (cfg.get("sliding_window") or 0) < PROMPT_LEN
    assert (cfg.get("attn_chunk") or 0) < PROMPT_LEN
    m = Model.load(case.converted("f32"), threads=THREADS, n_ctx=N_CTX)
    whole = _prefill(m, case.prompt)
    m.reset(0)
    cuts = [0, 3, 9, 17, PROMPT_LEN]
    parts = [_prefill(m, case.prompt[a:b], start=a)
             for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert _rel_max(np.concatenate(parts), whole) <= 1e-5


def test_gpt_oss_window_sinks_and_clamp_decide_the_reference(
        checkpoints: TinyCheckpoints) -> None:
    """Each gpt-oss feature the parity tests check moves transformers' own logits far past
    their 1e-4: without the sliding window, without the sinks, without the clamp."""
    case = _case("gpt_oss", checkpoints)
    ids = torch.tensor(case.prompt[None].astype(np.int64))
    n = case.hf.config.num_hidden_layers

    def logits(**overrides: Any) -> np.ndarray:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(case.hf_dir), dtype=torch.float32, attn_implementation="eager",
            **overrides).eval()
        with torch.no_grad():
            return model(ids).logits[0].float().numpy()

    full = logits(layer_types=["full_attention"] * n)
    assert _rel_max(full, case.ref_logits) > 1e-2
    assert _rel_max(logits(swiglu_limit=1e9), case.ref_logits) > 1e-2
    no_sinks = _hf_model(case.hf_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e30)
        ref = no_sinks(ids).logits[0].float().numpy()
    assert _rel_max(ref, case.ref_logits) > 1e-2


def test_llama4_chunks_temperature_qk_norm_and_input_scaling_decide_the_reference(
        checkpoints: TinyCheckpoints) -> None:
    """Each Llama 4 feature the parity tests check moves transformers' own logits far past
    their 1e-4: without the attention chunks, without the query temperature, without the q/k
    L2 norm, and with the router weight applied to the experts' output instead of their
    input."""
    case = _case("llama4", checkpoints)
    ids = torch.tensor(case.prompt[None].astype(np.int64))

    def logits(model: Any = None, **overrides: Any) -> np.ndarray:
        model = model or transformers.AutoModelForCausalLM.from_pretrained(
            str(case.hf_dir), dtype=torch.float32, attn_implementation="eager",
            **overrides).eval()
        with torch.no_grad():
            return model(ids).logits[0].float().numpy()

    n = case.hf.config.num_hidden_layers
    assert _rel_max(logits(layer_types=["full_attention"] * n), case.ref_logits) > 1e-2
    assert _rel_max(logits(attn_temperature_tuning=False), case.ref_logits) > 1e-2
    assert _rel_max(logits(use_qk_norm=False), case.ref_logits) > 1e-2

    def output_scaled(moe: Any) -> Any:
        """Llama4TextMoe.forward with each expert's output, not input, times its weight."""
        def forward(h: Any) -> Any:
            h = h.reshape(-1, moe.hidden_dim)
            scores, router_logits = moe.router(h)
            out = moe.shared_expert(h)
            ex = moe.experts
            for e in range(ex.num_experts):
                gate, up = (h @ ex.gate_up_proj[e]).chunk(2, dim=-1)
                out = out + scores[:, e:e + 1] * ((up * ex.act_fn(gate)) @ ex.down_proj[e])
            return out, router_logits
        return forward

    model = _hf_model(case.hf_dir)
    for layer in model.model.layers:
        if layer.is_moe_layer:
            layer.feed_forward.forward = output_scaled(layer.feed_forward)
    assert _rel_max(logits(model), case.ref_logits) > 1e-2


def test_llama4_multimodal_checkpoint_converts_its_text_model(
        checkpoints: TinyCheckpoints, capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama4ForConditionalGeneration checkpoint (how Llama 4 ships) around the llama4
    case's text model: conversion says it leaves the vision tower out, and the result gives
    transformers' text logits of the multimodal model."""
    case = _case("llama4", checkpoints)
    out = case.root / "hf-multimodal"
    vision = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_hidden_layers=1, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=case.hf.config.to_dict(),
                                       vision_config=vision)
    torch.manual_seed(3)
    mm = transformers.Llama4ForConditionalGeneration(config).eval()
    mm.language_model.load_state_dict(case.hf.state_dict())
    mm.save_pretrained(str(out))
    for f in case.hf_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(f, out / f.name)
    mm = transformers.Llama4ForConditionalGeneration.from_pretrained(
        str(out), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = mm(input_ids=torch.tensor(case.prompt[None].astype(np.int64))).logits[0].numpy()
    assert _rel_max(ref, case.ref_logits) <= 1e-6  # the same text model

    path = convert(out, case.root / "multimodal-f32", quant="f32", progress=True)
    err = capsys.readouterr().err
    assert ("recognised Llama4ForConditionalGeneration as the llama4 family: 4 layers, 2 dense, "
            "2 with 6 experts, top-1 (sigmoid_topk router), shared experts of width 32, 2 "
            "attending in chunks of 8, 2 globally, 2 without RoPE (query temperature tuning), "
            "router weights scale the experts' input, q/k L2 norm on the RoPE layers") in err
    assert "tensors of the vision encoder and its projector" in err
    m = Model.load(path, threads=THREADS, n_ctx=N_CTX)
    assert _rel_max(_prefill(m, case.prompt), ref) <= 1e-4
    text = json.loads((case.converted("f32") / "config.json").read_text())
    files = json.loads((path / "config.json").read_text())["files"]
    assert {k: v["sha256"] for k, v in files.items()} == {
        k: v["sha256"] for k, v in text["files"].items()}  # the same weights, byte for byte


def _mxfp4_checkpoint(case: Case) -> Path:
    """The gpt-oss case's checkpoint with its experts quantized to MXFP4 and stored as the
    released checkpoints store them (*_blocks [E, rows, in / 32, 16], *_scales [E, rows,
    in / 32], rows the output features: gate and up alternating) with the matching
    quantization_config."""
    from safetensors.numpy import load_file, save_file

    out = case.root / "hf-mxfp4"
    if (out / "model.safetensors").is_file():
        return out
    tensors = load_file(str(case.hf_dir / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = np.ascontiguousarray(np.swapaxes(tensors.pop(name), 1, 2))  # [E, out, in]
        E, n_out, n_in = rows.shape
        q = quant.quantize_mxfp4(rows.reshape(-1, n_in))
        tensors[name + "_blocks"] = np.ascontiguousarray(q["qs"]).reshape(E, n_out, -1, 16)
        tensors[name + "_scales"] = np.ascontiguousarray(q["e"]).reshape(E, n_out, -1)
    out.mkdir(exist_ok=True)
    for f in case.hf_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_gpt_oss_mxfp4_experts_match_their_dequantized_twin(
        checkpoints: TinyCheckpoints, isa: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Experts stored in MXFP4 are converted byte for byte (no second rounding, whatever the
    preset) and the model matches the same checkpoint as transformers dequantizes it (its own
    MXFP4 loader): only the activations' q8 rounding in the expert products differs."""
    from colibri.engine.format.wfile import read_wfile

    case = _case("gpt_oss", checkpoints)
    mx = _mxfp4_checkpoint(case)
    out = case.root / f"mxfp4-{isa}"
    if not out.exists():
        convert(mx, out, quant="f32", progress=True)
        err = capsys.readouterr().err
        assert "2 with a sliding window of 8, 1 full, attention sinks, experts kept in MXFP4" \
            in err
        assert "skipping" not in err
    cfg = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in cfg["tensor_types"].items() if k.startswith("experts.")} == {
        "experts.w1": "mxfp4", "experts.w3": "mxfp4", "experts.w2": "mxfp4"}
    twin = transformers.AutoModelForCausalLM.from_pretrained(
        str(mx), dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    # the stored experts are transformers' dequantized weights, exactly
    layer = twin.model.layers[1].mlp.experts
    f = read_wfile(out / "experts" / "layer_1_expert_5.bin")
    gate_up = layer.gate_up_proj[5].detach().numpy()  # [D, 2F], gate and up alternating
    np.testing.assert_array_equal(f.array("w1"), gate_up[:, 0::2].T)
    np.testing.assert_array_equal(f.array("w3"), gate_up[:, 1::2].T)
    np.testing.assert_array_equal(f.array("w2"), layer.down_proj[5].detach().numpy().T)

    ours, routes = _ours_with_routes(out, case.prompt)
    err = _rel_l2(ours, _reference(twin, case.prompt, routes))
    print(f"\ngpt_oss mxfp4/{isa}: rel L2 vs dequantized HF {err:.3e}")
    assert err <= 2e-2
    # the expert cache moves MXFP4 experts as it moves the others: same bits at any budget
    m = Model.load(out, threads=THREADS, n_ctx=N_CTX)
    m.core.enable_expert_cache(cfg["n_expert_used"], load="pread", prefetch=True)
    np.testing.assert_array_equal(_prefill(m, case.prompt), ours)


def _fake_quantized_checkpoint(case: Case, preset: str) -> Path:
    from safetensors.numpy import load_file, save_file

    out = case.root / f"hf-fq-{preset}"
    if (out / "model.safetensors").is_file():
        return out
    cfg = json.loads((case.converted(preset) / "config.json").read_text())
    tensors = load_file(str(case.hf_dir / "model.safetensors"))
    kv_b: dict[str, dict[str, np.ndarray]] = {}  # MLA's kv_b_proj: its per-head k and v parts
    for t in archs.plan(cfg, set(tensors)):
        ty = quant.row_type(cfg["tensor_types"][f"{t.group}.{t.name}"])
        name, src = t.source.hf_name, t.source
        if src.transform in ("t", "cols", "cols_t"):  # one expert's slice / part of a tensor
            whole = tensors[name] = np.array(tensors[name])
            part = whole if src.index is None else whole[src.index]
            ours = transform(part, src)
            if ty in ("q8", "q6", "q4", "f16", "bf16"):
                ours = quant.fake_quantize(ours, ty).astype(np.float32)
            if src.transform == "t":
                part[...] = untransform(ours, src)
            else:
                part[..., cols(src)] = untransform(ours, src)
            continue
        ours = transform(tensors[name], src)  # quantized in our layout, as the converter does
        if ty in ("q8", "q6", "q4", "f16", "bf16"):
            ours = quant.fake_quantize(ours, ty).astype(np.float32)
        back = untransform(ours, src)
        if src.transform in ("kv_b_k", "kv_b_v"):
            kv_b.setdefault(name, {})[src.transform] = back
        else:
            tensors[name] = back
    for name, parts in kv_b.items():  # per head: the key rows, then the value rows
        whole = np.concatenate([parts["kv_b_k"], parts["kv_b_v"]], axis=1)
        tensors[name] = whole.reshape(-1, whole.shape[-1])
    out.mkdir(exist_ok=True)
    for f in case.hf_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copyfile(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_q8_logits(case: Case, isa: str) -> None:
    ours, routes = _ours_with_routes(case.converted("q8"), case.prompt)
    err = _rel_l2(ours, _reference(case.hf, case.prompt, routes))
    print(f"\n{case.name}/{isa} q8: rel L2 vs float HF {err:.3e} "
          f"(unforced: {_rel_l2(ours, case.ref_logits):.3e})")
    assert err <= 5e-2


def test_q4_logits(case: Case, isa: str) -> None:
    ours, routes = _ours_with_routes(case.converted("q4"), case.prompt)
    ref = _reference(_hf_model(_fake_quantized_checkpoint(case, "q4")), case.prompt, routes)
    err = _rel_l2(ours, ref)
    print(f"\n{case.name}/{isa} q4: rel L2 vs same-weights HF {err:.3e}")
    assert err <= 3e-2


def test_forced_routing_is_the_identity_on_our_own_choices(moe_case: Case) -> None:
    """The forcing hooks change nothing when they force what transformers picks anyway (f32:
    Colibri picks the same experts), so the q8/q4 comparisons above are fair."""
    ours, routes = _ours_with_routes(moe_case.converted("f32"), moe_case.prompt)
    forced = _reference(moe_case.hf, moe_case.prompt, routes)
    assert _rel_max(forced, moe_case.ref_logits) <= 1e-6
    kinds = json.loads((moe_case.converted("f32") / "config.json").read_text())["layer_ffn"]
    assert (routes >= 0).any()
    for layer, kind in enumerate(kinds):  # a dense layer chooses no expert
        assert np.all(routes[:, layer] == -1) if kind == "dense" else np.all(routes[:, layer] >= 0)


@pytest.mark.parametrize("load", ["pread", "mmap"])
def test_expert_budget_decides_speed_not_tokens(moe_case: Case, load: str) -> None:
    path = moe_case.converted("q8")
    cfg = json.loads((path / "config.json").read_text())
    ref = _prefill(Model.load(path, threads=THREADS, n_ctx=N_CTX), moe_case.prompt)
    for per_layer in (cfg["n_expert_used"], cfg["n_expert"] - 1):
        m = Model.load(path, threads=THREADS, n_ctx=N_CTX)
        m.core.enable_expert_cache(per_layer, load=load, prefetch=True)
        np.testing.assert_array_equal(_prefill(m, moe_case.prompt), ref)
        assert m.core.expert_cache_stats()["loads"].sum() > 0


def test_mtp_layers_are_skipped_and_said(mtp_case: Case, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """GLM and DeepSeek checkpoints carry multi-token-prediction layers numbered past
    num_hidden_layers; conversion leaves them out, says so, and writes the same model."""
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(mtp_case.hf_dir, hf)
    tensors = load_file(str(hf / "model.safetensors"))
    n = mtp_case.hf.config.num_hidden_layers
    last = f"model.layers.{n - 1}."
    mtp = {f"model.layers.{n}." + k[len(last):]: v for k, v in tensors.items()
           if k.startswith(last)}
    mtp[f"model.layers.{n}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    mtp[f"model.layers.{n}.enorm.weight"] = np.ones(64, np.float32)
    save_file({**tensors, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    out = convert(hf, tmp_path / "q8", quant="q8", progress=True)
    err = capsys.readouterr().err
    cls = mtp_case.hf.config.architectures[0]
    family = archs.SUPPORTED[cls]
    assert f"recognised {cls} as the {family} family: {n} layers" in err
    assert f"skipping {len(mtp)} tensors of multi-token-prediction layer(s) {n}" in err
    files = json.loads((out / "config.json").read_text())["files"]
    assert files == json.loads((mtp_case.converted("q8") / "config.json").read_text())["files"]
