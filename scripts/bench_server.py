"""Server overhead: time to first token and per-token latency through HTTP/SSE versus
calling the engine directly, on the same model, prompt and sampling parameters.

    python scripts/bench_server.py --model MODEL_DIR [--runs 5] [--max-tokens 64]

The direct runs call LLM.generate_tokens in this process; the HTTP runs start
`python -m colibri.app serve` on 127.0.0.1 (after the direct runs, so the two never compete for the
cores) and stream /v1/completions with logprobs=0, so that every token is one SSE event.
A benchmark, not a test: it prints numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time there was a little hummingbird who lived in a garden"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(ttft: list[float], itl: list[float]) -> dict[str, float]:
    return {"ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p90_ms": 1e3 * _pct(ttft, 0.9),
            "itl_mean_ms": 1e3 * statistics.fmean(itl), "itl_p50_ms": 1e3 * _pct(itl, 0.5),
            "itl_p90_ms": 1e3 * _pct(itl, 0.9), "itl_p99_ms": 1e3 * _pct(itl, 0.99)}


def bench_direct(model: str | None, n_ctx: int, runs: int, max_tokens: int,
                 threads: int | None) -> dict[str, float]:
    sys.path.insert(0, str(ROOT))
    from colibri.engine import LLM, SamplingParams

    llm = LLM(model, threads=threads, n_ctx=n_ctx)
    ids = llm.tokenizer.encode(PROMPT)
    ttft: list[float] = []
    itl: list[float] = []
    for run in range(runs + 1):  # run 0 warms up
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=run, logprobs=0)
        t0 = time.perf_counter()
        times = [time.perf_counter() for _ in llm.generate_tokens(ids, params)]
        if run:
            ttft.append(times[0] - t0)
            itl += [b - a for a, b in zip(times, times[1:], strict=False)]
    del llm
    gc.collect()
    return _summary(ttft, itl)


def bench_http(model: str | None, n_ctx: int, runs: int, max_tokens: int,
               threads: int | None) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "colibri.app", "serve", "--port", str(port), "--n-ctx", str(n_ctx),
           "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p))
    with tempfile.TemporaryDirectory() as work:
        proc = subprocess.Popen(cmd, cwd=work, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            end = time.monotonic() + 300
            while time.monotonic() < end:
                try:
                    if httpx.get(url + "/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            ttft: list[float] = []
            itl: list[float] = []
            with httpx.Client(timeout=120) as client:
                for run in range(runs + 1):
                    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                            "seed": run, "logprobs": 0, "stream": True}
                    t0 = time.perf_counter()
                    times = []
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                chunk = json.loads(line[6:])
                                if chunk["choices"] and chunk["choices"][0]["logprobs"]:
                                    times.append(time.perf_counter())
                    if run:
                        ttft.append(times[0] - t0)
                        itl += [b - a for a, b in zip(times, times[1:], strict=False)]
        finally:
            proc.terminate()
            proc.wait(60)
    return _summary(ttft, itl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    direct = bench_direct(args.model, args.n_ctx, args.runs, args.max_tokens, args.threads)
    http = bench_http(args.model, args.n_ctx, args.runs, args.max_tokens, args.threads)
    print(f"{'metric':<14}{'direct':>10}{'http/sse':>10}{'overhead':>10}")
    for key in direct:
        print(f"{key:<14}{direct[key]:>10.3f}{http[key]:>10.3f}{http[key] - direct[key]:>10.3f}")


if __name__ == "__main__":
    main()
