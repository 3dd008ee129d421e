"""Test-session setup: every test file belongs to one subsystem, marked so a change runs its
part alone (`pytest -m kernels`, `pytest -m "models and not slow"`), and files whose tests take
long (browsers, real client libraries, whole-model references) are also marked `slow`, so
`pytest -m "not slow"` is the quick pass. The session keeps converted models in a temporary
folder (COLIBRI_CACHE_DIR), never in the user's ~/.cache/colibri. The `checkpoints` fixture
makes each tiny checkpoint once per session for every file that reads it. The `isa` fixture
runs a test on the best kernels this CPU has and, in the whole suite, on the reference ones.
docs/testing.md says how to run which part."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from colibri.engine import _core
from tests.tiny_models import TinyCheckpoints

# subsystem -> its test files (tests/test_markers.py checks that every file has exactly one)
SUBSYSTEMS: dict[str, tuple[str, ...]] = {
    # C kernels, pool, threads, KV layout: what a csrc/ change touches first
    "kernels": ("test_kernels.py", "test_kernel_invariance.py", "test_repack.py", "test_pool.py",
                "test_threadpool.py", "test_paged_kv.py", "test_c_api.py",
                "test_hparams_contract.py", "test_weight_types.py", "test_mxfp4.py"),
    # model families, conversion, weight files: engine/models and engine/format
    "models": ("test_parity.py", "test_parity_families.py", "test_fp8_checkpoint.py",
               "test_convert.py", "test_model_files.py", "test_reliability_files.py",
               "test_reliability_verify.py", "test_hub_models.py", "test_expert_cache.py",
               "test_expert_cache_warm.py",
               "test_demo_model.py", "test_demo_data.py", "test_demo_report.py",
               "test_gpt_oss_config.py", "test_minimax_m2.py", "test_linear_attn.py",
               "test_llama4_config.py", "test_torch_backend.py", "test_costmodel.py",
               "test_expert_split.py"),
    # scheduling, sampling, text: engine/core, engine/sample, engine/text
    "engine": ("test_batching.py", "test_block_manager.py", "test_scheduler.py", "test_llm.py",
               "test_sampling.py",
               "test_sample_batch.py", "test_constraints.py", "test_tokenizer.py",
               "test_detok.py", "test_toolcalls.py", "test_reasoning.py", "test_toolformats.py",
               "test_chat_template_files.py",
               "test_input_checks.py", "test_reliability_templates.py",
               "test_gpt_oss_text.py", "test_hybrid_engine.py", "test_spec_cost.py",
               "test_spec_ngram.py", "test_speculative.py", "test_kv_window_pool.py",
               "test_device_option.py", "test_mtp.py", "test_mtp_qwen3_next.py"),
    # the HTTP server and what clients see
    "server": ("test_server_openai.py", "test_server_errors.py", "test_server_lifecycle.py",
               "test_server_settings.py", "test_server_batching.py",
               "test_server_expert_cache.py", "test_families_serving.py",
               "test_reasoning_serving.py", "test_toolcall_serving.py",
               "test_reliability_http.py", "test_reliability_requests.py",
               "test_reliability_schema.py", "test_reliability_tooling.py",
               "test_reliability_grammar.py", "test_reliability_soak.py",
               "test_server_clients.py", "test_server_browser.py",
               "test_server_messages.py", "test_server_agent_requests.py",
               "test_messages_reasoning.py", "test_stream_path.py",
               "test_expert_page_browser.py", "test_lm_eval.py", "test_speculative_serving.py",
               "test_worker_endpoints.py", "test_server_router.py", "test_replica_routing.py",
               "test_replicas.py"),
    # command-line tools, scripts, packaging, docs
    "tools": ("test_bench.py", "test_cli_models.py", "test_cli_args.py", "test_evaluate.py",
              "test_replay.py", "test_options.py",
              "test_compare_llamacpp.py", "test_bench_long_context.py", "test_copy_model.py",
              "test_performance_page.py", "test_layering.py",
              "test_packaging.py", "test_run_agents.py",
              "test_readme_examples.py", "test_markers.py"),
}
# files whose tests take the longest or need a browser or client libraries (measured with
# --durations on 2 cores: the schema fuzzing alone is about half of the whole suite); single
# tests of several seconds elsewhere carry @pytest.mark.slow themselves
SLOW: tuple[str, ...] = ("test_reliability_schema.py", "test_expert_page_browser.py",
                         "test_server_browser.py", "test_lm_eval.py", "test_server_clients.py")

_BY_FILE = {f: name for name, files in SUBSYSTEMS.items() for f in files}


@pytest.fixture(scope="module")
def own_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """COLIBRI_CACHE_DIR pointed at a fresh folder for one test module (conversions made there
    stay out of the other modules' way), restored afterwards."""
    old = os.environ.get("COLIBRI_CACHE_DIR")
    path = tmp_path_factory.mktemp("cache")
    os.environ["COLIBRI_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("COLIBRI_CACHE_DIR", None)
    else:
        os.environ["COLIBRI_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    """Tiny checkpoints made once for the whole session (with their conversions and
    transformers models) and shared by every file that asks for the same one."""
    return TinyCheckpoints(tmp_path_factory.mktemp("checkpoints"))


def quick_params(values: Iterable[Any], quick: Iterable[Any]) -> list[Any]:
    """Parameters for a grid whose `quick` points run in the quick pass and the rest only in
    the whole suite (marked slow): a representative few where every point costs seconds."""
    keep = set(quick)
    return [v if v in keep else pytest.param(v, marks=pytest.mark.slow) for v in values]


# the model tests on the reference kernels are slow ones where the CPU has faster kernels:
# the kernel tests hold every ISA to the reference in the quick pass
_ISAS = sorted({"ref", _core.isa_best()}, key=lambda n: n != "ref")


@pytest.fixture(params=quick_params(_ISAS, _ISAS[-1:]))
def isa(request: pytest.FixtureRequest):  # noqa: ANN201
    """The reference kernels, then the best this CPU runs, for tests that compare a model or
    the cache across them (the kernel tests define their own, over every ISA); the quick
    pass runs the best only."""
    before = _core.isa_active()
    _core.isa_force(request.param)
    yield request.param
    _core.isa_force(before)


def pytest_configure(config: pytest.Config) -> None:
    for name in SUBSYSTEMS:
        config.addinivalue_line("markers", f"{name}: tests of the {name} subsystem")
    config.addinivalue_line("markers", "slow: long tests (browsers, client libraries, whole "
                                       "models); `-m 'not slow'` leaves them out")
    if not hasattr(config, "workerinput"):  # one folder per session, removed at its end
        cache = tempfile.mkdtemp(prefix="colibri-test-cache-")
        config._colibri_cache = cache  # type: ignore[attr-defined]
        os.environ["COLIBRI_CACHE_DIR"] = cache
    else:
        _share_the_cores(int(config.workerinput["workercount"]))


def _share_the_cores(workers: int) -> None:
    """Under `-n N` each worker gets its share of the cores: models and servers that do not
    say --threads default to cores / N threads (COLIBRI_THREADS, unless set), and so do
    transformers' reference computations, so N workers do not run N times the machine's
    threads, each waiting on the others' at every step."""
    import torch

    share = max(1, _core.physical_cores() // workers)
    os.environ.setdefault("COLIBRI_THREADS", str(share))
    torch.set_num_threads(share)


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.server_helpers import remove_tiny_models

    remove_tiny_models()
    cache = getattr(config, "_colibri_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name in _BY_FILE:
            item.add_marker(getattr(pytest.mark, _BY_FILE[name]))
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
