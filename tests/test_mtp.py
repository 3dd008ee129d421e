"""Multi-token-prediction drafts (`--speculative mtp`): the converter keeps the nextn layer that
DeepSeek-V3 and GLM-4.5 checkpoints ship as a one-layer model in the folder's mtp/; its logits
match a torch reference of the published layer (f32, 1e-4), chained on its own hidden state
too; greedy output with MTP drafts is token for token the output without them, at several k,
with an expert budget too; models without the layer are refused clearly (Qwen3-Next's and
Qwen3.5's module: tests/test_mtp_qwen3_next.py).

transformers does not implement these layers: the checkpoints here are tiny random models of
num_hidden_layers + 1 layers whose config then says num_hidden_layers, so the extra layer
(model.layers.{L}.*, as those checkpoints name it) becomes the nextn layer's decoder layer,
plus random enorm, hnorm, eh_proj and shared_head tensors under the shipped names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import quick_params
from tests.mtp_helpers import (
    N_CTX,
    TOL,
    MtpCheckpoints,
    assert_drafts_are_the_references,
    mtp_llm,
    paged,
    silence_layer,
    watch_drafts,
)
from tests.parity_helpers import hf_model, rel_max
from tests.test_speculative import PROMPTS, _ids, _params, _run, _spec, _trace
from tests.tiny_models import TinyCheckpoints, make_checkpoint

MTP_ARCHS = ("deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module", autouse=True)
def _cache(own_cache_dir: Path) -> None:
    """Conversions of this module's checkpoints in a cache folder of their own."""


def make_mtp_checkpoint(arch: str, out: Path, seed: int = 11, repeat: bool = False) -> Path:
    """A tiny arch checkpoint that ships a nextn layer under the names DeepSeek-V3 / GLM-4.5
    use: layers 0..L-1 the model, model.layers.{L}.* its MTP layer. With repeat, the layer
    proposes the token just chosen again: eh_proj keeps only the hidden half, the decoder
    layer adds nothing (zero output and down projections) and the head is the lm_head, so
    its logits are the main model's at the same position (an RMSNorm of an RMSNorm is the
    first), which lets drafts be accepted wherever the model repeats a token."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import _BASE

    n_layer = _BASE[arch]["num_hidden_layers"]
    make_checkpoint(arch, out, seed=seed, num_hidden_layers=n_layer + 1)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = n_layer
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(str(out / "model.safetensors"))
    D = cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    p = f"model.layers.{n_layer}."
    tensors[p + "enorm.weight"] = 1.0 + 0.3 * torch.randn(D, generator=g)
    tensors[p + "hnorm.weight"] = 1.0 + 0.3 * torch.randn(D, generator=g)
    tensors[p + "eh_proj.weight"] = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    tensors[p + "shared_head.norm.weight"] = 1.0 + 0.3 * torch.randn(D, generator=g)
    # the shipped layer carries its own copies of the embeddings and the lm_head
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    if repeat:
        tensors[p + "eh_proj.weight"] = torch.cat([torch.zeros(D, D), torch.eye(D)], dim=1)
        for name in (p + "hnorm.weight", p + "shared_head.norm.weight"):
            tensors[name] = torch.ones(D)
        silence_layer(tensors, p)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ckpts(checkpoints: TinyCheckpoints) -> MtpCheckpoints:
    return MtpCheckpoints(checkpoints, make_mtp_checkpoint)


@pytest.fixture(scope="module")
def converted(ckpts: MtpCheckpoints, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Path]:
    from colibri.engine.format.convert import convert

    root = tmp_path_factory.mktemp("mtp_conv")
    return {a: convert(ckpts[a], root / a, quant="f32", progress=False) for a in MTP_ARCHS}


def _rms(x: Any, w: Any, eps: float) -> Any:
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MtpReference:
    """The published nextn layer in torch, as vLLM's deepseek_mtp runs it: x =
    eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) with the embedding zeroed at position 0, h_i
    the main model's output (after its final norm) or, chained, the layer's own hidden state
    (before shared_head.norm); one decoder layer of the model's own kind (transformers' layer,
    at the layer's positions), shared_head.norm and the lm_head."""

    def __init__(self, hf_dir: Path, arch: str) -> None:
        import torch
        from safetensors.torch import load_file

        from tests.tiny_models import _classes

        raw = json.loads((hf_dir / "config.json").read_text())
        L = raw["num_hidden_layers"]
        t = load_file(str(hf_dir / "model.safetensors"))
        p = f"model.layers.{L}."
        self.eps = float(raw["rms_norm_eps"])
        self.embed = t[p + "embed_tokens.weight"]
        self.enorm, self.hnorm = t[p + "enorm.weight"], t[p + "hnorm.weight"]
        self.eh_proj = t[p + "eh_proj.weight"]
        config_cls, model_cls = _classes(arch)
        one = dict(raw, num_hidden_layers=1, first_k_dense_replace=0)
        one.pop("architectures", None)
        model = model_cls(config_cls(**{k: v for k, v in one.items()
                                        if k not in ("transformers_version", "model_type")}))
        state = {"model.embed_tokens.weight": self.embed,
                 "model.norm.weight": t[p + "shared_head.norm.weight"],
                 "lm_head.weight": t[p + "shared_head.head.weight"]}
        for k, v in t.items():
            if k.startswith(p) and not k[len(p):].startswith(
                    ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")):
                state["model.layers.0." + k[len(p):]] = v
        _fuse_experts(state, "model.layers.0.mlp.experts.")
        model.config._attn_implementation = "eager"
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        self.model = model.float().eval()
        self.pre_norm: list[Any] = []
        self.model.model.norm.register_forward_pre_hook(
            lambda _m, args: self.pre_norm.append(args[0].detach()))
        self.torch = torch

    def inputs(self, next_tokens: list[int], hidden: Any, first: int) -> Any:
        """The layer's input rows for tokens t_{i+1} and hidden states h_i ([n, D]) at
        positions first.."""
        e = _rms(self.embed[next_tokens].float(), self.enorm, self.eps)
        if first == 0:
            e[0] = 0.0
        h = _rms(hidden.float(), self.hnorm, self.eps)
        return self.torch.cat([e, h], dim=-1) @ self.eh_proj.float().T

    def run(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Logits and hidden states (before shared_head.norm) of input rows x at 0..n-1."""
        self.pre_norm.clear()
        with self.torch.no_grad():
            logits = self.model(inputs_embeds=x[None]).logits[0]
        return logits.numpy(), self.pre_norm[-1][0].numpy()


def _fuse_experts(state: dict[str, Any], e: str) -> None:
    """Per-expert tensors (as checkpoints ship them) -> transformers' fused gate_up_proj
    [E, 2F, D] (gate rows first) and down_proj [E, D, F], in place."""
    import torch

    n = sum(1 for k in state if k.startswith(e) and k.endswith(".gate_proj.weight"))
    if not n:
        return
    w = {part: [state.pop(f"{e}{j}.{part}_proj.weight") for j in range(n)]
         for part in ("gate", "up", "down")}
    state[e + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                             zip(w["gate"], w["up"], strict=True)])
    state[e + "down_proj"] = torch.stack(w["down"])


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_mtp_layer_matches_a_torch_reference(ckpts: MtpCheckpoints,
                                             converted: dict[str, Path], arch: str) -> None:
    """The main model's output after its final norm (hidden_out, normed) equals
    transformers'; the converted MTP layer run on it gives the reference layer's logits at
    every position of a prompt, and again when chained on its own hidden state and its own
    draft, in f32 within 1e-4 of the largest logit."""
    import torch

    from colibri.engine.executor.model import Model

    folder = converted[arch]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mtp"] == "mtp" and "mtp/embeddings.bin" in cfg["files"]
    main = Model.load(folder, threads=2, n_ctx=N_CTX)
    layer = Model.load(folder / "mtp", threads=2, n_ctx=N_CTX)
    assert layer.config.mtp_input and layer.config.n_layer == 1

    hf = hf_model(ckpts[arch])
    captured: list[Any] = []
    hf.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 320, size=20)]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    h_ref = captured[-1][0].numpy()
    _, h = paged(main, ids, 0, normed=True)
    assert rel_max(h, h_ref) < TOL

    ref = MtpReference(ckpts[arch], arch)
    x = ref.inputs(ids[1:], torch.from_numpy(h_ref[:-1]), 0)
    want, want_h = ref.run(x)
    got, got_h = paged(layer, ids[1:], 0, hidden_in=h[:-1].copy())
    assert rel_max(got, want) < TOL
    assert rel_max(got_h, want_h) < TOL

    # chained: its own hidden state at the last position and its own draft, one position on
    draft = int(np.argmax(got[-1]))
    x2 = torch.cat([x, ref.inputs([draft], torch.from_numpy(want_h[-1:]), len(ids) - 1)])
    want2, _ = ref.run(x2)
    got2, _ = paged(layer, [draft], len(ids) - 1, hidden_in=got_h[-1:].copy())
    assert rel_max(got2[0], want2[-1]) < TOL


@pytest.mark.slow  # a torch reference run per checked draft
@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_engine_drafts_are_the_reference_layers_chained_drafts(ckpts: MtpCheckpoints,
                                                               arch: str) -> None:
    """Four requests decoding together with k = 4: at every step each request's first draft
    is what the torch reference layer gives over its tokens so far (every position from the
    main model's outputs), and at its first steps the chained drafts are the reference's
    chained on its own hidden state and drafts; each draft a largest reference logit within
    1e-4: the catch-up, the chained positions and the scratch blocks hold the right rows."""
    llm = mtp_llm(ckpts[arch], speculative="mtp", num_speculative_tokens=4)
    prompts = [_ids(llm, p) for p in PROMPTS]
    seen = assert_drafts_are_the_references(llm, prompts, _params(max_tokens=12),
                                            hf_model(ckpts[arch]), MtpReference(ckpts[arch], arch),
                                            min_steps=10)
    assert len(seen) >= 4 * 10


# the repeated layer in the quick pass (each family's layer is checked against its
# reference there), all four in the whole suite
@pytest.mark.parametrize("arch", quick_params([*MTP_ARCHS, *(f"{a}_rep" for a in MTP_ARCHS)],
                                              ["deepseek_v3_rep"]))
def test_greedy_output_is_the_same_with_mtp_drafts(ckpts: MtpCheckpoints, arch: str) -> None:
    """Four prompts together, greedy with logprobs: with MTP drafts at k = 1, 2, 4 the
    outputs equal those without speculation, token for token and logprob for logprob; every
    decode step after the first drafted, and the counters add up. The layer that repeats the
    last token drafts exactly that, k times, at every step (so each catch-up read the hidden
    state of the last verified position), and some drafts are accepted."""
    base = mtp_llm(ckpts[arch])
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    spec = mtp_llm(ckpts[arch], speculative="mtp", num_speculative_tokens=2)
    assert spec.core._mtp is not None  # loaded at start
    seen = watch_drafts(spec.core)
    accepted = 0
    for k in (1, 2, 4):
        _spec(spec, k, "mtp")
        got = _run(spec, prompts, _params())
        for rid in want:
            assert _trace(got[rid]) == _trace(want[rid]), (arch, k, rid)
        st = spec.core.spec_stats
        assert st.n_drafts > 0 and st.n_draft_tokens >= st.n_drafts
        assert st.n_draft_tokens <= k * st.n_drafts
        assert 0 <= st.n_accepted <= st.n_draft_tokens
        accepted += st.n_accepted
    if arch.endswith("_rep"):
        assert seen and all(d == [t[-1]] * len(d) for d, t in seen)
        assert accepted > 0


def test_mtp_drafts_under_an_expert_budget(ckpts: MtpCheckpoints) -> None:
    """With three of eight experts per layer resident, greedy output with MTP drafts is the
    output with every expert resident and no drafts."""
    from colibri.engine.core.options import ExpertCacheConfig

    base = mtp_llm(ckpts["deepseek_v3_rep"])
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    llm = mtp_llm(ckpts["deepseek_v3_rep"], speculative="mtp", num_speculative_tokens=3,
               expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False))
    got = _run(llm, prompts, _params())
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    assert llm.core.spec_stats.n_accepted > 0
    assert llm.core.expert_cache.totals()["misses"] > 0  # the budget was in play


@pytest.mark.slow  # seconds; the speculative tests' rollback, prefix and budget are quick
def test_mtp_with_prefix_cache_preemption_and_choices(ckpts: MtpCheckpoints) -> None:
    """A KV pool too small for all four requests (so some are preempted and computed again),
    the prefix cache on (the second round hits the first one's blocks) and two choices on
    one request: greedy output with MTP drafts is the output of an engine with room for
    everything, no prefix cache and no drafts, and every block returns to the pool."""
    from colibri.engine import LLM, EngineConfig

    arch = "glm4_moe_rep"
    base = mtp_llm(ckpts[arch])
    prompts = [_ids(base, p) for p in PROMPTS]
    two = [_params(), _params()]
    plist: list[Any] = [_params(), two, _params(), _params()]
    want = _run(base, prompts, plist)
    need = -(-(max(len(p) for p in prompts) + 40) // 16)
    mb = 3 * need * base.model.kv_block_bytes() / 2**20
    llm = LLM(ckpts[arch], threads=2, quant="f32", n_ctx=N_CTX,
              config=EngineConfig(kv_cache_mb=mb, max_num_seqs=4, max_num_batched_tokens=64,
                                  speculative="mtp", num_speculative_tokens=3))
    for _ in range(2):
        got = _run(llm, prompts, plist)
        assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    assert llm.core.scheduler.n_preemptions > 0
    assert llm.core.blocks.prefix_hits > 0
    assert llm.core.spec_stats.n_accepted > 0


def test_models_without_a_usable_mtp_layer_are_refused(tmp_path: Path) -> None:
    """--speculative mtp on a checkpoint that ships no MTP layer (of a family that may have
    one, with linear-attention layers or not, and of one that never has one) fails at start
    with a message that says why and what to do."""
    from colibri.engine.core.mtp_layer import NoMtpLayer

    for arch in ("glm4_moe", "qwen3_next"):
        plain = make_checkpoint(arch, tmp_path / arch, seed=5)
        with pytest.raises(NoMtpLayer, match="no multi-token-prediction layer.*--add-mtp"):
            mtp_llm(plain, speculative="mtp")
    plain = make_checkpoint("mixtral", tmp_path / "mixtral", seed=5)
    with pytest.raises(NoMtpLayer, match="only DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5"):
        mtp_llm(plain, speculative="mtp")


def test_converted_folder_keeps_the_mtp_layer(ckpts: MtpCheckpoints,
                                              converted: dict[str, Path],
                                              tmp_path: Path) -> None:
    """The converter says it keeps the layer, the folder lists mtp/'s files (verify checks
    them, hashes and weights included), `colibri info` says the MTP layer is there and counts
    it apart from the model's parameters."""
    from colibri.engine.format.convert import describe_plan, verify
    from colibri.engine.format.safetensors_io import Checkpoint
    from colibri.engine.models import archs
    from colibri.engine.tools.info import describe, render

    hf = ckpts["deepseek_v3"]
    raw = json.loads((hf / "config.json").read_text())
    cfg = archs.colibri_config(raw, {})
    with Checkpoint(hf) as ck:
        names = set(ck.names())
    lines = describe_plan(cfg, names, archs.plan(cfg, names))
    assert any("multi-token-prediction layer 4 converted into mtp/" in x for x in lines)
    assert not any("skipping" in x for x in lines)
    folder = Path(shutil.copytree(converted["deepseek_v3"], tmp_path / "model"))
    verify(folder, full=True, deep=True)
    d = describe(folder)
    assert d["mtp"]["folder"] == "mtp" and d["mtp"]["params"] > 0
    assert "MTP layers    1 multi-token-prediction layer in mtp/" in render(d)
    (folder / "mtp" / "attention" / "layer_0.bin").write_bytes(b"broken")
    with pytest.raises(ValueError, match="mtp/attention/layer_0.bin"):
        verify(folder)


@pytest.mark.slow  # the bench's speculative report is quick in tests/test_bench.py
def test_bench_speculative_mtp(converted: dict[str, Path],
                               capsys: pytest.CaptureFixture[str]) -> None:
    """`colibri bench --speculative mtp` runs the step engine with and without MTP drafts
    (the same greedy tokens both ways, else the bench fails) and reports the counters."""
    from colibri.engine.tools.cli import main

    args = ["bench", "--model", str(converted["glm4_moe"]), "--prompt-tokens", "12",
            "--gen-tokens", "24", "--threads", "2", "--repeat", "2", "--probe-mib", "4",
            "--speculative", "mtp", "--num-speculative-tokens", "3", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)["speculative"]
    assert (r["method"], r["num_speculative_tokens"]) == ("mtp", 3)
    assert r["drafts"] > 0 and r["drafts"] <= r["draft_tokens"] <= 3 * r["drafts"]
    assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
