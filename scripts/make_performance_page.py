#!/usr/bin/env python3
"""Writes the current results in docs/performance.md from the benchmark results in results/.

Every results/<script>/<YYYY-MM-DD>-<name>.json is one measurement, written by a benchmark
script's --json (scripts/compare_llamacpp.py, scripts/ab_bench.py, scripts/bench_server.py,
scripts/bench_kv_pools.py, scripts/bench_expert_cache.py).
Files of one script whose names differ only in the date are one series; the page shows the
newest file of each series, in one table per CPU, and each row names its command, commit and
date and links its file. Everything between the two markers below is made here; the rest of
the page is prose and is left alone. Refuses a file without a CPU, a command or a date, and a
folder of results it has no table rows for: a measurement is never left out quietly, and no
figure comes from anywhere but the files.

    python scripts/make_performance_page.py          # rewrite the part of the page
    python scripts/make_performance_page.py --check  # exit 1 if the page is not current
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "results"
BEGIN = ("<!-- begin: made by scripts/make_performance_page.py from results/; "
         "edit those files, not this part -->")
END = "<!-- end: made by scripts/make_performance_page.py -->"
DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)$")
COLUMNS = ("benchmark", "model, workload", "Colibri", "prefill / decode tok/s", "beside",
           "its prefill / decode tok/s", "decode ratio (repeat by repeat)", "prefill ratio",
           "% of the read in the same minute, or the serving overhead", "command", "commit",
           "date")


@dataclass(frozen=True)
class Result:
    """One results file: which script wrote it, its series and date, and what it holds."""

    path: Path
    script: str
    series: str
    date: str
    data: dict[str, Any]

    @property
    def cpu(self) -> str:
        # a name written by hand (cpu_model) reads better than the probe's (cpu)
        return str(self.data.get("cpu_model") or self.data["cpu"])


def load_results(results: Path) -> list[Result]:
    """Every results/<script>/*.json, checked for what each table row needs."""
    out = []
    for path in sorted(results.glob("*/*.json")):
        data = json.loads(path.read_text())
        m = DATED.match(path.stem)
        date = data.get("date") or (m.group(1) if m else None)
        where = path.relative_to(results.parent)
        if not date:
            raise ValueError(f"{where}: no date (a 'date' field, or a YYYY-MM-DD- name)")
        for key in ("command", "commit"):
            if key not in data:
                raise ValueError(f"{where}: no '{key}'")
        if not (data.get("cpu_model") or data.get("cpu")):
            raise ValueError(f"{where}: no CPU ('cpu')")
        out.append(Result(path, path.parent.name, m.group(2) if m else path.stem, str(date),
                          data))
    return out


def newest(results: list[Result]) -> list[Result]:
    """The newest file of each series (by date, then name), in script and series order."""
    best: dict[tuple[str, str], Result] = {}
    for r in results:
        key = (r.script, r.series)
        if key not in best or (r.date, r.path.name) > (best[key].date, best[key].path.name):
            best[key] = r
    return [best[k] for k in sorted(best)]


# -- the rows of each script's files ---------------------------------------------------------

def _tok(prefill: float, decode: float) -> str:
    return f"{prefill:.1f} / {decode:.1f}"


def _ratio(x: float, pairs: dict[str, float] | None = None) -> str:
    return f"x{x:.2f}" + (f" (x{pairs['min']:.2f} to x{pairs['max']:.2f})" if pairs else "")


def _commit(c: str | None) -> str:
    """A commit as the page names it: 7 hex digits, or the text written in its place."""
    if not c:
        return "–"
    return c[:7] if re.fullmatch(r"[0-9a-f]{40}", c) else c


def _workload(d: dict[str, Any]) -> str:
    return (f"{d['prompt_tokens']}-token prompt, {d['gen_tokens']} tokens, "
            f"{d['threads']} threads, {d['repeat']} repeats")


def compare_llamacpp_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/compare_llamacpp.py: Colibri beside llama.cpp, one row per pair (q8 and q4; or
    gpt-oss's mxfp4 against MXFP4_MOE), the llama.cpp precision as each ratio records it (files
    from before it did: Q8_0 for q8, Q4_0 for q4)."""
    m = d["model"]
    model = (f"random {m.get('arch', 'mixtral')}: hidden {m['hidden']}, {m['layers']} layers, "
             f"{m['experts']} experts top-{m['top_k']}; {_workload(d)}")
    by = {(r["engine"], r["precision"]): r for r in d["rows"]}
    rows = []
    for q, ratio in d["ratios_colibri_over_llama"].items():
        lq = ratio.get("llama_precision") or {"q8": "Q8_0", "q4": "Q4_0"}[q]
        c, ll = by[("colibri", q)], by[("llama.cpp", lq)]
        same = "–"
        if "percent_of_bound_same_minute" in c:
            same = (f"{c['percent_of_bound_same_minute']['median']:.1f} / "
                    f"{ll['percent_of_bound_same_minute']['median']:.1f}")
        rows.append(["beside llama.cpp", model, q,
                     _tok(c["prefill_tok_s"]["median"], c["decode_tok_s"]["median"]),
                     f"llama.cpp {lq} (llama-cpp-python {d['llama_cpp_python']})",
                     _tok(ll["prefill_tok_s"]["median"], ll["decode_tok_s"]["median"]),
                     _ratio(ratio["decode_tok_s"], ratio.get("decode_pairs")),
                     _ratio(ratio["prefill_tok_s"]), same])
    return rows


def ab_bench_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/ab_bench.py: checkout B against checkout A, one row per model."""
    rows = []
    for path, r in d["models"].items():
        p = Path(path)
        rows.append(["before / after", f"{p.parent.name}/{p.name}; {_workload(d)}",
                     f"B: {_commit(d.get('b_commit') or d['commit'])}",
                     _tok(r["b"]["prefill_tok_s"], r["b"]["decode_tok_s"]),
                     f"A: {_commit(d.get('a_commit'))}",
                     _tok(r["a"]["prefill_tok_s"], r["a"]["decode_tok_s"]),
                     _ratio(r["b_over_a"]["decode"], r["b_over_a"].get("decode_pairs")),
                     _ratio(r["b_over_a"]["prefill"]), "–"])
    return rows


def bench_server_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_server.py: streaming through the server against the engine in-process,
    one row per server (this checkout's, and a baseline checkout's when there was one); the
    CPU figures where the file has them (files from before it measured them: the event loop's
    alone)."""
    direct = d["direct"]["itl_mean_ms"]
    n = d["threads"]
    threads = f"{n} compute thread{'s' if n != 1 else ''}" if n else "default threads"
    client = f", {d['client']} client" if "client" in d else ""
    work = (f"{Path(d['model']).name}; {d['max_tokens']} tokens streamed, logprobs 0, "
            f"{threads}, {d['repeat']} repeats{client}")
    rows = []
    for name, commit in (("http", d["commit"]),
                         ("baseline_http", (d.get("baseline") or {}).get("commit"))):
        if name not in d:
            continue
        r, o = d[name], d[name]["overhead"]
        ci = o.get("itl_mean_ms_ci95")
        more = (f"TTFT {o['ttft_ms']:+.2f} ms, {o['itl_mean_ms']:+.2f} ms a token ("
                + (f"95% CI {ci[0]:+.2f} to {ci[1]:+.2f}; pairs " if ci else "repeats ")
                + f"{o['itl_mean_ms_min']:+.2f} to {o['itl_mean_ms_max']:+.2f})")
        if "cpu_ms_per_token" in o:
            more += f"; CPU {o['cpu_ms_per_token']:+.2f} ms a token over the engine's"
        cpu = r.get("loop_cpu_ms_per_token")
        if cpu is not None:
            more += f"; event loop {cpu:.2f} ms CPU a token"
        if r.get("client_cpu_ms_per_token") is not None:
            more += f"; client {r['client_cpu_ms_per_token']:.3f} ms CPU a token"
        rows.append(["server overhead", work, f"HTTP/SSE at {_commit(commit)}",
                     f"– / {1e3 / r['itl_mean_ms']:.1f}", "the engine in-process",
                     f"– / {1e3 / direct:.1f}", _ratio(direct / r["itl_mean_ms"]), "–", more])
    return rows


def bench_long_context_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_long_context.py: each model at its longest prompt beside itself at the
    shortest (the ratio is how much of its decode speed the long context keeps)."""
    short, long = min(d["prompt_tokens"]), max(d["prompt_tokens"])
    dims = d["dims"]
    rows = []
    for arch, m in d["models"].items():
        n_full = m["layer_types"].count("full_attention")
        lo, hi = m["contexts"][str(short)], m["contexts"][str(long)]
        rows.append([
            "long context",
            f"random {arch}: hidden {dims['hidden']}, {len(m['layer_types'])} layers "
            f"({n_full} full attention), {dims['experts']} experts top-{dims['top_k']}; "
            f"{long}-token prompt, {d['gen_tokens']} tokens, {m['threads']} threads, "
            f"{d['repeat']} repeats",
            f"{d['quant']}, {long}-token context",
            _tok(hi["prefill_tok_s"]["median"], hi["decode_tok_s"]["median"]),
            f"itself at a {short}-token context",
            _tok(lo["prefill_tok_s"]["median"], lo["decode_tok_s"]["median"]),
            _ratio(m["decode_ratio"][f"{long}/{short}"]),
            _ratio(hi["prefill_tok_s"]["median"] / lo["prefill_tok_s"]["median"]), "–"])
    return rows


def bench_speculative_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_speculative.py: each workload, stream count and mode beside the first
    mode (speculation off), decode only."""
    rows = []
    base = d["runs"][0]
    modes = [m for m in base if isinstance(base[m], dict) and "speedup" in base[m]]
    for w in d["runs"]:
        off = w[modes[0]]
        for mode in modes[1:]:
            m = w[mode]
            rows.append([
                "speculative decoding",
                f"{Path(d['model']).parent.name}/{Path(d['model']).name}: {w['workload']}, "
                f"{w['streams']} stream"
                f"{'s' if w['streams'] != 1 else ''}, {d['gen_tokens']} greedy tokens each, "
                f"{d['threads']} threads, {d['repeat']} repeats",
                f"{mode}, up to {m.get('num_speculative_tokens') or d['num_speculative_tokens']}"
                " drafts" + (
                    " that are the tokens it will give (every draft accepted: the ceiling)"
                    if mode == "oracle" else ""),
                f"– / {m['decode_tok_s']:.1f}", f"{modes[0]} (one token a step)",
                f"– / {off['decode_tok_s']:.1f}", _ratio(m["speedup"]), "–",
                f"accepted {m['mean_accepted']:.2f} of {m['drafts_per_verify']:.2f} drafts a "
                f"verify; a verify step reads x{m['verify_expert_bytes_vs_one_step']:.2f} the "
                f"expert bytes of a step without"])
    return rows


def kv_bytes_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_kv_pools.py: the KV bytes a sequence holds per token with the windowed
    layers in a pool of their own, beside one pool for every layer and llama.cpp's figure,
    one row per sequence length."""
    m, ll = d["model"], d["llama_cpp"]
    rows = []
    for r in d["rows"]:
        one, win = r["one_pool"], r["windowed_pool"]
        rows.append([
            "KV bytes per token",
            f"random {m['arch']}, its KV shape: {m['layers']} layers ({m['layer_types']}, "
            f"window {m['sliding_window']}), {m['kv_heads']} KV heads of {m['head_dim']}; "
            f"{d['kv_cache_type']} KV, one sequence at {win['tokens']} tokens",
            "windowed pool", f"{win['bytes_per_token'] / 1000:.2f} kB a token",
            f"one pool for every layer; llama.cpp ({ll['kv_cache_type']}, from its load log "
            f"in {Path(ll['file']).name})",
            f"{one['bytes_per_token'] / 1000:.2f} kB a token; llama.cpp "
            f"{ll['kv_bytes_per_token'] / 1000:.2f} kB a token",
            f"x{one['bytes'] / win['bytes']:.2f} fewer bytes than one pool", "–",
            f"{win['full_blocks']} full + {win['win_blocks']} windowed blocks held"])
    return rows


def bench_replicas_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_replicas.py: prefix-aware routing beside round-robin over 2 replicas
    (hit rate and TTFT), then 2 replicas of 1 thread beside 1 replica of 2 threads."""
    p, rr = d["routing"]["prefix"], d["routing"]["round_robin"]
    chat = (f"{Path(d['model']).name}; {d['conversations']} conversations of {d['turns']} "
            f"turns over 2 shared system prompts, {d['max_tokens']} tokens a reply, 2 "
            f"replicas of 1 thread")

    def routing(r: dict[str, Any]) -> str:
        return (f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.1%}, TTFT p50 "
                f"{r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms")

    sc, two, one = d["scale"], d["two_replicas_one_thread"], d["one_replica_two_threads"]
    scale = (f"{Path(d['model']).name}; {sc['requests']} greedy requests of {sc['tokens']} "
             f"tokens, {sc['concurrency']} at a time")
    return [
        ["replica routing", chat, "prefix-aware routing", "–", "round-robin", "–",
         f"TTFT p50 x{rr['ttft_p50_ms'] / p['ttft_p50_ms']:.2f}", "–",
         f"prefix-aware: {routing(p)}; round-robin: {routing(rr)}"],
        ["replicas", scale, "2 replicas x 1 thread", f"– / {two['tok_s']:.1f}",
         "1 replica x 2 threads", f"– / {one['tok_s']:.1f}", _ratio(sc["ratio"]), "–", "–"],
    ]


def bench_expert_cache_rows(d: dict[str, Any]) -> list[list[str]]:
    """scripts/bench_expert_cache.py: the expert cache's defaults under a memory limit beside the
    OS's mmap and llama.cpp's, one row each per oversubscription factor, with the run's time per
    token against its physical floor (resident compute plus its storage reads at the storage's
    measured speed)."""
    st = d["storage"]
    disk = max(st["direct_cold_gb_s"], st["direct_huge_cold_gb_s"])
    rows = []
    for factor in sorted({r["factor"] for r in d["rows"]}):
        by = {r["engine"]: r for r in d["rows"] if r["factor"] == factor and "decode_tok_s" in r}
        c = by.get("colibri cache (defaults)")
        if c is None:
            continue
        model = (f"{d['model']} ({d['quant']}); experts x{factor} the memory limit, "
                 f"{d['prompt_tokens']}-token prompt, {d['gen_tokens']} tokens; storage "
                 f"{disk:.2f} GB/s")
        note = (f"x{c['s_per_token'] * c['floor_host_cache_tok_s']:.2f} the floor's time a "
                f"token; hit rate {c['cache']['hit_rate']:.2f}; {c['read_mb_per_token']:.1f} "
                f"MB/token read")
        for other in ("colibri mmap (OS)", "llama.cpp mmap"):
            o = by.get(other)
            if o is None:
                continue
            rows.append(["larger than memory", model, "expert cache (defaults)",
                         f"– / {c['decode_tok_s']:.1f}", other.replace("colibri ", ""),
                         f"– / {o['decode_tok_s']:.1f}",
                         _ratio(c["decode_tok_s"] / o["decode_tok_s"]), "–", note])
    return rows


ROWS: dict[str, Callable[[dict[str, Any]], list[list[str]]]] = {
    "bench_speculative": bench_speculative_rows,
    "kv_bytes": kv_bytes_rows,
    "bench_replicas": bench_replicas_rows,
    "bench_long_context": bench_long_context_rows,
    "bench_server": bench_server_rows,
    "compare_llamacpp": compare_llamacpp_rows,
    "ab_bench": ab_bench_rows,
    "bench_expert_cache": bench_expert_cache_rows,
}


# -- the page ------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_results(results: Path, page_dir: Path) -> str:
    """The generated part: one table per CPU over the newest file of each series."""
    chosen = newest(load_results(results))
    unknown = sorted({r.script for r in chosen} - set(ROWS))
    if unknown:
        raise ValueError(f"no table rows for results/{unknown[0]}/: teach "
                         "scripts/make_performance_page.py to read its files")
    by_cpu: dict[str, list[Result]] = {}
    for r in chosen:
        by_cpu.setdefault(r.cpu, []).append(r)
    lines = ["Colibri's current figures by CPU: the newest measurement of each benchmark, "
             "from results/. Ratios are Colibri over what it ran beside; % of the read is "
             "Colibri's decode, then the other engine's, against the memory read measured "
             "just before and after each run."]
    for cpu in sorted(by_cpu):
        lines += ["", f"### {cpu}", "", "| " + " | ".join(COLUMNS) + " |",
                  "|" + " --- |" * len(COLUMNS)]
        for r in by_cpu[cpu]:
            link = Path("..") / r.path.relative_to(page_dir.parent)
            tail = [f"`{r.data['command']}`", _commit(r.data["commit"]), f"[{r.date}]({link})"]
            for row in ROWS[r.script](r.data):
                lines.append("| " + " | ".join(_cell(c) for c in [*row, *tail]) + " |")
    return "\n".join(lines)


def render_page(text: str, results: Path = RESULTS, page_dir: Path = PAGE.parent) -> str:
    """text with the part between the markers made again from results."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{PAGE.name} needs one {BEGIN!r} line and one {END!r} line after it")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{render_results(results, page_dir)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 and show the difference if the page is stale")
    args = p.parse_args(argv)
    text = PAGE.read_text()
    new = render_page(text)
    if args.check:
        if new == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(
            text.splitlines(keepends=True), new.splitlines(keepends=True),
            str(PAGE.relative_to(ROOT)), "made from results/"))
        return 1
    if new != text:
        PAGE.write_text(new)
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
