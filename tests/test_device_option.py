"""--device and --gpu-memory-mb end to end on a machine without a GPU: the step engine
(scheduler, paged KV pool, prefix cache) on the torch backend (`torch-cpu`) gives the C core's
greedy tokens; `colibri generate` prints the same text on either device; `colibri info` says
what would run where; a CUDA device this machine lacks, and bench on a torch device, are
refused with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.engine.core.loader import EngineConfig  # noqa: E402
from colibri.engine.executor.backend import check_device, resolve_device  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.llm import LLM  # noqa: E402
from colibri.engine.sample.sampler import SamplingParams  # noqa: E402
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


def test_commands_take_the_device(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
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
    assert main(["bench", "--model", str(model), "--device", "torch-cpu",
                 "--no-progress"]) == 2
    assert "scripts/device_check.sh" in capsys.readouterr().err
