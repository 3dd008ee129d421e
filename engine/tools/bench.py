"""`colibri bench`: prefill and decode speed of one model, against the machine's memory bound.

Decode reads every active weight once per token, so tokens/s can never pass
bandwidth / bytes-per-token. This module measures both sides of that inequality: the speed
(one forward call over a deterministic prompt, then greedy single-token calls, a fresh
sequence per repeat) and the bound (weight bytes per decoded token, counted exactly from the
tensor tables, and read bandwidth from the C probe). It makes no claim about speed itself.
With --device and --gpu-memory-mb it loads the model where `serve` would place it and reports
the GPU tier's counters beside the expert cache's (bench_device.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from colibri.engine.core.kv_types import resolve_kv_type
from colibri.engine.core.loader import EngineConfig, available_memory_bytes
from colibri.engine.core.options import (
    OPTION,
    ExpertCacheConfig,
    add_option_args,
    check_flag,
    default,
)
from colibri.engine.core.speculative import SpeculativeConfig
from colibri.engine.executor.backend import resolve_device
from colibri.engine.executor.expert_cache import ExpertCacheMonitor
from colibri.engine.format.convert import DEFAULT_QUANT
from colibri.engine.format.modelcheck import check_model
from colibri.engine.models.config import ModelConfig
from colibri.engine.tools.bench_device import (
    device_experts,
    gpu_tier_report,
    load_bench_model,
    placement_text,
    render_gpu_tier,
)
from colibri.engine.tools.bench_profile import decode_profile, render_profile
from colibri.engine.tools.bench_spec import render_speculative, speculative_report
from colibri.engine.tools.cache_args import (
    DEFAULT_KV_CACHE_TYPE,
    add_device_args,
    add_expert_cache_args,
    add_kv_cache_type_arg,
    device_from_args,
    expert_cache_from_args,
    threads_from_args,
)
from colibri.engine.tools.routing_trace import add_trace_args, check_trace_args, record_bench_trace

PROMPT_SEED = 20240601
DEFAULT_PROBE_MIB = 1024  # several times any last-level cache this runs on (300 MiB seen)


# -- bytes of weights per decoded token ---------------------------------------------------

def _file_bytes(model_dir: Path, rel: str) -> dict[str, int]:
    """nbytes of each tensor of one weight file, from its validated table."""
    from colibri.engine.format.wfile import read_wfile

    return {name: t.nbytes for name, t in read_wfile(model_dir / rel).tensors.items()}


def weight_bytes_per_token(model_dir: str | Path) -> dict[str, int]:
    """Bytes of weights one decoded token reads, by part, and their "total".

    Per layer: every attention tensor; in a dense layer its FFN; in an MoE layer the router
    file (ffn norm, gate, shared gate), the shared expert, and n_expert_used experts (the mean
    expert size of the layer; all experts of a layer have one size). Once per token: one
    embedding row, the final norm and the lm_head (the whole embedding matrix when tied).
    Counts tensor data, not file headers.
    """
    from colibri.engine.models.config import ModelConfig

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    emb = _file_bytes(model_dir, "embeddings.bin")
    parts = {
        "embedding_row": emb["tok_embd"] // cfg.n_vocab,
        "output_norm": emb["output_norm"],
        "lm_head": emb["output"] if "output" in emb else emb["tok_embd"],
        "attention": 0,
        "router": 0,
        "shared": 0,
        "experts": 0,
        "dense": 0,
    }
    files = set(cfg.files)
    for i in range(cfg.n_layer):
        parts["attention"] += sum(_file_bytes(model_dir, f"attention/layer_{i}.bin").values())
        if i not in cfg.moe_layers:
            parts["dense"] += sum(_file_bytes(model_dir, f"dense/layer_{i}.bin").values())
            continue
        parts["router"] += sum(_file_bytes(model_dir, f"router/layer_{i}.bin").values())
        if f"shared/layer_{i}.bin" in files:
            parts["shared"] += sum(_file_bytes(model_dir, f"shared/layer_{i}.bin").values())
        sizes = [sum(_file_bytes(model_dir, f"experts/layer_{i}_expert_{j}.bin").values())
                 for j in range(cfg.n_expert)]
        parts["experts"] += sum(sizes) * cfg.n_expert_used // len(sizes)
    parts["total"] = sum(parts.values())
    return parts


# -- measurement ---------------------------------------------------------------------------

SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_int8")


def cpu_model() -> str:
    """This machine's CPU model name and the SIMD flags the kernels care about (Linux)."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name == "unknown CPU":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in SIMD_FLAGS if f in flags)}]"


# where conversions are kept: it changes nothing that is measured
_NOT_MEASURED = frozenset({"COLIBRI_CACHE_DIR"})


def measured_on(argv: list[str] | None = None) -> dict[str, str | None]:
    """Where and when a measurement runs, as each results/ JSON file records it: "cpu" (this
    machine's cpu_model()), "commit" (of the checkout this code runs from; None outside a
    git checkout), "command" (the command line, sys.argv by default, after the COLIBRI_*
    variables set in the environment that change what runs) and "date" (UTC, YYYY-MM-DD).
    docs/performance.md names all four beside every figure."""
    try:
        r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse",
                            "HEAD"], capture_output=True, text=True)
        commit = r.stdout.strip() if r.returncode == 0 else None
    except OSError:  # no git on this machine
        commit = None
    return {"cpu": cpu_model(), "commit": commit,
            "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                                   if k.startswith("COLIBRI_") and k not in _NOT_MEASURED),
                                 "python " + shlex.join(sys.argv if argv is None else argv)]),
            "date": datetime.datetime.now(datetime.UTC).date().isoformat()}


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib) * (1 if sys.platform == "darwin" else 1024)


def bench_prompt(n_vocab: int, n_tokens: int, seed: int = PROMPT_SEED) -> np.ndarray:
    """A deterministic prompt of n_tokens valid ids (int32), the same for every engine."""
    if n_tokens <= 0:
        raise ValueError(f"prompt tokens must be positive, got {n_tokens}")
    return np.random.default_rng(seed).integers(0, n_vocab, n_tokens).astype(np.int32)


@dataclass(frozen=True)
class RunTiming:
    """One prefill + greedy decode of a fresh sequence."""

    prefill_s: float
    decode_s: float
    tokens: list[int]  # greedy continuation: 1 from the prefill + one per decode call
    # of decode_s, timed in C: the products per phase (calls, s, weight_bytes), attention over
    # the KV cache, and the forward calls whole
    decode_phases: dict[str, dict[str, float]]
    decode_attention_s: float
    decode_forward_s: float

    @property
    def decode_products_s(self) -> float:
        """Of decode_s, in the weight products (all phases)."""
        return sum(ph["s"] for ph in self.decode_phases.values())

    @property
    def decode_product_bytes(self) -> int:
        """Weight bytes those products read."""
        return int(sum(ph["weight_bytes"] for ph in self.decode_phases.values()))


def timed_greedy_run(model: Any, prompt: np.ndarray, n_gen: int,
                     after_prefill: Callable[[], None] | None = None) -> RunTiming:
    """Prefill prompt in one forward call, then n_gen greedy single-token calls (EOS ignored).

    model is an engine.executor.model.Model; sequence 0 is cleared before and after. On a
    torch device the C core times only the products it runs (none with every layer on the
    device): decode_phases then holds those, and may be empty. after_prefill, if given, runs
    between the two, outside both timings (a caller's counters split at the phase boundary).
    """
    n = int(prompt.size)
    seq0 = np.zeros(1, dtype=np.int32)
    want = np.zeros(n, dtype=np.uint8)
    want[-1] = 1
    model.reset(0)
    try:
        t0 = time.perf_counter()
        logits = model.forward(prompt, np.zeros(n, np.int32), np.arange(n, dtype=np.int32), want)
        tok = int(np.argmax(logits[-1]))
        t_pre = time.perf_counter() - t0
        if after_prefill is not None:
            after_prefill()
        t1 = time.perf_counter()
        p1 = model.product_stats()
        tokens = [tok]
        for step in range(n_gen):
            logits = model.forward(np.asarray([tok], np.int32), seq0,
                                   np.asarray([n + step], np.int32))
            tok = int(np.argmax(logits[0]))
            tokens.append(tok)
        p2 = model.product_stats()
        t2 = time.perf_counter()
    finally:
        model.reset(0)
    phases = {name: {k: v - p1["phases"][name][k] for k, v in ph.items()}
              for name, ph in p2.get("phases", {}).items()}
    return RunTiming(t_pre, t2 - t1, tokens, phases,
                     p2.get("attention_s", 0.0) - p1.get("attention_s", 0.0),
                     p2["forward_s"] - p1["forward_s"])


def summarize(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the runs themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": list(values)}


@dataclass(frozen=True)
class BenchSettings:
    """What `colibri bench` measures and how."""

    model: str | None  # None: the bundled demo model
    prompt_tokens: int = 128
    gen_tokens: int = 128
    threads: int | None = None
    repeat: int = 3
    quant: str = DEFAULT_QUANT
    probe_mib: int = DEFAULT_PROBE_MIB
    probe_passes: int = 3
    profile: bool = False
    expert_cache: ExpertCacheConfig | None = None  # None: from the environment
    kv_cache_type: str = DEFAULT_KV_CACHE_TYPE
    progress: bool = False  # a bar on stderr over the phases and runs
    # off: no step-engine runs; else greedy decode through the step engine with and without
    # this method (engine.tools.bench_spec)
    speculative: str = default("speculative")
    num_speculative_tokens: int | None = default("num_speculative_tokens")
    # where the step runs, as `serve` places it (engine.core.loader.choose_placement)
    device: str = default("device")
    gpu_memory_mb: float | None = None
    device_profile: str | None = None

    def check(self) -> None:
        """Refuse counts below 1, named by their `colibri bench` option, and --profile on a
        torch device (its products are timed in the C core)."""
        for name in ("prompt_tokens", "gen_tokens", "repeat", "probe_mib", "probe_passes",
                     "threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        check_flag(OPTION["num_speculative_tokens"], self.num_speculative_tokens)
        # an unknown device, or a CUDA device this machine lacks, before anything is read
        if resolve_device(self.device) != "cpu" and self.profile:
            raise ValueError(f"--profile times the C core's products in place: the torch "
                             f"device of --device {self.device} runs them untimed; profile "
                             "with --device cpu")


def expert_cache_report(monitor: ExpertCacheMonitor, before: dict[str, Any] | None,
                        n_tokens: int) -> dict[str, Any]:
    """The cache's plan and what it did during the timed runs: the counters now minus the
    snapshot `before` (monitor.stats() taken before them), summed and per layer."""
    plan = monitor.plan
    out: dict[str, Any] = {"enabled": plan.per_layer is not None,
                           "slots_per_layer": plan.per_layer or plan.n_expert,
                           "n_expert": plan.n_expert, "expert_bytes": plan.expert_bytes,
                           "budget_bytes": plan.budget_bytes, "reason": plan.reason}
    after = monitor.stats()
    if after is None or before is None:
        return out
    now, prev = monitor.totals(after), monitor.totals(before)
    delta = {k: now[k] - prev[k] for k in now
             if k not in ("hit_rate", "resident_bytes", "budget_bytes")}
    acq = delta["hits"] + delta["misses"]
    out.update(delta)
    out["hit_rate"] = delta["hits"] / acq if acq else 0.0
    out["resident_bytes"] = now["resident_bytes"]
    out["bytes_read_per_token"] = delta["bytes_read"] / n_tokens if n_tokens else 0.0
    hits = (after["hits"] - before["hits"]).astype(float)
    misses = (after["misses"] - before["misses"]).astype(float)
    out["hit_rate_per_layer"] = [h / (h + m) if h + m else 0.0
                                 for h, m in zip(hits, misses, strict=True)]
    return out


def median_run(runs: list[RunTiming]) -> int:
    """The index of the run with the median decode time."""
    return sorted(range(len(runs)), key=lambda i: runs[i].decode_s)[len(runs) // 2]


def decode_products(runs: list[RunTiming], n_gen: int) -> dict[str, float]:
    """The weight products' part of a decoded token, from the run with the median decode:
    seconds and bytes per token, their rate, and seconds per token outside them."""
    r = runs[median_run(runs)]
    s, step = r.decode_products_s / n_gen, r.decode_s / n_gen
    nbytes = r.decode_product_bytes / n_gen
    return {"s_per_token": s, "bytes_per_token": nbytes,
            "gb_s": nbytes / s / 1e9 if s > 0 else 0.0, "step_s": step,
            "other_s_per_token": step - s}


def percent_of_read(n_gen: int, decode_s: float, bytes_per_token: float,
                    read_gb_s: float) -> float:
    """A decode of n_gen tokens in decode_s seconds as a % of the tokens/s that a read rate of
    read_gb_s allows at bytes_per_token."""
    return 100.0 * n_gen / decode_s * bytes_per_token / (read_gb_s * 1e9)


def same_minute(runs: list[RunTiming], reads: list[float], n_gen: int,
                bytes_per_token: float) -> dict[str, Any]:
    """Each run's decode as a % of the higher of the reads taken just before and just after
    it (reads[i] and reads[i + 1], GB/s): on a machine whose read rate drifts from minute to
    minute, what the decode made of the bandwidth it had."""
    return summarize([percent_of_read(n_gen, r.decode_s, bytes_per_token, max(a, b))
                      for r, a, b in zip(runs, reads, reads[1:], strict=False)])


def run_bench(s: BenchSettings) -> dict[str, Any]:
    """Measure a model; returns the result object `--json` prints."""
    from colibri.engine.format.convert import ensure_converted

    s.check()
    path = ensure_converted(check_model(s.model), s.quant, progress=s.progress)
    # one step per phase: the first read, loading, the warm-up, each timed run, the last read
    bar = tqdm(total=s.repeat + 4, desc="bench", file=sys.stderr, disable=not s.progress,
               bar_format="{desc} {n_fmt}/{total_fmt} |{bar:20}| {elapsed}{postfix}")
    try:
        return _measure(s, path, bar)
    finally:
        bar.close()


def _measure(s: BenchSettings, path: Path, bar: tqdm) -> dict[str, Any]:
    """run_bench's measurements; bar names each phase as it starts and counts it when done."""
    from colibri.engine import _core

    # the memory's read rate drifts on shared machines: probe before loading and again after
    # the runs (with the model freed, so the buffer never competes with it) and take the
    # higher, which bounds the decode in between from above
    n_threads = s.threads or _core.physical_cores()
    bar.set_postfix_str("reading memory")
    probes = [_core.bandwidth_probe(s.probe_mib << 20, n_threads, s.probe_passes)]
    bar.update()
    bar.set_postfix_str("loading the model")
    t0 = time.perf_counter()
    model, monitor = load_bench_model(
        path, EngineConfig(threads=n_threads, device=s.device, gpu_memory_mb=s.gpu_memory_mb,
                           device_profile=s.device_profile),
        s.prompt_tokens + s.gen_tokens,
        resolve_kv_type(s.kv_cache_type, ModelConfig.from_dir(path).quant),
        s.expert_cache or ExpertCacheConfig.from_env())
    load_s = time.perf_counter() - t0
    placed = device_experts(monitor)  # before the tier moves any
    bar.update()
    cfg = model.config
    prompt = bench_prompt(cfg.n_vocab, s.prompt_tokens)

    bar.set_postfix_str("warm-up")
    timed_greedy_run(model, prompt, min(s.gen_tokens, 8))  # warm-up: page in, spin up
    bar.update()
    before = monitor.stats() if monitor is not None else None
    tier_before = monitor.tier_stats() if monitor is not None else None
    # a read just before every run and after the last, where the probe's buffer fits beside
    # the model with room to spare (a model that fills the memory is never pushed out)
    free = available_memory_bytes()
    between = free is not None and free > 2 * (s.probe_mib << 20)
    reads: list[float] = []
    runs = []
    for i in range(s.repeat):
        bar.set_postfix_str(f"timed run {i + 1} of {s.repeat}" + (
            f" (the last decoded {s.gen_tokens / runs[-1].decode_s:.1f} tok/s)" if runs else ""))
        if between:
            reads.append(_core.bandwidth_probe(s.probe_mib << 20, n_threads, s.probe_passes))
        runs.append(timed_greedy_run(model, prompt, s.gen_tokens))
        bar.update()
    bar.set_postfix_str("reading memory")
    if between:
        reads.append(_core.bandwidth_probe(s.probe_mib << 20, n_threads, s.probe_passes))
    n_tokens = s.repeat * (s.prompt_tokens + s.gen_tokens)
    cache = (expert_cache_report(monitor, before, n_tokens) if monitor is not None else
             {"enabled": False, "reason": f"every routed expert on the device, {model.device}"})
    tier = gpu_tier_report(monitor, tier_before, placed)
    prefill = summarize([s.prompt_tokens / r.prefill_s for r in runs])
    decode = summarize([s.gen_tokens / r.decode_s for r in runs])
    # the C core times the products it runs; a torch device runs some or all of them untimed
    products = decode_products(runs, s.gen_tokens) if model.device == "cpu" else None
    spec = None
    if s.speculative != "off":
        from colibri.engine.text.tokenizer import Tokenizer

        bar.set_postfix_str("step engine with and without speculation")
        spec = speculative_report(model, Tokenizer.from_dir(path), prompt, s.gen_tokens,
                                  s.repeat, SpeculativeConfig(s.speculative,
                                                              s.num_speculative_tokens))
    rss = peak_rss_bytes()  # before the probe, whose buffer is not the model's memory
    n_threads = model.n_threads  # what the model runs on (the core caps very large counts)
    n_repacked = getattr(model.core, "n_repacked", 0)  # only the C core repacks
    kv_type = model.kv_type
    device, placement = model.device, placement_text(model)
    del model

    per_token = weight_bytes_per_token(path)
    probes.append(_core.bandwidth_probe(s.probe_mib << 20, n_threads, s.probe_passes))
    bar.set_postfix_str("done", refresh=False)
    bar.update()
    gbps = max(probes)
    bound = gbps * 1e9 / per_token["total"]
    result = {
        "model": str(path),
        "cpu": cpu_model(),
        "architecture": cfg.architecture,
        "quant": cfg.quant,
        "tensor_types": dict(cfg.tensor_types),
        "isa": _core.isa_active(),
        "prefetch": _core.stream_hint_active(),
        "repacked_matrices": n_repacked,
        "threads": n_threads,
        "device": device,
        "placement": placement,
        "kv_cache_type": kv_type,
        "prompt_tokens": s.prompt_tokens,
        "gen_tokens": s.gen_tokens,
        "repeat": s.repeat,
        "load_s": load_s,
        "prefill_tok_s": prefill,
        "decode_tok_s": decode,
        "peak_rss_bytes": rss,
        "bytes_per_token": per_token["total"],
        "bytes_per_token_parts": {k: v for k, v in per_token.items() if k != "total"},
        "bandwidth_gb_s": gbps,
        "bandwidth_probes_gb_s": probes,
        "probe_bytes": s.probe_mib << 20,
        "bound_tok_s": bound,
        "percent_of_bound": 100.0 * decode["median"] / bound if bound > 0 else math.nan,
        "bandwidth_between_runs_gb_s": reads,
        "percent_of_read_same_minute": (same_minute(runs, reads, s.gen_tokens,
                                                    per_token["total"]) if reads else None),
        "decode_products": products,
        "greedy_tokens": runs[0].tokens[:16],
        "expert_cache": cache,
        "gpu_tier": tier,
    }
    if spec is not None:
        result["speculative"] = spec
    if s.profile:
        i = median_run(runs)
        read = max(reads[i], reads[i + 1]) if reads else gbps
        result["profile"] = decode_profile(runs[i], s.gen_tokens, read, n_threads)
    return result


# -- output ---------------------------------------------------------------------------------

def _mb(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def render(r: dict[str, Any]) -> str:
    """A run_bench result as a readable table."""
    p, d = r["prefill_tok_s"], r["decode_tok_s"]
    parts = ", ".join(f"{k} {_mb(v)}" for k, v in r["bytes_per_token_parts"].items() if v)
    lines = [
        f"model          {r['model']}",
        f"               {r['architecture']}, {r['quant']}, {_threads(r['threads'])}, "
        f"kernels {r['isa']}"
        + (f", prefetch {r['prefetch']}" if r["isa"] == "avx512" else "")
        + (f" ({r['repacked_matrices']} matrices repacked)" if r["repacked_matrices"] else "")
        + f", loaded in {r['load_s']:.2f} s",
        f"device         {r.get('device', 'cpu')}: {r.get('placement', '')}",
        f"workload       {r['prompt_tokens']}-token prompt, {r['gen_tokens']} greedy tokens, "
        f"{r['repeat']} repeats, {r['kv_cache_type']} KV cache",
        f"{'':15}{'median':>10}{'min':>10}{'max':>10}",
        f"{'prefill tok/s':15}{p['median']:>10.1f}{p['min']:>10.1f}{p['max']:>10.1f}",
        f"{'decode tok/s':15}{d['median']:>10.1f}{d['min']:>10.1f}{d['max']:>10.1f}",
        f"peak RSS       {r['peak_rss_bytes'] / 2**20:.1f} MiB",
        f"weights/token  {_mb(r['bytes_per_token'])} ({parts})",
        f"bandwidth      {r['bandwidth_gb_s']:.1f} GB/s read, the higher of the probes before "
        f"and after the runs ({', '.join(f'{g:.1f}' for g in r['bandwidth_probes_gb_s'])}; "
        f"{_threads(r['threads'])}, {r['probe_bytes'] >> 20} MiB)",
        f"decode bound   {r['bound_tok_s']:.1f} tok/s; median decode is "
        f"{r['percent_of_bound']:.1f}% of it"
        + ("" if r.get("device", "cpu") == "cpu" else " (the bound of the CPU's memory)"),
    ]
    sm = r["percent_of_read_same_minute"]
    if sm is None:
        lines.append("same minute    not measured: too little free memory for the probe beside "
                     "the model")
    else:
        lines.append(
            f"same minute    each run's decode is {sm['median']:.1f}% (median; "
            f"{sm['min']:.1f} to {sm['max']:.1f}) of the higher of the reads just before and "
            f"after it ({', '.join(f'{g:.1f}' for g in r['bandwidth_between_runs_gb_s'])} "
            "GB/s)")
    pr = r["decode_products"]
    if pr is None:
        lines.append(f"products       not timed: {r['device']} runs them on the torch device")
    else:
        lines.append(
            f"products       {pr['s_per_token'] * 1e3:.3f} of {pr['step_s'] * 1e3:.3f} ms per "
            f"decoded token, {_mb(pr['bytes_per_token'])} at {pr['gb_s']:.1f} GB/s; the other "
            f"{pr['other_s_per_token'] * 1e3:.3f} ms: attention over the cache, norms, "
            "routing, Python (timed in place, median run)")
    xc = r.get("expert_cache") or {}
    if xc.get("enabled"):
        lines.append(
            f"expert cache   {xc['slots_per_layer']} of {xc['n_expert']} experts per layer "
            f"({_mb(xc['budget_bytes'])}); hit rate {xc['hit_rate']:.3f}, "
            f"{_mb(xc['bytes_read_per_token'])} read per token, stalled "
            f"{xc['stall_ns'] / 1e9:.2f} s, prefetch used {xc['prefetch_used']:.0f} of "
            f"{xc['prefetch_issued']:.0f} ({xc['prefetch_wasted']:.0f} wasted, "
            f"{xc['prefetch_cancelled']:.0f} cancelled before their read; "
            f"{xc.get('prefetch_busy', 0):.0f} held back by busy storage, "
            f"{xc.get('prefetch_aborted', 0):.0f} stopped part-way, "
            f"{xc.get('prefetch_spared', 0):.0f} spared a likelier expert), "
            f"{xc['overlapped']:.0f} experts run while others of their wave loaded")
    elif xc:
        lines.append(f"expert cache   off: every expert resident ({xc['reason']})")
    if r.get("gpu_tier"):
        lines.append(render_gpu_tier(r["gpu_tier"]))
    if "speculative" in r:
        lines.append(render_speculative(r["speculative"]))
    if "profile" in r:
        lines.append(render_profile(r["profile"]))
    return "\n".join(lines)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The options of `colibri bench`."""
    add_option_args(p, ("model",))
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("--gen-tokens", type=int, default=128,
                   help="greedy tokens decoded per repeat (default 128)")
    add_option_args(p, ("threads",))
    add_device_args(p)
    p.add_argument("--repeat", type=int, default=3, help="timed repeats (default 3)")
    add_option_args(p, ("quant",))
    p.add_argument("--probe-mib", type=int, default=DEFAULT_PROBE_MIB,
                   help=f"bandwidth probe buffer in MiB (default {DEFAULT_PROBE_MIB})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", action="store_true",
                   help="also print where a decoded token's time goes, timed in place: the "
                        "weight products of each phase (attention projections, router, "
                        "experts, lm_head), attention over the cache, the rest")
    add_kv_cache_type_arg(p)
    add_expert_cache_args(p)
    add_option_args(p, ("speculative", "num_speculative_tokens"))
    add_trace_args(p)


def bench_main(args: argparse.Namespace) -> int:
    """Run `colibri bench` with parsed arguments; prints the table or JSON."""
    settings = BenchSettings(
        model=args.model, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
        threads=threads_from_args(args), repeat=args.repeat, quant=args.quant,
        probe_mib=args.probe_mib,
        profile=args.profile, expert_cache=expert_cache_from_args(args),
        kv_cache_type=args.kv_cache_type, progress=not args.no_progress,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        **device_from_args(args))  # type: ignore[arg-type]
    settings.check()  # before anything is read, timed or converted
    check_model(args.model)
    check_trace_args(args)
    result = run_bench(settings)
    print(json.dumps(result, indent=2) if args.json else render(result))
    if args.routing_trace is not None:
        tr = record_bench_trace(args, result["model"],
                                lambda n_vocab: bench_prompt(n_vocab, args.prompt_tokens))
        print(f"routing trace: {tr.n_tokens} tokens -> {args.routing_trace}", file=sys.stderr)
    return 0
