"""Per-token cost of JSON Schema constraints at batch 8, as a share of the decode step.

Eight sequences decode in lockstep through one batched forward step (engine.executor.model.Model
with n_seq 8); each carries its own compiled constraint, applied to its row of logits and
advanced by its sampled token, as a batched sampler does. Timed separately: the forward step,
and the constraint work of the step (apply + accept for the 8 rows) in three ways: the masks
computed when apply() needs them (no overlap), computed in the background right after accept()
so they overlap the next forward pass (what Colibri does), and llguidance's parallel batch fill
(LLExecutor) for comparison. Sampling is greedy so every variant follows the same tokens. Then
the same through the step engine itself (LLM.generate_batch: scheduler, paged KV, batched
sampler): per step, the time outside the forward pass with and without constraints.

    python scripts/bench_constraints.py [--model DIR] [--steps 64] [--threads N] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format.convert import ensure_converted  # noqa: E402
from colibri.engine.llm import default_model_path  # noqa: E402
from colibri.engine.sample.constraints import ConstraintCompiler, ConstraintSpec  # noqa: E402
from colibri.engine.text.tokenizer import Tokenizer  # noqa: E402

BATCH = 8
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 12},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "kind": {"enum": ["book", "pen", "lamp"]}},
        "required": ["sku", "qty", "kind"], "additionalProperties": False}},
    "note": {"type": "string"}}, "required": ["items", "note"], "additionalProperties": False}


def run(model: Model, tok: Tokenizer, comp: ConstraintCompiler, steps: int, variant: str
        ) -> dict[str, Any]:
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Order {i}, in JSON."}])
               for i in range(BATCH)]
    for s in range(BATCH):
        model.reset(s)
    # a budget well past the steps run: the closing look-ahead (the last tokens of a budget)
    # is not part of this measurement
    cons = [comp.compile(ConstraintSpec("json_schema", SCHEMA), max_tokens=1024,
                         overlap=(variant == "overlap")) for _ in range(BATCH)]
    # prefill each sequence; keep its last row of logits
    logits = np.empty((BATCH, model.n_vocab), dtype=np.float32)
    for s, p in enumerate(prompts):
        ids = np.asarray(p, dtype=np.int32)
        want = np.zeros(ids.size, dtype=np.uint8)
        want[-1] = 1
        logits[s] = model.forward(ids, np.full(ids.size, s, np.int32),
                                  np.arange(ids.size, dtype=np.int32), want)[0]
    pos = np.asarray([len(p) for p in prompts], dtype=np.int32)
    fwd, mask = [], []
    executor = None
    if variant == "llg-batch":
        import llguidance
        import llguidance.numpy as lnp

        executor = llguidance.LLExecutor()
        bitmask = lnp.allocate_token_bitmask(BATCH, model.n_vocab)
    live = np.ones(BATCH, dtype=bool)
    for _ in range(steps):
        t0 = time.perf_counter()
        if executor is not None:
            lnp.fill_next_token_bitmask_par(
                executor, [(c._m, i) for i, c in enumerate(cons) if live[i]], bitmask)
            allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=model.n_vocab,
                                    bitorder="little").astype(bool)
            logits[~allowed] = -np.inf
        else:
            for i, c in enumerate(cons):
                if live[i]:
                    c.apply(logits[i])
        toks = np.argmax(logits, axis=1).astype(np.int32)
        for i, c in enumerate(cons):
            if live[i]:
                if executor is not None:
                    c._m.consume_token(int(toks[i]))
                else:
                    c.accept(int(toks[i]))
                if (c._m.is_stopped() if executor is not None else c.is_finished()):
                    live[i] = False
        t1 = time.perf_counter()
        if not live.any():
            break
        out = model.forward(toks, np.arange(BATCH, dtype=np.int32), pos)
        t2 = time.perf_counter()
        logits[:] = out
        pos += 1
        mask.append(t1 - t0)
        fwd.append(t2 - t1)
    return {"variant": variant, "steps": len(fwd), "forward_ms": statistics.median(fwd) * 1e3,
            "constraint_ms": statistics.median(mask) * 1e3,
            "share": statistics.median(mask) / statistics.median(fwd)}


def run_engine(source: Path | None, quant: str, threads: int | None, steps: int
               ) -> dict[str, Any]:
    """Per-step time outside the forward pass in the step engine, constrained or not."""
    from colibri.engine import LLM, SamplingParams

    llm = LLM(source, threads=threads, quant=quant)
    comp = ConstraintCompiler.for_tokenizer(llm.tokenizer, llm.vocab_size)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Order {i}"}])
               for i in range(BATCH)]
    res: dict[str, Any] = {}
    for label in ("plain", "constrained"):
        params = [SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True,
                                 constraint=(comp.compile(ConstraintSpec("json_schema", SCHEMA),
                                                          max_tokens=1024)
                                             if label == "constrained" else None))
                  for _ in range(BATCH)]
        st = llm.core.stats
        n0, s0, f0 = st.n_steps, st.step_time_s, st.forward_time_s
        outs = llm.generate_batch(prompts, params)
        n = st.n_steps - n0
        res[label] = {"steps": n, "tokens": sum(len(o) for o in outs),
                      "step_ms": (st.step_time_s - s0) / n * 1e3,
                      "outside_forward_ms": ((st.step_time_s - s0) - (st.forward_time_s - f0))
                      / n * 1e3}
    c, p = res["constrained"], res["plain"]
    res["constraint_share"] = (c["outside_forward_ms"] - p["outside_forward_ms"]) / c["step_ms"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="Hugging Face or Colibri folder")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    path = ensure_converted(args.model or default_model_path(), args.quant, progress=True)
    model = Model.load(path, threads=args.threads, n_seq=BATCH)
    tok = Tokenizer.from_dir(path)
    comp = ConstraintCompiler.for_tokenizer(tok, model.n_vocab)
    rows = []
    print(f"model {path.name}, vocab {model.n_vocab}, batch {BATCH}, {model.n_threads} threads")
    for _ in range(args.repeat):
        for variant in ("no-overlap", "overlap", "llg-batch"):
            r = run(model, tok, comp, args.steps, variant)
            rows.append(r)
            print(f"{variant:11} steps {r['steps']:3d}  forward {r['forward_ms']:7.3f} ms  "
                  f"constraints {r['constraint_ms']:6.3f} ms  share {100 * r['share']:5.1f}%")
    for _ in range(args.repeat):
        e = run_engine(args.model, args.quant, args.threads, args.steps)
        rows.append({"variant": "engine", **e})
        c, p = e["constrained"], e["plain"]
        print(f"engine      steps {c['steps']:3d}  step {c['step_ms']:7.3f} ms  outside forward: "
              f"constrained {c['outside_forward_ms']:6.3f} ms, plain {p['outside_forward_ms']:6.3f}"
              f" ms  constraint share {100 * e['constraint_share']:5.1f}%")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
