"""The bookkeeping of scripts/compare_llamacpp.py: which memory reads each run is set against,
the model shape from its flags, and the printed summary (the engines themselves run only
when the script is run, with llama-cpp-python installed); and the random gpt-oss checkpoint
with MXFP4 experts it writes (scripts/gpt_oss_checkpoint.py), read by transformers and
colibri convert."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.scripts_loader import load_script


def _script():  # noqa: ANN202
    return load_script("compare_llamacpp")


def test_each_run_is_set_against_the_reads_around_it() -> None:
    c = _script()
    reads = iter([30.0, 40.0, 20.0, 60.0])
    order: list[str] = []

    def runner(name: str, decode_s: float):  # noqa: ANN202
        def run() -> tuple[float, float, list[int]]:
            order.append(name)
            return 0.1, decode_s, [1, 2]
        return run

    seen: list[tuple[int, dict[str, int]]] = []
    between = [50.0]  # the read before the first run
    res, around = c.alternate({"llama.cpp": runner("llama.cpp", 2.0),
                               "colibri": runner("colibri", 1.0)}, 2, lambda: next(reads),
                              between, lambda rep, r: seen.append(
                                  (rep, {k: len(v) for k, v in r.items()})))
    assert order == ["llama.cpp", "colibri", "llama.cpp", "colibri"]
    assert between == [50.0, 30.0, 40.0, 20.0, 60.0]
    # llama.cpp's runs lie between reads 0-1 and 2-3, colibri's between 1-2 and 3-4
    assert around == {"llama.cpp": [50.0, 40.0], "colibri": [40.0, 60.0]}
    assert res["colibri"] == [(0.1, 1.0, [1, 2])] * 2
    assert seen == [(0, {"llama.cpp": 1, "colibri": 1}), (1, {"llama.cpp": 2, "colibri": 2})]


def test_percent_of_read() -> None:
    c = _script()
    # 128 tokens in 1 s at 100 MB per token stream 12.8 GB/s: half of a 25.6 GB/s read
    assert c.percent_of_read(128, 1.0, 100e6, 25.6) == pytest.approx(50.0)
    assert c.percent_of_read(128, 0.5, 100e6, 25.6) == pytest.approx(100.0)


def test_the_model_shape_comes_from_the_flags() -> None:
    c = _script()
    a = c.parse_args(["--hidden", "2048", "--intermediate", "1024", "--experts", "64",
                      "--top-k", "8", "--layers", "4"])
    d = c.Dims(a.vocab, a.hidden, a.intermediate, a.layers, a.experts, a.top_k, a.heads,
               a.kv_heads, a.seed)
    assert d.tag().startswith("mixtral-v32000-d2048-f1024-l4-e64k8-h16kv4-s0-")
    default = c.parse_args([])
    assert (default.hidden, default.experts, default.top_k, default.threads) == (1024, 16, 4, 2)
    assert c.Dims().tag() != d.tag() and c.Dims().tag() == c.Dims().tag()
    assert c.Dims(seed=1).tag() != c.Dims().tag()


def test_greedy_agreement_counts() -> None:
    c = _script()
    assert c._agree([1, 2, 3, 4], [1, 9, 3, 4]) == 3
    assert c._prefix([1, 2, 3, 4], [1, 9, 3, 4]) == 1
    assert c._prefix([1, 2], [1, 2, 3]) == 2
    assert c._agree(list(range(20)), list(range(20))) == 16  # the first 16 only


def _row(engine: str, prec: str, decode: list[float], same: list[float]) -> dict[str, Any]:
    c = _script()
    return {"engine": engine, "precision": prec, "bytes_per_token": 218.1e6,
            "tensor_types": {"blk.0.ffn_gate_exps.weight": prec},
            "prefill_tok_s": c.summarize([400.0, 410.0]), "decode_tok_s": c.summarize(decode),
            "percent_of_bound_same_minute": c.summarize(same), "bound_tok_s": 230.0,
            "percent_of_bound": 100 * c.summarize(decode)["median"] / 230.0}


def test_the_summary_names_the_cpu_and_both_engines() -> None:
    c = _script()
    rows = [_row("llama.cpp", "Q8_0", [130.0, 140.0, 120.0], [60.0, 62.0, 64.0]),
            _row("colibri", "q8", [200.0, 210.0, 190.0], [88.0, 90.0, 92.0])]
    res = {
        "model": {"vocab": 32000, "hidden": 1024, "intermediate": 1536, "layers": 8,
                  "experts": 16, "top_k": 4, "heads": 16, "kv_heads": 4, "seed": 0},
        "cpu": "Test CPU [avx2 fma]", "threads": 2, "prompt_tokens": 128, "gen_tokens": 128,
        "repeat": 3, "tf_repeat": 0, "llama_cpp_python": "0.3.36", "colibri_isa": "avx2",
        "colibri_prefetch": "l2", "kv_cache_type": "f16", "bandwidth_gb_s": 50.0,
        "bandwidth_probes_gb_s": [48.0, 50.0], "loadavg_start": (0.5, 0, 0),
        "loadavg_end": (0.7, 0, 0), "rows": rows,
        "ratios_colibri_over_llama": {"q8": {"prefill_tok_s": 4.9, "decode_tok_s": 1.5,
                                             "decode_pairs": c.summarize([1.4, 1.5, 1.6])}},
        "llama_cpp_system_info": "AVX2 = 1 ", "omp_wait_policy": "unset",
        "greedy_agreement_first16": {"q8 colibri vs llama.cpp": 16},
    }
    text = c.render(res)
    assert text.splitlines()[0] == "cpu: Test CPU [avx2 fma]"
    assert "hidden 1024, ffn 1536, 8 layers, 16 experts top-4" in text
    lines = {ln.split()[0] + " " + ln.split()[1]: ln for ln in text.splitlines()
             if ln.startswith(("llama.cpp ", "colibri ")) and "tensor types" not in ln}
    assert lines["llama.cpp Q8_0"].split()[-1] == "62.0"  # median same-minute %
    assert lines["colibri q8"].split()[-1] == "90.0"
    assert "decode x1.50 (repeat by repeat: median x1.50, x1.40 to x1.60)" in text
    assert "prefill x4.90" in text
    assert "load average 0.50 at start, 0.70 at end" in text
    assert "llama.cpp Q8_0 tensor types: blk.0.ffn_gate_exps.weight Q8_0" in text


def test_kv_bytes_per_token_from_llama_cpp_log() -> None:
    log = ("llama_kv_cache:        CPU KV buffer size =    27.00 MiB\n"
           "llama_kv_cache: size =   27.00 MiB (   384 cells,   4 layers,  1/1 seqs), "
           "K (f16):   27.00 MiB, V (f16):    0.00 MiB\n")
    cl = _script()
    assert cl.llama_kv_bytes_per_token(log) == 27 * 2**20 / 384
    assert cl.llama_kv_bytes_per_token("no such line") is None


def test_deepseek_arch_takes_v2_lite_dims_unless_given() -> None:
    cl = _script()
    args = cl.parse_args(["--arch", "deepseek_v2"])
    assert (args.hidden, args.experts, args.top_k, args.layers) == (2048, 64, 6, 4)
    assert cl.parse_args(["--arch", "deepseek_v2", "--layers", "2"]).layers == 2
    mixtral = cl.parse_args([])
    assert (mixtral.hidden, mixtral.experts) == (cl.Dims().hidden, cl.Dims().experts)


def test_gpt_oss_arch_takes_20b_dims_and_leaves_other_caches_alone() -> None:
    cl = _script()
    a = cl.parse_args(["--arch", "gpt_oss"])
    assert (a.hidden, a.intermediate, a.experts, a.top_k, a.heads, a.kv_heads, a.head_dim,
            a.layers) == (2880, 2880, 32, 4, 64, 8, 64, 24)
    d = cl.dims_from_args(cl.parse_args(["--arch", "gpt_oss", "--layers", "2"]))
    assert d.tag().startswith("gpt_oss-v32000-d2880-f2880-l2-e32k4-h64kv8-s0-")
    assert cl.dims_from_args(cl.parse_args(["--arch", "gpt_oss", "--layers", "2",
                                            "--head-dim", "32"])).tag() != d.tag()
    # the head width names gpt-oss folders only: the other models' cached folders keep theirs
    assert cl.Dims(head_dim=32).tag() == cl.Dims().tag()
    assert [(p.label, p.colibri, p.llama) for p in cl.pairs_for("gpt_oss")] == [
        ("mxfp4", "q8", "MXFP4_MOE")]
    assert [p.label for p in cl.pairs_for("mixtral")] == ["q8", "q4"]


def test_agreement_counts_name_each_pair() -> None:
    cl = _script()
    pairs = cl.pairs_for("gpt_oss")
    tokens = {"colibri mxfp4": [5, 6, 7, 8], "llama.cpp MXFP4_MOE": [5, 6, 1, 8],
              "transformers f32": [5, 6, 7, 9]}
    assert cl.agreement_counts(pairs, tokens) == {
        "mxfp4 colibri vs llama.cpp": 3, "mxfp4 colibri vs llama.cpp, common prefix": 2,
        "colibri mxfp4 vs transformers f32": 3, "llama.cpp MXFP4_MOE vs transformers f32": 2}
    text = cl.describe_model({**vars(cl.dims_from_args(cl.parse_args(["--arch", "gpt_oss"])))})
    assert text.startswith("random gpt-oss, experts MXFP4: vocab 32000, hidden 2880, 24 layers")
    assert "32 experts of width 2880 top-4, 64 heads of 64 / 8 kv" in text


def test_gpt_oss_checkpoint_is_mxfp4_as_transformers_and_colibri_read_it(
        tmp_path: Path) -> None:
    """The random gpt-oss checkpoint the benchmark writes shard by shard: transformers' own
    MXFP4 loader dequantizes its experts to numpy's decoding of the blocks (gate and up rows
    alternating), at the scale of the other matrices, and runs it; colibri convert keeps them
    MXFP4 byte for byte."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    import numpy as np
    from safetensors.numpy import load_file

    from colibri.engine.format import quant
    from colibri.engine.format.convert import convert
    from colibri.engine.format.wfile import read_wfile
    from colibri.engine.text.bpe import train_bpe_tokenizer

    cl = _script()
    s = cl.GptOssShape(vocab=300, hidden=64, intermediate=96, layers=2, experts=4, top_k=2,
                       heads=4, kv_heads=2, head_dim=16)
    hf = cl.write_checkpoint(tmp_path / "hf", s, seed=3)
    assert sorted(p.name for p in hf.glob("*.safetensors")) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors"]
    shard = load_file(str(hf / "model-00002-of-00003.safetensors"))  # layer 1
    blocks = shard["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    scales = shard["model.layers.1.mlp.experts.gate_up_proj_scales"]
    assert blocks.shape == (4, 192, 2, 16) and scales.shape == (4, 192, 2)
    decoded = quant.decode(quant.mxfp4_from_checkpoint(blocks, scales).tobytes(), "mxfp4",
                           (4, 192, 64))  # [E, 2F, D]
    assert 0.7 < float(decoded.std()) * 64 ** 0.5 < 1.4  # about 1 / sqrt(fan_in)

    model = tf.AutoModelForCausalLM.from_pretrained(
        str(hf), dtype=torch.float32,
        quantization_config=tf.Mxfp4Config(dequantize=True)).eval()
    gate_up = model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()  # [E, D, 2F]
    np.testing.assert_array_equal(gate_up, np.swapaxes(decoded, 1, 2))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert torch.isfinite(logits).all()

    train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 50, 300, hf)
    out = convert(hf, tmp_path / "q8", quant="q8", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in cfg["tensor_types"].items() if k.startswith("experts.")} == {
        "experts.w1": "mxfp4", "experts.w3": "mxfp4", "experts.w2": "mxfp4"}
    w1 = read_wfile(out / "experts" / "layer_1_expert_2.bin").array("w1")  # [F, D]: gate rows
    np.testing.assert_array_equal(w1, decoded[2, 0::2])
