"""`colibri bench --speculative ngram`: greedy decode through the step engine with and without
speculative decoding, alternating run by run on one loaded model, and the drafts' counters.

The plain decode figures of `colibri bench` come from single-token forward calls; speculation
lives in the step engine (scheduler, sampler, detokenizer), so both sides of this comparison
run there, over the same prompt, with the prefix cache off (every run computes its prompt).
Reports what it measured, never a verdict.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from colibri.engine.core.engine import EngineCore
from colibri.engine.core.scheduler import SchedulerConfig
from colibri.engine.core.speculative import SpecStats, SpeculativeConfig
from colibri.engine.sample.sampler import SamplingParams


def engine_decode(core: EngineCore, prompt: list[int], n_gen: int) -> tuple[float, list[int]]:
    """Seconds from the first sampled token to the last of one greedy request (EOS ignored),
    and its tokens."""
    core.add_request("bench", prompt, SamplingParams(max_tokens=n_gen, temperature=0.0,
                                                     ignore_eos=True))
    tokens: list[int] = []
    t_first = t_end = 0.0
    while core.has_work():
        for o in core.step():
            if o.error is not None:
                raise o.error
            if not tokens:
                t_first = time.perf_counter()
            tokens.append(o.token_id)
        t_end = time.perf_counter()
    return t_end - t_first, tokens


def speculative_report(model: Any, tokenizer: Any, prompt: np.ndarray, n_gen: int,
                       repeat: int, spec: SpeculativeConfig) -> dict[str, Any]:
    """Decode tok/s (median, min, max) of the step engine without and with speculation, each
    run alternating with the other, and the drafted / accepted counters of the speculative
    runs. The tokens must agree; RuntimeError if they do not."""
    core = EngineCore(model, tokenizer, SchedulerConfig(max_num_seqs=1), model.n_kv_blocks,
                      enable_prefix_cache=False)
    off = replace(spec, method="off")
    ids = [int(t) for t in prompt]
    n_after_first = max(n_gen - 1, 1)
    rates: dict[str, list[float]] = {"off": [], spec.method: []}
    stats = SpecStats()
    for _ in range(repeat):
        core.speculative = off
        s_off, want = engine_decode(core, ids, n_gen)
        core.speculative = spec
        core.spec_stats = SpecStats()
        s_on, got = engine_decode(core, ids, n_gen)
        if got != want:
            raise RuntimeError("speculative decoding changed the greedy tokens")
        rates["off"].append(n_after_first / s_off)
        rates[spec.method].append(n_after_first / s_on)
        for f in ("n_drafts", "n_draft_tokens", "n_accepted"):
            setattr(stats, f, getattr(stats, f) + getattr(core.spec_stats, f))
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_tokens,
        "decode_tok_s_off": _summary(rates["off"]),
        "decode_tok_s": _summary(rates[spec.method]),
        "drafts": stats.n_drafts,
        "draft_tokens": stats.n_draft_tokens,
        "accepted_tokens": stats.n_accepted,
        "mean_accepted": stats.mean_accepted,
        "acceptance_rate": (stats.n_accepted / stats.n_draft_tokens
                            if stats.n_draft_tokens else 0.0),
    }


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": float(np.median(values)), "min": min(values), "max": max(values),
            "runs": list(values)}


def render_speculative(r: dict[str, Any]) -> str:
    on, off = r["decode_tok_s"], r["decode_tok_s_off"]
    return (
        f"speculative    {r['method']}, up to {r['num_speculative_tokens']} drafts: step-engine "
        f"decode {on['median']:.1f} tok/s (median; {on['min']:.1f} to {on['max']:.1f}) against "
        f"{off['median']:.1f} without, runs alternating; {r['draft_tokens']} tokens drafted "
        f"in {r['drafts']} steps, {r['accepted_tokens']} accepted (mean accepted length "
        f"{r['mean_accepted']:.2f})")
