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
- two sequences in one paged call give what each gives alone; a refused call names the input.
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

from colibri.engine.errors import FormatError, InputError  # noqa: E402
from colibri.engine.executor.backend import LayerOp, Placement, step_ops  # noqa: E402
from colibri.engine.executor.model import Model  # noqa: E402
from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import prefill, rel_l2, rel_max  # noqa: E402
from tests.test_parity_families import CASES as FAMILY_CASES  # noqa: E402
from tests.test_parity_families import HYBRID_ARCHS, _forced_routing  # noqa: E402
from tests.tiny_models import ARCHS, VOCAB_SIZE, TinyCheckpoints  # noqa: E402

N_CTX = 64
N_GEN = 16
# scripts/device_check.sh runs these on a GPU with COLIBRI_TEST_TORCH_DEVICE=cuda:0
TORCH = os.environ.get("COLIBRI_TEST_TORCH_DEVICE", "torch-cpu")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{a: (a, {}) for a in ARCHS},
    **{k: v for k, v in FAMILY_CASES.items() if v[0] not in HYBRID_ARCHS},
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


# every family takes seconds: these run in the quick pass, the rest in the whole suite
QUICK = ("mixtral", "glm4_moe", "deepseek_v3", "gpt_oss", "llama4")


@pytest.fixture(scope="module", params=quick_params(CASES, QUICK))
def case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return Case(request.param, checkpoints)


@pytest.fixture(scope="module", params=quick_params(CASES, QUICK))
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
    m = Model.load(case.converted("q8"), threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=4)
    parts = Model.load(case.converted("q8"), threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=4)
    n, L = case.prompt.size, m.config.n_layer
    args = (case.prompt, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), None,
            np.array([[0, 1, -1, -1]], np.int32))
    whole = m.core.forward(m.kv, *args)
    h = np.full((n, m.config.n_embd), np.nan, np.float32)
    cuts = [0, *range(1, L), L]
    for a, b in zip(cuts, cuts[1:], strict=False):
        out = parts.core.forward(parts.kv, *args, span=(a, b), hidden=h)
        assert out.shape[0] == (n if b == L else 0)
    assert np.array_equal(out, whole)
    with pytest.raises(ValueError, match="span"):
        parts.core.forward(parts.kv, *args, span=(1, L + 1), hidden=h)


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
    rng = np.random.default_rng(0)
    a = rng.integers(0, VOCAB_SIZE, 20).astype(np.int32)
    b = rng.integers(0, VOCAB_SIZE, 9).astype(np.int32)
    tables = np.array([[5, 2, -1, -1], [7, -1, -1, -1]], np.int32)
    both = m.forward_paged(np.concatenate([a, b]), np.r_[np.zeros(20), np.ones(9)],
                           np.r_[np.arange(20), np.arange(9)], tables)
    alone = Model.load(path, n_ctx=N_CTX, device=TORCH)
    ra = prefill(alone, a)
    alone.reset(0)
    rb = prefill(alone, b)
    np.testing.assert_allclose(both[:20], ra, rtol=0, atol=1e-5 * np.abs(ra).max())
    np.testing.assert_allclose(both[20:], rb, rtol=0, atol=1e-5 * np.abs(rb).max())
    alone.reset(0)
    first = prefill(alone, a[:13])
    rest = prefill(alone, a[13:], start=13)
    np.testing.assert_allclose(np.concatenate([first, rest]), ra, rtol=0,
                               atol=1e-5 * np.abs(ra).max())
    with pytest.raises(InputError, match="block"):
        m.forward_paged(a[:1], np.zeros(1), np.zeros(1), np.array([[99]], np.int32))


def test_what_it_does_not_run_is_refused_by_name(checkpoints: TinyCheckpoints) -> None:
    path = checkpoints.get("qwen3_next", seed=3).converted("f32")
    with pytest.raises(FormatError, match="linear-attention"):
        Model.load(path, n_ctx=N_CTX, device=TORCH)
    path = checkpoints.get("mixtral", seed=3).converted("f32")
    with pytest.raises(ValueError, match="KV cache"):
        Model.load(path, n_ctx=N_CTX, device=TORCH, kv_type="q8")
