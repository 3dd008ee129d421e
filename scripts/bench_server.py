#!/usr/bin/env python3
"""Server overhead: time to first token and the time between tokens through HTTP/SSE against
calling the engine in-process, on the same model, prompt and sampling parameters.

    python scripts/bench_server.py --model MODEL_DIR [--repeat 7] [--max-tokens 128] \
        [--baseline OTHER_CHECKOUT] [--json results/bench_server/$(date +%F)-<name>.json]

Loads the model in this process (LLM.generate_tokens) and starts `colibri serve` on
127.0.0.1 (and, with --baseline, a second server from another checkout, whose extension is
built in place: `python setup.py build_ext --inplace`). Each repeat runs one request on each,
one after the other in a rotating order, so the engines never compete for the cores and a
slow minute hits them all. The HTTP requests stream /v1/completions with logprobs=0, so
every token is one SSE event; the direct runs ask for the same logprobs. The overhead is the
median over repeats of (HTTP - direct) within each repeat. A benchmark, not a test: it prints
and writes numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from checkouts import checkout_python, commit_of
from server_wait import wait_ready

from colibri.engine import LLM, SamplingParams
from colibri.engine.tools.bench import measured_on

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time there was a little hummingbird who lived in a garden"
TEMPERATURE = 0.8
Run = list[float]  # the times (perf_counter) at which each token arrived, after the start


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _gaps(run: Run) -> list[float]:
    return [b - a for a, b in zip(run[1:], run[2:], strict=False)]


def summary(runs: list[Run]) -> dict[str, float]:
    """TTFT over runs, the per-run mean gap between tokens, and gap percentiles, in ms."""
    ttft = [r[1] - r[0] for r in runs]
    gaps = [g for r in runs for g in _gaps(r)]
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
            "itl_mean_ms": 1e3 * statistics.median(statistics.fmean(_gaps(r)) for r in runs),
            "itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p90_ms": 1e3 * _pct(gaps, 0.9),
            "itl_p99_ms": 1e3 * _pct(gaps, 0.99)}


def overhead(runs: list[Run], direct: list[Run]) -> dict[str, float]:
    """Median over repeats of (this run - the direct run of the same repeat), in ms."""
    ttft = [(r[1] - r[0]) - (d[1] - d[0]) for r, d in zip(runs, direct, strict=True)]
    itl = [statistics.fmean(_gaps(r)) - statistics.fmean(_gaps(d))
           for r, d in zip(runs, direct, strict=True)]
    return {"ttft_ms": 1e3 * statistics.median(ttft), "itl_mean_ms": 1e3 * statistics.median(itl),
            "itl_mean_ms_min": 1e3 * min(itl), "itl_mean_ms_max": 1e3 * max(itl)}


def direct_runner(llm: LLM, max_tokens: int) -> Callable[[int], Run]:
    ids = llm.tokenizer.encode(PROMPT)

    def run(seed: int) -> Run:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, logprobs=0,
                                temperature=TEMPERATURE, top_p=1.0)
        t0 = time.perf_counter()
        return [t0, *(time.perf_counter() for _ in llm.generate_tokens(ids, params))]
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


TOKEN_EVENT = b'"logprobs": {"tokens"'  # in each completion chunk that carries a token


def http_runner(url: str, max_tokens: int) -> Callable[[int], Run]:
    """Streams one completion over a plain socket and notes when each token's event arrives.
    The client does next to no work per event (no HTTP library, no JSON parsing): on a
    machine with few cores its own time would otherwise be counted as the server's."""
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
            t0 = time.perf_counter()
            sock.sendall(head + body)
            times, tail, seen, first = [t0], b"", b"", b""
            while True:
                data = sock.recv(1 << 16)
                now = time.perf_counter()
                if not data:
                    break
                first = first or data
                buf = tail + data
                times += [now] * buf.count(TOKEN_EVENT)
                tail = buf[-(len(TOKEN_EVENT) - 1):]
                seen = (seen + data)[-64:]
                if b"data: [DONE]" in seen:
                    break
        if not first.startswith(b"HTTP/1.1 200") or len(times) != max_tokens + 1:
            raise SystemExit(f"{url}: {len(times) - 1} of {max_tokens} tokens came back: "
                             f"{first[:300]!r}")
        return times
    return run


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


def with_loop_cpu(run: Callable[[int], Run], pid: int, out: list[float]) -> Callable[[int], Run]:
    """run, also noting the server loop's CPU time per token of each run in out."""
    def timed(seed: int) -> Run:
        before = _thread_cpu_s(pid)
        times = run(seed)
        after = _thread_cpu_s(pid)
        if before is not None and after is not None:
            out.append((after - before) / (len(times) - 1))
        return times
    return timed


def measure(args: argparse.Namespace) -> dict[str, Any]:
    checkouts = {"http": ROOT}
    if args.baseline:
        checkouts["baseline_http"] = Path(args.baseline).resolve()
    llm = LLM(args.model, threads=args.threads, n_ctx=args.n_ctx)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        runners = {"direct": direct_runner(llm, args.max_tokens)}
        loop_cpu: dict[str, list[float]] = {}  # the server's event loop: CPU s per token
        for name, checkout in checkouts.items():
            url, pid = stack.enter_context(server(checkout, args, work))
            runners[name] = with_loop_cpu(http_runner(url, args.max_tokens), pid,
                                          loop_cpu.setdefault(name, []))
        names = list(runners)
        for name in names:  # warm-up, not counted
            runners[name](0)
        for cpu in loop_cpu.values():
            cpu.clear()
        runs: dict[str, list[Run]] = {n: [] for n in names}
        for rep in range(args.repeat):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                runs[name].append(runners[name](rep + 1))
            print(f"repeat {rep + 1}/{args.repeat}: " + ", ".join(
                f"{n} {1e3 * statistics.fmean(_gaps(runs[n][-1])):.2f} ms/token" for n in names),
                flush=True)
    out: dict[str, Any] = {**measured_on(), "model": args.model, "prompt": PROMPT,
                           "max_tokens": args.max_tokens, "repeat": args.repeat,
                           "threads": args.threads, "n_ctx": args.n_ctx,
                           "commit": commit_of(ROOT)}
    for name in names:
        out[name] = summary(runs[name])
    for name in names[1:]:
        out[name]["overhead"] = overhead(runs[name], runs["direct"])
        if loop_cpu[name]:
            out[name]["loop_cpu_ms_per_token"] = 1e3 * statistics.median(loop_cpu[name])
    if args.baseline:
        out["baseline"] = {"checkout": str(checkouts["baseline_http"]),
                           "commit": commit_of(checkouts["baseline_http"])}
    return out


def render(res: dict[str, Any]) -> str:
    names = [n for n in ("direct", "http", "baseline_http") if n in res]
    lines = [f"{'metric':<14}" + "".join(f"{n:>15}" for n in names)]
    for key in res["direct"]:
        lines.append(f"{key:<14}" + "".join(f"{res[n][key]:>15.3f}" for n in names))
    for n in names[1:]:
        o = res[n]["overhead"]
        cpu = res[n].get("loop_cpu_ms_per_token")
        lines.append(f"{n} over direct (median of repeats): TTFT {o['ttft_ms']:+.3f} ms, "
                     f"{o['itl_mean_ms']:+.3f} ms a token ({o['itl_mean_ms_min']:+.3f} to "
                     f"{o['itl_mean_ms_max']:+.3f}); event loop CPU "
                     + ("?" if cpu is None else f"{cpu:.3f}") + " ms a token")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a converted model folder")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
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
