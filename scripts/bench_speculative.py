"""Single-stream greedy decode with and without speculative decoding (prompt lookup).

    python scripts/bench_speculative.py [--model DIR] [--quant q8] [--threads N]
        [--gen-tokens 128] [--num-speculative-tokens 4] [--repeat 3] [--json]

Two workloads: an edit (the prompt holds a block of code the answer largely repeats) and free
text (the answer repeats nothing it was given). For each, runs alternate off / ngram on one
loaded model, through the step engine (scheduler, batched sampler, detokenizer), one request
at a time, prefix cache off. Reports decode tok/s (from the first token to the last), the mean
accepted length, and the expert weight bytes a decode step reads (timed products in C) with
drafts against one token's: on a MoE model a verify step reads the union of its tokens'
experts. The greedy tokens must be the same both ways (it stops if not). A benchmark, not a
test; it prints the CPU model with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def normalise(values):
    """Scale values to the range 0 .. 1."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [0.0 for _ in values]
    return [(x - lo) / (hi - lo) for x in values]
'''

WORKLOADS = {
    "edit": ("Here is a Python module:\n\n" + CODE + "\nRewrite the whole module with the "
             "parameter `values` renamed to `xs`. Reply with the code only."),
    "free": "Write a short story about a hummingbird who wants to see the sea.",
}
EXPERT_PHASES = ("experts gate+up", "experts down")


def _prompt(llm: Any, text: str) -> list[int]:
    tok = llm.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text, add_special_tokens=True)


def _expert_bytes(model: Any) -> int:
    st = model.product_stats()["phases"]
    return int(sum(st[p]["weight_bytes"] for p in EXPERT_PHASES if p in st))


def decode_run(llm: Any, prompt: list[int], n_gen: int) -> dict[str, Any]:
    """One greedy request alone: decode seconds, tokens, steps and expert bytes after the
    first token (the prefill step excluded)."""
    from colibri.engine import SamplingParams

    core = llm.core
    core.add_request("bench", prompt, SamplingParams(max_tokens=n_gen, temperature=0.0,
                                                     ignore_eos=True))
    tokens: list[int] = []
    t0 = 0.0
    steps0 = bytes0 = 0
    while core.has_work():
        outs = core.step()
        for o in outs:
            if o.error is not None:
                raise o.error
            if not tokens:
                t0, steps0, bytes0 = time.perf_counter(), core.stats.n_steps, \
                    _expert_bytes(llm.model)
            tokens.append(o.token_id)
    steps = core.stats.n_steps - steps0
    return {"s": time.perf_counter() - t0, "tokens": tokens, "steps": steps,
            "expert_bytes_per_step": (_expert_bytes(llm.model) - bytes0) / max(steps, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--quant", default="q8")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from colibri.engine import LLM, EngineConfig
    from colibri.engine.core.speculative import SpecStats, SpeculativeConfig
    from colibri.engine.tools.bench import cpu_model

    llm = LLM(args.model, threads=args.threads, quant=args.quant,
              config=EngineConfig(max_num_seqs=1, prefix_cache=False))
    on = SpeculativeConfig("ngram", args.num_speculative_tokens)
    off = SpeculativeConfig("off", args.num_speculative_tokens)
    result: dict[str, Any] = {"cpu": cpu_model(), "model": str(llm.path),
                              "threads": llm.model.n_threads, "gen_tokens": args.gen_tokens,
                              "num_speculative_tokens": args.num_speculative_tokens,
                              "workloads": {}}
    decode_run(llm, _prompt(llm, WORKLOADS["free"]), 8)  # warm-up
    for name, text in WORKLOADS.items():
        prompt = _prompt(llm, text)
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "ngram": []}
        stats = SpecStats()
        for _ in range(args.repeat):
            llm.core.speculative = off
            runs["off"].append(decode_run(llm, prompt, args.gen_tokens))
            llm.core.speculative, llm.core.spec_stats = on, SpecStats()
            runs["ngram"].append(decode_run(llm, prompt, args.gen_tokens))
            if runs["ngram"][-1]["tokens"] != runs["off"][-1]["tokens"]:
                print("speculative decoding changed the greedy tokens", file=sys.stderr)
                return 1
            for f in ("n_drafts", "n_draft_tokens", "n_accepted"):
                setattr(stats, f, getattr(stats, f) + getattr(llm.core.spec_stats, f))
        n = args.gen_tokens - 1
        w: dict[str, Any] = {"prompt_tokens": len(prompt)}
        for mode, rs in runs.items():
            w[mode] = {"decode_tok_s": statistics.median(n / r["s"] for r in rs),
                       "decode_tok_s_runs": [n / r["s"] for r in rs],
                       "steps": rs[0]["steps"],
                       "expert_bytes_per_step": statistics.median(
                           r["expert_bytes_per_step"] for r in rs)}
        w["mean_accepted"] = stats.mean_accepted
        w["acceptance_rate"] = (stats.n_accepted / stats.n_draft_tokens
                                if stats.n_draft_tokens else 0.0)
        w["speedup"] = w["ngram"]["decode_tok_s"] / w["off"]["decode_tok_s"]
        one = w["off"]["expert_bytes_per_step"]
        w["verify_expert_bytes_vs_one_token"] = (w["ngram"]["expert_bytes_per_step"] / one
                                                 if one else 0.0)
        result["workloads"][name] = w
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['cpu']}, {result['threads']} threads, {result['model']}, "
          f"{args.gen_tokens} greedy tokens, up to {args.num_speculative_tokens} drafts, "
          f"{args.repeat} runs each way, alternating")
    for name, w in result["workloads"].items():
        print(f"{name:5} ({w['prompt_tokens']} prompt tokens): off "
              f"{w['off']['decode_tok_s']:.1f} tok/s, ngram {w['ngram']['decode_tok_s']:.1f} "
              f"tok/s (x{w['speedup']:.2f}); mean accepted {w['mean_accepted']:.2f}, "
              f"acceptance {w['acceptance_rate']:.2f}; steps {w['off']['steps']} -> "
              f"{w['ngram']['steps']}; expert bytes per step x"
              f"{w['verify_expert_bytes_vs_one_token']:.2f} of one token's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
