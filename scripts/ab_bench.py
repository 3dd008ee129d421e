#!/usr/bin/env python3
"""Two Colibri checkouts on the same models, alternating: did a change move the speed?

Runs `colibri bench --json` of checkout A, then of checkout B, REPEAT times per model, each in a
fresh process with that checkout first on the path (each checkout needs its extension built in
place: `python setup.py build_ext --inplace`), and prints per model the median prefill and
decode tokens/s of each and the ratio B / A of the medians and repeat by repeat. A model
folder must be one both checkouts read (a conversion by the older one, or one whose format
did not change). Writes the whole result as JSON with --json, with the CPU, B's commit, the
command and the date (docs/performance.md is made from these files):

    python scripts/ab_bench.py --a /tmp/colibri_base --b . --model /tmp/m-q8 --model /tmp/m-q4 \
        --json results/ab_bench/$(date +%F)-<what changed>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from checkouts import checkout_python, commit_of

from colibri.engine.tools.bench import measured_on

ROOT = Path(__file__).resolve().parents[1]


def bench_once(checkout: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One `colibri bench` of checkout on model, in a fresh process run from the checkout."""
    with tempfile.TemporaryDirectory() as work:
        env, prefix = checkout_python(checkout, Path(work))
        code = f"import sys; from {prefix}app.cli import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "bench", "--model", model, "--prompt-tokens",
               str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--threads",
               str(args.threads), "--repeat", "1", "--json"]
        r = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{checkout}: bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key]["median"] for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", default=str(ROOT), help="checkout B (default: this one)")
    p.add_argument("--model", action="append", required=True, help="a converted model folder")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)
    a, b = Path(args.a).resolve(), Path(args.b).resolve()
    out: dict[str, Any] = {**measured_on(), "commit": commit_of(b), "a": str(a), "b": str(b),
                           "a_commit": commit_of(a), "b_commit": commit_of(b),
                           "repeat": args.repeat,
                           "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
                           "threads": args.threads, "models": {}}
    for model in args.model:
        runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        for rep in range(args.repeat):
            for name, checkout in (("a", a), ("b", b)):
                runs[name].append(bench_once(checkout, model, args))
            print(f"{Path(model).name} {rep + 1}/{args.repeat}: " + ", ".join(
                f"{k} decode {v[-1]['decode_tok_s']['median']:.1f} tok/s" for k, v in
                runs.items()), flush=True)
        pairs = [rb["decode_tok_s"]["median"] / ra["decode_tok_s"]["median"]
                 for ra, rb in zip(runs["a"], runs["b"], strict=True)]
        res = {k: {"prefill_tok_s": _median(v, "prefill_tok_s"),
                   "decode_tok_s": _median(v, "decode_tok_s")} for k, v in runs.items()}
        res["b_over_a"] = {
            "prefill": res["b"]["prefill_tok_s"] / res["a"]["prefill_tok_s"],
            "decode": res["b"]["decode_tok_s"] / res["a"]["decode_tok_s"],
            "decode_pairs": {"median": statistics.median(pairs), "min": min(pairs),
                             "max": max(pairs)}}
        res["cpu"] = runs["a"][0].get("cpu")
        out["models"][model] = res
        r = res["b_over_a"]
        print(f"{model}: A prefill {res['a']['prefill_tok_s']:.1f} decode "
              f"{res['a']['decode_tok_s']:.1f}; B prefill {res['b']['prefill_tok_s']:.1f} "
              f"decode {res['b']['decode_tok_s']:.1f} tok/s; B/A prefill x{r['prefill']:.3f}, "
              f"decode x{r['decode']:.3f} (repeat by repeat x{r['decode_pairs']['min']:.3f} "
              f"to x{r['decode_pairs']['max']:.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
