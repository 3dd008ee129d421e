#!/usr/bin/env python3
"""Hit rate of the running expert cache on text, with and without the prefetch thread.

The replay (`colibri replay`) measures demand policies offline; prefetching reads experts
before they are asked for, which no replay of demands can show. This runs the model itself
over consecutive pieces of a text (each piece: a prompt prefilled as a fresh sequence, then
decode steps fed the text's next tokens), warms on the first half of the pieces and prints
the counters of the second half: hit rate (uses found resident), prefetches issued / used,
for each budget, prefetch off and on.

    python scripts/expert_cache_text.py                       # the demo model, its plays
    python scripts/expert_cache_text.py --model DIR --text FILE --sizes 8,16,32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def main(argv: list[str] | None = None) -> int:
    from colibri.engine.demo import default_model_path
    from colibri.engine.executor.model import Model
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.text.tokenizer import Tokenizer
    from colibri.engine.tools.routing_trace import (
        RouteRecorder,
        greedy_run,
        read_trace_text,
        text_segments,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--text", default="demo", help="UTF-8 text file, or demo (default)")
    p.add_argument("--sizes", default="8,12,16,32", help="slots per layer")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=384)
    p.add_argument("--tokens", type=int, default=4096, help="tokens run in all")
    p.add_argument("--load", default="pread", help="expert load mode (default pread)")
    args = p.parse_args(argv)
    path = ensure_converted(Path(args.model or default_model_path()), "q8", progress=False)
    ids = Tokenizer.from_dir(path).encode(read_trace_text(args.text), add_special_tokens=False)
    pieces = list(text_segments(ids, args.prompt_tokens, args.gen_tokens, args.tokens))
    if len(pieces) < 2:
        raise SystemExit("the text is too short for two pieces")
    n_ctx = args.prompt_tokens + args.gen_tokens
    print(f"model {path}; {len(pieces)} pieces of {args.prompt_tokens} + {args.gen_tokens} "
          f"tokens, scored on the last {len(pieces) - len(pieces) // 2}")
    print(f"{'slots':>6} {'prefetch':>9} {'hit rate %':>11} {'prefetch used/issued':>22}")
    for size in [int(s) for s in args.sizes.split(",")]:
        for pf in (False, True):
            m = Model.load(path, n_ctx=n_ctx)
            m.core.enable_expert_cache(size, load=args.load, prefetch=pf)
            rec = RouteRecorder(m)
            half = len(pieces) // 2
            for i, (prompt, rest) in enumerate(pieces):
                if i == half:
                    s0 = m.core.expert_cache_stats()
                greedy_run(rec, prompt, args.gen_tokens, follow=rest)
            s1 = m.core.expert_cache_stats()
            d = {k: int(s1[k].sum() - s0[k].sum())
                 for k in ("hits", "misses", "prefetch_issued", "prefetch_used")}
            rate = 100.0 * d["hits"] / max(1, d["hits"] + d["misses"])
            print(f"{size:>6} {'on' if pf else 'off':>9} {rate:>11.1f} "
                  f"{d['prefetch_used']:>10}/{d['prefetch_issued']:<11}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
