"""Routed experts of one layer split between the torch backend (on torch's CPU device, the
code a CUDA device runs; COLIBRI_TEST_TORCH_DEVICE=cuda:0 runs it on a GPU) and the C core,
and the GPU tier that moves experts between them by heat, on tiny random checkpoints:

- clb_moe_experts (the C core's experts of one layer, by a mask) against numpy's
  route -> run -> combine, and a mask's share plus its complement's is the whole layer's;
- greedy tokens equal the all-C tokens, and f32 logits are within 1e-4 (max |diff| / max
  |ref|) of them, for Mixtral, Qwen3-MoE and DeepSeek-V3 (MLA, dense first layers, shared
  experts) at several sets of device experts, with and without whole C layers beside them.
  The tolerance is the one the torch backend meets whole (tests/test_torch_backend.py): the
  same f32 math, the torch and C products only rounding in another order (about 1e-6 per
  product); q8 splits are within the q8 tolerance (relative L2 <= 5e-2: the C core's q8
  products quantize the activations, torch's dequantize the weights and keep them f32);
- batch invariance: two sequences in one paged call give what each gives alone;
- the tier: hysteresis and the bound on uploads per step, experts moving toward the hot ones
  while the tokens stay the all-C tokens, and counters that add up;
- the per-step choice for experts on the CPU: under a profile where uploading is cheap and the
  CPU slow, a prefill chunk uploads exactly the cold experts whose rows reach the crossing the
  profile predicts (found here by scanning cold_expert_choice over rows, and checked against
  the closed form) and a decode token uploads none; under the opposite profile nothing
  uploads; the tokens are the all-C tokens either way and the counters add up;
- the engine under --gpu-memory-mb with a device profile places experts hottest first and
  shows the tier on /metrics and /v1/expert_cache;
- a split's C side (its layers, and the experts a device layer leaves to it) reads through
  the expert cache under a budget and gives the bits it gives without one; the cache sees only
  the C side's selections, and the routing history saved at close takes the tier's counts for
  the device layers.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.engine.core.loader import start_expert_cache  # noqa: E402
from colibri.engine.core.options import ExpertCacheConfig  # noqa: E402
from colibri.engine.errors import InputError  # noqa: E402
from colibri.engine.executor.backend import Op, Placement, step_ops  # noqa: E402
from colibri.engine.executor.costmodel import (  # noqa: E402
    CpuProfile,
    DeviceProfile,
    GpuProfile,
    Item,
    cold_expert_choice,
    model_costs,
)
from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.executor.torch_backend.expert_split import TierConfig  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.format.wfile import read_wfile  # noqa: E402
from colibri.engine.models.config import ModelConfig  # noqa: E402
from tests.parity_helpers import (  # noqa: E402
    assert_paged_batch_invariant,
    prefill,
    rel_l2,
    rel_max,
)
from tests.tiny_models import VOCAB_SIZE, make_checkpoint  # noqa: E402

N_CTX = 64
N_GEN = 12
TORCH = os.environ.get("COLIBRI_TEST_TORCH_DEVICE", "torch-cpu")
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
PROMPT = np.random.default_rng(5).integers(0, VOCAB_SIZE, 20).astype(np.int32)


class Family:
    def __init__(self, arch: str, root: Path) -> None:
        self.hf = make_checkpoint(arch, root / "hf", seed=21)
        self.root = root
        self._dirs: dict[str, Path] = {}

    def path(self, preset: str) -> Path:
        if preset not in self._dirs:
            self._dirs[preset] = convert(self.hf, self.root / preset, quant=preset,
                                         progress=False)
        return self._dirs[preset]


_FAMILIES: dict[str, Family] = {}


def _family(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Family:
    if arch not in _FAMILIES:
        _FAMILIES[arch] = Family(arch, tmp_path_factory.mktemp(arch))
    return _FAMILIES[arch]


# Mixtral in the quick pass; the other families (a minute more on 2 cores) are slow
@pytest.fixture(scope="module", params=[a if a == "mixtral" else
                                        pytest.param(a, marks=pytest.mark.slow)
                                        for a in FAMILIES])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family("mixtral", tmp_path_factory)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family("deepseek_v3", tmp_path_factory)


def placement(cfg: ModelConfig, torch_layers: set[int],
              on_device: dict[int, set[int]]) -> Placement:
    """torch_layers' attention, routers, shared and dense work on the torch backend, with the
    routed experts on_device names; every other expert and layer on the C core."""
    ops = {o: "torch" for o in step_ops(cfg) if o.layer in torch_layers and o.op != Op.EXPERTS}
    return Placement(default="c", ops=ops,
                     experts={(il, e): "torch" for il, es in on_device.items() for e in es})


def greedy(m: Model, prompt: np.ndarray, n: int) -> list[int]:
    logits = prefill(m, prompt)
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        logits = m.forward(np.array([out[-1]], np.int32), np.zeros(1, np.int32),
                           np.array([prompt.size + i], np.int32))
        out.append(int(logits[-1].argmax()))
    return out


def split_model(path: Path, p: Placement, **kw: Any) -> Model:
    m = Model.load(path, threads=2, n_ctx=N_CTX, device=TORCH, placement=p, **kw)
    assert type(m.core).__name__ == "SplitCore" and m.core.expert_split is not None
    return m


def device_sets(cfg: ModelConfig) -> list[tuple[set[int], dict[int, set[int]]]]:
    """(torch layers, device experts) to try: none of a layer's experts on the device, a
    few, half of each layer, and a whole C layer beside a split one."""
    moe, E, L = cfg.moe_layers, cfg.n_expert, cfg.n_layer
    every = set(range(L))
    return [
        (every, {il: set() for il in moe}),
        (every, {il: {(il * 3 + 1) % E} for il in moe}),
        (every, {il: set(range(E // 2)) if i % 2 else set(range(E // 2, E))
                 for i, il in enumerate(moe)}),
        (every - {moe[-1]}, {il: {0, E - 1} for il in moe[:-1]}),
    ]


def test_c_experts_by_mask_match_numpy(mixtral: Family) -> None:
    path = mixtral.path("f32")
    m = Model.load(path, threads=2, n_ctx=N_CTX)
    cfg = m.config
    D, E, K = cfg.n_embd, cfg.n_expert, cfg.n_expert_used
    rng = np.random.default_rng(0)
    T, il = 7, 1
    xn = rng.standard_normal((T, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)

    def run(mask: np.ndarray) -> np.ndarray:
        out = np.full((T, D), np.nan, np.float32)  # an unwritten row cannot pass
        m.core.moe_experts(il, xn, ids, w, mask, out)
        return out

    want = np.zeros((T, D))
    mask = np.zeros(E, bool)
    mask[[0, 2]] = True
    part = np.zeros((T, D))
    for e in range(E):
        f = read_wfile(path / "experts" / f"layer_{il}_expert_{e}.bin")
        w1, w3, w2 = (f.array(n).astype(np.float64) for n in ("w1", "w3", "w2"))
        for t, k in zip(*np.nonzero(ids == e), strict=True):
            x = xn[t].astype(np.float64)
            g = w1 @ x
            y = w2 @ (g / (1 + np.exp(-g)) * (w3 @ x)) * w[t, k]
            want[t] += y
            if mask[e]:
                part[t] += y
    every = run(np.ones(E, bool))
    assert rel_max(every, want) <= 1e-5
    mine = run(mask)
    assert rel_max(mine, part) <= 1e-5
    np.testing.assert_allclose(mine + run(~mask), every, rtol=0, atol=1e-6 * np.abs(want).max())
    assert not run(np.zeros(E, bool)).any()
    bad = ids.copy()
    bad[0, 0] = E
    with pytest.raises(InputError, match="expert id"):
        m.core.moe_experts(il, xn, bad, w, mask, np.empty((T, D), np.float32))


def test_a_dense_layer_has_no_experts_to_run(deepseek: Family) -> None:
    m = Model.load(deepseek.path("f32"), threads=2, n_ctx=N_CTX)
    cfg = m.config
    dense = [il for il in range(cfg.n_layer) if il not in cfg.moe_layers]
    assert dense, "DeepSeek-V3's first layers are dense"
    x = np.zeros((1, cfg.n_embd), np.float32)
    with pytest.raises(InputError, match="routed experts"):
        m.core.moe_experts(dense[0], x, np.zeros((1, cfg.n_expert_used), np.int32),
                           np.ones((1, cfg.n_expert_used), np.float32),
                           np.ones(cfg.n_expert, bool), x.copy())


def c_reference(path: Path) -> tuple[Model, list[int], np.ndarray]:
    """The all-CPU model, its greedy tokens and its prefill logits of the test prompt."""
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    want_tokens = greedy(c, PROMPT, N_GEN)
    c.reset(0)
    return c, want_tokens, prefill(c, PROMPT)


def test_split_tokens_equal_all_cpu(family: Family) -> None:
    path = family.path("f32")
    c, want_tokens, want = c_reference(path)
    cfg = c.config
    for layers, on in device_sets(cfg):
        s = split_model(path, placement(cfg, layers, on))
        split = s.core.expert_split
        split.tier = TierConfig(max_uploads=0)  # these sets, as placed
        for il in cfg.moe_layers:
            assert {e for e in range(cfg.n_expert) if split.on_device[il, e]} == \
                (on.get(il, set()) if il in layers else set())
        assert rel_max(prefill(s, PROMPT), want) <= 1e-4, on
        s.reset(0)
        assert greedy(s, PROMPT, N_GEN) == want_tokens, on


def test_q8_split_within_the_q8_tolerance(mixtral: Family) -> None:
    path = mixtral.path("q8")
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    want = prefill(c, PROMPT)
    cfg = c.config
    s = split_model(path, placement(cfg, set(range(cfg.n_layer)),
                                    {il: {0, 1} for il in cfg.moe_layers}))
    assert rel_l2(prefill(s, PROMPT), want) <= 5e-2


def test_split_calls_are_batch_invariant(mixtral: Family) -> None:
    path = mixtral.path("f32")
    cfg = ModelConfig.from_dir(path)
    p = placement(cfg, set(range(cfg.n_layer)), {il: {1, 2} for il in cfg.moe_layers})
    assert_paged_batch_invariant(split_model(path, p, n_seq=0, kv_blocks=16),
                                 split_model(path, p), seed=1)


def _routes(m: Model, prompt: np.ndarray, n: int) -> np.ndarray:
    """Selections per layer and expert of a greedy run of n tokens (the C core's routes)."""
    cfg = m.config
    sel = np.zeros((cfg.n_layer, cfg.n_expert), np.int64)
    toks = greedy(m, prompt, n)
    m.reset(0)
    seq = np.concatenate([prompt, np.array(toks[:-1], np.int32)])
    r = np.full((seq.size, cfg.n_layer, cfg.n_expert_used), -1, np.int32)
    m.forward(seq, np.zeros(seq.size, np.int32), np.arange(seq.size, dtype=np.int32), routes=r)
    for il in cfg.moe_layers:
        sel[il] = np.bincount(r[:, il].reshape(-1), minlength=cfg.n_expert)
    return sel


def test_the_tier_moves_hot_experts_to_the_device_and_tokens_stay(family: Family) -> None:
    path = family.path("f32")
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    want_tokens = greedy(c, PROMPT, N_GEN)
    c.reset(0)
    sel = _routes(c, PROMPT, N_GEN)
    cfg = c.config
    # the coldest expert of each layer on the device: the heat should bring hotter ones
    cold = {il: {int(np.argsort(sel[il], kind="stable")[0])} for il in cfg.moe_layers}
    s = split_model(path, placement(cfg, set(range(cfg.n_layer)), cold))
    split = s.core.expert_split
    split.tier = TierConfig(half_life_steps=8, margin=0.25, min_gap=1.0, max_uploads=1)
    before = split.stats()
    assert greedy(s, PROMPT, N_GEN) == want_tokens
    st = split.stats()
    n_tok = PROMPT.size + N_GEN - 1
    # every selection of a device layer is a hit or a miss; the device holds as many as before
    assert st["hits"] + st["misses"] == n_tok * cfg.n_expert_used * len(cfg.moe_layers)
    assert st["experts_on_device"] == before["experts_on_device"] == len(cfg.moe_layers)
    assert st["uploads"] == st["evictions"] >= 1
    assert st["uploads"] <= st["steps"]  # at most max_uploads (1) per step
    assert st["upload_bytes"] == st["uploads"] * split._expert_bytes[cfg.moe_layers[0]]
    # what is on the device now is hotter than what was placed there
    placed = sum(sel[il, e] for il in cfg.moe_layers for e in cold[il])
    now = sum(sel[il, e] for il, e in zip(*np.nonzero(split.on_device), strict=True))
    assert now > placed


def test_the_tier_keeps_its_hysteresis_and_bound(mixtral: Family) -> None:
    path = mixtral.path("f32")
    cfg = ModelConfig.from_dir(path)
    s = split_model(path, placement(cfg, set(range(cfg.n_layer)),
                                    {il: {0, 1} for il in cfg.moe_layers}))
    split = s.core.expert_split
    split.tier = TierConfig(margin=0.5, min_gap=2.0, max_uploads=2)
    L0, L1 = cfg.moe_layers[0], cfg.moe_layers[-1]
    split.heat[:] = 10.0
    # 16 = 10 * 1.5 + 1: not past the margin and the gap (10 * 1.5 + 2 = 17)
    split.heat[L0, 2] = 16.0
    assert split.rebalance() == [] and split.stats()["uploads"] == 0
    split.heat[L0, 2] = 17.5
    split.heat[L1, 3] = 30.0
    split.heat[L1, 2] = 18.0  # hot enough too, but the bound is 2 per step
    split.heat[L0, 0] = 1.0  # the coldest device experts go first
    split.heat[L1, 1] = 2.0
    swaps = split.rebalance()
    assert swaps == [((L1, 3), (L0, 0)), ((L1, 2), (L1, 1))]
    st = split.stats()
    assert st["uploads"] == 2 and st["evictions"] == 2 and st["experts_on_device"] == 4
    assert split.on_device[L1, 3] and split.on_device[L1, 2] and not split.on_device[L0, 0]
    # and the step still gives the all-C logits with the experts where they are now
    c = Model.load(path, threads=2, n_ctx=N_CTX)
    split.tier = TierConfig(max_uploads=0)
    assert rel_max(prefill(s, PROMPT), prefill(c, PROMPT)) <= 1e-4


def _profile(ex: Item, cpu_gmacs: float, h2d_gb_s: float) -> DeviceProfile:
    """A simulated machine whose CPU is compute-bound at cpu_gmacs for these experts (its
    bandwidth is no limit) beside a GPU that computes almost for free behind a h2d_gb_s link."""
    return DeviceProfile("sim", "simulated", CpuProfile(1e6, {ex.wtype: cpu_gmacs}),
                         GpuProfile("sim-gpu", 1000, 1e6, 1e6, h2d_gb_s, 0.0, 0.0))


def _crossing(prof: DeviceProfile, ex: Item, most: int) -> int | None:
    """The fewest rows for which cold_expert_choice uploads (None: none up to `most`), after
    checking that it stays "upload" above that (one flip)."""
    ups = [r for r in range(1, most + 1) if cold_expert_choice(prof, ex, r) == "upload"]
    if not ups:
        return None
    assert ups == list(range(ups[0], most + 1)), "the choice flips once"
    return ups[0]


def _greedy_steps(s: Model) -> tuple[np.ndarray, np.ndarray, list[int], list[list[Any]]]:
    """A greedy run of PROMPT in slot 0, one call a step: the prompt's logits and routes
    [T, n_layer, K], the tokens, and per step the split's transient uploads."""
    cfg = s.config
    split = s.core.expert_split
    s.reset(0)
    routes = np.full((PROMPT.size, cfg.n_layer, cfg.n_expert_used), -1, np.int32)
    first = s.forward(PROMPT, np.zeros(PROMPT.size, np.int32),
                      np.arange(PROMPT.size, dtype=np.int32), routes=routes)
    ups = [list(split.last_step_uploads)]
    out = [int(first[-1].argmax())]
    for i in range(N_GEN - 1):
        logits = s.forward(np.array([out[-1]], np.int32), np.zeros(1, np.int32),
                           np.array([PROMPT.size + i], np.int32))
        ups.append(list(split.last_step_uploads))
        out.append(int(logits[-1].argmax()))
    return first, routes, out, ups


# Mixtral in the quick pass; gpt-oss (expert biases from the router file) and Llama 4 (the
# routing weight scales the experts' input) in the slow one
@pytest.fixture(scope="module", params=["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow),
                                        pytest.param("llama4", marks=pytest.mark.slow)])
def upload_family(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family(request.param, tmp_path_factory)


def test_cold_experts_upload_for_a_step_where_the_profile_says(upload_family: Family) -> None:
    path = upload_family.path("f32")
    c, want_tokens, want = c_reference(path)
    cfg = c.config
    moe, K = cfg.moe_layers, cfg.n_expert_used
    ex = model_costs(path, cfg, context=N_CTX).experts[moe[0]]
    on = {il: {0} for il in moe}  # the other experts of each layer are on the CPU
    s = split_model(path, placement(cfg, set(range(cfg.n_layer)), on))
    split = s.core.expert_split
    split.tier = TierConfig(max_uploads=0)  # the placement stays: only per-step uploads
    per = split._expert_bytes[moe[0]]  # f32: the same bytes on the device
    n_sel = (PROMPT.size + N_GEN - 1) * K * len(moe)  # selections of one greedy run

    # where the prompt's rows fall (no profile: nothing uploads, and routing is unchanged)
    _l, routes, _t, ups = _greedy_steps(s)
    assert ups == [[]] * N_GEN
    rows = {(il, e): int((routes[:, il] == e).sum()) for il in moe for e in range(cfg.n_expert)
            if e not in on[il]}
    used = sorted({n for n in rows.values() if n > 0})
    assert len(used) >= 2, "the prompt should give cold experts different row counts"
    r_want = used[len(used) // 2]  # a crossing inside the prompt's counts, above 1 row
    # CPU at 1 GMAC/s: r rows cost r * macs ns; the link takes (r_want - 0.5) * macs ns for
    # the expert's bytes, so the copy (and the near-free GPU product) pays from r_want rows on
    cheap = _profile(ex, 1.0, ex.gpu_bytes / ((r_want - 0.5) * ex.macs))
    dear = _profile(ex, 1.0, ex.gpu_bytes / (1e4 * ex.macs))  # the copy: 10^4 rows of CPU
    r_up = _crossing(cheap, ex, PROMPT.size)
    assert r_up == r_want == int(np.floor(ex.gpu_bytes / (cheap.gpu.h2d_gb_s * 1e9)  # closed
                                          / (ex.macs / 1e9))) + 1  # form
    assert _crossing(dear, ex, N_CTX) is None
    base = split.stats()

    split.profile = cheap
    logits, routes2, toks, ups = _greedy_steps(s)
    assert rel_max(logits, want) <= 1e-4 and toks == want_tokens
    np.testing.assert_array_equal(routes2, routes)
    expect = {(il, e, n) for (il, e), n in rows.items() if n >= r_up}
    below = {(il, e) for (il, e), n in rows.items() if 0 < n < r_up}
    assert expect and below, "the prompt's chunk should route on both sides of the crossing"
    assert set(ups[0]) == expect
    assert ups[1:] == [[]] * (N_GEN - 1)  # a decode token gives a cold expert 1 row: the CPU
    st = split.stats()
    n_up, n_rows = len(expect), sum(n for _l, _e, n in expect)
    assert (st["step_uploads"], st["step_upload_rows"]) == (n_up, n_rows)
    assert st["step_upload_bytes"] == n_up * per
    assert st["uploads"] == st["evictions"] == 0 and st["experts_on_device"] == len(moe)
    assert st["hits"] + st["misses"] + st["step_upload_rows"] == 2 * n_sel
    assert st["hits"] == 2 * base["hits"] and st["misses"] == 2 * base["misses"] - n_rows
    assert st["upload_buffer_bytes"] == 2 * per  # one ring of two, reused for every upload

    split.profile = dear
    logits, _routes, toks, ups = _greedy_steps(s)
    assert rel_max(logits, want) <= 1e-4 and toks == want_tokens
    assert ups == [[]] * N_GEN
    st = split.stats()
    assert (st["step_uploads"], st["step_upload_rows"]) == (n_up, n_rows)
    assert st["hits"] + st["misses"] + st["step_upload_rows"] == 3 * n_sel


SIM = DeviceProfile("sim", "simulated", CpuProfile(20.0, {"f32": 25.0, "q8": 50.0}),
                    GpuProfile("sim-gpu", 1000, 2000.0, 10000.0, 10.0, 0.0, 0.0))


def test_the_engine_places_experts_and_shows_the_tier(mixtral: Family, tmp_path: Path) -> None:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings
    from colibri.engine import LLM, EngineConfig
    from colibri.engine.sample.sampler import SamplingParams
    from tests.server_helpers import InProcessServer, wait_for

    path = mixtral.path("f32")
    cfg = ModelConfig.from_dir(path)
    prof = tmp_path / "sim.json"
    prof.write_text(SIM.to_json())
    selections = np.ones((len(cfg.moe_layers), cfg.n_expert), np.int64)
    selections[0, 3] = selections[-1, 2] = 50  # the hottest two by the routing history
    (path / "expert_routing.json").write_text(json.dumps({"selections": selections.tolist()}))
    try:
        mc = model_costs(path, cfg, context=N_CTX)
        per = mc.experts[cfg.moe_layers[0]].gpu_bytes
        mb = (sum(i.gpu_bytes for i in mc.always) + 2 * per + per // 2) / 1e6
        prompts = [PROMPT.tolist(), PROMPT[:7].tolist()]
        greedy_p = SamplingParams(max_tokens=8, temperature=0.0)
        cpu = LLM(path, threads=2, n_ctx=N_CTX, config=EngineConfig(device="cpu"))
        want = cpu.generate_batch(prompts, greedy_p)
        cpu.core.close()
        llm = LLM(path, threads=2, n_ctx=N_CTX, config=EngineConfig(
            device="torch-cpu", gpu_memory_mb=mb, device_profile=str(prof), max_num_seqs=4))
    finally:
        (path / "expert_routing.json").unlink()
    split = llm.model.core.expert_split
    assert split is not None
    assert {(int(a), int(b)) for a, b in zip(*np.nonzero(split.on_device), strict=True)} == \
        {(cfg.moe_layers[0], 3), (cfg.moe_layers[-1], 2)}
    split.tier = TierConfig(max_uploads=0)
    assert llm.generate_batch(prompts, greedy_p) == want
    tier = llm.core.expert_cache.tier_data()
    assert tier["experts_on_device"] == 2 and tier["hits"] + tier["misses"] > 0
    srv = InProcessServer(create_app(Settings(_env_file=None),  # type: ignore[call-arg]
                                     loader=lambda: llm.core)).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
        metrics = httpx.get(srv.url + "/metrics").text
        page = httpx.get(srv.url + "/v1/expert_cache").json()
    finally:
        srv.stop()
        llm.core.close()
    assert "colibri_gpu_tier_experts_on_device 2" in metrics
    assert page["gpu_tier"]["hits"] == tier["hits"]  # no step ran in between
    # every counter the tier keeps is named, on the page and on /metrics
    names = page["gpu_tier"]["counter_names"]
    assert names == list(asdict(split.counters))
    assert {"hits", "misses", "uploads", "upload_bytes", "evictions", "steps"} <= set(names)
    for key in names:
        assert f"colibri_gpu_tier_{key}_total {page['gpu_tier'][key]}" in metrics
    assert (f"colibri_gpu_tier_device_expert_bytes {page['gpu_tier']['device_expert_bytes']}"
            in metrics)
    assert page["gpu_tier"]["experts_on_device"] == 2
    ub = page["gpu_tier"]["upload_buffer_bytes"]
    assert f"colibri_gpu_tier_upload_buffer_bytes {ub}" in metrics
    assert (ub > 0) == (page["gpu_tier"]["step_uploads"] > 0)
    assert page["gpu_tier"]["on_device"][cfg.moe_layers[0]][3] == 1
    assert sum(map(sum, page["gpu_tier"]["on_device"])) == 2


@pytest.mark.parametrize("preset", ["f32", pytest.param("q8", marks=pytest.mark.slow)])
def test_the_split_c_side_reads_through_the_expert_cache(mixtral: Family, preset: str) -> None:
    path = mixtral.path(preset)
    cfg = ModelConfig.from_dir(path)
    moe, E, K = cfg.moe_layers, cfg.n_expert, cfg.n_expert_used
    # a split layer with two experts on the device beside a whole C layer
    on = {il: {0, E - 1} for il in moe[:-1]}
    p = placement(cfg, set(range(cfg.n_layer)) - {moe[-1]}, on)
    plain = split_model(path, p)
    plain.core.expert_split.tier = TierConfig(max_uploads=0)
    want_tokens = greedy(plain, PROMPT, N_GEN)
    plain.reset(0)
    want = prefill(plain, PROMPT)
    assert plain.core.c.expert_cache_stats() is None
    cached = split_model(path, p)
    split = cached.core.expert_split
    split.tier = TierConfig(max_uploads=0)
    mon = start_expert_cache(cached, path, ExpertCacheConfig(expert_cache_size=K,
                                                             expert_pin=False), 0,
                             core=cached.core.c, repack=False)
    assert mon.plan.per_layer == K
    assert greedy(cached, PROMPT, N_GEN) == want_tokens
    cached.reset(0)
    np.testing.assert_array_equal(prefill(cached, PROMPT), want)  # the same bits
    st = cached.core.c.expert_cache_stats()
    assert st is not None and st["loads"][moe].min() > 0 and st["evictions"][moe].sum() > 0
    n_sel = (2 * PROMPT.size + N_GEN - 1) * K
    assert st["selections"][moe[-1]].sum() == n_sel  # the C layer: every selection
    for il in moe[:-1]:  # the split layers: only the experts left to the C core
        cold = ~split.on_device[il]
        assert st["selections"][il, ~cold].sum() == 0 and split.selections[il].sum() == n_sel
        np.testing.assert_array_equal(st["selections"][il, cold], split.selections[il, cold])


def test_the_engine_runs_a_split_with_an_expert_cache(mixtral: Family, tmp_path: Path) -> None:
    from colibri.engine import LLM, EngineConfig
    from colibri.engine.sample.sampler import SamplingParams

    path = Path(shutil.copytree(mixtral.path("f32"), tmp_path / "m"))  # close() writes here
    cfg = ModelConfig.from_dir(path)
    K = cfg.n_expert_used
    prof = tmp_path / "sim.json"
    prof.write_text(SIM.to_json())
    mc = model_costs(path, cfg, context=N_CTX)
    mb = (sum(i.gpu_bytes for i in mc.always) + 2.5 * mc.experts[cfg.moe_layers[0]].gpu_bytes
          ) / 1e6  # every layer, two experts
    prompts = [PROMPT.tolist(), PROMPT[:7].tolist()]
    greedy_p = SamplingParams(max_tokens=8, temperature=0.0)
    cpu = LLM(path, threads=2, n_ctx=N_CTX, config=EngineConfig(device="cpu"))
    want = cpu.generate_batch(prompts, greedy_p)
    cpu.core.close()
    assert not (path / "expert_routing.json").exists()  # no cache on the CPU run: nothing saved
    llm = LLM(path, threads=2, n_ctx=N_CTX, config=EngineConfig(
        device="torch-cpu", gpu_memory_mb=mb, device_profile=str(prof), max_num_seqs=4,
        expert_cache=ExpertCacheConfig(expert_cache_size=K, expert_pin=False)))
    mon = llm.core.expert_cache
    split = llm.model.core.expert_split
    assert split is not None and mon.gpu_tier is split and mon.plan.per_layer == K
    assert llm.generate_batch(prompts, greedy_p) == want
    assert mon.stats() is not None and mon.totals()["misses"] > 0
    assert mon.page_data()["gpu_tier"]["hits"] == split.stats()["hits"]
    tier_sel = split.stats()["selections"]
    c_sel = mon.stats()["selections"]
    llm.core.close()
    saved = np.array(json.loads((path / "expert_routing.json").read_text())["selections"])
    for il in range(cfg.n_layer):
        np.testing.assert_array_equal(saved[il], tier_sel[il] if il in split.layers
                                      else c_sel[il])
