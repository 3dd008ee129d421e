"""--device and --gpu-memory-mb end to end on a machine without a GPU: the step engine
(scheduler, paged KV pool, prefix cache) on the torch backend (`torch-cpu`) gives the C core's
greedy tokens; `colibri generate` prints the same text on either device; `colibri info` says
what would run where; a CUDA device this machine lacks is refused with one line; `colibri
bench` on torch-cpu under a budget runs the experts where the plan put them, gives the C
core's greedy tokens and counts the GPU tier: every routed expert use of the device's layers
a hit or a miss, a step per forward call, swaps that keep the count of device experts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.engine.core.loader import EngineConfig  # noqa: E402
from colibri.engine.executor.backend import check_device, resolve_device  # noqa: E402
from colibri.engine.executor.costmodel import (  # noqa: E402
    CpuProfile,
    DeviceProfile,
    GpuProfile,
    model_costs,
)
from colibri.engine.executor.placement import plan_placement  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.llm import LLM  # noqa: E402
from colibri.engine.models.config import ModelConfig  # noqa: E402
from colibri.engine.sample.sampler import SamplingParams  # noqa: E402
from colibri.engine.tools.bench import render  # noqa: E402
from colibri.engine.tools.cli import main  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dev")
    hf = make_checkpoint("qwen2_moe", root / "hf", seed=7)
    return convert(hf, root / "f32", quant="f32", progress=False)


PROMPTS = [[5, 9, 33, 71, 12, 8, 90, 41, 17, 3, 66, 28, 19, 44, 7, 101, 55, 38],
           [5, 9, 33, 71, 12, 8, 90, 41, 17, 3, 66, 28, 19, 44, 7, 101, 2, 200],
           [250, 11, 4]]


def _tokens(model: Path, **kw: object) -> tuple[list[list[int]], str]:
    llm = LLM(model, threads=2, config=EngineConfig(max_num_seqs=4, **kw))  # type: ignore[arg-type]
    try:
        out = llm.generate_batch(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))
        return out, llm.model.device
    finally:
        llm.core.close()


# slow: the bench test below runs the engine on torch-cpu against the C tokens in the quick
# pass, and tests/test_expert_split.py the engine with experts placed on the device
@pytest.mark.slow
def test_the_engine_on_torch_cpu_gives_the_c_tokens(model: Path) -> None:
    want, dev = _tokens(model, device="cpu")
    assert dev == "cpu"
    got, dev = _tokens(model, device="torch-cpu")
    assert dev == "torch-cpu" and got == want
    # auto without a GPU is the C core
    assert _tokens(model, device="auto") == (want, "cpu")
    # a budget on the torch device: what the cost model places, same tokens
    got, dev = _tokens(model, device="torch-cpu", gpu_memory_mb=0.5)
    assert dev in ("cpu", "torch-cpu") and got == want


def test_devices_are_checked() -> None:
    assert check_device("CUDA:1") == "cuda:1"
    assert resolve_device("torch-cpu") == "torch-cpu"
    for bad in ("gpu", "cuda:", "cuda:x", "tpu"):
        with pytest.raises(ValueError, match="unknown device"):
            check_device(bad)
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_device("cuda:0")


def test_auto_asks_torch_only_where_a_gpu_driver_is(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--device auto on a Linux machine with no GPU driver's device file answers cpu without
    importing torch (a second of every start); with one, torch is asked."""
    import types

    from colibri.engine.executor import backend

    asked: list[str] = []

    def is_available() -> bool:
        asked.append("is_available")
        return False

    # what `import torch` finds: a torch that records being asked and sees no CUDA device
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=is_available,
                                                            device_count=lambda: 0))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(backend, "GPU_DEVICE_FILES", (str(tmp_path / "missing"),))
    assert resolve_device("auto") == "cpu" and asked == []
    marker = tmp_path / "nvidiactl"
    marker.write_text("")
    monkeypatch.setattr(backend, "GPU_DEVICE_FILES", (str(tmp_path / "missing"), str(marker)))
    assert resolve_device("auto") == "cpu" and asked == ["is_available"]


def test_commands_take_the_device(model: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--model", str(model), "--prompt", "hello", "--max-tokens", "8",
            "--temperature", "0", "--threads", "2"]
    assert main([*base, "--device", "cpu"]) == 0
    on_cpu = capsys.readouterr().out
    assert main([*base, "--device", "torch-cpu"]) == 0
    assert capsys.readouterr().out == on_cpu
    assert main(["info", str(model), "--device", "cpu"]) == 0
    assert "placement     everything on the CPU (the C core)" in capsys.readouterr().out
    assert main(["info", str(model), "--device", "torch-cpu"]) == 0
    assert "everything on torch-cpu (the torch backend)" in capsys.readouterr().out
    assert main(["info", str(model), "--device", "cuda"]) == 0
    assert "cannot run here" in capsys.readouterr().out
    assert main(["info", str(model), "--device", "gpu"]) == 2
    assert "--device" in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text("The river runs past the old stone mill.")
    for cmd in (["bench"], ["eval", "--text", str(text)]):
        assert main([*cmd, "--model", str(model), "--device", "cuda:0", "--no-progress"]) == 2
        assert "CUDA device" in capsys.readouterr().err


# a machine whose GPU the cost model finds worth filling with whatever fits
SIM = DeviceProfile("sim", "simulated", CpuProfile(20.0, {"f32": 25.0}),
                    GpuProfile("sim-gpu", 1000, 2000.0, 10000.0, 10.0, 0.0, 0.0))
PROMPT_TOKENS, GEN_TOKENS, REPEAT = 12, 6, 2


def test_bench_on_a_torch_device_counts_the_gpu_tier(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ModelConfig.from_dir(model)
    prof = tmp_path / "sim.json"
    prof.write_text(SIM.to_json())
    n_ctx = PROMPT_TOKENS + GEN_TOKENS
    mc = model_costs(model, cfg, context=n_ctx)
    per = mc.experts[cfg.moe_layers[0]].gpu_bytes
    mb = (sum(i.gpu_bytes for i in mc.always) + 3 * per + per // 2) / 1e6
    placement, _text, _plan = plan_placement(model, cfg, SIM, mb, n_ctx)
    assert placement is not None
    placed = [[e for e in range(cfg.n_expert) if il in cfg.moe_layers
               and placement.of_expert(il, e) == "torch"] for il in range(cfg.n_layer)]
    assert sum(map(len, placed)) == 3
    base = ["bench", "--model", str(model), "--prompt-tokens", str(PROMPT_TOKENS),
            "--gen-tokens", str(GEN_TOKENS), "--repeat", str(REPEAT), "--threads", "2",
            "--probe-mib", "8", "--no-progress"]
    args = [*base, "--device", "torch-cpu", "--gpu-memory-mb", str(mb),
            "--device-profile", str(prof)]
    assert main([*base, "--device", "cpu", "--json"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)
    assert on_cpu["device"] == "cpu" and on_cpu["gpu_tier"] is None
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"] == "torch-cpu" and r["greedy_tokens"] == on_cpu["greedy_tokens"]
    assert r["placement"] == (f"{cfg.n_layer} of {cfg.n_layer} layers on torch-cpu with 3 of "
                              f"{cfg.n_expert * len(cfg.moe_layers)} routed experts; the rest "
                              "on the CPU (the C core)")
    assert r["decode_products"] is None  # the torch device's products are not timed
    t = r["gpu_tier"]
    assert {"hits", "misses", "uploads", "upload_bytes", "evictions", "steps"} <= set(
        t["counter_names"])
    assert all(isinstance(t[k], int) and t[k] >= 0 for k in t["counter_names"])
    # the experts the plan placed were on the device at load; the tier swaps, never adds
    assert t["placed_experts"] == placed and t["layers"] == cfg.moe_layers
    assert t["experts_on_device"] == 3 == sum(map(len, t["device_experts"]))
    assert t["uploads"] == t["evictions"]
    expert_bytes = t["device_expert_bytes"] // 3
    assert t["upload_bytes"] == t["uploads"] * expert_bytes
    # every token of the timed runs chose n_expert_used experts in each of the device's
    # layers, each choice computed on the device (a hit) or on the CPU beside it (a miss)
    n_tokens = REPEAT * (PROMPT_TOKENS + GEN_TOKENS)
    assert t["hits"] + t["misses"] == n_tokens * cfg.n_expert_used * len(cfg.moe_layers)
    assert t["hit_rate"] == pytest.approx(t["hits"] / (t["hits"] + t["misses"]))
    assert t["steps"] == REPEAT * (1 + GEN_TOKENS)  # one prefill call, then one per token
    out = render(r)  # what the table run prints
    assert "device         torch-cpu: " in out and "GPU tier       3 experts on the device" in out
    assert f"steps {t['steps']}" in out and "products       not timed" in out
    assert main([*args, "--profile"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    # colibri info says where serve would put the same budget (at the model's own context)
    _p, text, _plan = plan_placement(model, cfg, SIM, mb, cfg.default_n_ctx())
    assert main(["info", str(model), "--device", "torch-cpu", "--gpu-memory-mb", str(mb),
                 "--device-profile", str(prof)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("placement"))
    assert line == (f"placement     torch-cpu under {mb:.3g} MB (a KV cache of "
                    f"{cfg.default_n_ctx()} positions): {text}")
    assert " routed experts (hottest first; by layer " in text
