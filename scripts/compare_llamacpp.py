#!/usr/bin/env python3
"""Colibri against llama.cpp (and transformers eager) on one random MoE model, same machine.

Builds a seeded random Mixtral (or, with --arch deepseek_v2, a DeepSeek-V2-Lite-shaped model:
MLA with a kv_lora latent, shared experts, dense first layers) checkpoint with transformers
(f16 safetensors plus a
sentencepiece tokenizer.model and the matching tokenizer.json), converts it with llama.cpp's
own converter to GGUF f16 and quantizes that to Q8_0 and Q4_0 (llama_model_quantize), converts
it with Colibri to q8 and q4, then times the engines alternately on the same prompt token ids:
prefill of the prompt in one call, then greedy single-token decode (EOS ignored). Each timed
run is a fresh child process (model load and one warm-up run untimed), so neither engine's
idle threads (llama.cpp's OpenMP workers spin while waiting) can slow the other. Everything
built is cached in --workdir, keyed by the model dimensions and seed.

The bandwidth bound is the weight bytes per token against a plain read of memory on the same
threads (the probe). A virtual machine's read rate can drift by half within minutes, so besides
the % of the bound at the higher of the probes before and after all runs, the script reads
memory again after every run and prints each engine's median "same-minute" % (every run
against the higher of the reads just before and after it), and the decode ratio repeat
by repeat (each Colibri run against the llama.cpp run just before it) beside the ratio of the
medians.

Needs the bench extra: pip install -e '.[bench]' (llama-cpp-python, sentencepiece, gguf)
(llama-cpp-python compiles llama.cpp, about ten minutes on a 2-core machine).

    python scripts/compare_llamacpp.py                      # the default benchmark model
    python scripts/compare_llamacpp.py --layers 2 --repeat 3 --skip-transformers --json out.json
    python scripts/compare_llamacpp.py --arch deepseek_v2 --skip-transformers   # V2-Lite shape
    python scripts/compare_llamacpp.py --arch gpt_oss --skip-transformers --layers 12

--arch gpt_oss is gpt-oss-20b's shape (hidden 2880, 64 heads of 64, 8 KV heads, 32 experts of
width 2880 top-4, sliding window 128 on every other layer; 24 layers unless --layers says
fewer: at 24 layers each engine's copy is about 11 GB, and the work folder holds three) with
its experts in MXFP4 as the released checkpoints ship them (scripts/gpt_oss_checkpoint.py
draws the blocks at random and writes the checkpoint shard by shard), a sentencepiece
vocabulary of --vocab tokens (the real o200k one has 201088: its lm_head would add as much to
both engines' bytes per token). llama.cpp's converter turns it into GGUF with the experts in
llama.cpp's MXFP4 and every other matrix Q8_0 (what llama-quantize's MXFP4_MOE gives), Colibri
converts it with the q8 preset, which keeps the experts MXFP4 byte for byte and makes every
other matrix q8: one pair, "mxfp4". transformers runs it with its experts dequantized to f32
(about 80 GB at full size): leave it out there with --skip-transformers.

A measurement for docs/performance.md goes into results/ (the file records the CPU, commit,
command and date), then `python scripts/make_performance_page.py` makes the page again:

    python scripts/compare_llamacpp.py --skip-transformers --repeat 5 \
        --json results/compare_llamacpp/$(date +%F)-<machine>-<model>.json

Each run also prints and records the KV cache bytes per token of both engines (llama.cpp's
from its own log). A DeepSeek checkpoint's converter expects DeepSeek's BPE tokenizer; the
random model has a sentencepiece one, so its GGUF vocabulary is written as sentencepiece
(the vocabulary does not change speed).

Pitfalls met on 2-vCPU Xeons with AMX: a GGML_NATIVE build of llama.cpp dies with SIGILL or
SIGSEGV in its AMX matmul (the script checks in a child process first and prints how to build
without AMX; run with PYTHONPATH=that build); and OpenMP's spinning workers made two-thread
decode ~30x slower whenever other work shared the cores: run on a quiet machine (the load
average is printed), or set OMP_WAIT_POLICY=PASSIVE yourself to see llama.cpp under load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colibri.engine.tools.bench import (  # noqa: E402
    bench_prompt,
    measured_on,
    percent_of_read,
    summarize,
    timed_greedy_run,
    weight_bytes_per_token,
)

if str(Path(__file__).resolve().parent) not in sys.path:  # the module beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt_oss_checkpoint import GptOssShape, write_checkpoint  # noqa: E402

# the KV cache of both engines: llama.cpp's default, and what Colibri's "auto" picks for the
# q8 and q4 models compared here
KV_CACHE_TYPE = "f16"

INSTALL_HINT = ("llama-cpp-python is not installed. Install the benchmark extra with\n"
                "    pip install 'llama-cpp-python==0.3.36' sentencepiece gguf\n"
                "(it compiles llama.cpp: about ten minutes on a 2-core machine), "
                "or pip install -e '.[bench]'.")
DEFAULT_LLAMA_VERSION = "0.3.36"
Run = tuple[float, float, list[int]]  # prefill seconds, decode seconds, greedy tokens


# -- the model ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Dims:
    vocab: int = 32000
    hidden: int = 1024
    intermediate: int = 1536
    layers: int = 8
    experts: int = 16
    top_k: int = 4
    heads: int = 16
    kv_heads: int = 4
    seed: int = 0
    arch: str = "mixtral"
    # deepseek_v2 only (DeepSeek-V2-Lite's values): MLA widths, expert width, shared experts
    # and dense first layers; intermediate is then the dense layers' width
    kv_lora: int = 512
    q_lora: int = 1536  # V2-Lite has none, but llama.cpp reads a q_lora_rank unless 26/27 layers
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    moe_intermediate: int = 1408
    shared: int = 2
    dense: int = 1
    # gpt_oss only: the attention heads' width (its 64 is not hidden / heads)
    head_dim: int = 64

    def tag(self) -> str:
        fields = {k: v for k, v in asdict(self).items()
                  if k not in GPT_OSS_ONLY or self.arch == "gpt_oss"}
        raw = json.dumps(fields, sort_keys=True).encode()
        return (f"{self.arch}-v{self.vocab}-d{self.hidden}-f{self.intermediate}-l{self.layers}"
                f"-e{self.experts}k{self.top_k}-h{self.heads}kv{self.kv_heads}-s{self.seed}-"
                + hashlib.sha256(raw).hexdigest()[:8])


# --arch deepseek_v2 defaults: DeepSeek-V2-Lite (hidden 2048, 16 heads, kv_lora 512, rope 64,
# 64 routed experts top-6, 2 shared, 1 dense layer), 4 of its 27 layers to fit in memory; with
# DeepSeek-V2's q_lora_rank 1536, since llama.cpp takes a model of other than 26 or 27 layers
# for the full V2 and refuses one without it
DEEPSEEK_V2_LITE = dict(vocab=32000, hidden=2048, intermediate=10944, layers=4, experts=64,
                        top_k=6, heads=16, kv_heads=16)
# --arch gpt_oss defaults: gpt-oss-20b (its 24 layers; --layers 12 keeps both engines' copies
# in the page cache of a 24 GB machine)
GPT_OSS_20B = dict(vocab=32000, hidden=2880, intermediate=2880, layers=24, experts=32, top_k=4,
                   heads=64, kv_heads=8)
GPT_OSS_ONLY = ("head_dim",)  # fields that name other models' cached folders only when set
ARCH_DEFAULTS: dict[str, dict[str, int]] = {"mixtral": {}, "deepseek_v2": DEEPSEEK_V2_LITE,
                                            "gpt_oss": GPT_OSS_20B}


@dataclass(frozen=True)
class Pair:
    """One side-by-side comparison: Colibri's conversion preset against a llama.cpp GGUF."""
    label: str  # the name both engines' rows and the ratios go by
    colibri: str  # colibri convert --quant
    llama: str  # the GGUF's precision (a llama_ftype name without LLAMA_FTYPE_MOSTLY_)


def pairs_for(arch: str) -> list[Pair]:
    """gpt-oss: its MXFP4 experts with every other matrix 8-bit in both engines; the others:
    Q8_0 against q8, Q4_0 against q4."""
    if arch == "gpt_oss":
        return [Pair("mxfp4", "q8", "MXFP4_MOE")]
    return [Pair("q8", "q8", "Q8_0"), Pair("q4", "q4", "Q4_0")]


def _words(rng: random.Random, n: int) -> list[str]:
    cons = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl br gr".split()
    vows = "a e i o u ai ea ou io".split()
    syl = [c + v for c in cons for v in vows] + [v + c for c in cons for v in vows]
    return ["".join(rng.choice(syl) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def train_tokenizer(out: Path, vocab: int, seed: int) -> None:
    """tokenizer.model (sentencepiece BPE with byte fallback, Llama-style ids 0 unk, 1 <s>,
    2 </s>) trained on generated pseudo-words, and the same tokenizer as tokenizer.json."""
    import sentencepiece as spm

    rng = random.Random(seed)
    words = _words(rng, 60000)
    text = out / "sp_train.txt"
    with open(text, "w", encoding="utf-8") as f:
        for _ in range(100000):
            f.write(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + ".\n")
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=vocab,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, num_threads=2,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, input_sentence_size=100000,
        shuffle_input_sentence=False, minloglevel=2)
    text.unlink()
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    _write_tokenizer_json(out / "tokenizer.model", out)


def _write_tokenizer_json(model_file: Path, out: Path) -> None:
    """The sentencepiece BPE model as a `tokenizers` BPE (merges rebuilt from piece ranks)."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    merges: list[tuple[int, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_byte(pid) or sp.is_unknown(pid) or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((pid, vocab[a], vocab[b], a, b))
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token="<unk>",
                     fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    sample = "hello wörld, the quick brown fox 12345 !"
    if tok.encode(sample).ids != sp.encode(sample):
        raise RuntimeError("tokenizer.json does not reproduce tokenizer.model")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "legacy": True}, indent=2) + "\n")


def _scale_init(model: Any, seed: int) -> None:
    """Weights N(0, 1/fan_in), embeddings N(0, 1): activations keep their scale through the
    layers, so greedy output depends on the prompt (transformers' 0.02 init mostly repeats
    one token, which makes the agreement check say little). Speed does not depend on it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=g)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def gpt_oss_shape(d: Dims) -> GptOssShape:
    return GptOssShape(vocab=d.vocab, hidden=d.hidden, intermediate=d.intermediate,
                       layers=d.layers, experts=d.experts, top_k=d.top_k, heads=d.heads,
                       kv_heads=d.kv_heads, head_dim=d.head_dim)


def build_checkpoint(out: Path, d: Dims) -> Path:
    """Random Mixtral or DeepSeek-V2 (transformers' own init, seeded) saved as f16
    safetensors, or a random gpt-oss with MXFP4 experts (scripts/gpt_oss_checkpoint.py)."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"building the random checkpoint in {out} ...", flush=True)
    if d.arch == "gpt_oss":
        write_checkpoint(tmp, gpt_oss_shape(d), d.seed)
        train_tokenizer(tmp, d.vocab, d.seed)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
        return out
    import torch
    import transformers as tf

    if d.arch == "deepseek_v2":
        cfg = tf.DeepseekV2Config(
            vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate,
            moe_intermediate_size=d.moe_intermediate, num_hidden_layers=d.layers,
            num_attention_heads=d.heads, num_key_value_heads=d.heads, q_lora_rank=d.q_lora or None,
            kv_lora_rank=d.kv_lora, qk_nope_head_dim=d.nope_dim, qk_rope_head_dim=d.rope_dim,
            v_head_dim=d.v_dim, n_routed_experts=d.experts, num_experts_per_tok=d.top_k,
            n_shared_experts=d.shared, first_k_dense_replace=d.dense, topk_method="greedy",
            n_group=1, topk_group=1, routed_scaling_factor=1.0, max_position_embeddings=8192,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
        model_cls: Any = tf.DeepseekV2ForCausalLM
    else:
        cfg = tf.MixtralConfig(
            vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate,
            num_hidden_layers=d.layers, num_attention_heads=d.heads,
            num_key_value_heads=d.kv_heads, num_local_experts=d.experts,
            num_experts_per_tok=d.top_k, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=1e6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            sliding_window=None)
        model_cls = tf.MixtralForCausalLM
    torch.manual_seed(d.seed)
    model = model_cls(cfg).eval()
    _scale_init(model, d.seed)
    model = model.to(torch.float16)
    model.save_pretrained(str(tmp))
    del model
    train_tokenizer(tmp, d.vocab, d.seed)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


# -- llama.cpp side ---------------------------------------------------------------------------

def llama_source(workdir: Path, given: str | None) -> Path:
    """A folder with llama.cpp's convert_hf_to_gguf.py (and its conversion/, gguf-py/)."""
    if given:
        src = Path(given)
        if not (src / "convert_hf_to_gguf.py").is_file():
            raise SystemExit(f"{src}: no convert_hf_to_gguf.py (give llama.cpp's source root)")
        return src
    try:
        import llama_cpp
        version = llama_cpp.__version__
    except ImportError:
        version = DEFAULT_LLAMA_VERSION
    dest = workdir / f"llama_src-{version}"
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    sdist_dir = workdir / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    print(f"fetching the llama-cpp-python {version} source distribution ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    "llama-cpp-python", f"llama-cpp-python=={version}", "-d", str(sdist_dir)],
                   check=True)
    archive = next(sdist_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                   and ".." not in Path(m.name).parts and (m.isfile() or m.isdir()) and (
            m.name == prefix + "convert_hf_to_gguf.py"
            or m.name.startswith((prefix + "gguf-py/", prefix + "conversion/")))]
        for m in members:
            m.name = m.name[len(prefix):]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp, members=members, filter="data")
        else:  # Python without extraction filters: the names were checked above
            tar.extractall(tmp, members=members)
    os.rename(tmp, dest)
    return dest


# Runs llama.cpp's converter with the model class's vocabulary written from the random model's
# sentencepiece tokenizer (DeepSeek-V2's and gpt-oss's converters only know their own BPE
# tokenizers). argv: source root, "module:Class" under conversion/, the converter's arguments.
_CONVERT_SENTENCEPIECE_VOCAB = """\
import importlib, runpy, sys
sys.path.insert(0, sys.argv[1])
module, cls = sys.argv[2].split(":")
model = getattr(importlib.import_module("conversion." + module), cls)
model.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_SENTENCEPIECE_CLASSES = {"deepseek_v2": "deepseek:DeepseekV2Model",
                          "gpt_oss": "gpt_oss:GptOssModel"}


def _converter(src: Path, arch: str) -> list[str]:
    if arch in _SENTENCEPIECE_CLASSES:
        return [sys.executable, "-c", _CONVERT_SENTENCEPIECE_VOCAB, str(src),
                _SENTENCEPIECE_CLASSES[arch]]
    return [sys.executable, str(src / "convert_hf_to_gguf.py")]


def build_gguf(hf: Path, out_dir: Path, src: Path, arch: str = "mixtral") -> dict[str, Path]:
    """GGUF f16 by llama.cpp's converter, then Q8_0 and Q4_0 by llama_model_quantize; gpt-oss:
    MXFP4_MOE straight from the converter (its MXFP4 experts copied, the rest Q8_0)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if arch == "gpt_oss":
        path = out_dir / "model-MXFP4_MOE.gguf"
        if not path.is_file():
            print("converting to GGUF (MXFP4 experts, Q8_0 elsewhere) with "
                  "convert_hf_to_gguf.py ...", flush=True)
            part = path.with_suffix(".part")
            subprocess.run([*_converter(src, arch), str(hf), "--outtype", "q8_0", "--outfile",
                            str(part)], check=True)
            os.rename(part, path)
        return {"MXFP4_MOE": path}
    import llama_cpp

    f16 = out_dir / "model-f16.gguf"
    if not f16.is_file():
        print("converting to GGUF f16 with convert_hf_to_gguf.py ...", flush=True)
        part = f16.with_suffix(".part")
        subprocess.run([*_converter(src, arch), str(hf), "--outtype", "f16", "--outfile",
                        str(part)], check=True)
        os.rename(part, f16)
    out = {}
    for name, ftype in (("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0),
                        ("Q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0)):
        path = out_dir / f"model-{name}.gguf"
        if not path.is_file():
            print(f"quantizing to {name} with llama_model_quantize ...", flush=True)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = 2
            part = path.with_suffix(".part")
            with _stderr_to(out_dir / f"quantize-{name}.log"):
                rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(part).encode(),
                                                    ctypes.byref(params))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {name} failed ({rc})")
            os.rename(part, path)
        out[name] = path
    return out


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send the C library's stderr (file descriptor 2) to path for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "w") as f:
            os.dup2(f.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


AMX_HINT = """llama.cpp died with {signal} evaluating the model. Where this was seen (SIGILL on
one Xeon, SIGSEGV on another), the cause was ggml's AMX path (ggml_backend_amx_mul_mat) of a
GGML_NATIVE build. Build llama-cpp-python without AMX but with the other native features, e.g.
into a folder of its own (--no-cache-dir: otherwise pip reuses the wheel it built natively):

  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
    -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \\
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \\
    -DGGML_AMX_BF16=OFF" pip install --no-cache-dir --no-deps --target DIR \\
    llama-cpp-python==0.3.36

and run this script with PYTHONPATH=DIR."""


def llama_preflight(path: Path, threads: int) -> None:
    """Evaluate a few tokens in a child process, so a crash in llama.cpp is explained."""
    code = ("import sys, llama_cpp\n"
            "lm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]),"
            " n_threads_batch=int(sys.argv[2]), verbose=False)\n"
            "lm.eval([1, 2, 3, 4, 5, 6, 7, 8]); lm.eval([9])\n")
    r = subprocess.run([sys.executable, "-c", code, str(path), str(threads)],
                       capture_output=True, text=True)
    if r.returncode in (-signal.SIGILL, -signal.SIGSEGV):
        raise SystemExit(AMX_HINT.format(signal=signal.Signals(-r.returncode).name))
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp cannot evaluate {path} (exit {r.returncode}):\n"
                         + r.stderr[-2000:])


def gguf_bytes_per_token(path: Path, n_used: int) -> dict[str, Any]:
    """Weight bytes one decoded token reads in llama.cpp, counted as engine.tools.bench counts."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    t = {x.name: x for x in r.tensors}
    emb = t["token_embd.weight"]
    n_vocab = int(max(emb.shape))
    parts = {"embedding_row": int(emb.n_bytes) // n_vocab,
             "output_norm": int(t["output_norm.weight"].n_bytes),
             "lm_head": int(t.get("output.weight", emb).n_bytes),
             "attention": 0, "router": 0, "experts": 0, "shared": 0, "dense": 0}
    types: dict[str, set[str]] = {}
    for name, x in t.items():
        kind = name.split(".")[-2] if name.startswith("blk.") else name.rsplit(".", 1)[0]
        types.setdefault(kind, set()).add(x.tensor_type.name)
        if not name.startswith("blk."):
            continue
        if "_exps" in name:  # [n_expert, rows, cols]; GGUF lists dims innermost first
            parts["experts"] += int(x.n_bytes) * n_used // int(x.shape[-1])
        elif "_shexp" in name:
            parts["shared"] += int(x.n_bytes)
        elif kind in ("ffn_gate", "ffn_up", "ffn_down"):
            parts["dense"] += int(x.n_bytes)
        elif kind in ("ffn_norm", "ffn_gate_inp", "exp_probs_b"):
            parts["router"] += int(x.n_bytes)
        else:
            parts["attention"] += int(x.n_bytes)
    return {"total": sum(parts.values()), "parts": parts,
            "types": {k: "/".join(sorted(v)) for k, v in sorted(types.items())}}


def llama_load(path: Path, threads: int, n_ctx: int, verbose: bool = False) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                 n_threads=threads, n_threads_batch=threads, logits_all=False,
                 use_mmap=True, verbose=verbose, seed=0)


def llama_kv_bytes_per_token(log: str) -> float | None:
    """KV cache bytes per token from llama.cpp's load log ("llama_kv_cache: size = 27.00 MiB
    (  384 cells, ..."), None when the line is not there."""
    import re

    m = re.search(r"llama_kv_cache[^\n]*?size\s*=\s*([\d.]+)\s*MiB\s*\(\s*(\d+)\s*cells", log)
    return float(m.group(1)) * 2**20 / int(m.group(2)) if m else None


def llama_greedy_run(lm: Any, prompt: np.ndarray, n_gen: int,
                     after_prefill: Callable[[], None] | None = None) -> Run:
    """Same protocol as engine.tools.bench.timed_greedy_run, through llama-cpp-python's eval
    (after_prefill likewise runs between the two timings).

    Llama.eval leaves `scores` empty without logits_all, so the last row is read with
    llama_get_logits_ith.
    """
    import llama_cpp

    n_vocab = lm.n_vocab()

    def last_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(lm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    ids = [int(x) for x in prompt]
    lm.reset()
    t0 = time.perf_counter()
    lm.eval(ids)
    tok = last_argmax()
    t_pre = time.perf_counter() - t0
    if after_prefill is not None:
        after_prefill()
    t1 = time.perf_counter()
    tokens = [tok]
    for _ in range(n_gen):
        lm.eval([tok])
        tok = last_argmax()
        tokens.append(tok)
    t2 = time.perf_counter()
    lm.reset()
    return t_pre, t2 - t1, tokens


# -- transformers side --------------------------------------------------------------------

def hf_bytes_per_token(model: Any, n_used: int, n_expert: int, elem: int) -> int:
    """Parameter bytes one token reads in a Hugging Face Mixtral at elem bytes per value."""
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if "embed_tokens" in name:
            n = p.shape[-1]  # one row
        elif ".experts." in name:  # fused [E, ...] or one of E per-expert tensors: same share
            n = n * n_used // n_expert
        total += n * elem
    return total


def hf_greedy_run(model: Any, prompt: np.ndarray, n_gen: int) -> Run:
    """transformers eager generate(): prefill = start to the first logits processor call,
    decode = first to last call (n_gen single-token forwards)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompt[None].astype(np.int64))
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_gen + 1,
                             min_new_tokens=n_gen + 1, do_sample=False,
                             logits_processor=LogitsProcessorList([Stamp()]), pad_token_id=0)
    tokens = [int(x) for x in out[0, prompt.size:]]
    return stamps[0] - t0, stamps[-1] - stamps[0], tokens


# -- the comparison ---------------------------------------------------------------------------

def _as_tuple(r: Any) -> Run:
    return r.prefill_s, r.decode_s, r.tokens


def alternate(runners: dict[str, Callable[[], Run]], repeat: int, read: Callable[[], float],
              between: list[float], report: Callable[[int, dict[str, list[Run]]], None]
              ) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    """Run the engines in turn, repeat times, reading memory after every run (appended to
    between, whose last entry is the read just before the first run). Returns each engine's
    runs and, per run, the higher of the reads just before and just after it."""
    res: dict[str, list[Run]] = {k: [] for k in runners}
    reads: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(repeat):
        for name, run in runners.items():  # alternate: llama.cpp, colibri, llama.cpp, ...
            res[name].append(run())
            between.append(read())
            reads[name].append(max(between[-2:]))
        report(rep, res)
    return res, reads


def _agree(a: list[int], b: list[int], n: int = 16) -> int:
    return sum(1 for x, y in zip(a[:n], b[:n], strict=False) if x == y)


def _prefix(a: list[int], b: list[int], n: int = 16) -> int:
    k = 0
    while k < min(n, len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def child_run(args: argparse.Namespace) -> int:
    """One timed run in this (fresh) process: load, warm up, time, print one JSON line."""
    path = Path(args.child_model)
    prompt = bench_prompt(args.vocab, args.prompt_tokens)
    n_ctx = args.prompt_tokens + args.gen_tokens + 8
    kv_bytes: float | None
    if args.child == "llama.cpp":
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-load-{os.getpid()}.log"
        with _stderr_to(log):  # the load log says how large the KV cache is
            lm = llama_load(path, args.threads, n_ctx, verbose=True)
        kv_bytes = llama_kv_bytes_per_token(log.read_text(errors="replace"))
        log.unlink()
        llama_greedy_run(lm, prompt, 8)  # warm-up: page weights in, start threads
        run = llama_greedy_run(lm, prompt, args.gen_tokens)
    else:
        from colibri.engine.core.loader import start_expert_cache
        from colibri.engine.core.options import ExpertCacheConfig
        from colibri.engine.executor.model import Model

        # loaded as the server and colibri bench load it: the expert budget, the repacking,
        # the f16 KV cache (llama.cpp's default too)
        cm = Model.load(path, threads=args.threads, n_ctx=n_ctx, kv_type=KV_CACHE_TYPE)
        start_expert_cache(cm, path, ExpertCacheConfig.from_env(),
                           cm.n_kv_blocks * cm.kv_block_bytes())
        kv_bytes = cm.kv_block_bytes() / _core_kv_block()
        timed_greedy_run(cm, prompt, 8)
        run = _as_tuple(timed_greedy_run(cm, prompt, args.gen_tokens))
    print(json.dumps({"prefill_s": run[0], "decode_s": run[1], "tokens": run[2],
                      "kv_bytes_per_token": kv_bytes}))
    return 0


def _core_kv_block() -> int:
    from colibri.engine import _core

    return int(_core.KV_BLOCK)


def _spawn(args: argparse.Namespace, engine: str, path: Path) -> Run:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine,
           "--child-model", str(path), "--threads", str(args.threads),
           "--vocab", str(args.vocab), "--prompt-tokens", str(args.prompt_tokens),
           "--gen-tokens", str(args.gen_tokens)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} run failed ({r.returncode}):\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    _KV_BYTES[engine] = out.get("kv_bytes_per_token")
    return out["prefill_s"], out["decode_s"], out["tokens"]


_KV_BYTES: dict[str, float | None] = {}  # each engine's KV bytes per token, from its runs


def dims_from_args(args: argparse.Namespace) -> Dims:
    return Dims(args.vocab, args.hidden, args.intermediate, args.layers, args.experts,
                args.top_k, args.heads, args.kv_heads, args.seed, args.arch,
                head_dim=args.head_dim)


def compare(args: argparse.Namespace) -> dict[str, Any]:
    from colibri.engine import _core
    from colibri.engine.executor.model import kernels_from_env
    from colibri.engine.format.convert import convert_once

    isa = kernels_from_env()  # a COLIBRI_ISA this CPU cannot run fails here, not after the runs
    d = dims_from_args(args)
    work = Path(args.workdir)
    base = work / d.tag()
    hf = build_checkpoint(base / "hf", d)
    src = llama_source(work, args.llama_src)
    ggufs = build_gguf(hf, base / "gguf", src, d.arch)
    pairs = pairs_for(d.arch)
    colibri_dirs = {}
    for q in sorted({pr.colibri for pr in pairs}):
        print(f"Colibri {q} ...", flush=True)
        colibri_dirs[q] = convert_once(hf, base / f"colibri-{q}", q)

    llama_preflight(ggufs[pairs[-1].llama], args.threads)
    load0 = os.getloadavg()

    def read_memory() -> float:
        return _core.bandwidth_probe(args.probe_mib << 20, args.threads, 3)

    probe = [read_memory()]
    between = probe[:]  # the first probe, then one after every run
    prompt = bench_prompt(d.vocab, args.prompt_tokens)
    rows: list[dict[str, Any]] = []
    tokens: dict[str, list[int]] = {}
    by_rep: dict[str, list[float]] = {}  # colibri / llama.cpp decode speed, repeat by repeat
    for pr in pairs:
        q, lq = pr.label, pr.llama
        runners = {
            "llama.cpp": lambda lq=lq: _spawn(args, "llama.cpp", ggufs[lq]),
            "colibri": lambda c=pr.colibri: _spawn(args, "colibri", colibri_dirs[c]),
        }

        def report(rep: int, res: dict[str, list[Run]], q: str = q) -> None:
            print(f"  {q} repeat {rep + 1}/{args.repeat}: " + ", ".join(
                f"{k} prefill {args.prompt_tokens / v[-1][0]:.1f} decode "
                f"{args.gen_tokens / v[-1][1]:.1f} tok/s" for k, v in res.items())
                + f"; read {between[-1]:.1f} GB/s", flush=True)

        res, reads = alternate(runners, args.repeat, read_memory, between, report)
        lbytes = gguf_bytes_per_token(ggufs[lq], d.top_k)
        cdir = colibri_dirs[pr.colibri]
        cbytes = weight_bytes_per_token(cdir)
        for name, prec, nbytes, types in (
                ("llama.cpp", lq, lbytes["total"], lbytes["types"]),
                ("colibri", q, cbytes["total"], json.loads(
                    (cdir / "config.json").read_text())["tensor_types"])):
            runs = res[name]
            same_minute = [percent_of_read(args.gen_tokens, r[1], nbytes, g)
                           for r, g in zip(runs, reads[name], strict=True)]
            rows.append({"engine": name, "precision": prec, "bytes_per_token": nbytes,
                         "kv_bytes_per_token": _KV_BYTES.get(name),
                         "tensor_types": types,
                         "bytes_per_token_parts": (lbytes["parts"] if name == "llama.cpp"
                                                   else {k: v for k, v in cbytes.items()
                                                         if k != "total"}),
                         "prefill_tok_s": summarize([args.prompt_tokens / r[0] for r in runs]),
                         "decode_tok_s": summarize([args.gen_tokens / r[1] for r in runs]),
                         "percent_of_bound_same_minute": summarize(same_minute)})
            tokens[f"{name} {prec}"] = runs[0][2]
        by_rep[q] = [ll[1] / c[1] for ll, c in zip(res["llama.cpp"], res["colibri"],
                                                    strict=True)]

    if not args.skip_transformers:
        import torch
        import transformers as tf

        torch.set_num_threads(args.threads)
        # gpt-oss: its MXFP4 experts dequantized by transformers' own loader
        extra = ({"quantization_config": tf.Mxfp4Config(dequantize=True)}
                 if d.arch == "gpt_oss" else {})
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(hf), dtype=torch.float32, attn_implementation="eager", **extra).eval()
        hf_greedy_run(model, prompt, 4)  # warm-up
        runs = []
        for rep in range(args.tf_repeat):
            runs.append(hf_greedy_run(model, prompt, args.gen_tokens))
            print(f"  transformers repeat {rep + 1}/{args.tf_repeat}: prefill "
                  f"{args.prompt_tokens / runs[-1][0]:.1f} decode "
                  f"{args.gen_tokens / runs[-1][1]:.1f} tok/s", flush=True)
        rows.append({"engine": "transformers", "precision": "f32 eager",
                     "bytes_per_token": hf_bytes_per_token(model, d.top_k, d.experts, 4),
                     "tensor_types": {"all": "f32"}, "bytes_per_token_parts": {},
                     "prefill_tok_s": summarize([args.prompt_tokens / r[0] for r in runs]),
                     "decode_tok_s": summarize([args.gen_tokens / r[1] for r in runs])})
        tokens["transformers f32"] = runs[0][2]
        del model

    probe.append(read_memory())
    gbps = max(probe)
    for r in rows:
        r["bound_tok_s"] = gbps * 1e9 / r["bytes_per_token"]
        r["percent_of_bound"] = 100 * r["decode_tok_s"]["median"] / r["bound_tok_s"]
    by = {(r["engine"], r["precision"]): r for r in rows}
    ratios = {}
    for pr in pairs:
        c, ll = by[("colibri", pr.label)], by[("llama.cpp", pr.llama)]
        ratios[pr.label] = {k: c[k]["median"] / ll[k]["median"]
                            for k in ("prefill_tok_s", "decode_tok_s")}
        ratios[pr.label]["decode_pairs"] = summarize(by_rep[pr.label])
        ratios[pr.label]["llama_precision"] = pr.llama  # the row it was set against
    agreement = agreement_counts(pairs, tokens)
    import llama_cpp

    return {
        **measured_on(),  # cpu, commit, command, date: what docs/performance.md shows
        "model": asdict(d), "workdir": str(base), "threads": args.threads,
        "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "repeat": args.repeat, "tf_repeat": 0 if args.skip_transformers else args.tf_repeat,
        "llama_cpp_python": llama_cpp.__version__, "colibri_isa": isa,
        "colibri_prefetch": _core.stream_hint_active(), "kv_cache_type": KV_CACHE_TYPE,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "bandwidth_gb_s": gbps, "bandwidth_probes_gb_s": probe,
        "bandwidth_between_runs_gb_s": between,
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "rows": rows, "ratios_colibri_over_llama": ratios,
        "greedy_agreement_first16": agreement, "greedy_tokens_first16": {
            k: v[:16] for k, v in tokens.items()},
    }


def agreement_counts(pairs: list[Pair], tokens: dict[str, list[int]]) -> dict[str, int]:
    """Greedy tokens agreeing among the first 16: each pair's engines, the first pair's common
    prefix, and each run against transformers when it ran (tokens keyed "engine precision")."""
    out: dict[str, int] = {}
    for pr in pairs:
        out[f"{pr.label} colibri vs llama.cpp"] = _agree(tokens[f"colibri {pr.label}"],
                                                         tokens[f"llama.cpp {pr.llama}"])
    first = pairs[0]
    out[f"{first.label} colibri vs llama.cpp, common prefix"] = _prefix(
        tokens[f"colibri {first.label}"], tokens[f"llama.cpp {first.llama}"])
    if "transformers f32" in tokens:
        for pr in pairs:
            for k in (f"colibri {pr.label}", f"llama.cpp {pr.llama}"):
                out[f"{k} vs transformers f32"] = _agree(tokens[k], tokens["transformers f32"])
    return out


def describe_model(d: dict[str, Any]) -> str:
    arch = d.get("arch", "mixtral")
    if arch == "gpt_oss":
        return (f"random gpt-oss, experts MXFP4: vocab {d['vocab']}, hidden {d['hidden']}, "
                f"{d['layers']} layers (sliding window 128 and full alternating), "
                f"{d['experts']} experts of width {d['intermediate']} top-{d['top_k']}, "
                f"{d['heads']} heads of {d['head_dim']} / {d['kv_heads']} kv, seed {d['seed']}")
    if arch == "deepseek_v2":
        return (f"random DeepSeek-V2 (MLA): vocab {d['vocab']}, hidden {d['hidden']}, "
                f"{d['layers']} layers ({d['dense']} dense, ffn {d['intermediate']}), "
                f"{d['experts']} experts top-{d['top_k']} of width {d['moe_intermediate']} + "
                f"{d['shared']} shared, {d['heads']} heads, q_lora {d['q_lora']}, kv_lora "
                f"{d['kv_lora']}, rope {d['rope_dim']}, nope {d['nope_dim']}, v {d['v_dim']}, "
                f"seed {d['seed']}")
    return (f"random Mixtral: vocab {d['vocab']}, hidden {d['hidden']}, ffn "
            f"{d['intermediate']}, {d['layers']} layers, {d['experts']} experts "
            f"top-{d['top_k']}, {d['heads']} heads / {d['kv_heads']} kv, seed {d['seed']}")


def render(res: dict[str, Any]) -> str:
    d = res["model"]
    lines = [
        f"cpu: {res['cpu']}",
        describe_model(d),
        f"{res['threads']} threads, {res['prompt_tokens']}-token prompt, {res['gen_tokens']} "
        f"greedy tokens, medians of {res['repeat']} alternating repeats "
        f"(transformers: {res['tf_repeat']}); llama-cpp-python {res['llama_cpp_python']}, "
        f"colibri kernels {res['colibri_isa']}"
        + (f", prefetch {res['colibri_prefetch']}" if res["colibri_isa"] == "avx512" else "")
        + f"; {res['kv_cache_type']} KV cache in both engines",
        f"read bandwidth {res['bandwidth_gb_s']:.1f} GB/s (probes "
        + ", ".join(f"{x:.1f}" for x in res["bandwidth_probes_gb_s"])
        + f"); load average {res['loadavg_start'][0]:.2f} at start, "
        f"{res['loadavg_end'][0]:.2f} at end",
        "",
        f"{'engine':13}{'precision':11}{'MB/token':>10}{'prefill tok/s':>15}"
        f"{'decode tok/s':>14}{'(min-max)':>17}{'bound tok/s':>13}{'% bound':>9}"
        f"{'same-minute %':>15}",
    ]
    for r in res["rows"]:
        p, dd = r["prefill_tok_s"], r["decode_tok_s"]
        spread = f"{dd['min']:.1f}-{dd['max']:.1f}"
        lines.append(
            f"{r['engine']:13}{r['precision']:11}{r['bytes_per_token'] / 1e6:>10.1f}"
            f"{p['median']:>15.1f}{dd['median']:>14.1f}{spread:>17}"
            f"{r['bound_tok_s']:>13.1f}{r['percent_of_bound']:>9.1f}"
            + (f"{r['percent_of_bound_same_minute']['median']:>15.1f}"
               if "percent_of_bound_same_minute" in r else ""))
    lines.append("KV cache bytes per token (all layers): " + ", ".join(
        f"{r['engine']} {r['precision']} {r['kv_bytes_per_token']:.0f}"
        for r in res["rows"] if r.get("kv_bytes_per_token")))
    lines.append("")
    for q, rr in res["ratios_colibri_over_llama"].items():
        dp = rr["decode_pairs"]
        lines.append(f"colibri / llama.cpp at {q}: prefill x{rr['prefill_tok_s']:.2f}, "
                     f"decode x{rr['decode_tok_s']:.2f} (repeat by repeat: median "
                     f"x{dp['median']:.2f}, x{dp['min']:.2f} to x{dp['max']:.2f})")
    lines.append("% bound: at the higher of the first and last probes; same-minute %: each "
                 "run at the higher of the reads just before and after it, median")
    lines.append(f"llama.cpp build: {res['llama_cpp_system_info'].strip()} "
                 f"(OMP_WAIT_POLICY={res['omp_wait_policy']})")
    lines.append("greedy tokens agreeing among the first 16: " + ", ".join(
        f"{k}: {v}" for k, v in res["greedy_agreement_first16"].items()))
    for r in res["rows"]:
        if r["engine"] == "llama.cpp":
            lines.append(f"llama.cpp {r['precision']} tensor types: " + ", ".join(
                f"{k} {v}" for k, v in r["tensor_types"].items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=tuple(ARCH_DEFAULTS), default="mixtral",
                   help="mixtral (default dims below), deepseek_v2 (DeepSeek-V2-Lite's dims, "
                        "4 layers) or gpt_oss (gpt-oss-20b's dims, experts MXFP4)")
    for name in ("vocab", "hidden", "intermediate", "layers", "experts", "heads", "seed"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None, help="gpt_oss: attention head width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5, help="alternating repeats per engine")
    p.add_argument("--tf-repeat", type=int, default=2, help="transformers repeats (slow)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--probe-mib", type=int, default=1024, help="bandwidth probe buffer, MiB")
    p.add_argument("--workdir", default="/tmp/colibri_compare",
                   help="cache of the checkpoint, conversions and llama.cpp source")
    p.add_argument("--llama-src", default=None,
                   help="llama.cpp source root with convert_hf_to_gguf.py (default: fetched "
                        "from the llama-cpp-python source distribution into --workdir)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the result here")
    p.add_argument("--child", choices=("llama.cpp", "colibri"), default=None,
                   help=argparse.SUPPRESS)  # internal: one timed run in a fresh process
    p.add_argument("--child-model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    dflt = {**asdict(Dims()), **ARCH_DEFAULTS[args.arch]}
    for name in ("vocab", "hidden", "intermediate", "layers", "experts", "heads", "seed",
                 "top_k", "kv_heads", "head_dim"):
        if getattr(args, name) is None:
            setattr(args, name, dflt[name])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_run(args)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    for mod in ("sentencepiece", "gguf"):
        try:
            __import__(mod)
        except ImportError:
            print(f"{mod} is not installed: pip install {mod}", file=sys.stderr)
            return 2
    res = compare(args)
    print()
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
