"""The torch backend on torch's CPU device (`--device torch-cpu`, the code a CUDA device runs)
against the C core and transformers, for every family it runs, on tiny random checkpoints:

- f32: prompt logits within 1e-4 (max |diff| / max |ref|) of the C core's and of transformers
  float32; 16 greedy tokens through its paged KV cache equal the C core's;
- q8: relative L2 of the logits <= 5e-2 against transformers float32 with transformers' routers
  made to pick the experts the torch backend picked (the q8 tolerance and method of
  tests/test_parity_families.py: near-ties of tiny random routers are not what is measured);
- split placements (some layers on the torch backend, the rest on the C core, in one step):
  greedy tokens equal the all-C tokens, logits within 1e-4; the C core's layer spans
  (clb_forward_span) called in order give clb_forward's logits bit for bit;
- two sequences in one paged call give what each gives alone; a refused call names the input;
- linear-attention layers (Qwen3-Next, Qwen3.5): a prompt in uneven chunks then decode gives
  the C core's logits and tokens; sequences batched with their state slots give what each
  gives alone; a saved state restored continues as before; the chunked form of the delta rule
  equals the recurrent one; the state slots refuse what the C core's refuse.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.engine.errors import InputError  # noqa: E402
from colibri.engine.executor.backend import LayerOp, Placement, step_ops  # noqa: E402
from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import (  # noqa: E402
    assert_paged_batch_invariant,
    prefill,
    rel_l2,
    rel_max,
)
from tests.test_parity_families import CASES as FAMILY_CASES  # noqa: E402
from tests.test_parity_families import _forced_routing  # noqa: E402
from tests.tiny_models import ARCHS, VOCAB_SIZE, TinyCheckpoints, make_checkpoint  # noqa: E402

N_CTX = 64
N_GEN = 16
# scripts/device_check.sh runs these on a GPU with COLIBRI_TEST_TORCH_DEVICE=cuda:0
TORCH = os.environ.get("COLIBRI_TEST_TORCH_DEVICE", "torch-cpu")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{a: (a, {}) for a in ARCHS},
    **FAMILY_CASES,
}


class Case:
    def __init__(self, name: str, checkpoints: TinyCheckpoints) -> None:
        self.arch, overrides = CASES[name]
        self.ckpt = checkpoints.get(self.arch, seed=11, **overrides)
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.prompt = rng.integers(0, VOCAB_SIZE, 24).astype(np.int32)

    def converted(self, preset: str) -> Path:
        return self.ckpt.converted(preset)

    def reference(self, routes: np.ndarray | None = None) -> np.ndarray:
        hf = self.ckpt.hf
        hooks = _forced_routing(hf, routes) if routes is not None else []
        try:
            with torch.no_grad():
                ids = torch.tensor(self.prompt[None].astype(np.int64))
                return hf(ids).logits[0].float().numpy()
        finally:
            for h in hooks:
                h.remove()


# every family takes seconds: a softmax MoE, MLA, sinks and linear attention run in the quick
# pass (where the C core's parity of every family runs too), the rest in the whole suite
QUICK = ("mixtral", "deepseek_v3", "gpt_oss", "qwen3_next")
# split placements: a plain MoE and a linear-attention model (each split takes seconds)
QUICK_SPLIT = ("mixtral", "qwen3_next")


@pytest.fixture(scope="module", params=quick_params(CASES, QUICK))
def case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return Case(request.param, checkpoints)


@pytest.fixture(scope="module", params=quick_params(CASES, QUICK_SPLIT))
def split_case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return Case(request.param, checkpoints)


def _greedy(m: Model, prompt: np.ndarray, n: int) -> list[int]:
    logits = prefill(m, prompt)
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        pos = prompt.size + i
        logits = m.forward(np.array([out[-1]], np.int32), np.zeros(1, np.int32),
                           np.array([pos], np.int32))
        out.append(int(logits[-1].argmax()))
    return out


def test_f32_logits_and_greedy_tokens_match_the_c_core(case: Case) -> None:
    path = case.converted("f32")
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    t = Model.load(path, n_ctx=N_CTX, device=TORCH)
    assert t.device == TORCH and type(t.core).__name__ == "TorchCore"
    ours = prefill(t, case.prompt)
    assert rel_max(ours, prefill(c, case.prompt)) <= 1e-4
    assert rel_max(ours, case.reference()) <= 1e-4
    c.reset(0)
    t.reset(0)
    assert _greedy(t, case.prompt, N_GEN) == _greedy(c, case.prompt, N_GEN)


def test_q8_logits_within_the_q8_tolerance(case: Case) -> None:
    t = Model.load(case.converted("q8"), n_ctx=N_CTX, device=TORCH)
    cfg = t.config
    routes = (np.full((case.prompt.size, cfg.n_layer, cfg.n_expert_used), -1, np.int32)
              if cfg.n_expert else None)
    ours = t.forward(case.prompt, np.zeros(case.prompt.size, np.int32),
                     np.arange(case.prompt.size, dtype=np.int32), routes=routes)
    assert rel_l2(ours, case.reference(routes)) <= 5e-2


def _on_torch(path: Path, layers: set[int]) -> Placement:
    """Layers `layers` on the torch backend, the rest (with their experts) on the C core."""
    from colibri.engine.models.config import ModelConfig

    ops = step_ops(ModelConfig.from_dir(path))
    return Placement(default="c", ops={o: "torch" for o in ops if o.layer in layers})


def test_split_placement_tokens_equal_all_cpu(split_case: Case) -> None:
    case = split_case
    path = case.converted("f32")
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    want_tokens = _greedy(c, case.prompt, N_GEN)
    c.reset(0)
    want = prefill(c, case.prompt)
    n = c.config.n_layer
    splits = [{0}, {n - 1}, set(range(1, n, 2))]
    for layers in [x for i, x in enumerate(splits) if x not in splits[:i]]:
        s = Model.load(path, threads=2, n_ctx=N_CTX, device=TORCH,
                       placement=_on_torch(path, layers))
        assert type(s.core).__name__ == "SplitCore" and "torch" in s.core.backends
        assert rel_max(prefill(s, case.prompt), want) <= 1e-4, layers
        s.reset(0)
        assert _greedy(s, case.prompt, N_GEN) == want_tokens, layers


def test_c_layer_spans_equal_the_whole_step_bit_for_bit(case: Case) -> None:
    """Also over linear-attention layers: each span starts and advances its own layers'
    part of the state slot, so a prompt then a decode token, both in spans, give the whole
    steps' bits."""
    m = Model.load(case.converted("q8"), threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=4,
                   state_slots=1)
    parts = Model.load(case.converted("q8"), threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=4,
                       state_slots=1)
    n, L = case.prompt.size, m.config.n_layer
    slots = np.zeros(1, np.int32) if m.config.hybrid else None
    tables = np.array([[0, 1, -1, -1]], np.int32)
    cuts = [0, *range(1, L), L]
    for toks, pos in ((case.prompt[:-1], np.arange(n - 1)), (case.prompt[-1:], [n - 1])):
        args = (toks, np.zeros(toks.size, np.int32), np.asarray(pos, np.int32), None, tables)
        whole = m.core.forward(m.kv, *args, state_slots=slots)
        h = np.full((toks.size, m.config.n_embd), np.nan, np.float32)
        for a, b in zip(cuts, cuts[1:], strict=False):
            out = parts.core.forward(parts.kv, *args, state_slots=slots, span=(a, b), hidden=h)
            assert out.shape[0] == (toks.size if b == L else 0)
        assert np.array_equal(out, whole)
    if m.config.hybrid:
        assert parts.kv.state_len(0) == m.kv.state_len(0) == n
    with pytest.raises(ValueError, match="span"):
        parts.core.forward(parts.kv, *args, state_slots=slots, span=(1, L + 1), hidden=h)


def test_a_placement_that_splits_a_layer_is_refused(checkpoints: TinyCheckpoints) -> None:
    path = checkpoints.get("mixtral", seed=3).converted("f32")
    from colibri.engine.executor.backend import Op

    bad = Placement(default="c", ops={LayerOp(0, Op.EXPERTS): "torch"})
    with pytest.raises(ValueError, match="layer 0"):
        Model.load(path, n_ctx=N_CTX, device=TORCH, placement=bad)


def test_paged_calls_are_batch_invariant(checkpoints: TinyCheckpoints) -> None:
    """Two sequences in one call (in blocks of one shared pool, through block tables) give
    what each gives alone, and a prompt in two chunks gives one call's logits."""
    path = checkpoints.get("mixtral", seed=3).converted("f32")
    m = Model.load(path, n_ctx=N_CTX, n_seq=0, kv_blocks=16, device=TORCH)
    alone = Model.load(path, n_ctx=N_CTX, device=TORCH)
    a, ra = assert_paged_batch_invariant(m, alone, seed=0)
    alone.reset(0)
    first = prefill(alone, a[:13])
    rest = prefill(alone, a[13:], start=13)
    np.testing.assert_allclose(np.concatenate([first, rest]), ra, rtol=0,
                               atol=1e-5 * np.abs(ra).max())
    with pytest.raises(InputError, match="block"):
        m.forward_paged(a[:1], np.zeros(1), np.zeros(1), np.array([[99]], np.int32))


def test_what_it_does_not_run_is_refused_by_name(checkpoints: TinyCheckpoints) -> None:
    path = checkpoints.get("mixtral", seed=3).converted("f32")
    with pytest.raises(ValueError, match="KV cache"):
        Model.load(path, n_ctx=N_CTX, device=TORCH, kv_type="q8")


# ---- linear-attention layers ------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_next_state")
    hf = make_checkpoint("qwen3_next", root / "hf", seed=5)
    return convert(hf, root / "f32", quant="f32", progress=False)


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB_SIZE, n).astype(np.int32)


def test_linear_attention_in_uneven_chunks_then_decode_equals_the_c_core(hybrid: Path) -> None:
    """A prompt fed in chunks of 7, 1 and 13 positions, then 8 decode steps: each call's
    logits within 1e-4 of the C core's fed the same way, the greedy tokens equal."""
    c = Model.load(hybrid, threads=2, n_ctx=N_CTX)
    t = Model.load(hybrid, n_ctx=N_CTX, device=TORCH)
    p = _ids(21, 1)
    start = 0
    for size in (7, 1, 13):
        got = prefill(t, p[start:start + size], start=start)
        want = prefill(c, p[start:start + size], start=start)
        assert rel_max(got, want) <= 1e-4, (start, size)
        start += size
    toks = [int(want[-1].argmax())]
    assert int(got[-1].argmax()) == toks[0]
    for i in range(8):
        pos = np.array([start + i], np.int32)
        a = t.forward(np.array(toks[-1:], np.int32), np.zeros(1, np.int32), pos)
        b = c.forward(np.array(toks[-1:], np.int32), np.zeros(1, np.int32), pos)
        assert rel_max(a, b) <= 1e-4 and int(a[-1].argmax()) == int(b[-1].argmax())
        toks.append(int(b[-1].argmax()))
    assert t.kv.state_len(0) == start + 8


def test_linear_attention_sequences_batched_give_what_each_gives_alone(hybrid: Path) -> None:
    """Three sequences of different lengths in one paged call, their tokens interleaved, each
    in its own state slot (slots not in sequence order); then a step decoding two of them
    while the third starts again: each row as the sequence alone gives it."""
    nb = -(-N_CTX // 16)
    m = Model.load(hybrid, n_ctx=N_CTX, n_seq=0, kv_blocks=3 * nb, state_slots=4,
                   device=TORCH)
    alone = Model.load(hybrid, n_ctx=N_CTX, device=TORCH)
    ps = [_ids(n, 10 + n) for n in (9, 17, 3)]
    refs = []
    for p in ps:
        alone.reset(0)
        refs.append(prefill(alone, np.concatenate([p, [4]]).astype(np.int32)))
    tables = np.arange(3 * nb, dtype=np.int32).reshape(3, nb)
    slots = np.array([2, 0, 3], np.int32)
    seq = np.concatenate([np.full(p.size, i, np.int32) for i, p in enumerate(ps)])
    pos = np.concatenate([np.arange(p.size, dtype=np.int32) for p in ps])
    order = np.argsort(np.r_[np.arange(9) * 2.0, np.arange(17) * 1.0, np.arange(3) * 5.0],
                       kind="stable")  # interleaved, each sequence's tokens in order
    out = m.forward_paged(np.concatenate(ps)[order], seq[order], pos[order], tables,
                          state_slots=slots)
    for i, p in enumerate(ps):
        rows = out[seq[order] == i]
        np.testing.assert_allclose(rows, refs[i][:p.size], rtol=0,
                                   atol=1e-5 * np.abs(refs[i]).max())
    out = m.forward_paged(np.array([4, 4, ps[2][0]], np.int32), np.array([0, 1, 2], np.int32),
                          np.array([9, 17, 0], np.int32), tables, state_slots=slots)
    for row, ref in zip(out, (refs[0][9], refs[1][17], refs[2][0]), strict=True):
        np.testing.assert_allclose(row, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert [m.kv.state_len(s) for s in range(4)] == [18, -1, 10, 1]


def test_linear_attention_state_saved_and_restored_continues(hybrid: Path) -> None:
    """The speculation path's snapshot: copy a sequence's state aside, run two tokens (a
    rejected draft), copy it back: the next token gives what it gives without the detour;
    and the state slots refuse a rewind, a missing slot and a shared one, changing nothing."""
    nb = -(-N_CTX // 16)
    m = Model.load(hybrid, n_ctx=N_CTX, n_seq=0, kv_blocks=2 * nb, state_slots=3,
                   device=TORCH)
    c = Model.load(hybrid, threads=2, n_ctx=N_CTX)
    p = _ids(12, 3)
    tables = np.arange(2 * nb, dtype=np.int32).reshape(2, nb)
    slot = np.array([1], np.int32)
    m.forward_paged(p, np.zeros(12, np.int32), np.arange(12, dtype=np.int32), tables,
                    state_slots=slot)
    m.kv.copy_state(2, 1)
    assert m.kv.state_len(2) == 12
    m.forward_paged(np.array([5, 6], np.int32), np.zeros(2, np.int32),
                    np.array([12, 13], np.int32), tables, state_slots=slot)
    assert m.kv.state_len(1) == 14
    m.kv.copy_state(1, 2)
    got = m.forward_paged(np.array([7], np.int32), np.zeros(1, np.int32),
                          np.array([12], np.int32), tables, state_slots=slot)
    want = prefill(c, np.concatenate([p, [7]]).astype(np.int32))[-1:]
    assert rel_max(got, want) <= 1e-4
    with pytest.raises(InputError, match="cannot be rewound"):
        m.forward_paged(np.array([7], np.int32), np.zeros(1, np.int32),
                        np.array([5], np.int32), tables, state_slots=slot)
    two = (np.array([5, 6], np.int32), np.array([0, 1], np.int32), np.zeros(2, np.int32))
    with pytest.raises(InputError, match="state slots"):
        m.forward_paged(*two, tables)
    with pytest.raises(InputError, match="used by sequences 0 and 1"):
        m.forward_paged(*two, tables, state_slots=np.zeros(2, np.int32))
    with pytest.raises(InputError, match="not in 0..2"):
        m.forward_paged(*two, tables, state_slots=np.array([0, 3], np.int32))
    with pytest.raises(InputError, match="state slots"):
        m.kv.copy_state(0, 3)
    assert [m.kv.state_len(s) for s in range(3)] == [-1, 13, 12]


def test_chunked_delta_rule_equals_the_recurrent_one() -> None:
    """The chunked form (long prefill chunks) against one position at a time, from a nonzero
    state, with sequences of different lengths padded (a pad leaves the state as it is)."""
    from colibri.engine.executor.torch_backend.linear import _chunked, _recurrent

    g = torch.Generator().manual_seed(0)
    S_, L, H, dk, dv = 3, 70, 2, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(S_, L, H, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(S_, L, H, dv, generator=g)
    gl = -torch.rand(S_, L, H, generator=g)
    beta = torch.rand(S_, L, H, generator=g)
    gl[2, 40:], beta[2, 40:] = 0.0, 0.0  # sequence 2 ends at 40
    S0 = torch.randn(S_, H, dk, dv, generator=g)
    Sa, Sb = S0.clone(), S0.clone()
    want = _recurrent(Sa, q, k, v, gl, beta)
    got = _chunked(Sb, q, k, v, gl, beta, chunk=16)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    torch.testing.assert_close(Sb, Sa, rtol=0, atol=1e-4 * float(Sa.abs().max()))


def test_linear_attention_long_prefill_takes_the_chunked_form(hybrid: Path) -> None:
    """A prompt longer than the chunked form's threshold: its logits and state still give the
    C core's logits for the prompt and the next token."""
    from colibri.engine.executor.torch_backend import linear

    n = linear.CHUNKED_FROM + 9
    c = Model.load(hybrid, threads=2, n_ctx=2 * n)
    t = Model.load(hybrid, n_ctx=2 * n, device=TORCH)
    p = _ids(n + 1, 4)
    assert rel_max(prefill(t, p[:n]), prefill(c, p[:n])) <= 1e-4
    assert rel_max(prefill(t, p[n:], start=n), prefill(c, p[n:], start=n)) <= 1e-4


@pytest.mark.slow  # seconds; the engine on torch-cpu is quick in tests/test_device_option.py
def test_the_engine_on_torch_speculates_on_a_linear_attention_model(hybrid: Path) -> None:
    """Through the step engine (scheduler, state slots, speculation's save and restore of a
    sequence's recurrent state around a verify step): greedy tokens on the torch backend
    equal the C core's, and stay the same with drafts all kept and all rejected."""
    from colibri.engine import LLM, EngineConfig, SamplingParams
    from tests.test_speculative import ScriptedDrafter, _run, _spec

    def llm(**cfg: Any) -> Any:
        return LLM(hybrid, threads=2, n_ctx=N_CTX,
                   config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                       prefix_cache=False, **cfg))

    prompts = [_ids(20, 7).tolist(), _ids(5, 8).tolist(), _ids(11, 9).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def tokens(out: dict[str, list[Any]]) -> list[list[int]]:
        return [[o.token_id for o in out[f"r{i}"]] for i in range(len(prompts))]

    c = llm()
    want = tokens(_run(c, prompts, params))
    c.core.close()
    t = llm(device=TORCH, speculative="ngram")
    assert t.model.device == TORCH and t.core.speculates
    _spec(t, 1, "off")
    assert tokens(_run(t, prompts, params)) == want
    for wrong in (False, True):
        _spec(t, 3)
        drafters = [ScriptedDrafter(p, w, wrong) for p, w in zip(prompts, want, strict=True)]
        assert tokens(_run(t, prompts, params, drafters)) == want, wrong
        st = t.core.spec_stats
        assert st.n_draft_tokens > 0 and st.n_accepted == (0 if wrong else st.n_draft_tokens)
    t.core.close()
