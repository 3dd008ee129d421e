"""The cost model and `colibri plan` against simulated device profiles on a tiny converted
MoE model: plans fit their budget, more memory never predicts a slower step, the hottest
experts (by the routing history) are placed first, and a cold expert's per-step choice
between the CPU and an upload flips at the number of tokens the profile's figures give."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from colibri.engine.executor.costmodel import (
    ROUTING_FILE,
    CpuProfile,
    DeviceProfile,
    GpuProfile,
    cold_expert_choice,
    cpu_time,
    gpu_time,
    make_plan,
    model_costs,
    upload_time,
)
from colibri.engine.format.convert import convert
from colibri.engine.models.config import ModelConfig
from colibri.engine.tools.cli import main
from tests.tiny_models import make_checkpoint

pytest.importorskip("transformers")

# a CPU far slower than its GPU, a slow link, no launch cost: the GPU wins whatever it holds
SIM = DeviceProfile("sim", "simulated", CpuProfile(20.0, {"q8": 50.0, "f32": 25.0}),
                    GpuProfile("sim-gpu", 1000, 2000.0, 10000.0, 10.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plan")
    hf = make_checkpoint("qwen2_moe", root / "hf", seed=5)
    return convert(hf, root / "q8", quant="q8", progress=False)


def _budgets(total_mb: float) -> list[float]:
    return [total_mb * f for f in np.linspace(0.0, 1.05, 23)]


def test_plans_fit_and_more_memory_is_never_slower(model: Path) -> None:
    cfg = ModelConfig.from_dir(model)
    mc = model_costs(model, cfg)
    total = sum(i.gpu_bytes for i in mc.always) + sum(
        e.gpu_bytes * cfg.n_expert for e in mc.experts.values())
    last = math.inf
    plans = [make_plan(SIM, mc, b) for b in _budgets(total / 1e6)]
    for p in plans:
        assert p.gpu_bytes <= p.budget_mb * 1e6
        assert p.decode_ms <= last
        last = p.decode_ms
    assert plans[0].gpu_layers == [] and plans[0].decode_ms == plans[0].cpu_decode_ms
    full = plans[-1]
    assert full.gpu_layers == list(range(cfg.n_layer)) and full.lm_head_on_gpu
    assert sum(len(v) for v in full.gpu_experts.values()) == cfg.n_expert * cfg.n_layer
    assert full.decode_ms < full.cpu_decode_ms and full.prefill_ms < full.cpu_prefill_ms
    # a CPU-only profile places nothing
    cpu_only = DeviceProfile("cpu", "simulated", SIM.cpu)
    assert make_plan(cpu_only, mc, 1e9).gpu_bytes == 0


def test_hottest_experts_are_placed_first(model: Path) -> None:
    cfg = ModelConfig.from_dir(model)
    rng = np.random.default_rng(3)
    sel = rng.integers(1, 1000, (len(cfg.moe_layers), cfg.n_expert))
    (model / ROUTING_FILE).write_text(json.dumps({"selections": sel.tolist()}))
    try:
        mc = model_costs(model, cfg)
        always = sum(i.gpu_bytes for i in mc.always)
        per = mc.experts[0].gpu_bytes
        n = 5
        plan = make_plan(SIM, mc, (always + n * per + per // 2) / 1e6)
    finally:
        (model / ROUTING_FILE).unlink()
    share = sel / sel.sum(axis=1, keepdims=True)
    order = sorted(((-share[r, e], il, e) for r, il in enumerate(cfg.moe_layers)
                    for e in range(cfg.n_expert)))
    want: dict[int, list[int]] = {}
    for _s, il, e in order[:n]:
        want.setdefault(il, []).append(e)
    assert plan.gpu_experts == want


def test_routing_history_with_dense_layers_is_read(tmp_path: Path) -> None:
    """The expert cache keeps a row for every layer (a dense layer's stays empty): the heat of
    the MoE layers follows it, as it follows a history of MoE rows alone."""
    from types import SimpleNamespace

    from colibri.engine.executor.costmodel import _heat

    cfg = SimpleNamespace(n_expert=4, n_expert_used=2, n_layer=3, moe_layers=[1, 2])
    moe_rows = np.array([[1, 3, 0, 0], [2, 2, 2, 2]])
    want = np.zeros((3, 4))
    want[1] = [0.5, 1.0, 0.0, 0.0]  # shares times K = 2, at most 1
    want[2] = 0.5
    for sel in (moe_rows, np.vstack([np.zeros((1, 4), int), moe_rows])):
        (tmp_path / ROUTING_FILE).write_text(json.dumps({"selections": sel.tolist()}))
        np.testing.assert_allclose(_heat(tmp_path, cfg), want)  # type: ignore[arg-type]
    (tmp_path / ROUTING_FILE).write_text(json.dumps({"selections": [[1, 2, 3]]}))
    uniform = np.zeros((3, 4))
    uniform[[1, 2]] = 0.5
    np.testing.assert_allclose(_heat(tmp_path, cfg), uniform)  # type: ignore[arg-type]


def test_cold_expert_choice_flips_where_the_profile_says(model: Path) -> None:
    mc = model_costs(model, ModelConfig.from_dir(model))
    ex = mc.experts[0]

    def crossing(prof: DeviceProfile) -> int:
        """The fewest rows for which uploading costs less than the CPU, from the formulas'
        own terms: CPU max(bytes / bw, rows * macs / rate) against upload + GPU time."""
        up = ex.gpu_bytes / (prof.gpu.h2d_gb_s * 1e9)
        rows = 1
        while max(ex.cpu_bytes / (prof.cpu.read_gb_s * 1e9),
                  rows * ex.macs / (prof.cpu.rate(ex.wtype) * 1e9)) <= up + gpu_time(
                      prof, ex, rows):
            rows += 1
        return rows

    for h2d in (2.0, 5.0, 15.0):  # below the CPU's 20 GB/s: one token stays on the CPU
        prof = DeviceProfile("sim", "simulated", SIM.cpu,
                             GpuProfile("g", 1000, 2000.0, 10000.0, h2d, 0.0, 0.0))
        r = crossing(prof)
        assert 1 < r < 4096
        assert cold_expert_choice(prof, ex, r - 1) == "cpu"
        assert cold_expert_choice(prof, ex, r) == "upload"
        assert cold_expert_choice(prof, ex, 1) == "cpu"
        assert upload_time(prof, ex) + gpu_time(prof, ex, r) < cpu_time(prof, ex, r)
    # a faster link flips sooner
    rates = [crossing(DeviceProfile("s", "s", SIM.cpu, GpuProfile("g", 1000, 2000.0, 1e4,
                                                                   h, 0.0, 0.0)))
             for h in (2.0, 5.0, 15.0)]
    assert rates[0] > rates[1] > rates[2]


def test_profiles_load_and_refuse_bad_ones(tmp_path: Path) -> None:
    h200 = DeviceProfile.load("h200")
    assert h200.source == "spec" and h200.gpu is not None
    assert h200.gpu.hbm_gb_s == 4800.0 and h200.gpu.h2d_gb_s == 55.0
    p = tmp_path / "p.json"
    p.write_text(SIM.to_json())
    assert DeviceProfile.load(p) == SIM
    bad = json.loads(SIM.to_json())
    bad["gpu"]["hbm_gb_s"] = -1
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="positive"):
        DeviceProfile.load(p)
    with pytest.raises(ValueError, match="h200"):
        DeviceProfile.load(tmp_path / "missing.json")


def test_plan_command_prints_the_plan(model: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "sim.json"
    prof.write_text(SIM.to_json())
    assert main(["plan", "--model", str(model), "--profile", str(prof), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cfg = ModelConfig.from_dir(model)
    assert d["plan"]["gpu_layers"] == list(range(cfg.n_layer))
    assert 0 < d["plan"]["decode_ms"] < d["plan"]["cpu_decode_ms"]
    assert main(["plan", "--model", str(model), "--profile", "h200",
                 "--gpu-memory-mb", "0"]) == 0
    out = capsys.readouterr().out
    assert "h200 (spec)" in out and "decode" in out and "ms per 512 tokens" in out
    assert main(["plan", "--model", str(model), "--profile", str(tmp_path / "nope")]) == 2


def test_a_torch_device_profile_is_measured() -> None:
    pytest.importorskip("torch")
    from colibri.engine.executor.torch_backend.profile import measure_gpu

    g = measure_gpu("cpu", mib=8)
    for v in (g.hbm_gb_s, g.gmacs, g.h2d_gb_s, g.launch_us, g.sync_us):
        assert math.isfinite(v) and v > 0


def test_linear_attention_layers_are_placed_like_any_other(tmp_path: Path) -> None:
    """A Qwen3-Next model: the torch backend runs every layer (auto may put it on a GPU), a
    linear layer's item holds its recurrent state per sequence (no KV), and a budget that
    fits everything places every layer, linear ones included, on the GPU."""
    from colibri.engine.executor.backend import Op, torch_unsupported
    from colibri.engine.executor.placement import plan_placement

    hf = make_checkpoint("qwen3_next", tmp_path / "hf", seed=5)
    path = convert(hf, tmp_path / "q8", quant="q8", progress=False)
    cfg = ModelConfig.from_dir(path)
    assert cfg.hybrid and torch_unsupported(cfg) == []
    one, four = model_costs(path, cfg, n_seq=1), model_costs(path, cfg, n_seq=4)
    C = 2 * cfg.lin_n_k_heads * cfg.lin_k_dim + cfg.lin_n_v_heads * cfg.lin_v_dim
    state = 4 * ((cfg.lin_conv - 1) * C + cfg.lin_n_v_heads * cfg.lin_k_dim * cfg.lin_v_dim)
    linear = [il for il in range(cfg.n_layer) if cfg.layer_mixer[il] == "linear"]
    assert linear
    for il in linear:
        assert four.always[il].gpu_bytes - one.always[il].gpu_bytes == 3 * state
    total = sum(i.gpu_bytes for i in one.always) + sum(
        e.gpu_bytes * cfg.n_expert for e in one.experts.values())
    plan = make_plan(SIM, one, 2 * total / 1e6)
    assert plan.gpu_layers == list(range(cfg.n_layer)) and plan.lm_head_on_gpu
    placement, _text, _plan = plan_placement(path, cfg, SIM, 2 * total / 1e6, 64)
    assert placement is not None
    assert all(placement.of(o) == "torch" for o in placement.ops if o.op == Op.LINEAR_ATTENTION)
    assert {o.layer for o in placement.ops if o.op == Op.LINEAR_ATTENTION} == set(linear)
