#!/usr/bin/env python3
"""KV cache bytes per token of a gpt-oss-shaped sequence, with the sliding-window layers in a
pool of their own (blocks given back once they leave every window) and with one pool for every
layer, beside llama.cpp's figure for the same shape (from a scripts/compare_llamacpp.py results
file, which reads it from llama.cpp's own load log).

The figure is counted, not timed and not a formula: a random checkpoint with gpt-oss-20b's
attention cache shape (alternating sliding-window-128 and full layers, 8 KV heads of 64; the
other dimensions tiny, since they do not enter the cache) runs one sequence through the paged
step, its prompt in 256-token chunks as the engine's steps take it, over the real block manager;
at each measured length the blocks the sequence holds in each pool are multiplied by the bytes
one block of that pool takes in the C cache's own allocation.

    python scripts/bench_kv_pools.py --json results/kv_bytes/$(date +%F)-<name>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from colibri.engine.core.block_manager import BLOCK_SIZE, BlockManager
from colibri.engine.executor.model import Model
from colibri.engine.format.convert import convert
from colibri.engine.tools.bench import measured_on

ROOT = Path(__file__).resolve().parents[1]
LLAMA = (ROOT / "results" / "compare_llamacpp"
         / "2026-12-06-epyc-zen4-gpt-oss-20b-shape-12-layers-mxfp4.json")
WINDOW, KV_HEADS, HEAD_DIM = 128, 8, 64  # gpt-oss-20b
STEP = 256  # prompt tokens per engine step (max_num_batched_tokens' default)


def checkpoint(out: Path, layers: int, n_ctx: int) -> Path:
    """A random gpt_oss checkpoint whose KV cache has gpt-oss-20b's shape."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
        max_position_embeddings=n_ctx,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    transformers.GptOssForCausalLM(cfg).eval().save_pretrained(out)
    return out


def held_bytes(m: Model, n_tokens: int) -> dict[str, Any]:
    """One sequence computed up to n_tokens positions in STEP-token chunks, then the step that
    decodes its next token: the bytes of the blocks it holds during that step."""
    n_win = m.n_kv_win_blocks
    bm = BlockManager(m.n_kv_blocks, BLOCK_SIZE, False, 0, n_win, WINDOW if n_win else 0)
    assert bm.allocate_prompt("s", []) == 0
    ids = np.random.default_rng(0).integers(0, 512, n_tokens + 1).astype(np.int32)
    for a in [*range(0, n_tokens, STEP), n_tokens]:
        b = min(a + STEP, n_tokens) if a < n_tokens else n_tokens + 1
        bm.release_window("s", a)
        assert bm.grow("s", b)
        if a == n_tokens:
            break
        table = np.asarray([bm.table("s")], np.int32)
        win = np.asarray([bm.win_table("s")], np.int32) if n_win else None
        m.forward_paged(ids[a:b], np.zeros(b - a, np.int32), np.arange(a, b, dtype=np.int32),
                        table, np.zeros(b - a, bool), win_tables=win)
    full = len(bm.table("s"))
    win_held = bm.win_held("s") if n_win else 0
    total = full * m.kv.block_bytes + win_held * m.kv.win_block_bytes
    bm.free("s")
    return {"tokens": n_tokens + 1, "full_blocks": full, "full_block_bytes": m.kv.block_bytes,
            "win_blocks": win_held, "win_block_bytes": m.kv.win_block_bytes,
            "bytes": total, "bytes_per_token": total / (n_tokens + 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12,
                   help="layers (gpt-oss-20b has 24; 12 is the shape compared with llama.cpp)")
    p.add_argument("--tokens", type=int, nargs="+", default=[383, 1023, 4095],
                   help="positions computed before the measured decode step")
    p.add_argument("--kv-type", default="f16", choices=("f32", "f16", "q8"))
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    n_ctx = max(args.tokens) + 1
    with tempfile.TemporaryDirectory(prefix="colibri_kv_pools_") as tmp:
        hf = checkpoint(Path(tmp) / "hf", args.layers, n_ctx)
        folder = convert(hf, Path(tmp) / "f32", quant="f32", progress=False)
        nb = -(-n_ctx // BLOCK_SIZE)
        one = Model.load(folder, threads=2, n_ctx=n_ctx, n_seq=0, kv_type=args.kv_type,
                         kv_blocks=nb)
        two = Model.load(folder, threads=2, n_ctx=n_ctx, n_seq=0, kv_type=args.kv_type,
                         kv_blocks=nb, kv_win_blocks=nb)
        rows = [{"one_pool": held_bytes(one, n), "windowed_pool": held_bytes(two, n)}
                for n in args.tokens]
    llama = json.loads(LLAMA.read_text())
    llama_bpt = next(r["kv_bytes_per_token"] for r in llama["rows"]
                     if r["engine"] == "llama.cpp")
    out = {**measured_on(["scripts/bench_kv_pools.py", *(argv or sys.argv[1:])]),
           "model": {"arch": "gpt_oss", "layers": args.layers, "sliding_window": WINDOW,
                     "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                     "layer_types": "sliding, full alternating"},
           "kv_cache_type": args.kv_type, "step_tokens": STEP, "rows": rows,
           "llama_cpp": {"kv_bytes_per_token": llama_bpt,
                         "file": str(LLAMA.relative_to(ROOT)),
                         "kv_cache_type": llama.get("kv_cache_type")}}
    for r in rows:
        a, b = r["one_pool"], r["windowed_pool"]
        print(f"{a['tokens']:>6} tokens: one pool {a['bytes_per_token'] / 1000:.2f} kB/token, "
              f"windowed pool {b['bytes_per_token'] / 1000:.2f} kB/token "
              f"({b['full_blocks']} full + {b['win_blocks']} windowed blocks); "
              f"llama.cpp {llama_bpt / 1000:.2f} kB/token")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
