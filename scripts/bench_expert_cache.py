#!/usr/bin/env python3
"""Decode speed of a model larger than its memory: Colibri's expert cache against the OS.

Uses the benchmark Mixtral of scripts/compare_llamacpp.py (built once and cached in
--workdir, with its llama.cpp GGUF). For each oversubscription factor F (default 2 and 4) the
routed experts are F times the budget: a memory cgroup (cgroup v1, /sys/fs/cgroup/memory; run
as root) caps every engine at the same limit, the page cache is dropped before every run, and
each engine runs in a fresh child process placed in the group:

- colibri cache: its defaults under the limit (O_DIRECT into slots on 2 MiB pages, with
                 prefetch 1 or 2 layers ahead as measured, reader threads from the storage
                 probe), and the same budget with one thing changed: no prefetch, prefetch
                 always 1 or always 2 layers ahead, io_uring (uring), 1 reader, 8 readers,
                 pread, mmap + madvise, slots on 4 KiB pages
- colibri mmap:  every expert mapped, the kernel decides what stays ("trust the OS")
- llama.cpp:     mmap, the way llama-cpp-python loads a GGUF
- resident:      Colibri with no limit and a warm page cache (the compute floor)

Each child reports decode tok/s, the bytes its decode read from storage (/proc/self/io
read_bytes; the prefill's apart), the decode's major faults and, for the cache, its counters
over the decode. The physical floor of a run is the resident time per decoded token plus the
bytes its decode read from storage per token divided by the storage's read
bandwidth, measured here: O_DIRECT reads of files not read recently (cold), into 4 KiB pages
and into 2 MiB pages (a virtual disk may move every page as a segment of its own), and
buffered re-reads after dropping the guest page cache (a virtual disk's host may still cache
them); the floor takes the fastest. The guest page cache bandwidth is printed too.

    sudo python scripts/bench_expert_cache.py                   # factors 2 and 4
    python scripts/bench_expert_cache.py --factors 2 --gen-tokens 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
GROUP = "colibri_bench_expert_cache"


# -- machine facts ------------------------------------------------------------------------

from colibri.engine.tools.bench import cpu_model, measured_on  # noqa: E402  (after sys.path)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _buffer(size: int, huge: bool) -> memoryview:
    """A private anonymous buffer of size bytes, on 2 MiB pages when huge (and granted)."""
    import ctypes
    import mmap

    m = mmap.mmap(-1, size + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % (2 << 20)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE, off, (size + (2 << 20) - 1) // (2 << 20) * (2 << 20))
    view = memoryview(m)[off:off + size]
    view[:] = b"\1" * size  # fault it in before the clock starts
    return view


def _read_all(paths: list[Path], direct: bool, huge: bool = False) -> tuple[int, float]:
    """Bytes and seconds to read paths once (O_DIRECT or buffered), 1 MiB at a time, or 6 MiB
    (an expert's span) into 2 MiB pages when huge."""
    buf = _buffer(6 << 20 if huge else 1 << 20, huge)
    n, t0 = 0, time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            while True:
                r = os.readv(fd, [buf])
                n += r
                if r < len(buf):
                    break
        finally:
            os.close(fd)
    return n, time.perf_counter() - t0


def storage_bandwidths(files: list[Path], cold_files: list[Path]) -> dict[str, float]:
    """GB/s: O_DIRECT over files not read recently (into 4 KiB pages, then into 2 MiB pages:
    this virtual disk moves each page as a segment of its own), buffered after a drop, page
    cache, O_DIRECT re-read."""
    out: dict[str, float] = {}
    half = len(cold_files) // 2
    drop_caches()
    n, s = _read_all(cold_files[:half] or cold_files, direct=True)
    out["direct_cold_gb_s"] = n / s / 1e9
    drop_caches()
    n, s = _read_all(cold_files[half:], direct=True, huge=True)
    out["direct_huge_cold_gb_s"] = n / s / 1e9
    drop_caches()
    n, s = _read_all(files, direct=False)
    out["buffered_after_drop_gb_s"] = n / s / 1e9
    n, s = _read_all(files, direct=False)
    out["page_cache_gb_s"] = n / s / 1e9
    n, s = _read_all(files, direct=True)
    out["direct_reread_gb_s"] = n / s / 1e9
    return out


# -- the cgroup ---------------------------------------------------------------------------

def make_group(limit: int) -> Path:
    g = CGROUP_ROOT / GROUP
    g.mkdir(exist_ok=True)
    (g / "memory.limit_in_bytes").write_text(str(limit))
    try:
        (g / "memory.memsw.limit_in_bytes").write_text(str(limit))
    except OSError:
        pass  # no swap accounting: there is no swap here either
    return g


def remove_group() -> None:
    g = CGROUP_ROOT / GROUP
    if g.exists():
        try:
            g.rmdir()
        except OSError:
            pass


# -- one run in a child process ------------------------------------------------------------

def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _majflt() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])


def _minflt() -> int:
    """Minor faults of the whole process (every thread): a read into a slot page that was
    never touched is one (the kernel zeroes and maps the page inside the read)."""
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> int:
    """Load, prefill, decode; one JSON line. Runs inside the cgroup when the parent put it
    there (it writes its own pid into cgroup.procs first)."""
    if args.cgroup:
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    from colibri.engine.tools.bench import bench_prompt

    prompt = bench_prompt(args.vocab, args.prompt_tokens)
    n_ctx = args.prompt_tokens + args.gen_tokens + 8
    t_load = time.perf_counter()
    stats: dict[str, Any] = {}
    plan: dict[str, Any] = {}
    totals: Any = dict  # the cache's counters now (none outside the cache)
    at: dict[str, Any] = {}  # the process's counters at the start of the decode

    def decode_starts() -> None:
        at.update(io=_io_read_bytes(), flt=_majflt(), minflt=_minflt(), cache=totals())

    if args.child == "llama.cpp":
        from compare_llamacpp import llama_greedy_run, llama_load

        lm = llama_load(Path(args.child_model), args.threads, n_ctx)
        load_s = time.perf_counter() - t_load
        io0 = _io_read_bytes()
        pre, dec, toks = llama_greedy_run(lm, prompt, args.gen_tokens, decode_starts)
    else:
        from colibri.engine.core.loader import start_expert_cache
        from colibri.engine.core.options import ExpertCacheConfig
        from colibri.engine.executor.expert_cache import resolve_load
        from colibri.engine.executor.model import Model
        from colibri.engine.tools.bench import timed_greedy_run

        m = Model.load(args.child_model, threads=args.threads, n_ctx=n_ctx)
        xc = ExpertCacheConfig(expert_cache_size=args.size, expert_load=args.load,
                               expert_prefetch=args.prefetch, expert_pin=False,
                               expert_huge_pages=args.huge)
        if args.readers is not None:
            xc.expert_readers = args.readers
        xc.expert_prefetch_depth = args.prefetch_depth
        mon = start_expert_cache(m, Path(args.child_model), xc, 0)
        # the slots' pre-fault runs beside the first steps in a server; here it ends first
        m.core.expert_cache_prefault(wait_s=600.0)
        load_s = time.perf_counter() - t_load
        if args.warm:
            timed_greedy_run(m, prompt, 8)
        totals = mon.totals
        io0 = _io_read_bytes()
        r = timed_greedy_run(m, prompt, args.gen_tokens, decode_starts)
        pre, dec, toks = r.prefill_s, r.decode_s, r.tokens
        before, after = at["cache"], mon.totals()
        plan = {"per_layer": mon.plan.per_layer, "load": xc.expert_load if mon.plan.per_layer
                      is None else resolve_load(xc.expert_load, Path(args.child_model)),
                "readers": mon.plan.readers, "readers_reason": mon.plan.readers_reason,
                "timing": m.core.expert_cache_timing()}
        if after:
            stats = {k: after[k] - before.get(k, 0.0) for k in after
                     if k not in ("hit_rate", "resident_bytes", "budget_bytes")}
            acq = stats["hits"] + stats["misses"]
            stats["hit_rate"] = stats["hits"] / acq if acq else 0.0
    # the storage reads and faults of the decode, and the prefill's reads apart: a prompt's
    # chunk shares its experts among its tokens, the decode's tokens each read their own
    print(json.dumps({"load_s": load_s, "prefill_s": pre, "decode_s": dec, "tokens": toks[:16],
                      "read_bytes": _io_read_bytes() - at["io"],
                      "prefill_read_bytes": at["io"] - io0, "majflt": _majflt() - at["flt"],
                      "minflt": _minflt() - at["minflt"],
                      "rss_anon": _rss_anon(), **plan,
                      "cache": stats}))
    return 0


def spawn(args: argparse.Namespace, engine: str, model: Path, cgroup: Path | None,
          size: int | None = None, load: str = "auto", prefetch: bool = True,
          warm: bool = False, huge: bool = True, repack: bool = True,
          readers: int | None = None, depth: str = "auto") -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine,
           "--child-model", str(model), "--threads", str(args.threads), "--vocab",
           str(args.vocab), "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens",
           str(args.gen_tokens), "--load", load]
    if size is not None:
        cmd += ["--size", str(size)]
    if not prefetch:
        cmd.append("--no-prefetch")
    if warm:
        cmd.append("--warm")
    if not huge:
        cmd.append("--no-huge")
    if readers is not None:
        cmd += ["--readers", str(readers)]
    cmd += ["--prefetch-depth", depth]
    if cgroup is not None:
        cmd += ["--cgroup", str(cgroup)]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", COLIBRI_REPACK="1" if repack else "0")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout)[-1500:]
        return {"error": f"exit {r.returncode} (killed by the memory limit?): {tail}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the benchmark --------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/colibri_compare")
    p.add_argument("--quant", choices=("q8", "q4"), default="q8")
    p.add_argument("--factors", default="2,4", help="experts / budget (default 2,4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per engine and factor, taken in turns: run 1 of every engine, "
                        "then run 2, ... (medians are reported)")
    p.add_argument("--rows", default=None, metavar="WORDS",
                   help="only the runs whose names contain one of these comma-separated words "
                        "(e.g. defaults,huge,OS); default: all")
    p.add_argument("--slack-mb", type=float, default=48.0,
                   help="memory above the measured need of the cache run (default 48)")
    p.add_argument("--json", default=None, metavar="OUT")
    for name in ("vocab", "hidden", "intermediate", "layers", "experts", "top_k"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cgroup", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--load", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-huge", dest="huge", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--readers", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--prefetch-depth", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import compare_llamacpp as cl

    dflt = cl.Dims()
    for name in ("vocab", "hidden", "intermediate", "layers", "experts", "top_k"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(dflt, name))
    if args.child:
        return child(args)
    if os.geteuid() != 0 or not CGROUP_ROOT.is_dir():
        raise SystemExit("needs root and the cgroup v1 memory controller at "
                         f"{CGROUP_ROOT} (to cap memory and drop the page cache)")

    from colibri.engine.format.convert import convert_once

    d = cl.Dims(args.vocab, args.hidden, args.intermediate, args.layers, args.experts,
                args.top_k, dflt.heads, dflt.kv_heads, dflt.seed)
    work = Path(args.workdir)
    base = work / d.tag()
    hf = cl.build_checkpoint(base / "hf", d)
    ggufs = cl.build_gguf(hf, base / "gguf", cl.llama_source(work, None))
    gguf = ggufs["Q8_0" if args.quant == "q8" else "Q4_0"]
    model = convert_once(hf, base / f"colibri-{args.quant}", args.quant)
    expert_files = sorted((model / "experts").glob("*.bin"))
    expert_bytes = sum(f.stat().st_size for f in expert_files)
    other_bytes = sum(f.stat().st_size for f in model.rglob("*.bin")
                      if f.parent.name != "experts")
    other_gguf = base / f"colibri-{'q4' if args.quant == 'q8' else 'q8'}"
    cold = sorted(other_gguf.rglob("*.bin")) if other_gguf.is_dir() else expert_files

    print(f"CPU: {cpu_model()}; {os.cpu_count()} CPUs; model {base.name} at {args.quant}: "
          f"experts {expert_bytes / 1e6:.0f} MB, other weights {other_bytes / 1e6:.0f} MB",
          flush=True)
    bw = storage_bandwidths(expert_files, cold)
    print("storage: O_DIRECT of files this run had not read {direct_cold_gb_s:.2f} GB/s into "
          "4 KiB pages, {direct_huge_cold_gb_s:.2f} GB/s into 2 MiB pages; O_DIRECT re-read "
          "{direct_reread_gb_s:.2f} GB/s; buffered after dropping the page cache "
          "{buffered_after_drop_gb_s:.2f} GB/s; guest page cache {page_cache_gb_s:.2f} "
          "GB/s".format(**bw), flush=True)
    # the floor uses the fastest storage read seen (the host's cache of the virtual disk, or
    # reads into 2 MiB pages)
    storage_best = max(bw["direct_reread_gb_s"], bw["buffered_after_drop_gb_s"],
                       bw["direct_huge_cold_gb_s"])

    # the compute floor: everything resident, warm, no limit
    resident = [spawn(args, "colibri", model, None, warm=True) for _ in range(args.repeat)]
    t_res = statistics.median(r["decode_s"] for r in resident) / args.gen_tokens
    print(f"resident: {1 / t_res:.1f} tok/s", flush=True)
    ref_tokens = resident[0]["tokens"]

    # prefetch on a warm cache (no limit, every expert but one per layer fits): does the
    # prefetch thread cost tokens/s when misses are rare?
    warm_s: dict[str, list[float]] = {"on": [], "off": []}
    warm_loads: dict[str, float] = {}
    for _ in range(args.repeat):  # on and off in turns, so a drift reaches both alike
        for pf in (True, False):
            r = spawn(args, "colibri", model, None, size=args.experts - 1, prefetch=pf,
                      warm=True)
            key = "on" if pf else "off"
            warm_s[key].append(r["decode_s"])
            warm_loads[key] = r["cache"].get("loads", 0.0) / args.gen_tokens
    warm_rows = {k: args.gen_tokens / statistics.median(v) for k, v in warm_s.items()}
    print(f"warm cache ({args.experts - 1} of {args.experts} per layer, no limit): prefetch on "
          f"{warm_rows['on']:.1f} tok/s ({warm_loads['on']:.2f} loads per token), off "
          f"{warm_rows['off']:.1f} tok/s ({warm_loads['off']:.2f})", flush=True)

    rows: list[dict[str, Any]] = []
    remove_group()
    # the process's own anonymous memory (interpreter, scratch, KV) without expert slots, and
    # without the repacked copies of the weights (counted below as the weights they are)
    base_anon = spawn(args, "colibri", model, None, size=args.experts, repack=False)["rss_anon"]
    for factor in [int(x) for x in args.factors.split(",")]:
        # the limit: that memory, the mapped non-expert weights every token reads, 1/F of the
        # experts and a little slack; the same limit for every engine
        limit = int(base_anon + other_bytes + expert_bytes / factor + args.slack_mb * 2**20)
        group = make_group(limit)
        print(f"\nfactor {factor}: memory limit {limit / 1e6:.0f} MB = process "
              f"{base_anon / 1e6:.0f} MB + other weights {other_bytes / 1e6:.0f} MB + experts "
              f"/ {factor} + {args.slack_mb:.0f} MB (model {(expert_bytes + other_bytes) / 1e6:.0f}"
              f" MB)", flush=True)
        drop_caches()
        auto = spawn(args, "colibri", model, group)  # Colibri's defaults under the limit
        per_layer = auto.get("per_layer") or args.top_k
        print(f"  the default budget under this limit: {per_layer} of {args.experts} experts "
              f"per layer, load {auto.get('load')}, {auto.get('readers')} readers "
              f"({auto.get('readers_reason')}); read-ahead {auto.get('timing')}", flush=True)
        runs = {
            "colibri cache (defaults)": dict(engine="colibri", model=model),
            "colibri cache, no prefetch": dict(engine="colibri", model=model, size=per_layer,
                                               prefetch=False),
            "colibri cache, prefetch 1 layer ahead": dict(engine="colibri", model=model,
                                                          size=per_layer, depth="1"),
            "colibri cache, prefetch 2 layers ahead": dict(engine="colibri", model=model,
                                                           size=per_layer, depth="2"),
            "colibri cache, uring": dict(engine="colibri", model=model, size=per_layer,
                                         load="uring"),
            "colibri cache, 1 reader": dict(engine="colibri", model=model, size=per_layer,
                                            readers=1),
            "colibri cache, 8 readers": dict(engine="colibri", model=model, size=per_layer,
                                             readers=8),
            "colibri cache, pread": dict(engine="colibri", model=model, size=per_layer,
                                         load="pread"),
            "colibri cache, mmap+madvise": dict(engine="colibri", model=model,
                                                size=per_layer, load="mmap"),
            "colibri cache, 4 KiB pages": dict(engine="colibri", model=model, size=per_layer,
                                               huge=False),
            "colibri mmap (OS)": dict(engine="colibri", model=model, size=args.experts),
            "llama.cpp mmap": dict(engine="llama.cpp", model=gguf),
        }
        if args.rows:
            words = [w.strip() for w in args.rows.split(",") if w.strip()]
            runs = {n: kw for n, kw in runs.items() if any(w in n for w in words)}
        # in turns, so a drift of the storage (the host's cache of the virtual disk fills and
        # empties) reaches every engine alike
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, kw in runs.items():
                drop_caches()
                opts = {k: v for k, v in kw.items() if k not in ("engine", "model")}
                results[name].append(spawn(args, kw["engine"], kw["model"], group, **opts))
        for name, res in results.items():
            ok = [r for r in res if "error" not in r]
            row: dict[str, Any] = {"factor": factor, "engine": name, "limit_bytes": limit,
                                   "per_layer": ok[0].get("per_layer") if ok else None}
            if not ok:
                row["error"] = res[0]["error"]
                print(f"  {name:40} failed: {row['error'][:300]}", flush=True)
                rows.append(row)
                continue
            dec = statistics.median(r["decode_s"] for r in ok)
            rb = statistics.median(r["read_bytes"] for r in ok)
            per_tok = rb / args.gen_tokens
            cold_best = max(bw["direct_cold_gb_s"], bw["direct_huge_cold_gb_s"])
            floor_cold = t_res + per_tok / (cold_best * 1e9)
            floor_host = t_res + per_tok / (storage_best * 1e9)
            # reads that overlap compute completely: the longer of the two sets the pace
            overlap = max(t_res, per_tok / (storage_best * 1e9))
            row.update(decode_tok_s=args.gen_tokens / dec, read_mb_per_token=per_tok / 1e6,
                       prefill_read_mb=statistics.median(r["prefill_read_bytes"]
                                                         for r in ok) / 1e6,
                       majflt=statistics.median(r["majflt"] for r in ok),
                       minflt=statistics.median(r.get("minflt", 0) for r in ok),
                       floor_cold_tok_s=1 / floor_cold, floor_host_cache_tok_s=1 / floor_host,
                       overlap_bound_tok_s=1 / overlap,
                       s_per_token=dec / args.gen_tokens, cache=ok[0]["cache"],
                       same_tokens=ok[0]["tokens"] == ref_tokens if name.startswith(
                           "colibri") else None)
            rows.append(row)
            c = row["cache"]
            hit = (f", hit rate {c['hit_rate']:.3f}" if c else "")
            if c and c.get("prefetch_issued", 0) + c.get("prefetch_busy", 0) > 0:
                n_tok = args.gen_tokens
                hit += (f"; per token: {c['loads'] / n_tok:.2f} loads, prefetch "
                        f"{c['prefetch_issued'] / n_tok:.2f} issued, "
                        f"{c['prefetch_used'] / n_tok:.2f} used, "
                        f"{c.get('prefetch_busy', 0) / n_tok:.2f} held back by busy storage, "
                        f"{c.get('prefetch_aborted', 0) / n_tok:.2f} stopped part-way, "
                        f"{c.get('prefetch_spared', 0) / n_tok:.2f} spared")
            print(f"  {name:40} {row['decode_tok_s']:8.2f} tok/s, read "
                  f"{row['read_mb_per_token']:6.2f} MB/token from storage, "
                  f"{row['majflt']:.0f} major and {row['minflt']:.0f} minor faults{hit}; floor "
                  f"{row['floor_host_cache_tok_s']:.2f} tok/s (fastest storage read) / "
                  f"{row['floor_cold_tok_s']:.2f} (files not read recently)", flush=True)
        remove_group()
        by = {r["engine"]: r for r in rows if r["factor"] == factor and "decode_tok_s" in r}
        c, o = by.get("colibri cache (defaults)"), by.get("colibri mmap (OS)")
        lc = by.get("llama.cpp mmap")
        if c and o:
            print(f"  cache / OS mmap: x{c['decode_tok_s'] / o['decode_tok_s']:.2f}", end="")
        if c and lc:
            print(f"; cache / llama.cpp: x{c['decode_tok_s'] / lc['decode_tok_s']:.2f}", end="")
        if c:
            print(f"; cache time per token / floor: "
                  f"{c['s_per_token'] * c['floor_host_cache_tok_s']:.2f}x (reading the same "
                  f"bytes beside the compute at the storage's best speed would give "
                  f"{c['overlap_bound_tok_s']:.1f} tok/s", end="")
            if o:
                print(f", x{c['overlap_bound_tok_s'] / o['decode_tok_s']:.2f} OS mmap", end="")
            print(")", end="")
        print(flush=True)
    result = {**measured_on(), "model": base.name, "quant": args.quant,
              "storage": bw, "resident_tok_s": 1 / t_res, "rows": rows,
              "warm_prefetch_tok_s": warm_rows,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
