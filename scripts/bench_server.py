#!/usr/bin/env python3
"""Server overhead: time to first token, time per token and CPU per token streamed through
HTTP/SSE, against calling the engine in-process, on the same model, prompt and sampling.

    python scripts/bench_server.py --model MODEL_DIR [--repeat 15] [--max-tokens 128] \
        [--client quiet|timed] [--baseline OTHER_CHECKOUT] \
        [--json results/bench_server/$(date +%F)-<name>.json]

Loads the model in this process (LLM.generate_tokens) and starts `colibri serve` on
127.0.0.1 (with --baseline, also the server of another checkout, whose extension is built in
place: `python setup.py build_ext --inplace`). Each repeat runs, for each server, one pair: a
request to the engine in-process and the same request to the server, back to back, the
direct one first in every other pair; so a slow minute on a shared machine falls on both
halves of a pair, and a steady drift cancels over the pairs. The overhead is the median over
pairs of the difference within each pair, with the spread of those differences (quartiles and
range) and a 95% confidence interval of that median (distribution-free: order statistics).

Beside the wall clock, CPU time: the server process's CPU seconds per token (every thread:
event loop, engine thread, compute threads; ns exact from the kernel's process clock), its
event loop thread's alone, and this process's while the engine runs in it. Their difference
is what serving costs in CPU: where the compute threads fill the cores it is what serving
costs in time, and other programs on the machine disturb it far less than the wall clock.

The HTTP requests stream /v1/completions with logprobs=0, so every token is one SSE event; the
direct runs ask for the same logprobs. The client ("quiet", the default) wakes twice a
request: at the first token, then, with the socket's low-water mark above the whole reply,
when the server closes the connection; so it does not compete with the server for the cores
while tokens stream (the time per token is then (end - first token) / (tokens - 1), the end
being the close that follows [DONE] at once). "timed" wakes at every event and adds the gap
percentiles. Either way the client's own CPU per token is measured and written beside.
A benchmark, not a test: it prints and writes numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkouts import checkout_python, commit_of
from server_wait import wait_ready

from colibri.engine import LLM, SamplingParams
from colibri.engine.tools.bench import measured_on

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time there was a little hummingbird who lived in a garden"
TEMPERATURE = 0.8
TOKEN_EVENT = b'"logprobs": {"tokens"'  # in each completion chunk that carries a token
QUIET_LOWAT = 1 << 20  # bytes: more than any reply here (the kernel caps it, then wakes more)


@dataclass
class Run:
    """One streamed request: when it began, when its tokens arrived (every token's time; from
    the quiet client, the first's and the end's), how many, and the CPU it cost."""

    t0: float
    times: list[float]
    n_tokens: int
    cpu_s: float | None = None  # direct: this process; HTTP: the server process
    loop_cpu_s: float | None = None  # HTTP: the server's event loop thread
    client_cpu_s: float | None = None  # HTTP: this thread, sending and reading

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t0

    @property
    def itl_mean(self) -> float:
        """Mean time between tokens (the mean of the gaps is the span over their count)."""
        return (self.times[-1] - self.times[0]) / (self.n_tokens - 1)

    def gaps(self) -> list[float] | None:
        """Each gap between consecutive tokens; None when only the ends were timed."""
        if len(self.times) != self.n_tokens:
            return None
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]

    def per_token(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds / self.n_tokens


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms_median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return 1e3 * statistics.median(known) if known else None


def summary(runs: list[Run]) -> dict[str, float]:
    """TTFT over runs, the per-run mean gap between tokens and (where every token was timed)
    gap percentiles, in ms; the CPU per token (median over runs) where it was measured."""
    ttft = [r.ttft for r in runs]
    out = {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
           "itl_mean_ms": 1e3 * statistics.median(r.itl_mean for r in runs)}
    per_run = [r.gaps() for r in runs]
    if all(g is not None for g in per_run):
        gaps = [g for run_gaps in per_run for g in run_gaps or []]
        out |= {"itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p90_ms": 1e3 * _pct(gaps, 0.9),
                "itl_p99_ms": 1e3 * _pct(gaps, 0.99)}
    for key, attr in (("process_cpu_ms_per_token", "cpu_s"),
                      ("loop_cpu_ms_per_token", "loop_cpu_s"),
                      ("client_cpu_ms_per_token", "client_cpu_s")):
        value = _ms_median([r.per_token(getattr(r, attr)) for r in runs])
        if value is not None:
            out[key] = value
    return out


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of values: the k-th smallest and
    the k-th largest, k the largest count for which fewer than k of n values fall below the
    median with chance at most (1 - level) / 2 (binomial, p = 1/2); the whole range when n is
    too small for the level."""
    ordered = sorted(values)
    n = len(ordered)
    k, below = 0, 0.0
    for j in range(n):
        below += math.comb(n, j) / 2 ** n  # P(at most j values below the median)
        if below > (1 - level) / 2:
            break
        k = j + 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def spread(diffs: list[float], key: str) -> dict[str, float]:
    """The median of diffs (ms) and its spread: quartiles, range, 95% CI of the median."""
    ms = [1e3 * d for d in diffs]
    q1, _, q3 = statistics.quantiles(ms, n=4) if len(ms) > 1 else (ms[0], ms[0], ms[0])
    lo, hi = median_ci(ms)
    return {key: statistics.median(ms), f"{key}_min": min(ms), f"{key}_max": max(ms),
            f"{key}_p25": q1, f"{key}_p75": q3, f"{key}_ci95": [lo, hi]}


def overhead(pairs: list[tuple[Run, Run]]) -> dict[str, Any]:
    """Median over pairs of (server run - direct run of the same pair), in ms: TTFT, time per
    token, and CPU per token (the server process's against this process's)."""
    out: dict[str, Any] = {"ttft_ms": 1e3 * statistics.median(h.ttft - d.ttft for d, h in pairs)}
    out |= spread([h.itl_mean - d.itl_mean for d, h in pairs], "itl_mean_ms")
    cpu = [hc - dc for d, h in pairs
           if (hc := h.per_token(h.cpu_s)) is not None and (dc := d.per_token(d.cpu_s)) is not None]
    if cpu:
        out |= spread(cpu, "cpu_ms_per_token")
    return out


def direct_runner(llm: LLM, max_tokens: int) -> Callable[[int], Run]:
    ids = llm.tokenizer.encode(PROMPT)

    def run(seed: int) -> Run:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, logprobs=0,
                                temperature=TEMPERATURE, top_p=1.0)
        c0 = time.process_time()
        t0 = time.perf_counter()
        times = [time.perf_counter() for _ in llm.generate_tokens(ids, params)]
        return Run(t0, times, len(times), cpu_s=time.process_time() - c0)
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(checkout: Path, args: argparse.Namespace, work: Path):  # noqa: ANN201
    """`serve` of checkout on a free port until the block ends; yields (URL, pid)."""
    env, prefix = checkout_python(checkout, work / checkout.name)
    port = _free_port()
    cmd = [sys.executable, "-m", f"{prefix}app", "serve", "--port", str(port), "--model",
           args.model, "--n-ctx", str(args.n_ctx), "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=work, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, f"the server of {checkout}", poll_s=0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(60)


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds of every thread of process pid so far (threads that ended included): the
    kernel's CPU clock of that process, exact to the ns; None where there is none."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # Linux: the scheduler clock of pid
    except OSError:
        return None


def _thread_cpu_s(pid: int) -> float | None:
    """CPU seconds of the process's main thread, which runs the server's event loop: the
    scheduler's exact count (schedstat, ns) where the kernel keeps one, else user + system
    ticks; None where /proc cannot tell."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def http_runner(url: str, pid: int, max_tokens: int, quiet: bool) -> Callable[[int], Run]:
    """Streams one completion over a plain socket (no HTTP library, no JSON parsing) and notes
    when tokens arrive: each event's time, or (quiet) the first token's and the end's."""
    host, port = url.removeprefix("http://").split(":")

    def run(seed: int) -> Run:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                           "seed": seed, "logprobs": 0, "temperature": TEMPERATURE,
                           "top_p": 1.0, "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
                "\r\n").encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cpu0, loop0, client0 = _process_cpu_s(pid), _thread_cpu_s(pid), time.thread_time()
            t0 = time.perf_counter()
            sock.sendall(head + body)
            times: list[float] = []
            received: list[bytes] = []
            tail, end = b"", t0
            while not (quiet and times) and (data := sock.recv(1 << 16)):
                end = time.perf_counter()
                received.append(data)
                buf = tail + data
                times += [end] * buf.count(TOKEN_EVENT)
                tail = buf[-(len(TOKEN_EVENT) - 1):]
            if quiet and times:
                # the first token is in: asleep until the reply is all in (the close wakes it)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, QUIET_LOWAT)
                while data := sock.recv(QUIET_LOWAT):
                    end = time.perf_counter()
                    received.append(data)
                times = [times[0], end]
            client = time.thread_time() - client0
            cpu1, loop1 = _process_cpu_s(pid), _thread_cpu_s(pid)
        reply = b"".join(received)
        n_tokens = reply.count(TOKEN_EVENT)
        if not reply.startswith(b"HTTP/1.1 200") or n_tokens != max_tokens:
            raise SystemExit(f"{url}: {n_tokens} of {max_tokens} tokens came back: "
                             f"{reply[:300]!r}")
        return Run(t0, times, n_tokens, cpu_s=_delta(cpu0, cpu1),
                   loop_cpu_s=_delta(loop0, loop1), client_cpu_s=client)
    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"http": ROOT}
    if args.baseline:
        checkouts["baseline_http"] = Path(args.baseline).resolve()
    llm = LLM(args.model, threads=args.threads, n_ctx=args.n_ctx)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        direct = direct_runner(llm, args.max_tokens)
        servers: dict[str, Callable[[int], Run]] = {}
        for name, checkout in checkouts.items():
            url, pid = stack.enter_context(server(checkout, args, work))
            servers[name] = http_runner(url, pid, args.max_tokens, args.client == "quiet")
        names = list(servers)
        direct(0)  # warm-up, not counted
        for name in names:
            servers[name](0)
        pairs: dict[str, list[tuple[Run, Run]]] = {n: [] for n in names}
        for rep in range(args.repeat):
            for i, name in enumerate(names[rep % len(names):] + names[:rep % len(names)]):
                if (rep + i) % 2 == 0:
                    d = direct(rep + 1)
                    h = servers[name](rep + 1)
                else:
                    h = servers[name](rep + 1)
                    d = direct(rep + 1)
                pairs[name].append((d, h))
            print(f"repeat {rep + 1}/{args.repeat}: " + ", ".join(
                f"{n} {1e3 * pairs[n][-1][1].itl_mean:.2f} ms/token (direct "
                f"{1e3 * pairs[n][-1][0].itl_mean:.2f})" for n in names), flush=True)
    out: dict[str, Any] = {**measured_on(), "model": args.model, "prompt": PROMPT,
                           "max_tokens": args.max_tokens, "repeat": args.repeat,
                           "threads": args.threads, "n_ctx": args.n_ctx, "client": args.client,
                           "commit": commit_of(ROOT)}
    out["direct"] = summary([d for name in names for d, _ in pairs[name]])
    for name in names:
        out[name] = summary([h for _, h in pairs[name]])
        out[name]["overhead"] = overhead(pairs[name])
    if args.baseline:
        out["baseline"] = {"checkout": str(checkouts["baseline_http"]),
                           "commit": commit_of(checkouts["baseline_http"])}
    return out


def _fmt(value: Any) -> str:
    return f"{value:>15.3f}" if isinstance(value, float) else f"{'–':>15}"


def render(res: dict[str, Any]) -> str:
    names = [n for n in ("direct", "http", "baseline_http") if n in res]
    keys = [k for k in dict.fromkeys(k for n in names for k in res[n]) if k != "overhead"]
    lines = [f"{'metric':<26}" + "".join(f"{n:>15}" for n in names)]
    for key in keys:
        lines.append(f"{key:<26}" + "".join(_fmt(res[n].get(key)) for n in names))
    for n in names[1:]:
        o = res[n]["overhead"]
        lo, hi = o["itl_mean_ms_ci95"]
        line = (f"{n} over direct (median of {res['repeat']} pairs): TTFT {o['ttft_ms']:+.3f} ms,"
                f" {o['itl_mean_ms']:+.3f} ms a token (95% CI {lo:+.3f} to {hi:+.3f}; quartiles "
                f"{o['itl_mean_ms_p25']:+.3f} to {o['itl_mean_ms_p75']:+.3f}; range "
                f"{o['itl_mean_ms_min']:+.3f} to {o['itl_mean_ms_max']:+.3f})")
        if "cpu_ms_per_token" in o:
            clo, chi = o["cpu_ms_per_token_ci95"]
            line += (f"\n  CPU: {o['cpu_ms_per_token']:+.3f} ms a token over the engine's (95% CI "
                     f"{clo:+.3f} to {chi:+.3f}); event loop "
                     f"{res[n].get('loop_cpu_ms_per_token', float('nan')):.3f} ms a token; the "
                     f"client {res[n].get('client_cpu_ms_per_token', float('nan')):.3f} ms a token")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a converted model folder")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=15, help="pairs per server")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--client", choices=("quiet", "timed"), default="quiet",
                    help="quiet: wake at the first token and the end; timed: at every event")
    ap.add_argument("--baseline", default=None, metavar="CHECKOUT",
                    help="also measure the server of this other checkout")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the result here")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.max_tokens < 3:
        ap.error("--repeat must be at least 1 and --max-tokens at least 3")
    res = measure(args)
    print(render(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
