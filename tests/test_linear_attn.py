"""Gated DeltaNet linear attention (Qwen3-Next): the reference kernels against numpy, and the
per-sequence state slots the forward pass keeps beside the paged KV cache (logit parity with
transformers lives in tests/test_parity_families.py).

- the state update and the conv step equal a float64 numpy description of the formulas,
  including tail sizes, and write every output element; every ISA's state update equals the
  reference bit for bit;
- a sequence's state continues only where it stopped: a rewind, a missing or shared slot is
  refused and changes nothing; position 0 starts it afresh;
- copying a slot forks a sequence: both continue as the sequence would alone;
- an incomplete multi-token-prediction module (mtp.*) is skipped at conversion, and said (a
  complete one is converted: tests/test_mtp_qwen3_next.py);
- `colibri info`, routing traces and `colibri bench` follow the layer mix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core
from colibri.engine.errors import InputError
from colibri.engine.executor.model import Model
from tests.parity_helpers import prefill

N_CTX = 64


def _delta_numpy(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: float,
                 beta: float) -> tuple[np.ndarray, np.ndarray]:
    """transformers' torch_recurrent_gated_delta_rule for one token and one head, in float64."""
    S = S.astype(np.float64) * decay
    mem = (S * k[:, None]).sum(axis=0)
    delta = (v - mem) * beta
    S = S + k[:, None] * delta[None, :]
    return (S * q[:, None]).sum(axis=0), S


@pytest.mark.parametrize("dk,dv", [(16, 24), (1, 1), (7, 37), (128, 128)])
def test_delta_step_matches_numpy(dk: int, dv: int) -> None:
    rng = np.random.default_rng(dk * 1000 + dv)
    S = rng.standard_normal((dk, dv)).astype(np.float32)
    for _ in range(3):  # the state carries over
        q, k = ((rng.standard_normal(dk) / np.sqrt(dk)).astype(np.float32) for _ in range(2))
        v = rng.standard_normal(dv).astype(np.float32)
        decay, beta = float(rng.uniform(0.1, 1.0)), float(rng.uniform(0.0, 1.0))
        want, want_S = _delta_numpy(S, q, k, v, decay, beta)
        out = _core.delta_step_ref(S, q, k, v, decay, beta)
        assert np.all(np.isfinite(out)), "an output element was not written"
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(S, want_S, rtol=1e-5, atol=1e-5 * np.abs(want_S).max())


@pytest.mark.parametrize("isa", _core.isa_supported())
@pytest.mark.parametrize("dk,dv", [(16, 24), (3, 7), (128, 128), (5, 33)])
def test_delta_step_every_isa_equals_the_reference(isa: str, dk: int, dv: int) -> None:
    """Vector bodies and scalar tails (dv % 8, dv % 16) give the reference's bits."""
    rng = np.random.default_rng(7 * dk + dv)
    S0 = rng.standard_normal((dk, dv)).astype(np.float32)
    q, k = (rng.standard_normal(dk).astype(np.float32) for _ in range(2))
    v = rng.standard_normal(dv).astype(np.float32)
    S_ref, S_isa = S0.copy(), S0.copy()
    want = _core.delta_step_ref(S_ref, q, k, v, 0.75, 0.4)
    before = _core.isa_active()
    _core.isa_force(isa)
    try:
        got = _core.delta_step(S_isa, q, k, v, 0.75, 0.4)
    finally:
        _core.isa_force(before)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(S_isa, S_ref)


def test_delta_step_extremes() -> None:
    """decay 0 forgets the state; beta 0 leaves it decayed; beta 1 with a unit key writes v
    exactly at that key (the delta rule's overwrite)."""
    dk, dv = 4, 3
    S = np.arange(dk * dv, dtype=np.float32).reshape(dk, dv)
    k = np.eye(dk, dtype=np.float32)[1]
    v = np.array([1.0, -2.0, 3.0], np.float32)
    out = _core.delta_step_ref(S, k, k, v, 0.0, 1.0)
    np.testing.assert_array_equal(out, v)
    np.testing.assert_array_equal(S[1], v)
    assert not S[[0, 2, 3]].any()
    S2 = np.ones((dk, dv), np.float32)
    _core.delta_step_ref(S2, k, k, v, 0.5, 0.0)
    np.testing.assert_array_equal(S2, np.full((dk, dv), 0.5, np.float32))


@pytest.mark.parametrize("C,K", [(5, 4), (64, 2), (33, 5)])
def test_conv_step_matches_numpy(C: int, K: int) -> None:
    rng = np.random.default_rng(C * 10 + K)
    w = rng.standard_normal((C, K)).astype(np.float32)
    win = np.zeros((K - 1, C), np.float32)
    xs = rng.standard_normal((9, C)).astype(np.float32)
    padded = np.concatenate([np.zeros((K - 1, C)), xs.astype(np.float64)])
    for t in range(xs.shape[0]):
        y = _core.conv_step_ref(w, win, xs[t])
        s = (w.T.astype(np.float64) * padded[t:t + K]).sum(axis=0)  # causal, zero-padded
        np.testing.assert_allclose(y, s / (1 + np.exp(-s)), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(win, padded[t + 1:t + K].astype(np.float32))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.engine.format.convert import convert
    from tests.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("qwen3_next")
    hf = make_checkpoint("qwen3_next", root / "hf", seed=3)
    return convert(hf, root / "f32", quant="f32", progress=False)


def _prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 320, n).astype(np.int32)


def test_state_continues_only_where_it_stopped(hybrid: Path) -> None:
    m = Model.load(hybrid, threads=2, n_ctx=N_CTX, n_seq=2)
    p = _prompt(20)
    whole = prefill(m, p)
    assert m.kv.n_state_slots == 2 and m.kv.state_len(0) == 20 and m.kv.state_bytes > 0
    # a rewind is refused and changes nothing: the next token still continues the state
    with pytest.raises(InputError, match="cannot be rewound"):
        m.forward(p[10:12], np.zeros(2, np.int32), np.arange(10, 12, dtype=np.int32))
    assert m.kv.state_len(0) == 20
    # position 0 starts afresh: the same prompt gives the same bits
    m.reset(0)
    np.testing.assert_array_equal(prefill(m, p), whole)
    # forward_paged needs each sequence's slot, and one slot per sequence
    tables = m.slot_tables
    toks, seqs, pos = np.array([5, 6], np.int32), np.array([0, 1], np.int32), np.zeros(2, np.int32)
    with pytest.raises(InputError, match="state slots"):
        m.forward_paged(toks, seqs, pos, tables)
    with pytest.raises(InputError, match="used by sequences 0 and 1"):
        m.forward_paged(toks, seqs, pos, tables, state_slots=np.zeros(2, np.int32))
    with pytest.raises(InputError, match="not in 0..1"):
        m.forward_paged(toks, seqs, pos, tables, state_slots=np.array([0, 2], np.int32))
    assert m.kv.state_len(0) == 20 and m.kv.state_len(1) == -1


def test_a_copied_state_forks_the_sequence(hybrid: Path) -> None:
    """A prompt of two full KV blocks, then a fork: sequence 1 shares sequence 0's blocks and
    takes a copy of its state; each continues with its own tokens exactly as that sequence
    computed alone (bit for bit), and the fork left sequence 0's state untouched."""
    p = _prompt(2 * _core.KV_BLOCK, seed=1)
    tails = (np.array([7, 8, 9], np.int32), np.array([11, 3, 5], np.int32))
    alone = Model.load(hybrid, threads=2, n_ctx=N_CTX)
    want = []
    for tail in tails:
        alone.reset(0)
        want.append(prefill(alone, np.concatenate([p, tail]))[p.size:])
    nb = -(-N_CTX // _core.KV_BLOCK)
    m = Model.load(hybrid, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=2 * nb, state_slots=2)
    tab = np.arange(2 * nb, dtype=np.int32).reshape(2, nb)
    slots = np.array([0, 1], np.int32)
    m.forward_paged(p, np.zeros(p.size, np.int32), np.arange(p.size, dtype=np.int32), tab,
                    state_slots=slots)
    m.kv.copy_state(1, 0)
    assert m.kv.state_len(1) == p.size
    tab[1, :2] = tab[0, :2]  # the prompt's blocks, shared read-only
    n = tails[0].size
    toks = np.concatenate(tails)
    seqs = np.repeat(np.array([0, 1], np.int32), n)
    pos = np.tile(np.arange(p.size, p.size + n, dtype=np.int32), 2)
    out = m.forward_paged(toks, seqs, pos, tab, state_slots=slots)
    np.testing.assert_array_equal(out[:n], want[0])
    np.testing.assert_array_equal(out[n:], want[1])
    assert m.kv.state_len(0) == m.kv.state_len(1) == p.size + n


def test_mtp_module_is_skipped_and_said(hybrid: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.numpy import load_file, save_file

    from colibri.engine.format.convert import convert

    src = hybrid.parent / "hf"
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    tensors = load_file(str(hf / "model.safetensors"))
    mtp = {"mtp.fc.weight": np.zeros((64, 128), np.float32),
           "mtp.norm.weight": np.ones(64, np.float32),
           "mtp.layers.0.input_layernorm.weight": np.ones(64, np.float32)}
    save_file({**tensors, **mtp}, str(hf / "model.safetensors"), metadata={"format": "pt"})
    out = convert(hf, tmp_path / "f32", quant="f32", progress=True)
    err = capsys.readouterr().err
    assert ("recognised Qwen3NextForCausalLM as the qwen3_next family: 4 layers, 1 dense, "
            "3 with 8 experts") in err
    assert "3 linear attention (gated DeltaNet, conv width 4), 1 gated full attention" in err
    assert "skipping 3 tensors of the multi-token-prediction module (mtp.*)" in err
    assert (json.loads((out / "config.json").read_text())["files"]
            == json.loads((hybrid / "config.json").read_text())["files"])


def test_info_traces_and_bench_follow_the_layer_mix(hybrid: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.app.cli import main
    from colibri.engine.tools.info import describe, render
    from colibri.engine.tools.routing_trace import RouteRecorder, greedy_run

    d = describe(hybrid)
    text = render(d)
    assert ("layers        1 dense (2), 3 MoE (0, 1, 3), 3 linear attention (recurrent state "
            "per sequence) (0, 2, 3), 1 full attention (KV cache) (1)") in text
    assert "attn_gate=True" in text and "lin_conv=4" in text
    assert d["experts_per_layer"] == [8, 8, 0, 8]
    m = Model.load(hybrid, threads=2, n_ctx=N_CTX)
    rec = RouteRecorder(m)
    greedy_run(rec, np.arange(5, 25, dtype=np.int32), 6)
    trace = rec.trace("test")
    assert trace.n_layer == 3 and trace.n_tokens == 20 + 6  # the MoE layers only
    assert trace.routes.min() >= 0 and trace.routes.max() < 8
    assert main(["bench", "--model", str(hybrid), "--prompt-tokens", "12", "--gen-tokens", "6",
                 "--threads", "2", "--repeat", "1", "--probe-mib", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["architecture"] == "qwen3_next"


@pytest.mark.skipif("avx2" not in _core.isa_supported(), reason="needs AVX2")
def test_repacked_linear_layers_give_the_same_logits(hybrid: Path, tmp_path: Path) -> None:
    """Where the AVX2 products read interleaved rows, the linear layers' q8 projections are
    repacked too, and the logits stay those of the rows layout, bit for bit."""
    from colibri.engine.format.convert import convert

    q8 = convert(hybrid.parent / "hf", tmp_path / "q8", quant="q8", progress=False)
    p = _prompt(21, seed=4)
    before = _core.isa_active()
    _core.isa_force("avx2")
    try:
        rows = prefill(Model.load(q8, threads=2, n_ctx=N_CTX), p)
        packed = Model.load(q8, threads=2, n_ctx=N_CTX)
        n = packed.core.repack(experts=True)
        got = prefill(packed, p)
    finally:
        _core.isa_force(before)
    # per linear layer lin_qkvz, lin_ba (8 rows) and lin_out; per attention layer wq, wk, wv, wo
    cfg = json.loads((q8 / "config.json").read_text())
    n_lin = cfg["layer_mixer"].count("linear")
    assert n >= 3 * n_lin + 4
    np.testing.assert_array_equal(got, rows)


def test_multimodal_qwen3_5_checkpoint_serves_its_text_model(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """Qwen3.5 ships as Qwen3_5MoeForConditionalGeneration: text_config and
    model.language_model.* are converted, the vision encoder is skipped and said, and the
    text logits match transformers' multimodal model at f32 (1e-4)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from colibri.engine.format.convert import convert
    from tests.parity_helpers import hf_model, rel_max
    from tests.tiny_models import _BASE, _randomize

    text = dict(_BASE["qwen3_5_moe"], vocab_size=320, eos_token_id=2, pad_token_id=0,
                bos_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    _randomize(model, 6)
    hf = tmp_path / "hf"
    model.save_pretrained(str(hf))
    out = convert(hf, tmp_path / "f32", quant="f32", progress=True)
    err = capsys.readouterr().err
    assert "recognised Qwen3_5MoeForConditionalGeneration as the qwen3_5_moe family" in err
    assert "tensors of the vision encoder (model.visual.*): only the text model is served" in err
    ids = _prompt(22, seed=9)
    ours = prefill(Model.load(out, threads=2, n_ctx=N_CTX), ids)
    with torch.no_grad():
        ref = hf_model(hf)(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    assert rel_max(ours, ref) <= 1e-4
