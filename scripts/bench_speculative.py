"""Greedy decode with and without speculative decoding (prompt lookup), one stream and eight.

    python scripts/bench_speculative.py [--model DIR] [--quant q8] [--threads N]
        [--gen-tokens 128] [--num-speculative-tokens N] [--repeat 3] [--streams 1,8]
        [--modes off,ngram,auto] [--workloads edit,free] [--json]
        [--out results/bench_speculative/DATE-NAME.json]

Two workloads: an edit (the prompt holds a block of code the answer largely repeats) and free
text (the answer repeats nothing it was given); with several streams each gets its own variant
(another identifier to rename, another subject). For each workload and stream count, runs
alternate between the modes (off, ngram: always num_speculative_tokens drafts, auto: the cost
model's k up to a cap that grows with the prompt-lookup match, oracle: num_speculative_tokens
drafts that are the tokens the baseline run gave, so every draft is accepted; the ceiling of an
edit the model copies perfectly) on one loaded model, through the step engine
(scheduler, batched sampler, detokenizer), prefix cache off. Reports decode tok/s of all
streams together (from the step where the last stream got its first token to the end), the
steps and how many verified drafts, the mean accepted length of the drafts per verify, the
expert weight bytes (counted by the C products) of a step that verified drafts against a step
of the baseline (on a MoE model a verify step reads the union of its tokens' experts), and the
expert bytes per decoded token against the baseline's. num_speculative_tokens is each mode's
default unless given (16 for auto, 4 for ngram and oracle), as the server's is. The greedy
tokens must be the same in every mode (it stops if not). A benchmark, not a test; it prints the
CPU model with the figures.

A model with random weights never repeats its prompt, so on it the edit workload measures only
what failed drafts cost; run the edit workload on a model that copies (`--workloads edit` on the
output of scripts/make_copy_model.py, the benchmark Mixtral rewritten to copy its prompt with the
same bytes per token) and free text on the random one (`--workloads free`). Beside the edit
runs it replays prompt lookup against the edit done exactly (no model run): the tokens a step
that a model making the edit would get from the drafter, to set the copy model's against.
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

RENAMES = [("values", "xs"), ("window", "width"), ("total", "acc"), ("out", "result"),
           ("normalise", "rescale"), ("moving_average", "rolling_mean"), ("lo", "low"),
           ("hi", "high")]
SUBJECTS = ["a hummingbird who wants to see the sea", "a lighthouse keeper's last night",
            "a robot learning to bake bread", "two rivers that meet", "a clock that runs late",
            "a fox in a city library", "the first snow of the year", "a ship in a bottle"]


def workload(name: str, i: int) -> str:
    """Prompt i of a workload (stream i gets variant i)."""
    if name == "edit":
        old, new = RENAMES[i % len(RENAMES)]
        return (f"Here is a Python module:\n\n{CODE}\nRewrite the whole module with `{old}` "
                f"renamed to `{new}`. Reply with the code only.")
    return f"Write a short story about {SUBJECTS[i % len(SUBJECTS)]}."


WORKLOADS = ("edit", "free")
EXPERT_PHASES = ("experts gate+up", "experts down")


def prompt_ids(tok: Any, text: str) -> list[int]:
    """The token ids of a user message: through the chat template where the tokenizer has one."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(text, add_special_tokens=True)


def _expert_bytes(model: Any) -> int:
    st = model.product_stats()["phases"]
    return int(sum(st[p]["weight_bytes"] for p in EXPERT_PHASES if p in st))


class OracleDrafter:
    """Drafts the tokens a baseline run gave after the same prompt (every one is accepted)."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer = prompt_len, answer

    def propose(self, tokens: list[int], k: int) -> list[int]:
        at = len(tokens) - self.prompt_len
        return list(self.answer[at:at + k])


def decode_run(llm: Any, prompts: list[list[int]], n_gen: int,
               answers: list[list[int]] | None = None) -> dict[str, Any]:
    """Greedy requests run together: decode seconds and tokens from the step in which the
    last of them got its first token, steps and expert bytes of those steps. With answers,
    each request drafts from its answer (OracleDrafter)."""
    from colibri.engine import SamplingParams

    core = llm.core
    for i, prompt in enumerate(prompts):
        core.add_request(f"bench{i}", prompt, SamplingParams(max_tokens=n_gen,
                                                             temperature=0.0, ignore_eos=True))
        if answers is not None:
            for req in core.requests[f"bench{i}"]:
                req.drafter = OracleDrafter(len(prompt), answers[i])
    tokens: dict[str, list[int]] = {f"bench{i}": [] for i in range(len(prompts))}
    t0 = 0.0
    steps0 = bytes0 = n0 = 0
    started = False
    # expert bytes of the decode steps that verified drafts and of those that did not
    verify_bytes, plain_bytes = [], []
    while core.has_work():
        b, drafts = _expert_bytes(llm.model), core.spec_stats.n_drafts
        outs = core.step()
        for o in outs:
            if o.error is not None:
                raise o.error
            tokens[o.request_id].append(o.token_id)
        if started:
            (verify_bytes if core.spec_stats.n_drafts > drafts else plain_bytes).append(
                _expert_bytes(llm.model) - b)
        if not started and all(tokens.values()):
            started = True
            t0, steps0, bytes0 = time.perf_counter(), core.stats.n_steps, \
                _expert_bytes(llm.model)
            n0 = sum(len(t) for t in tokens.values())
    steps = core.stats.n_steps - steps0
    n_decoded = sum(len(t) for t in tokens.values()) - n0
    spent = _expert_bytes(llm.model) - bytes0
    return {"s": time.perf_counter() - t0, "tokens": [tokens[k] for k in sorted(tokens)],
            "n_decoded": n_decoded, "steps": steps,
            "expert_bytes_per_step": spent / max(steps, 1),
            "expert_bytes_per_token": spent / max(n_decoded, 1),
            "verify_steps": len(verify_bytes),
            "expert_bytes_per_verify": statistics.fmean(verify_bytes) if verify_bytes else 0.0,
            "expert_bytes_per_plain_step": statistics.fmean(plain_bytes) if plain_bytes
            else 0.0}


def replay_edit(tok: Any, n_streams: int, k: int) -> dict[str, float]:
    """Prompt lookup (k drafts a step) against the edit done exactly (the code renamed as each
    stream's prompt asks), no model run: tokens per step and drafts kept per step, the mean
    over the streams (drafts kept per step: one less). What a model that makes the edit would
    get from the drafter."""
    from colibri.engine.spec.ngram import NgramDrafter

    per_step = []
    for i in range(n_streams):
        old, new = RENAMES[i % len(RENAMES)]
        prompt = prompt_ids(tok, workload("edit", i))
        answer = tok.encode(CODE.replace(old, new), add_special_tokens=False)
        drafter, out, steps = NgramDrafter(), answer[:1], 0
        while len(out) < len(answer):
            drafter.find(prompt, out)
            drafts = drafter.drafts(min(k, len(answer) - len(out) - 1))
            kept = 0
            while kept < len(drafts) and drafts[kept] == answer[len(out) + kept]:
                kept += 1
            out += answer[len(out):len(out) + kept + 1]
            steps += 1
        per_step.append((len(answer) - 1) / steps)
    return {"tokens_per_step": statistics.fmean(per_step), "drafts": k}


def bench(llm: Any, name: str, n_streams: int, modes: list[str], args: Any) -> dict[str, Any]:
    """Alternating runs of every mode on one workload and stream count."""
    from colibri.engine.core.speculative import SpecStats, SpeculativeConfig
    from colibri.engine.spec import default_num_tokens

    prompts = [prompt_ids(llm.tokenizer, workload(name, i)) for i in range(n_streams)]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    stats = {m: SpecStats() for m in modes}
    for _ in range(args.repeat):
        for mode in modes:
            oracle = mode == "oracle"
            k = args.num_speculative_tokens or default_num_tokens(mode)
            llm.core.speculative = SpeculativeConfig("ngram" if oracle else mode, k)
            llm.core.spec_stats = SpecStats()
            answers = runs[modes[0]][-1]["tokens"] if oracle else None
            runs[mode].append(decode_run(llm, prompts, args.gen_tokens, answers))
            if runs[mode][-1]["tokens"] != runs[modes[0]][-1]["tokens"]:
                raise SystemExit(f"speculative decoding ({mode}) changed the greedy tokens")
            for f in ("n_drafts", "n_draft_tokens", "n_accepted"):
                setattr(stats[mode], f, getattr(stats[mode], f)
                        + getattr(llm.core.spec_stats, f))
    w: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts], "streams": n_streams}
    if name == "edit":
        w["exact_edit_replay"] = replay_edit(llm.tokenizer, n_streams,
                                             args.num_speculative_tokens or 4)
    for mode, rs in runs.items():
        st = stats[mode]
        w[mode] = {"decode_tok_s": statistics.median(r["n_decoded"] / r["s"] for r in rs),
                   "decode_tok_s_runs": [r["n_decoded"] / r["s"] for r in rs],
                   "steps": rs[0]["steps"],
                   "expert_bytes_per_step": statistics.median(
                       r["expert_bytes_per_step"] for r in rs),
                   "expert_bytes_per_token": statistics.median(
                       r["expert_bytes_per_token"] for r in rs),
                   "verify_steps": rs[0]["verify_steps"],
                   # over the runs that verified drafts (a run without any has no such step)
                   "expert_bytes_per_verify": statistics.median(
                       [r["expert_bytes_per_verify"] for r in rs if r["verify_steps"]] or [0.0]),
                   "mean_accepted": st.mean_accepted,
                   "drafts_per_verify": st.n_draft_tokens / st.n_drafts if st.n_drafts else 0.0,
                   "acceptance_rate": (st.n_accepted / st.n_draft_tokens
                                       if st.n_draft_tokens else 0.0),
                   "num_speculative_tokens": args.num_speculative_tokens
                   or default_num_tokens(mode)}
    # a step of the baseline (one token per stream) against a step that verified drafts
    one = statistics.median(r["expert_bytes_per_plain_step"] for r in runs[modes[0]])
    per_token = w[modes[0]]["expert_bytes_per_token"]
    for mode in modes:
        w[mode]["speedup"] = w[mode]["decode_tok_s"] / w[modes[0]]["decode_tok_s"]
        w[mode]["verify_expert_bytes_vs_one_step"] = (w[mode]["expert_bytes_per_verify"] / one
                                                      if one else 0.0)
        w[mode]["expert_bytes_per_token_vs_off"] = (w[mode]["expert_bytes_per_token"]
                                                    / per_token if per_token else 0.0)
    return w


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--quant", default="q8")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step at most (default: 16 for auto, 4 for the others)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--streams", default="1,8", help="stream counts, comma-separated")
    p.add_argument("--modes", default="off,ngram,auto",
                   help="modes to alternate, comma-separated (off, ngram, auto, oracle); the "
                   "first is the baseline and must not be oracle")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="workloads to run, comma-separated (edit, free): the edit workload "
                   "belongs on a model that copies (scripts/make_copy_model.py)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON result here (a measurement for "
                   "docs/performance.md goes to results/bench_speculative/DATE-NAME.json)")
    args = p.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    modes = args.modes.split(",")
    workloads = args.workloads.split(",")
    if not workloads or not set(workloads) <= set(WORKLOADS):
        p.error("--workloads: edit or free, comma-separated")
    if modes[0] == "oracle" or not set(modes) <= {"off", "ngram", "auto", "oracle"}:
        p.error("--modes: off, ngram, auto or oracle, comma-separated, oracle not first")

    from colibri.engine import LLM, EngineConfig
    from colibri.engine.tools.bench import measured_on

    # loaded with speculation on, so a model with linear-attention layers keeps the spare
    # state slots drafts need; each run sets its own mode
    llm = LLM(args.model, threads=args.threads, quant=args.quant,
              config=EngineConfig(max_num_seqs=max(streams), prefix_cache=False,
                                  speculative="ngram",
                                  num_speculative_tokens=args.num_speculative_tokens or 16))
    result: dict[str, Any] = {**measured_on(argv), "model": str(llm.path),
                              "threads": llm.model.n_threads, "gen_tokens": args.gen_tokens,
                              "num_speculative_tokens": args.num_speculative_tokens,
                              "repeat": args.repeat, "runs": []}
    decode_run(llm, [prompt_ids(llm.tokenizer, workload("free", 0))], 8)  # warm-up
    for n in streams:
        for name in workloads:
            result["runs"].append({"workload": name, **bench(llm, name, n, modes, args)})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['cpu']}, {result['threads']} threads, {result['model']}, "
          f"{args.gen_tokens} greedy tokens per stream, up to "
          f"{args.num_speculative_tokens or '16 (auto) or 4 (ngram, oracle)'} drafts, "
          f"{args.repeat} runs each way, alternating")
    for w in result["runs"]:
        line = [f"{w['workload']:5} x{w['streams']}:"]
        for mode in modes:
            m = w[mode]
            line.append(f"{mode} {m['decode_tok_s']:.1f} tok/s (x{m['speedup']:.2f}, "
                        f"{m['steps']} steps" + (
                            f", {m['verify_steps']} verifying: accepted "
                            f"{m['mean_accepted']:.2f} of {m['drafts_per_verify']:.2f} drafts, "
                            f"expert bytes x{m['verify_expert_bytes_vs_one_step']:.2f} of a "
                            f"step without; per token x{m['expert_bytes_per_token_vs_off']:.2f}"
                            if mode != modes[0] else "") + ")")
        print(" ".join(line[:1]) + "\n    " + "\n    ".join(line[1:]))
        if "exact_edit_replay" in w:
            r = w["exact_edit_replay"]
            print(f"    prompt lookup on the edit done exactly ({r['drafts']} drafts, no model "
                  f"run): {r['tokens_per_step']:.2f} tokens a step, {r['tokens_per_step'] - 1:.2f} "
                  "drafts kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
