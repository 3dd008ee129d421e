"""Per-step Python work of the step engine next to its forward pass.

    python scripts/step_overhead.py --model DIR [--seqs 16] [--prompt-tokens 64]
        [--gen-tokens 64] [--threads 2] [--quant q8] [--sampled]

Runs --seqs requests together through engine.core (the server's step loop, in process) and
reports, over the decode steps, the median step time, the median forward-pass time (the C
core, GIL released) and the share of the step spent in Python: scheduling, building the batch,
batched sampling, detokenizing and stop strings. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quant", default="q8")
    p.add_argument("--sampled", action="store_true",
                   help="temperature 0.8, top_p 0.95 and penalties instead of greedy")
    args = p.parse_args(argv)

    from colibri.engine import LLM, EngineConfig, SamplingParams

    llm = LLM(args.model, threads=args.threads, quant=args.quant,
              config=EngineConfig(max_num_seqs=args.seqs, max_num_batched_tokens=4096))
    core = llm.core
    rng = np.random.default_rng(0)
    extra = (dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.1,
                  seed=1) if args.sampled else dict(temperature=0.0))
    for i in range(args.seqs):
        prompt = rng.integers(10, llm.vocab_size - 10, args.prompt_tokens).tolist()
        core.add_request(f"s{i}", prompt, SamplingParams(max_tokens=args.gen_tokens,
                                                         ignore_eos=True, **extra))
    steps, fwd = [], []
    while core.has_work():
        t0 = time.perf_counter()
        f0 = core.stats.forward_time_s
        outs = core.step()
        dt = time.perf_counter() - t0
        if len(outs) == args.seqs and all(o.token_id >= 0 for o in outs):
            steps.append(dt)
            fwd.append(core.stats.forward_time_s - f0)
    step, forward = statistics.median(steps[1:]), statistics.median(fwd[1:])
    print(f"model {llm.path.name}, {args.seqs} sequences, {len(steps)} decode steps, "
          f"{'sampled' if args.sampled else 'greedy'}")
    print(f"step {step * 1e3:.2f} ms, forward {forward * 1e3:.2f} ms, Python "
          f"{(step - forward) * 1e3:.2f} ms = {100 * (step - forward) / step:.1f}% of the step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
