#!/usr/bin/env python3
"""Replicas on Ray Serve: prefix-aware routing against round-robin on a multi-turn chat
workload with shared prefixes, and 2 replicas of 1 thread against 1 replica of 2 threads.

    python scripts/bench_replicas.py [--model MODEL_DIR] [--conversations 8] [--turns 4] \
        [--max-tokens 32] [--json results/bench_replicas/$(date +%F)-<name>.json]

Routing: `colibri serve --replicas 2 --threads 1 --replica-routing prefix`, then the same
with round_robin, each on a fresh local Ray cluster. Each conversation opens with one of two
long system prompts (an agent's instructions) and goes on for --turns turns, every turn
sending the whole conversation so far; the conversations run side by side, each turn
streamed. Reported per policy: the prefix-cache hit rate (prompt tokens found in the prefix
cache over prompt tokens looked up, summed over each replica's /metrics) and the time to
first token at p50 and p99. Scaling: --scale-requests independent greedy requests of
--scale-tokens tokens, --concurrency at a time, through 2 replicas of 1 thread and through one
plain `colibri serve --threads 2`: generated tokens per second of each. A benchmark, not a
test: it prints and writes numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from server_wait import wait_ready

from colibri.app.replicas.launch import port_outside_ray
from colibri.engine.tools.bench import measured_on

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = [
    "You are the help desk of a theatre company. Answer questions about plays, seats and "
    "times in the voice of a Shakespearean actor, briefly, and never invent a date. " * 6,
    "You are a code review assistant. Point out bugs first, then style; quote the line you "
    "mean; keep each remark to one sentence; do not rewrite the whole function. " * 6,
]
QUESTIONS = ["Good morrow! What plays tonight?", "And tomorrow?", "Which seats are left?",
             "How long is it?", "Is there an interval?", "Thank you kindly."]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextmanager
def server(args: argparse.Namespace, *flags: str) -> Iterator[str]:
    """`colibri serve FLAGS` on a free port in its own session (and Ray folder); its URL.
    Everything it started is ended afterwards."""
    port = port_outside_ray()
    ray_dir = tempfile.mkdtemp(prefix="clbray", dir="/tmp")
    env = dict(os.environ, RAY_TMPDIR=ray_dir)
    cmd = [sys.executable, "-m", "colibri.app", "serve", "--port", str(port), *flags]
    if args.model:
        cmd += ["--model", args.model]
    log = open(Path(ray_dir) / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, f"{' '.join(cmd)} (its output: {log.name})", poll_s=0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
        except ProcessLookupError:
            pass
        log.close()


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"])


def _stream_chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                 ) -> tuple[float, str, str | None]:
    """One streamed greedy chat turn: time to first token (s), the reply, its replica."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    ttft, text = None, ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-colibri-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return (ttft if ttft is not None else time.perf_counter() - t0), text, replica


def _replica_metrics(url: str) -> dict[str, dict[str, float]]:
    """Each replica's prefix-cache counters, read from its own /metrics."""
    out = {}
    for rep in httpx.get(url + "/v1/replicas", timeout=60).json()["data"]:
        text = httpx.get(url + "/metrics", headers={"x-colibri-replica": rep["id"]},
                         timeout=60).text
        vals: dict[str, float] = {}
        for line in text.splitlines():
            for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
                if line.startswith(name + "{") or line.startswith(name + " "):
                    vals[name.split(":")[1]] = float(line.rsplit(" ", 1)[1])
        out[rep["id"]] = vals
    return out


def chat_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The multi-turn conversations side by side; TTFTs, hit rate and requests per replica."""
    ttfts: list[float] = []
    per_replica: dict[str, int] = {}
    lock = threading.Lock()
    model = _model(url)

    def conversation(i: int) -> None:
        messages = [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]}]
        for turn in range(args.turns):
            messages.append({"role": "user",
                             "content": f"{QUESTIONS[turn % len(QUESTIONS)]} (guest {i})"})
            ttft, reply, replica = _stream_chat(url, model, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})
            with lock:
                ttfts.append(ttft)
                per_replica[str(replica)] = per_replica.get(str(replica), 0) + 1

    with ThreadPoolExecutor(args.conversations) as pool:
        list(pool.map(conversation, range(args.conversations)))
    counters = _replica_metrics(url)
    hits = sum(c.get("prefix_cache_hits_total", 0) for c in counters.values())
    queries = sum(c.get("prefix_cache_queries_total", 0) for c in counters.values())
    return {"requests": len(ttfts), "requests_per_replica": per_replica,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache": counters,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts), "ttft_p99_ms": 1e3 * _pct(ttfts, 0.99)}


def throughput(url: str, args: argparse.Namespace) -> dict[str, float]:
    """Independent greedy completions, --concurrency at a time: generated tokens a second."""
    model = _model(url)

    def one(i: int) -> int:
        body = {"model": model, "prompt": f"{QUESTIONS[i % len(QUESTIONS)]} {i}\n",
                "max_tokens": args.scale_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    one(0)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(one, range(args.scale_requests)))
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per chat reply")
    ap.add_argument("--scale-requests", type=int, default=32)
    ap.add_argument("--scale-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the result here")
    args = ap.parse_args(argv)
    argv = sys.argv if argv is None else ["scripts/bench_replicas.py", *argv]
    result: dict[str, Any] = {**measured_on(argv), "model": args.model or "demo_model",
                              "conversations": args.conversations, "turns": args.turns,
                              "max_tokens": args.max_tokens, "system_prompt_chars":
                              [len(s) for s in SYSTEMS], "routing": {}}
    two = ("--replicas", "2", "--threads", "1")
    for policy in ("prefix", "round_robin"):
        with server(args, *two, "--replica-routing", policy) as url:
            result["routing"][policy] = r = chat_workload(url, args)
            print(f"{policy:>12}: hit rate {r['prefix_cache_hit_rate']:.1%}, TTFT p50 "
                  f"{r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms, requests "
                  f"{r['requests_per_replica']}", flush=True)
            if policy == "prefix":
                result["two_replicas_one_thread"] = t = throughput(url, args)
                print(f"2 replicas x 1 thread: {t['tok_s']:.1f} tok/s", flush=True)
    with server(args, "--threads", "2") as url:
        result["one_replica_two_threads"] = t = throughput(url, args)
        print(f"1 replica x 2 threads: {t['tok_s']:.1f} tok/s", flush=True)
    result["scale"] = {"requests": args.scale_requests, "tokens": args.scale_tokens,
                       "concurrency": args.concurrency,
                       "ratio": result["two_replicas_one_thread"]["tok_s"]
                       / result["one_replica_two_threads"]["tok_s"]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
