#!/usr/bin/env python3
"""Decode speed at a short and a long context: a Qwen3-Next-shaped model against one whose
every layer is full attention.

Qwen3-Next keeps a fixed-size recurrent state in its gated DeltaNet linear-attention layers
and a KV cache only in its full-attention layers (every fourth), so a decoded token reads
little more at an 8K context than at 256: its decode speed should barely fall. A Qwen3-MoE
of the same widths, with full attention in every layer, reads the whole KV cache of every
layer for each token: the contrast.

Builds (cached in --workdir, keyed by the dimensions and seed) two seeded random checkpoints
with transformers, bf16 safetensors: Qwen3NextForCausalLM (linear attention with the real
model's head widths and half its head counts, full attention every --full-every layers,
routed experts and a shared expert) and Qwen3MoeForCausalLM with the same hidden size,
attention heads, experts and layer count. At the default shape each has about 1.1 billion
parameters (2.2 GB of bf16 and 1.2 GB of q8 on disk, about 450 MB of weights read per decoded
token): both fit a 24 GB machine. Both are converted with Colibri (--quant, q8 by
default). Then, for each repeat, for each prompt length, for each model (the order of the
models alternates from one repeat to the next), a fresh child process loads the model (the
KV cache sized for the longest prompt plus --gen-tokens, Colibri's default KV type), warms
up on a short prompt, prefills the prompt in one call and decodes --gen-tokens greedy tokens
one call each (EOS ignored), as `colibri bench` does. The prompt is the same deterministic
token ids for both models.

The JSON written to --json records the machine, commit and command (as every results/ file),
each model's shape and bytes of weights per decoded token, the KV cache bytes per position,
every run, the medians of prefill and decode tokens/s per prompt length, and per model the
ratio of each length's median decode to the shortest length's (the 8K/256 ratio).

A measurement for docs/performance.md goes into results/ (the file records the CPU, commit,
command and date), then `python scripts/make_performance_page.py` makes the page again:

    python scripts/bench_long_context.py \
        --json results/bench_long_context/$(date +%F)-<machine>-qwen3-next.json

A quick check that everything runs (small models, short prompts; seconds):

    python scripts/bench_long_context.py --vocab 2048 --hidden 256 --layers 4 --experts 8 \
        --top-k 2 --moe-intermediate 128 --shared-intermediate 128 --heads 4 --head-dim 64 \
        --linear-key-heads 2 --linear-value-heads 4 --linear-head-dim 64 \
        --prompt-tokens 64 512 --gen-tokens 16 --repeat 1 --json /tmp/long-context.json

Run it on a quiet machine: other work on the same cores changes the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:  # the modules beside this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_llamacpp import _scale_init, _words  # noqa: E402

from colibri.engine.tools.bench import (  # noqa: E402
    bench_prompt,
    measured_on,
    summarize,
    timed_greedy_run,
    weight_bytes_per_token,
)

HYBRID = "qwen3_next"
FULL = "qwen3_moe"
ARCHS = (HYBRID, FULL)
TOKENIZER_VOCAB = 1024  # the tokenizer's size; the model's vocabulary (and lm_head) is --vocab
WARMUP_PROMPT, WARMUP_GEN = 16, 4


@dataclass(frozen=True)
class Dims:
    """The shape both models share; the linear_* fields are Qwen3-Next's only."""

    vocab: int = 32000
    hidden: int = 2048
    layers: int = 8
    full_every: int = 4  # Qwen3-Next: layer i is full attention when (i + 1) % full_every == 0
    experts: int = 32
    top_k: int = 8
    moe_intermediate: int = 512
    shared_intermediate: int = 512  # Qwen3-Next's shared expert (Qwen3-MoE has none)
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    linear_key_heads: int = 8  # Qwen3-Next-80B-A3B: 16 key heads and 32 value heads of 128
    linear_value_heads: int = 16
    linear_head_dim: int = 128
    conv_kernel: int = 4
    max_positions: int = 32768
    seed: int = 0

    def tag(self, arch: str) -> str:
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return (f"{arch}-v{self.vocab}-d{self.hidden}-l{self.layers}-e{self.experts}k{self.top_k}"
                f"-f{self.moe_intermediate}-s{self.seed}-" + hashlib.sha256(raw).hexdigest()[:8])


def layer_types(d: Dims, arch: str) -> list[str]:
    """Each layer's attention: Qwen3-Next's mix, or full attention everywhere."""
    if arch == FULL:
        return ["full_attention"] * d.layers
    return ["full_attention" if (i + 1) % d.full_every == 0 else "linear_attention"
            for i in range(d.layers)]


def config_kwargs(d: Dims, arch: str) -> dict[str, Any]:
    """The transformers config fields of one of the two models."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHS}")
    common: dict[str, Any] = dict(
        vocab_size=d.vocab, hidden_size=d.hidden, num_hidden_layers=d.layers,
        num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, head_dim=d.head_dim,
        intermediate_size=d.moe_intermediate * d.top_k, moe_intermediate_size=d.moe_intermediate,
        num_experts=d.experts, num_experts_per_tok=d.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=d.max_positions,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=2,
        pad_token_id=0)
    if arch == FULL:
        return {**common, "use_sliding_window": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    return {**common, "shared_expert_intermediate_size": d.shared_intermediate,
            "linear_conv_kernel_dim": d.conv_kernel, "linear_key_head_dim": d.linear_head_dim,
            "linear_value_head_dim": d.linear_head_dim,
            "linear_num_key_heads": d.linear_key_heads,
            "linear_num_value_heads": d.linear_value_heads,
            "layer_types": layer_types(d, arch),
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25}}


def make_config(d: Dims, arch: str) -> Any:
    """The transformers config object of one of the two models."""
    import transformers as tf

    cls = tf.Qwen3NextConfig if arch == HYBRID else tf.Qwen3MoeConfig
    return cls(**config_kwargs(d, arch))


def _model_class(arch: str) -> Any:
    import transformers as tf

    return tf.Qwen3NextForCausalLM if arch == HYBRID else tf.Qwen3MoeForCausalLM


def build_checkpoint(out: Path, d: Dims, arch: str) -> Path:
    """A seeded random checkpoint (bf16 safetensors) with a small byte-level BPE tokenizer;
    kept when out already holds one."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import torch

    from colibri.engine.text.bpe import train_bpe_tokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"building the random {arch} checkpoint in {out} ...", flush=True)
    torch.manual_seed(d.seed)
    model = _model_class(arch)._from_config(make_config(d, arch), dtype=torch.bfloat16).eval()
    _scale_init(model, d.seed)
    model.save_pretrained(str(tmp))
    del model
    rng = random.Random(d.seed)
    words = _words(rng, 4000)
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + "."
            for _ in range(20000)]
    train_bpe_tokenizer(text, min(TOKENIZER_VOCAB, d.vocab), tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


# -- the runs -------------------------------------------------------------------------------

def child_run(args: argparse.Namespace) -> int:
    """One timed run in this (fresh) process: load, warm up, time; prints one JSON line."""
    from colibri.engine.core.kv_types import resolve_kv_type
    from colibri.engine.core.loader import start_expert_cache
    from colibri.engine.core.options import ExpertCacheConfig
    from colibri.engine.executor.model import Model
    from colibri.engine.models.config import ModelConfig
    from colibri.engine.tools.cache_args import DEFAULT_KV_CACHE_TYPE

    path = Path(args.child)
    cfg = ModelConfig.from_dir(path)
    model = Model.load(path, threads=args.threads, n_ctx=args.n_ctx,
                       kv_type=resolve_kv_type(DEFAULT_KV_CACHE_TYPE, cfg.quant))
    start_expert_cache(model, path, ExpertCacheConfig.from_env(),
                       model.n_kv_blocks * model.kv_block_bytes())
    # warm-up: page the weights in and start the threads
    timed_greedy_run(model, bench_prompt(cfg.n_vocab, WARMUP_PROMPT, seed=1), WARMUP_GEN)
    prompt = bench_prompt(cfg.n_vocab, args.prompt_tokens[0])
    run = timed_greedy_run(model, prompt, args.gen_tokens)
    from colibri.engine import _core

    print(json.dumps({"prefill_s": run.prefill_s, "decode_s": run.decode_s,
                      "decode_attention_s": run.decode_attention_s, "tokens": run.tokens[:16],
                      "threads": model.n_threads, "kv_type": model.kv_type,
                      "kv_bytes_per_position": model.kv_block_bytes() / int(_core.KV_BLOCK)}))
    return 0


def _spawn(args: argparse.Namespace, path: Path, prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path),
           "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(args.gen_tokens),
           "--n-ctx", str(n_ctx)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"run of {path} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def dims_from_args(args: argparse.Namespace) -> Dims:
    return Dims(vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                full_every=args.full_every, experts=args.experts, top_k=args.top_k,
                moe_intermediate=args.moe_intermediate,
                shared_intermediate=args.shared_intermediate, heads=args.heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim,
                linear_key_heads=args.linear_key_heads,
                linear_value_heads=args.linear_value_heads,
                linear_head_dim=args.linear_head_dim, max_positions=args.max_positions,
                seed=args.seed)


def context_ratios(decode_medians: dict[int, float]) -> dict[str, float]:
    """Each prompt length's median decode tokens/s over the shortest length's, keyed
    "LONG/SHORT" (e.g. "8192/256")."""
    short = min(decode_medians)
    return {f"{n}/{short}": decode_medians[n] / decode_medians[short]
            for n in sorted(decode_medians) if n != short}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from colibri.engine.format.convert import convert_once

    d = dims_from_args(args)
    lengths = sorted(set(args.prompt_tokens))
    n_ctx = lengths[-1] + args.gen_tokens
    if n_ctx > d.max_positions:
        raise SystemExit(f"the longest prompt plus --gen-tokens ({n_ctx}) is past "
                         f"--max-positions ({d.max_positions})")
    work = Path(args.workdir)
    paths: dict[str, Path] = {}
    shapes: dict[str, Any] = {}
    for arch in ARCHS:
        base = work / d.tag(arch)
        hf = build_checkpoint(base / "hf", d, arch)
        print(f"Colibri {args.quant} of {arch} ...", flush=True)
        paths[arch] = convert_once(hf, base / f"colibri-{args.quant}", args.quant)
        per_token = weight_bytes_per_token(paths[arch])
        shapes[arch] = {"layer_types": layer_types(d, arch), "path": str(paths[arch]),
                        "weight_bytes_per_token": per_token["total"],
                        "weight_bytes_per_token_parts": {k: v for k, v in per_token.items()
                                                         if k != "total"}}

    load0 = os.getloadavg()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {a: {n: [] for n in lengths}
                                                        for a in ARCHS}
    t0 = time.perf_counter()
    for rep in range(args.repeat):
        for n in lengths:
            for arch in (ARCHS if rep % 2 == 0 else ARCHS[::-1]):
                r = _spawn(args, paths[arch], n, n_ctx)
                r["repeat"] = rep
                runs[arch][n].append(r)
                print(f"repeat {rep + 1}/{args.repeat}  {arch:10} {n:>6}-token prompt: "
                      f"prefill {n / r['prefill_s']:8.1f} tok/s, decode "
                      f"{args.gen_tokens / r['decode_s']:6.2f} tok/s", flush=True)
    models: dict[str, Any] = {}
    for arch in ARCHS:
        per_len: dict[str, Any] = {}
        medians: dict[int, float] = {}
        for n in lengths:
            rs = runs[arch][n]
            dec = summarize([args.gen_tokens / r["decode_s"] for r in rs])
            medians[n] = dec["median"]
            per_len[str(n)] = {
                "prefill_tok_s": summarize([n / r["prefill_s"] for r in rs]),
                "decode_tok_s": dec,
                "decode_attention_s_per_token": statistics.median(
                    r["decode_attention_s"] / args.gen_tokens for r in rs),
                "runs": rs}
        first = runs[arch][lengths[0]][0]
        models[arch] = {**shapes[arch], "threads": first["threads"], "kv_type": first["kv_type"],
                        "kv_bytes_per_position": first["kv_bytes_per_position"],
                        "contexts": per_len, "decode_ratio": context_ratios(medians)}
    return {**measured_on(), "dims": asdict(d), "quant": args.quant,
            "prompt_tokens": lengths, "gen_tokens": args.gen_tokens, "repeat": args.repeat,
            "n_ctx": n_ctx, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "wall_s": time.perf_counter() - t0, "models": models}


def render(res: dict[str, Any]) -> str:
    """The medians as a short table."""
    lengths = res["prompt_tokens"]
    lines = [f"{res['cpu']}; {res['quant']}, {res['gen_tokens']} decoded tokens, "
             f"{res['repeat']} repeats (medians)",
             f"{'model':12}{'weights/tok':>12}{'KV/pos':>9}"
             + "".join(f"{f'decode@{n}':>14}" for n in lengths)
             + "".join(f"{k:>12}" for k in res["models"][HYBRID]["decode_ratio"])]
    for arch, m in res["models"].items():
        lines.append(
            f"{arch:12}{m['weight_bytes_per_token'] / 1e6:>10.1f}MB"
            f"{m['kv_bytes_per_position'] / 1e3:>7.1f}kB"
            + "".join(f"{m['contexts'][str(n)]['decode_tok_s']['median']:>10.2f} t/s"
                      for n in lengths)
            + "".join(f"{v:>12.3f}" for v in m["decode_ratio"].values()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dflt = Dims()
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 8192],
                   help="prompt lengths (default 256 8192)")
    p.add_argument("--gen-tokens", type=int, default=48,
                   help="greedy tokens decoded per run (default 48)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per model and length")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    p.add_argument("--quant", default="q8", help="Colibri conversion preset (default q8)")
    p.add_argument("--workdir", default=str(Path.home() / ".cache" / "colibri-long-context"),
                   help="where the checkpoints and conversions are kept")
    p.add_argument("--json", help="write the result here")
    for f in ("vocab", "hidden", "layers", "full_every", "experts", "top_k",
              "moe_intermediate", "shared_intermediate", "heads", "kv_heads", "head_dim",
              "linear_key_heads", "linear_value_heads", "linear_head_dim", "max_positions",
              "seed"):
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(dflt, f),
                       help=f"default {getattr(dflt, f)}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("gen_tokens", "repeat"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.prompt_tokens) <= 0:
        p.error("--prompt-tokens must be positive")
    if not args.child and len(set(args.prompt_tokens)) < 2:
        p.error("--prompt-tokens needs at least two lengths to compare")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_run(args)
    res = bench(args)
    print(render(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
