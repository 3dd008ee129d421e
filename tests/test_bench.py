"""`colibri bench` and its probes: shapes of the output and exact byte counts, never speed.

- the bandwidth probe and the int8 loop ceiling return positive finite figures and refuse
  bad arguments;
- `colibri bench --json` on tiny converted Mixtral models prints one JSON object with every
  field, and bytes per token equal a count made by hand from the model's dimensions and the
  format's block sizes (f32 and q4, tied and untied lm_head);
- greedy decoding of a tiny f32 model gives the same tokens with the reference kernels and
  the best ISA the machine has.
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.app.settings import Settings  # noqa: E402
from colibri.engine import _core  # noqa: E402
from colibri.engine.core.loader import EngineConfig  # noqa: E402
from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.format.wfile import read_wfile  # noqa: E402
from colibri.engine.tools.bench import (  # noqa: E402
    bench_prompt,
    cpu_model,
    timed_greedy_run,
    weight_bytes_per_token,
)
from colibri.engine.tools.cache_args import DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES  # noqa: E402
from colibri.engine.tools.cli import main  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, make_checkpoint  # noqa: E402

# tests/tiny_models.py's mixtral dimensions
D, F, LAYERS, H, HKV, HD, E, K = 64, 96, 2, 4, 2, 16, 4, 2


def _row(type_name: str, n: int) -> int:
    """Bytes of one row of n elements (docs/INTERNALS.md's type table)."""
    return {"f32": 4 * n, "f16": 2 * n, "q8": n // 32 * 34, "q6": n // 32 * 26,
            "q4": n // 32 * 18}[type_name]


def _hand_count(vocab: str, mat: str, expert: str) -> int:
    """Weight bytes one decoded token reads, from the dimensions alone: vocab is the type of
    the embeddings and lm_head, mat of the attention matrices (tied or not: the lm_head reads
    a [V, D] matrix of the embeddings' type either way)."""
    attention = (4 * D + _row(mat, D) * (H * HD + 2 * HKV * HD) + _row(mat, H * HD) * D)
    router = 4 * D + 4 * E * D  # ffn_norm + gate_inp, both f32
    one_expert = 2 * F * _row(expert, D) + D * _row(expert, F)
    per_layer = attention + router + K * one_expert
    lm_head = VOCAB_SIZE * _row(vocab, D)  # the output matrix, or the tied embedding matrix
    return LAYERS * per_layer + _row(vocab, D) + 4 * D + lm_head


# the q4 preset: embeddings and lm_head q6, every other matrix q4
Q4 = ("q6", "q4", "q4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    hf = make_checkpoint("mixtral", root / "hf", seed=3)
    hf_tied = make_checkpoint("mixtral", root / "hf_tied", seed=4, tie_word_embeddings=True)
    return {
        "hf": hf,
        "f32": convert(hf, root / "f32", quant="f32", progress=False),
        "q4": convert(hf, root / "q4", quant="q4", progress=False),
        "q4_tied": convert(hf_tied, root / "q4_tied", quant="q4", progress=False),
    }


def test_bandwidth_probe_positive_and_finite_on_every_isa() -> None:
    """Each ISA's read kernel must reproduce the fill pattern's checksum (else ValueError),
    including a tail that is not a whole vector (4 MiB + 24 bytes)."""
    before = _core.isa_active()
    try:
        for isa in _core.isa_supported():
            _core.isa_force(isa)
            for threads in (1, 2):
                gbps = _core.bandwidth_probe((4 << 20) + 24, threads, 2)
                assert math.isfinite(gbps) and gbps > 0
    finally:
        _core.isa_force(before)


def test_int8_loop_ceiling_positive_and_finite() -> None:
    for variant, isa in zip(_core.INT8_LOOP_VARIANTS, _core.INT8_LOOP_ISA, strict=True):
        if isa in _core.isa_supported():
            g = _core.int8_loop_bench(variant)
            assert g > 0 and math.isfinite(g)
        else:  # the loop is that ISA's code
            need = "AVX-512" if isa == "avx512" else "AVX2"
            with pytest.raises(ValueError, match=f"needs a CPU with {need}"):
                _core.int8_loop_bench(variant)
    with pytest.raises(ValueError, match="variant must be one of"):
        _core.int8_loop_bench("q5")


@pytest.mark.parametrize("args", [(100, 1, 1), (1 << 20, 0, 1), (1 << 20, 1, 0)])
def test_bandwidth_probe_refuses_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        _core.bandwidth_probe(*args)


@pytest.mark.parametrize("name,types,tied", [
    ("f32", ("f32", "f32", "f32"), False),
    ("q4", Q4, False),
    ("q4_tied", Q4, True),
])
def test_bytes_per_token_match_hand_count(tiny: dict[str, Path], name: str,
                                          types: tuple[str, str, str], tied: bool) -> None:
    has_output = "output" in read_wfile(tiny[name] / "embeddings.bin").tensors
    assert has_output != tied  # the tied model really reads its lm_head from tok_embd
    parts = weight_bytes_per_token(tiny[name])
    assert parts["total"] == _hand_count(*types)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    expert = types[2]
    assert parts["experts"] == LAYERS * K * (2 * F * _row(expert, D) + D * _row(expert, F))


def test_bench_json_has_every_field(tiny: dict[str, Path],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12",
               "--gen-tokens", "6", "--threads", "2", "--repeat", "2", "--probe-mib", "8",
               "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["architecture"] == "mixtral" and r["quant"] == "q4"
    assert r["cpu"] == cpu_model()  # what results files and ab_bench record
    assert (r["threads"], r["prompt_tokens"], r["gen_tokens"], r["repeat"]) == (2, 12, 6, 2)
    assert r["kv_cache_type"] == "f16"  # what the server runs by default
    for key in ("prefill_tok_s", "decode_tok_s"):
        s = r[key]
        assert len(s["runs"]) == 2
        assert all(math.isfinite(v) and v > 0 for v in s["runs"])
        assert s["min"] <= s["median"] <= s["max"]
    assert r["bytes_per_token"] == _hand_count(*Q4)
    assert sum(r["bytes_per_token_parts"].values()) == r["bytes_per_token"]
    assert r["peak_rss_bytes"] > 0
    assert r["probe_bytes"] == 8 << 20
    assert r["bandwidth_gb_s"] > 0 and math.isfinite(r["bandwidth_gb_s"])
    # one probe before loading, one after the runs; the bound takes the higher
    probes = r["bandwidth_probes_gb_s"]
    assert len(probes) == 2 and all(g > 0 and math.isfinite(g) for g in probes)
    assert r["bandwidth_gb_s"] == max(probes)
    assert r["bound_tok_s"] == pytest.approx(r["bandwidth_gb_s"] * 1e9 / r["bytes_per_token"])
    assert r["percent_of_bound"] == pytest.approx(
        100 * r["decode_tok_s"]["median"] / r["bound_tok_s"])
    # a read before every run and after the last; each run against the higher of its two
    reads = r["bandwidth_between_runs_gb_s"]
    assert len(reads) == 3 and all(g > 0 and math.isfinite(g) for g in reads)
    sm = r["percent_of_read_same_minute"]
    want = [100 * v * r["bytes_per_token"] / (max(a, b) * 1e9)
            for v, a, b in zip(r["decode_tok_s"]["runs"], reads, reads[1:], strict=False)]
    assert sm["runs"] == pytest.approx(want) and len(want) == 2
    assert sm["min"] <= sm["median"] <= sm["max"]
    # the products timed in place read every weight of a token once, all but the norms and
    # the embedding row; the step they are set against is the median run's
    pr = r["decode_products"]
    norms = LAYERS * 2 * 4 * D + 4 * D
    assert pr["bytes_per_token"] == _hand_count(*Q4) - norms - _row(Q4[0], D)
    assert 0 < pr["s_per_token"] < pr["step_s"]
    assert any(1 / pr["step_s"] == pytest.approx(v) for v in r["decode_tok_s"]["runs"])
    assert pr["other_s_per_token"] == pytest.approx(pr["step_s"] - pr["s_per_token"])
    assert pr["gb_s"] == pytest.approx(pr["bytes_per_token"] / pr["s_per_token"] / 1e9)
    assert r["isa"] in _core.isa_supported()
    assert r["prefetch"] in _core.STREAM_HINTS
    assert len(r["greedy_tokens"]) == 7 and all(0 <= t < VOCAB_SIZE for t in r["greedy_tokens"])


def test_bench_reports_the_expert_cache(tiny: dict[str, Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12", "--gen-tokens", "6",
            "--threads", "2", "--repeat", "2", "--probe-mib", "8"]
    assert main([*args, "--json"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["expert_cache"]["enabled"] is False
    assert main([*args, "--json", "--expert-cache-size", "2", "--no-expert-prefetch",
                 "--expert-load", "pread", "--expert-readers", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    xc = r["expert_cache"]
    assert xc["enabled"] is True and xc["slots_per_layer"] == 2
    assert r["greedy_tokens"] == off["greedy_tokens"]  # the budget never changes a token
    acq = xc["hits"] + xc["misses"]
    assert acq > 0 and xc["hit_rate"] == pytest.approx(xc["hits"] / acq)
    assert len(xc["hit_rate_per_layer"]) == LAYERS
    assert xc["bytes_read"] == xc["loads"] * xc["expert_bytes"]  # pread reads just the span
    assert xc["resident_bytes"] <= xc["budget_bytes"] == 2 * LAYERS * xc["expert_bytes"]
    assert xc["prefetch_issued"] == 0 and xc["prefetch_cancelled"] == 0
    assert main([*args, "--expert-cache-size", "2"]) == 0
    assert "expert cache   2 of" in capsys.readouterr().out
    assert main([*args, "--expert-cache-size", "1"]) == 2
    assert "must be in" in capsys.readouterr().err


@pytest.mark.parametrize("kv", ["f32", "q8"])
def test_bench_runs_the_kv_cache_type_asked_for(tiny: dict[str, Path], kv: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12", "--gen-tokens", "6",
            "--threads", "2", "--repeat", "1", "--probe-mib", "8"]
    assert main([*args, "--kv-cache-type", kv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_cache_type"] == kv
    assert main([*args, "--kv-cache-type", kv]) == 0
    assert f"1 repeats, {kv} KV cache" in capsys.readouterr().out
    assert main([*args, "--kv-cache-type", "f8"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_kv_cache_type_names_match_the_core() -> None:
    # spelled out where options are parsed (no C loaded there), and in the server's settings
    assert KV_CACHE_TYPES == ("auto", *_core.KV_TYPES)
    field = Settings.model_fields["kv_cache_type"]
    assert typing.get_args(field.annotation) == KV_CACHE_TYPES
    assert field.default == DEFAULT_KV_CACHE_TYPE == EngineConfig().kv_cache_type == "auto"


@pytest.mark.parametrize("quant, want", [("f32", "f32"), ("f16", "f16"), ("q8", "f16"),
                                         ("q4", "f16")])
def test_auto_kv_cache_follows_the_weights(quant: str, want: str) -> None:
    from colibri.engine.core.kv_types import resolve_kv_type

    assert resolve_kv_type("auto", quant) == want
    assert resolve_kv_type("q8", quant) == "q8"  # a type asked for is kept
    with pytest.raises(ValueError, match="unknown KV cache type"):
        resolve_kv_type("f8", quant)


def test_bench_leaves_out_the_reads_between_runs_when_memory_is_short(
        tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import colibri.engine.tools.bench as bench

    args = ["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12", "--gen-tokens", "6",
            "--threads", "2", "--repeat", "2", "--probe-mib", "8"]
    assert main([*args]) == 0
    assert "same minute    each run's decode is" in capsys.readouterr().out
    # free memory below twice the probe's buffer: no probe beside the model
    monkeypatch.setattr(bench, "available_memory_bytes", lambda: 15 << 20)
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bandwidth_between_runs_gb_s"] == [] and r["percent_of_read_same_minute"] is None
    assert len(r["bandwidth_probes_gb_s"]) == 2  # the bound's own probes still run
    assert main(args) == 0
    assert "same minute    not measured" in capsys.readouterr().out


def test_bench_table_and_bad_arguments(tiny: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--model", str(tiny["f32"]), "--prompt-tokens", "4",
               "--gen-tokens", "2", "--repeat", "1", "--threads", "1", "--probe-mib", "4"])
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("prefill tok/s", "decode tok/s", "peak RSS", "weights/token", "bandwidth",
                  "decode bound", "products"):
        assert label in out
    assert main(["bench", "--model", str(tiny["f32"]), "--repeat", "0"]) == 2
    assert "repeat must be positive" in capsys.readouterr().err


def test_bench_speculative_runs_the_step_engine_both_ways(
        tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """--speculative ngram adds step-engine decode figures with and without drafts (runs
    alternating, the same greedy tokens both ways, else the bench fails) and the counters."""
    args = ["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12", "--gen-tokens", "24",
            "--threads", "2", "--repeat", "2", "--probe-mib", "4", "--speculative", "ngram",
            "--num-speculative-tokens", "3"]
    assert main([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["speculative"]
    assert (r["method"], r["num_speculative_tokens"]) == ("ngram", 3)
    for key in ("decode_tok_s", "decode_tok_s_off"):
        assert len(r[key]["runs"]) == 2 and all(v > 0 for v in r[key]["runs"])
    assert r["drafts"] > 0 and 0 < r["draft_tokens"] <= 3 * r["drafts"]
    assert 0 <= r["accepted_tokens"] <= r["draft_tokens"]
    assert r["mean_accepted"] == pytest.approx(r["accepted_tokens"] / r["drafts"])
    assert main(args) == 0
    assert "mean accepted length" in capsys.readouterr().out
    assert main([*args[:-1], "0"]) == 2
    assert "--num-speculative-tokens must be at least 1" in capsys.readouterr().err


def test_bench_converts_a_hugging_face_folder(tiny: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path))
    rc = main(["bench", "--model", str(tiny["hf"]), "--quant", "q4", "--prompt-tokens", "4",
               "--gen-tokens", "2", "--repeat", "1", "--threads", "1", "--probe-mib", "4",
               "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert Path(r["model"]).parent == tmp_path and r["quant"] == "q4"
    assert r["bytes_per_token"] == _hand_count(*Q4)


def test_prompt_is_deterministic_and_valid() -> None:
    a, b = bench_prompt(320, 128), bench_prompt(320, 128)
    assert np.array_equal(a, b) and a.dtype == np.int32
    assert a.min() >= 0 and a.max() < 320 and len(np.unique(a)) > 64


def test_greedy_tokens_same_on_reference_and_best_isa(tiny: dict[str, Path]) -> None:
    prompt = bench_prompt(VOCAB_SIZE, 20)
    before = _core.isa_active()
    runs = {}
    try:
        for isa in sorted({"ref", _core.isa_best()}):
            _core.isa_force(isa)
            m = Model.load(tiny["f32"], threads=2, n_ctx=64)
            runs[isa] = timed_greedy_run(m, prompt, 24).tokens
    finally:
        _core.isa_force(before)
    assert len(runs["ref"]) == 25
    assert runs["ref"] == runs[_core.isa_best()]
    assert len(set(runs["ref"])) > 1  # a model stuck on one token would prove little


@pytest.mark.parametrize("name", ["q4", "q4_tied"])
def test_profile_times_every_product_of_a_decode_step_in_place(
        tiny: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each phase's bytes per decoded token equal that part of the hand count, its dispatches
    are the forward pass's, and the parts add up to the measured step."""
    rc = main(["bench", "--model", str(tiny[name]), "--prompt-tokens", "12", "--gen-tokens",
               "5", "--threads", "2", "--repeat", "3", "--probe-mib", "8", "--profile",
               "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    p, parts = r["profile"], r["bytes_per_token_parts"]
    ph = p["phases"]
    assert list(ph) == ["attention projections", "router", "experts gate+up", "experts down",
                        "lm_head"]  # this model has no shared expert
    assert ph["experts gate+up"]["bytes"] + ph["experts down"]["bytes"] == parts["experts"]
    assert ph["lm_head"]["bytes"] == parts["lm_head"]
    assert ph["attention projections"]["bytes"] == parts["attention"] - LAYERS * 4 * D  # norm
    assert ph["router"]["bytes"] == LAYERS * 4 * E * D
    # per layer: q, k and v in one dispatch and the output projection; one router product;
    # every routed expert's gate and up in one dispatch, their down in another
    want_calls = {"attention projections": 2 * LAYERS, "router": LAYERS,
                  "experts gate+up": LAYERS, "experts down": LAYERS, "lm_head": 1}
    assert {k: v["calls"] for k, v in ph.items()} == want_calls
    assert all(v["s"] > 0 and v["gb_s"] == pytest.approx(v["bytes"] / v["s"] / 1e9)
               for v in ph.values())
    assert p["products_s"] == pytest.approx(sum(v["s"] for v in ph.values()))
    assert p["products_s"] == pytest.approx(r["decode_products"]["s_per_token"])
    assert p["attention_s"] > 0 and p["rest_of_forward_s"] > 0 and p["outside_forward_s"] > 0
    assert p["step_s"] == pytest.approx(r["decode_products"]["step_s"])
    assert p["step_s"] == pytest.approx(p["products_s"] + p["attention_s"]
                                        + p["rest_of_forward_s"] + p["outside_forward_s"])
    reads = r["bandwidth_between_runs_gb_s"]
    assert any(p["read_gb_s"] == max(a, b) for a, b in zip(reads, reads[1:], strict=False))
    assert p["pool_run_us"] > 0
    main(["bench", "--model", str(tiny[name]), "--prompt-tokens", "4", "--gen-tokens", "2",
          "--threads", "2", "--repeat", "1", "--probe-mib", "8", "--profile"])
    out = capsys.readouterr().out
    for label in ("experts gate+up", "attention over the cache", "outside the forward pass",
                  "measured decode step"):
        assert label in out


def test_bench_profile_never_imports_bench() -> None:
    """bench imports bench_profile, never the other way round, not even inside a function or
    for type checking: the two modules are one layer over the other, not a circle."""
    import ast

    import colibri.engine.tools.bench_profile as bench_profile

    tree = ast.parse(Path(bench_profile.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [f"{n.module}.{a.name}" for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    bench = "colibri.engine.tools.bench"
    assert not [n for n in names if n == bench or n.startswith(bench + ".")], names


def test_bench_shows_its_progress_on_stderr(tiny: dict[str, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A bar on stderr names each phase and counts them (first read, load, warm-up, each
    timed run, last read); --no-progress leaves stderr empty; stdout is the result alone."""
    args = ["bench", "--model", str(tiny["q4"]), "--prompt-tokens", "12", "--gen-tokens", "6",
            "--threads", "2", "--repeat", "2", "--probe-mib", "8", "--json"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    for shown in ("bench 0/6", "reading memory", "loading the model", "warm-up",
                  "timed run 1 of 2", "timed run 2 of 2 (the last decoded", "bench 6/6"):
        assert shown in err, err
    assert main([*args, "--no-progress"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert err == ""
