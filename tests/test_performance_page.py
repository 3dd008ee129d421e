"""docs/performance.md's current results are made from results/ and nothing else: making the
part again from the files gives the committed page, each table row comes from the newest file
of its series, and a file or folder the page cannot account for is refused, not skipped."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts_loader import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def page() -> ModuleType:
    return load_script("make_performance_page")


def test_the_committed_page_is_made_from_results(page: ModuleType) -> None:
    text = (ROOT / "docs" / "performance.md").read_text()
    assert page.render_page(text) == text, (
        "docs/performance.md differs from results/: run python scripts/make_performance_page.py")
    assert page.main(["--check"]) == 0


def test_every_figure_comes_from_a_results_file(page: ModuleType) -> None:
    """Each row links its file, and its figures are that file's, as the page rounds them."""
    text = (ROOT / "docs" / "performance.md").read_text()
    part = text.split(page.BEGIN)[1].split(page.END)[0]
    rows = [ln for ln in part.splitlines() if ln.startswith("| ") and "](../results/" in ln]
    assert rows
    for row in rows:
        link = re.search(r"\]\(\.\./(results/[^)]+\.json)\)", row)
        assert link is not None, row
        data = json.loads((ROOT / link.group(1)).read_text())
        assert f"`{data['command']}`" in row.replace("\\|", "|")
        assert data["commit"][:7] in row
        for rate in re.findall(r"\| (\d+\.\d) / (\d+\.\d) \|", row):
            for x in rate:
                assert _rounded_in(float(x), data), (x, row)


def _rounded_in(x: float, data: object) -> bool:
    """Some number in data rounds to x at one decimal."""
    if isinstance(data, dict):
        return any(_rounded_in(x, v) for v in data.values())
    if isinstance(data, list):
        return any(_rounded_in(x, v) for v in data)
    return isinstance(data, float) and f"{data:.1f}" == f"{x:.1f}"


def _copy(src: str, dst: Path, drop: tuple[str, ...] = (), **changes: object) -> None:
    """A results file of this repository, with changes, at dst."""
    data = json.loads((ROOT / "results" / src).read_text())
    data.update(changes)
    for key in drop:
        del data[key]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps(data))


AB = "ab_bench/2026-12-04-xeon-spr-mixtral-before-after-family-modules.json"
CMP = "compare_llamacpp/2026-12-04-xeon-spr-deepseek_v2-lite-shape.json"


def test_a_new_measurement_replaces_the_older_one_of_its_series(page: ModuleType,
                                                                 tmp_path: Path) -> None:
    res = tmp_path / "results"
    _copy(CMP, res / "compare_llamacpp" / "2026-01-01-spr-ds.json", command="old run")
    _copy(CMP, res / "compare_llamacpp" / "2026-02-01-spr-ds.json", command="new run")
    _copy(CMP, res / "compare_llamacpp" / "2026-01-15-spr-other.json", command="other series")
    # another machine: a table of its own
    _copy(AB, res / "ab_bench" / "2026-01-01-zen5.json", cpu_model="AMD EPYC Zen 5")
    out = page.render_results(res, tmp_path / "docs")
    assert "new run" in out and "other series" in out and "old run" not in out
    assert out.count("\n### ") == 2
    zen5 = out.split("### AMD EPYC Zen 5")[1].split("\n### ")[0]
    assert "before / after" in zen5 and "beside llama.cpp" not in zen5
    assert "(../results/compare_llamacpp/2026-02-01-spr-ds.json)" in out


def test_files_the_page_cannot_account_for_are_refused(page: ModuleType, tmp_path: Path) -> None:
    res = tmp_path / "results"
    _copy(CMP, res / "compare_llamacpp" / "undated.json")
    with pytest.raises(ValueError, match="no date"):
        page.render_results(res, tmp_path / "docs")
    shutil.rmtree(res)
    _copy(CMP, res / "compare_llamacpp" / "2026-01-01-x.json", drop=("command",))
    with pytest.raises(ValueError, match="no 'command'"):
        page.render_results(res, tmp_path / "docs")
    shutil.rmtree(res)
    _copy(CMP, res / "bench_serving" / "2026-01-01-x.json")
    with pytest.raises(ValueError, match="no table rows for results/bench_serving/"):
        page.render_results(res, tmp_path / "docs")


def test_the_page_keeps_its_prose_around_the_markers(page: ModuleType) -> None:
    text = "intro\n" + page.BEGIN + "\nstale table\n" + page.END + "\nmethod\n"
    out = page.render_page(text)
    assert out.startswith("intro\n" + page.BEGIN + "\n") and out.endswith(page.END + "\nmethod\n")
    assert "stale table" not in out and "### " in out
    with pytest.raises(ValueError, match="needs one"):
        page.render_page("no markers\n")


def test_scripts_record_what_the_page_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """measured_on(), which the benchmark scripts put into every results file, gives the CPU,
    this checkout's commit, the command line (with the COLIBRI_* variables it ran under) and
    today's date."""
    import datetime
    import os
    import subprocess

    for key in [k for k in os.environ if k.startswith("COLIBRI_")]:
        monkeypatch.delenv(key)

    from colibri.engine.tools.bench import cpu_model, measured_on

    rec = measured_on(["scripts/x.py", "--json", "out file.json"])
    assert set(rec) == {"cpu", "commit", "command", "date"}
    assert rec["cpu"] == cpu_model()
    assert rec["command"] == "python scripts/x.py --json 'out file.json'"
    monkeypatch.setenv("COLIBRI_THREADS", "3")
    assert measured_on(["scripts/x.py"])["command"] == "COLIBRI_THREADS=3 python scripts/x.py"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert rec["commit"] == (head or None)
    assert rec["date"] == datetime.datetime.now(datetime.UTC).date().isoformat()


def test_bench_server_rows_name_both_servers(page: ModuleType) -> None:
    files = sorted((ROOT / "results" / "bench_server").glob("*.json"))
    assert files, "results/bench_server/ holds no measurement"
    d = json.loads(files[-1].read_text())
    rows = page.bench_server_rows(d)
    assert len(rows) == (2 if "baseline_http" in d else 1)
    for row, name in zip(rows, ("http", "baseline_http"), strict=False):
        assert f"{d[name]['overhead']['itl_mean_ms']:+.2f} ms a token" in row[8]
        assert row[5] == f"– / {1e3 / d['direct']['itl_mean_ms']:.1f}"


def test_checkout_python_imports_each_layout(tmp_path: Path) -> None:
    """A checkout from before the colibri.* names runs as `app`, a later one through links
    that make colibri.app / colibri.engine its own code."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from checkouts import checkout_python
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    old = tmp_path / "old"
    (old / "engine").mkdir(parents=True)
    (old / "engine" / "__init__.py").write_text('"""engine"""\n')
    env, prefix = checkout_python(old, tmp_path / "work-old")
    assert prefix == "" and env["PYTHONPATH"].split(":")[0] == str(old)
    env, prefix = checkout_python(ROOT, tmp_path / "work-new")
    assert prefix == "colibri."
    names = Path(env["PYTHONPATH"].split(":")[0]) / "colibri"
    assert (names / "engine").resolve() == (ROOT / "engine").resolve()
    assert (names / "app").resolve() == (ROOT / "app").resolve()


def test_a_gpt_oss_comparison_names_its_mxfp4_pair(page: ModuleType) -> None:
    """compare_llamacpp --arch gpt_oss records one pair, Colibri's mxfp4 against llama.cpp's
    MXFP4_MOE, with the llama.cpp precision in its ratio."""
    d = json.loads((ROOT / "results" / CMP).read_text())
    d["model"] = {**d["model"], "arch": "gpt_oss", "hidden": 2880, "layers": 12, "experts": 32,
                  "top_k": 4}
    q8 = d["ratios_colibri_over_llama"]["q8"]
    d["ratios_colibri_over_llama"] = {"mxfp4": {**q8, "llama_precision": "MXFP4_MOE"}}
    by = {(r["engine"], r["precision"]): r for r in d["rows"]}
    d["rows"] = [{**by[("colibri", "q8")], "precision": "mxfp4"},
                 {**by[("llama.cpp", "Q8_0")], "precision": "MXFP4_MOE"}]
    (row,) = page.compare_llamacpp_rows(d)
    assert row[1].startswith("random gpt_oss: hidden 2880, 12 layers, 32 experts top-4; ")
    assert row[2] == "mxfp4"
    assert row[4] == f"llama.cpp MXFP4_MOE (llama-cpp-python {d['llama_cpp_python']})"


def test_a_long_context_run_gives_one_row_per_model(page: ModuleType) -> None:
    """scripts/bench_long_context.py's file: each model's longest context beside its
    shortest, with the ratio of the decode medians the file records."""
    ctx = {n: {"prefill_tok_s": {"median": p}, "decode_tok_s": {"median": dec}}
           for n, p, dec in (("256", 200.0, 20.0), ("8192", 100.0, 19.0))}
    d = {"prompt_tokens": [256, 8192], "gen_tokens": 48, "repeat": 3, "quant": "q8",
         "dims": {"hidden": 2048, "experts": 32, "top_k": 8},
         "models": {"qwen3_next": {"layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                   "threads": 2, "contexts": ctx,
                                   "decode_ratio": {"8192/256": 0.95}}}}
    (row,) = page.bench_long_context_rows(d)
    assert row[1].startswith("random qwen3_next: hidden 2048, 4 layers (1 full attention), "
                             "32 experts top-8; 8192-token prompt")
    assert row[3] == "100.0 / 19.0" and row[5] == "200.0 / 20.0"
    assert row[6] == "x0.95" and row[7] == "x0.50"


def test_a_kv_bytes_run_gives_one_row_per_length(page: ModuleType) -> None:
    """scripts/bench_kv_pools.py's file: per sequence length, the windowed pool's bytes a token
    beside one pool's and llama.cpp's, as the file records them."""
    d = json.loads((ROOT / "results" / "kv_bytes"
                    / "2026-12-06-gpt-oss-20b-shape-12-layers.json").read_text())
    rows = page.kv_bytes_rows(d)
    assert len(rows) == len(d["rows"]) >= 2
    for row, r in zip(rows, d["rows"], strict=True):
        win, one = r["windowed_pool"], r["one_pool"]
        assert f"one sequence at {win['tokens']} tokens" in row[1]
        assert row[3] == f"{win['bytes_per_token'] / 1000:.2f} kB a token"
        assert row[5].startswith(f"{one['bytes_per_token'] / 1000:.2f} kB a token; llama.cpp ")
        assert win["bytes"] < one["bytes"]
    # held blocks times the C cache's block sizes: the windowed pool's share stays the window's
    assert {r["windowed_pool"]["win_blocks"] for r in d["rows"]} == {128 // 16}


def test_a_replicas_run_gives_a_routing_row_and_a_scaling_row(page: ModuleType) -> None:
    routing = {"prefix_cache_hit_rate": 0.75, "ttft_p50_ms": 40.0, "ttft_p99_ms": 90.0}
    d = {"model": "demo_model", "conversations": 8, "turns": 4, "max_tokens": 32,
         "routing": {"prefix": routing,
                     "round_robin": {**routing, "prefix_cache_hit_rate": 0.5,
                                     "ttft_p50_ms": 60.0}},
         "two_replicas_one_thread": {"tok_s": 50.0}, "one_replica_two_threads": {"tok_s": 48.0},
         "scale": {"requests": 32, "tokens": 64, "concurrency": 8, "ratio": 50.0 / 48.0}}
    route, scale = page.bench_replicas_rows(d)
    assert "x1.50" in route[6] and "75.0%" in route[8] and "50.0%" in route[8]
    assert scale[3] == "– / 50.0" and scale[5] == "– / 48.0" and scale[6] == "x1.04"
