"""Multi-token-prediction drafts for Qwen3-Next and Qwen3.5 (`--speculative mtp`): the converter
keeps their mtp.* module as a one-layer model in the folder's mtp/; its logits match a torch
reference built from transformers' own classes (f32, 1e-4), at position 0 and chained on its
own normed hidden state too; greedy output with its drafts is token for token the output
without them at several k, with an expert budget too, while the linear-attention layers'
states are saved and restored around each verify step; a cached conversion made without the
module gets only the module added, and a folder without it is refused with the command that
adds it.

transformers ignores mtp.* on load: the checkpoints here are tiny random models plus an mtp.*
module whose decoder layer is a one-layer transformers model of the same family (a full
attention layer with the MoE), saved as checkpoints name it, and random fc and norms.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import mtp_helpers
from tests.conftest import quick_params
from tests.mtp_helpers import TOL, MtpCheckpoints, mtp_llm
from tests.parity_helpers import hf_model, rel_max
from tests.test_speculative import PROMPTS, _ids, _params, _run, _spec, _trace
from tests.tiny_models import TinyCheckpoints, make_checkpoint

ARCHS = ("qwen3_next", "qwen3_5_moe")
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


@pytest.fixture(scope="module", autouse=True)
def _cache(own_cache_dir: Path) -> None:
    """Conversions of this module's checkpoints in a cache folder of their own."""


def _layer_dir(out: Path) -> Path:
    return out.parent / f"{out.name}_mtp_layer"


def make_qwen_mtp_checkpoint(arch: str, out: Path, seed: int = 11,
                             repeat: bool = False) -> Path:
    """A tiny arch checkpoint with an mtp.* module as Qwen3-Next / Qwen3.5 checkpoints ship
    it: mtp.layers.0 is the layer of a one-layer full-attention model of the same family
    (kept beside it in _layer_dir(out) for the reference), mtp.fc [D, 2D] and the three
    zero-centred norms random. With repeat, the module proposes the token just chosen again:
    fc keeps only the hidden half, the layer adds nothing (zero output and down projections)
    and its norms multiply by 1, so its logits are the main model's at the same position
    scaled (each norm only rescales a vector), which lets drafts be accepted wherever the
    model repeats a token; and the main model's lm_head leans toward the embedding of the
    token read (lm_head + 0.3 embed, at the lm_head's scale), so that it repeats one often
    but not always (random tiny hybrid models hardly ever do)."""
    import torch
    from safetensors.torch import load_file, save_file

    make_checkpoint(arch, out, seed=seed)
    one = dict(num_hidden_layers=1, layer_types=["full_attention"])
    if arch == "qwen3_next":
        one["mlp_only_layers"] = []
    layer_dir = make_checkpoint(arch, _layer_dir(out), seed=seed + 1, **one)
    tensors = load_file(str(out / "model.safetensors"))
    for k, v in load_file(str(layer_dir / "model.safetensors")).items():
        if k.startswith("model.layers.0."):
            tensors["mtp.layers.0." + k[len("model.layers.0."):]] = v
    D = json.loads((out / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(seed + 2)
    tensors["mtp.fc.weight"] = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    for n in MTP_NORMS:
        tensors[f"mtp.{n}.weight"] = 0.3 * torch.randn(D, generator=g)
    if repeat:
        e, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
        tensors["lm_head.weight"] = head + 0.3 * e * (head.norm() / e.norm())
        tensors["mtp.fc.weight"] = torch.cat([torch.zeros(D, D), torch.eye(D)], dim=1)
        for n in MTP_NORMS:
            tensors[f"mtp.{n}.weight"] = torch.zeros(D)
        mtp_helpers.silence_layer(tensors, "mtp.layers.0.")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ckpts(checkpoints: TinyCheckpoints) -> MtpCheckpoints:
    return MtpCheckpoints(checkpoints, make_qwen_mtp_checkpoint)


class QwenMtpReference:
    """The mtp.* module in torch, as vLLM's qwen3_next_mtp runs it, from transformers' classes:
    x = fc([norm_e(embed(t_{i+1})); norm_h(h_i)]) with the family's zero-centred RMSNorm (the
    embedding first and not zeroed at position 0), h_i the main model's output after its
    final norm or, chained, the module's own output after mtp.norm; then transformers'
    one-layer model of the family (its decoder layer holding mtp.layers.0) with mtp.norm as
    its final norm and the main model's embeddings and lm_head."""

    def __init__(self, hf_dir: Path, arch: str) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

        norm_cls = Qwen3NextRMSNorm if arch.startswith("qwen3_next") else Qwen3_5MoeRMSNorm
        raw = json.loads((hf_dir / "config.json").read_text())
        eps, D = float(raw["rms_norm_eps"]), int(raw["hidden_size"])
        t = load_file(str(hf_dir / "model.safetensors"))
        self.model = hf_model(_layer_dir(hf_dir))
        assert self.model.config.num_hidden_layers == 1
        with torch.no_grad():
            self.model.model.embed_tokens.weight.copy_(t["model.embed_tokens.weight"])
            self.model.lm_head.weight.copy_(t["lm_head.weight"])
            self.model.model.norm.weight.copy_(t["mtp.norm.weight"])
        self.norm_e, self.norm_h = norm_cls(D, eps), norm_cls(D, eps)
        with torch.no_grad():
            self.norm_e.weight.copy_(t["mtp.pre_fc_norm_embedding.weight"])
            self.norm_h.weight.copy_(t["mtp.pre_fc_norm_hidden.weight"])
        self.fc = t["mtp.fc.weight"].float()
        self.embed = t["model.embed_tokens.weight"].float()
        self.normed: list[Any] = []
        self.model.model.norm.register_forward_hook(
            lambda _m, _a, out: self.normed.append(out.detach()))
        self.torch = torch

    def inputs(self, next_tokens: list[int], hidden: Any, first: int = 0) -> Any:
        """The module's input rows for tokens t_{i+1} and hidden states h_i ([n, D]) (at
        any position: the embedding is not zeroed at position 0)."""
        with self.torch.no_grad():
            e = self.norm_e(self.embed[next_tokens])
            h = self.norm_h(hidden.float())
            return self.torch.cat([e, h], dim=-1) @ self.fc.T

    def run(self, x: Any) -> tuple[np.ndarray, np.ndarray]:
        """Logits and hidden states (after mtp.norm) of input rows x at positions 0..n-1."""
        self.normed.clear()
        with self.torch.no_grad():
            logits = self.model(inputs_embeds=x[None]).logits[0]
        return logits.numpy(), self.normed[-1][0].numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_qwen_mtp_layer_matches_a_transformers_reference(ckpts: MtpCheckpoints, arch: str,
                                                         tmp_path: Path) -> None:
    """The converted module, run on the main model's normed output, gives the reference's
    logits and normed hidden states at every position of a prompt (position 0 included,
    where the embedding is not zeroed), and chained on its own normed hidden state and its
    own draft, one position on, in f32 within 1e-4 of the largest logit."""
    import torch

    from colibri.engine.executor.model import Model
    from colibri.engine.format.convert import convert

    folder = convert(ckpts[arch], tmp_path / "conv", quant="f32", progress=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["mtp"] == "mtp" and "mtp/embeddings.bin" in cfg["files"]
    main = Model.load(folder, threads=2, n_ctx=mtp_helpers.N_CTX)
    layer = Model.load(folder / "mtp", threads=2, n_ctx=mtp_helpers.N_CTX)
    lc = layer.config
    assert lc.mtp_input and lc.mtp_keep_first and lc.mtp_chain_normed
    assert lc.n_layer == 1 and not lc.hybrid and lc.layer_ffn == ("moe",)

    hf = hf_model(ckpts[arch])
    captured: list[Any] = []
    hf.model.norm.register_forward_hook(lambda _m, _a, out: captured.append(out))
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 320, size=20)]
    with torch.no_grad():
        hf(torch.tensor([ids]))
    h_ref = captured[-1][0]
    _, h = mtp_helpers.paged(main, ids, 0, normed=True)
    assert rel_max(h, h_ref.numpy()) < TOL

    ref = QwenMtpReference(ckpts[arch], arch)
    x = ref.inputs(ids[1:], h_ref[:-1])
    want, want_h = ref.run(x)
    got, got_h = mtp_helpers.paged(layer, ids[1:], 0, hidden_in=h[:-1].copy(), normed=True)
    assert rel_max(got, want) < TOL
    assert rel_max(got_h, want_h) < TOL

    draft = int(np.argmax(got[-1]))
    x2 = torch.cat([x, ref.inputs([draft], torch.from_numpy(want_h[-1:]))])
    want2, _ = ref.run(x2)
    got2, _ = mtp_helpers.paged(layer, [draft], len(ids) - 1, hidden_in=got_h[-1:].copy())
    assert rel_max(got2[0], want2[-1]) < TOL


def test_engine_drafts_are_the_reference_modules_chained_drafts(ckpts: MtpCheckpoints) -> None:
    """Two requests decoding together with k = 4: at every step each request's first draft
    is what the reference module gives over its tokens so far (every position from the main
    model's outputs), and at its first steps the chained drafts are the reference's chained
    on its own output after mtp.norm and its drafts; each draft a largest reference logit
    within 1e-4."""
    arch = "qwen3_next"
    llm = mtp_llm(ckpts[arch], speculative="mtp", num_speculative_tokens=4)
    prompts = [_ids(llm, p) for p in PROMPTS[:2]]
    ref = QwenMtpReference(ckpts[arch], arch)
    mtp_helpers.assert_drafts_are_the_references(llm, prompts, _params(max_tokens=10),
                                                 hf_model(ckpts[arch]), ref, min_steps=3)


# the hybrid family whose layer repeats (drafts kept and rejected) in the quick pass
@pytest.mark.parametrize("arch", quick_params([*ARCHS, *(f"{a}_rep" for a in ARCHS)],
                                              ["qwen3_5_moe_rep"]))
def test_greedy_output_is_the_same_with_qwen_mtp_drafts(ckpts: MtpCheckpoints,
                                                        arch: str) -> None:
    """Four prompts together, greedy with logprobs: with the module's drafts at k = 1, 2, 4
    the outputs equal those without speculation, token for token and logprob for logprob;
    no more sequences draft in a step than there are spare state slots to save their
    linear-attention states in. The module that repeats the last token drafts exactly that,
    and some of its drafts are accepted, some rejected (so states were restored)."""
    base = mtp_llm(ckpts[arch])
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    spec = mtp_llm(ckpts[arch], speculative="mtp", num_speculative_tokens=2)
    core = spec.core
    assert core._mtp is not None and core.hybrid and core.speculates
    n_slots = len(core.snapshot_slots)
    assert 0 < n_slots < len(prompts)
    per_step: list[int] = []
    propose = core._mtp_propose

    def counted(mtp: Any) -> None:
        propose(mtp)
        per_step.append(sum(1 for r in core.scheduler.running if r.drafts))

    core._mtp_propose = counted
    seen = mtp_helpers.watch_drafts(core)
    accepted = rejected = 0
    for k in (1, 2, 4):
        _spec(spec, k, "mtp")
        got = _run(spec, prompts, _params())
        for rid in want:
            assert _trace(got[rid]) == _trace(want[rid]), (arch, k, rid)
        st = core.spec_stats
        assert st.n_drafts > 0 and st.n_drafts <= st.n_draft_tokens <= k * st.n_drafts
        accepted += st.n_accepted
        rejected += st.n_draft_tokens - st.n_accepted
    assert per_step and max(per_step) == n_slots
    if arch.endswith("_rep"):
        assert seen and all(d == [t[-1]] * len(d) for d, t in seen)
        assert accepted > 0 and rejected > 0


@pytest.mark.slow  # seconds; MTP drafts under a budget run quick in tests/test_mtp.py
def test_qwen_mtp_drafts_under_an_expert_budget(ckpts: MtpCheckpoints) -> None:
    """With three of eight experts per layer resident, greedy output with the module's drafts
    at k = 1, 2, 4 is the output with every expert resident and no drafts."""
    from colibri.engine.core.options import ExpertCacheConfig

    arch = "qwen3_next_rep"
    base = mtp_llm(ckpts[arch])
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    llm = mtp_llm(ckpts[arch], speculative="mtp", num_speculative_tokens=3,
               expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False))
    for k in (1, 2, 4):
        _spec(llm, k, "mtp")
        got = _run(llm, prompts, _params())
        assert all(_trace(got[r]) == _trace(want[r]) for r in want), k
        assert llm.core.spec_stats.n_accepted > 0
    assert llm.core.expert_cache.totals()["misses"] > 0  # the budget was in play


def test_converter_says_it_keeps_the_module(ckpts: MtpCheckpoints) -> None:
    """The conversion plan says the mtp.* module goes into mtp/ and skips nothing."""
    from colibri.engine.format.convert import describe_plan
    from colibri.engine.format.safetensors_io import Checkpoint
    from colibri.engine.models import archs

    hf = ckpts["qwen3_next"]
    cfg = archs.colibri_config(json.loads((hf / "config.json").read_text()), {})
    with Checkpoint(hf) as ck:
        names = set(ck.names())
    lines = describe_plan(cfg, names, archs.plan(cfg, names))
    assert any("multi-token-prediction module (mtp.*) converted into mtp/" in x for x in lines)
    assert not any("skipping" in x for x in lines)


def _strip_mtp(folder: Path) -> None:
    """folder as a conversion made before the module was kept: no mtp/, not in config.json."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["mtp"]
    cfg["files"] = {k: v for k, v in cfg["files"].items() if not k.startswith("mtp/")}
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(folder / "mtp")


def test_cached_conversion_without_the_module_gets_only_the_module(
        ckpts: MtpCheckpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A cache entry converted without the mtp.* module (as before it was kept) gets just the
    module added at the next start, its other files untouched; `--speculative mtp` then drafts
    and gives the output without drafts. A folder given directly that lacks the module is
    refused with the command that adds it, and that command adds it."""
    from colibri.engine.core.mtp_layer import NoMtpLayer
    from colibri.engine.format.convert import ensure_converted, verify
    from colibri.engine.tools.cli import main

    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path / "cache"))
    hf = ckpts["qwen3_next_rep"]
    dest = ensure_converted(hf, "f32")
    _strip_mtp(dest)
    verify(dest, full=True)  # a complete folder of its own, as an old conversion is
    stamps = {p: p.stat().st_mtime_ns for p in dest.rglob("*.bin")}
    os.utime(dest / "embeddings.bin", ns=(1, 1))
    stamps[dest / "embeddings.bin"] = 1
    assert ensure_converted(hf, "f32") == dest
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*.bin")
            if not p.is_relative_to(dest / "mtp")} == stamps
    assert json.loads((dest / "config.json").read_text())["mtp"] == "mtp"
    verify(dest, full=True, deep=True)

    base = mtp_llm(hf)
    prompts = [_ids(base, p) for p in PROMPTS]
    want = _run(base, prompts, _params())
    spec = mtp_llm(hf, speculative="mtp", num_speculative_tokens=3)
    got = _run(spec, prompts, _params())
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    assert spec.core.spec_stats.n_accepted > 0

    mine = Path(shutil.copytree(dest, tmp_path / "mine"))
    _strip_mtp(mine)
    with pytest.raises(NoMtpLayer, match="colibri convert --add-mtp HF_DIR"):
        mtp_llm(mine, speculative="mtp")
    assert main(["convert", "--add-mtp", str(hf), str(mine)]) == 0
    verify(mine, full=True, deep=True)
    assert main(["convert", "--add-mtp", str(hf), str(mine)]) == 0  # there already
    got = _run(mtp_llm(mine, speculative="mtp", num_speculative_tokens=3), prompts, _params())
    assert all(_trace(got[r]) == _trace(want[r]) for r in want)
    _strip_mtp(mine)  # and another model's checkpoint cannot give it
    other = make_checkpoint("qwen3_next", tmp_path / "other", seed=5, num_experts=4)
    capsys.readouterr()
    assert main(["convert", "--add-mtp", str(other), str(mine)]) != 0
    assert "is not a conversion of" in capsys.readouterr().err
    assert not (mine / "mtp").exists() and "mtp" not in json.loads(
        (mine / "config.json").read_text())


def test_multimodal_qwen3_5_keeps_the_module_with_the_text_models_embeddings(
        ckpts: MtpCheckpoints) -> None:
    """A multimodal Qwen3.5 checkpoint keeps its text model under model.language_model. and
    the module at the top level (mtp.*): the module's plan takes the text model's
    embeddings and the lm_head, and everything else from mtp.*."""
    from colibri.engine.format.safetensors_io import Checkpoint
    from colibri.engine.models import archs

    hf = ckpts["qwen3_5_moe"]
    text = json.loads((hf / "config.json").read_text())
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text,
           "tie_word_embeddings": False}
    with Checkpoint(hf) as ck:
        names = {n.replace("model.", "model.language_model.", 1) if n.startswith("model.")
                 else n for n in ck.names()}
    cfg = archs.colibri_config(raw, {})
    mtp = archs.mtp_plan(cfg, names)
    assert mtp is not None
    sources = {t.name: t.source.hf_name for t in mtp[1] if t.file == "embeddings.bin"}
    assert sources["tok_embd"] == "model.language_model.embed_tokens.weight"
    assert sources["output"] == "lm_head.weight"
    assert {t.source.hf_name for t in mtp[1]} - {sources["tok_embd"], sources["output"]} == {
        n for n in names if n.startswith("mtp.")}
