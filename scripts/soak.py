#!/usr/bin/env python
"""Soak test: N concurrent streams for M minutes against `colibri serve`, with random
client disconnects and a SIGTERM at the end; samples the server's RSS, open fds, threads and
KV-cache use (from /metrics, when it exports a `*kv_cache_usage_perc` gauge) and fails when
any of them grows. On 127.0.0.1 only.

    python scripts/soak.py --streams 16 --minutes 10 [--model DIR] [--disconnect 0.2]

Trend: the median over the second quarter of the run (after warm-up) against the median
over the last quarter. Limits: RSS may grow 10% + 16 MiB, fds 8, threads 4; after the load
stops, running/waiting requests must return to 0 and KV use to its idle value. The server
must then exit 0 on SIGTERM. Prints a table of samples and a verdict; exit status 1 on
growth, on failed requests (anything but a completed stream or our own disconnect) or on a
bad exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.app.metrics import parse_metrics  # noqa: E402
from tests.server_helpers import free_port  # noqa: E402


def proc_sample(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
            "threads": int(fields["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def metrics_sample(url: str) -> dict[str, float]:
    try:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for key, value in m.items():
        name = key.split("{", 1)[0]
        if name.endswith("kv_cache_usage_perc"):
            out["kv_usage"] = out.get("kv_usage", 0.0) + value
        elif name.endswith("num_free_blocks") or name.endswith("kv_free_blocks"):
            out["kv_free_blocks"] = out.get("kv_free_blocks", 0.0) + value
        elif name in ("colibri_requests_running", "colibri_requests_waiting"):
            out[name.rsplit("_", 1)[1]] = value
    return out


class Load:
    """N threads, each streaming chat completions back to back until stopped."""

    def __init__(self, url: str, streams: int, disconnect: float, seed: int) -> None:
        self.url, self.streams, self.disconnect = url, streams, disconnect
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {"completed": 0, "disconnected": 0, "failed": 0}
        self.failures: list[str] = []
        self.rng = random.Random(seed)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(streams)]

    def _count(self, what: str, detail: str = "") -> None:
        with self.lock:
            self.counts[what] += 1
            if detail and len(self.failures) < 20:
                self.failures.append(detail)

    def _run(self, i: int) -> None:
        rng = random.Random(self.rng.random() + i)
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                cut = rng.randint(1, 8) if rng.random() < self.disconnect else None
                body = {"messages": [{"role": "user", "content": f"Tell me a story {i}"}],
                        "max_tokens": rng.randint(8, 64), "stream": True,
                        "temperature": 0.8, "seed": rng.randint(0, 1 << 30)}
                try:
                    with client.stream("POST", self.url + "/v1/chat/completions",
                                       json=body) as r:
                        if r.status_code != 200:
                            self._count("failed", f"{r.status_code} {r.read()[:200]!r}")
                            continue
                        n, done = 0, False
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                n += 1
                                done = line == "data: [DONE]"
                                if '"error"' in line:
                                    self._count("failed", line[:200])
                                    break
                            if cut is not None and n >= cut:
                                break  # leaving the with block closes the connection
                        if cut is not None and not done:
                            self._count("disconnected")
                        elif done:
                            self._count("completed")
                        else:
                            self._count("failed", "stream ended without [DONE]")
                except httpx.HTTPError as e:
                    if not self.stop.is_set():
                        self._count("failed", f"{type(e).__name__}: {e}")


def trend(samples: list[dict[str, float]], key: str) -> tuple[float, float] | None:
    vals = [s[key] for s in samples if key in s]
    if len(vals) < 8:
        return None
    q = len(vals) // 4
    return statistics.median(vals[q:2 * q]), statistics.median(vals[-q:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--disconnect", type=float, default=0.2,
                    help="fraction of streams the client abandons mid-way (default 0.2)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the samples and verdict here")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="colibri-soak-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p))
    cmd = [sys.executable, "-m", "colibri.app", "serve", "--port", str(port),
           "--max-queue", str(args.streams * 2), "--drain-timeout-s", "10"]
    if args.model:
        cmd += ["--model", args.model]
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed at the end
    server = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            print((work / "server.log").read_text()[-4000:])
            return 1
        time.sleep(0.2)

    idle_before = {**proc_sample(server.pid), **metrics_sample(url)}
    load = Load(url, args.streams, args.disconnect, args.seed)
    for t in load.threads:
        t.start()
    samples: list[dict[str, float]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    print(f"{'t_s':>6} {'rss_mb':>8} {'fds':>5} {'thr':>4} {'kv':>6} {'run':>4} {'wait':>4} "
          f"{'done':>6} {'cut':>5} {'fail':>5}")
    while time.monotonic() < end:
        time.sleep(args.interval)
        s = {"t_s": time.monotonic() - t0, **proc_sample(server.pid), **metrics_sample(url)}
        samples.append(s)
        c = load.counts
        print(f"{s['t_s']:6.0f} {s['rss_mb']:8.1f} {s['fds']:5.0f} {s['threads']:4.0f} "
              f"{s.get('kv_usage', float('nan')):6.3f} {s.get('running', 0):4.0f} "
              f"{s.get('waiting', 0):4.0f} {c['completed']:6d} {c['disconnected']:5d} "
              f"{c['failed']:5d}", flush=True)
    load.stop.set()
    for t in load.threads:
        t.join(180)
    time.sleep(2 * args.interval)  # let aborted requests and freed blocks settle
    idle_after = {**proc_sample(server.pid), **metrics_sample(url)}

    problems: list[str] = []
    limits = {"rss_mb": lambda b: b * 1.10 + 16, "fds": lambda b: b + 8,
              "threads": lambda b: b + 4}
    report: dict[str, object] = {"streams": args.streams, "minutes": args.minutes,
                                 "counts": dict(load.counts), "idle_before": idle_before,
                                 "idle_after": idle_after, "trend": {}}
    for key, limit in limits.items():
        tr = trend(samples, key)
        if tr is None:
            continue
        report["trend"][key] = tr  # type: ignore[index]
        if tr[1] > limit(tr[0]):
            problems.append(f"{key} grew from {tr[0]:.1f} to {tr[1]:.1f}")
    for key in ("running", "waiting"):
        if idle_after.get(key, 0) != 0:
            problems.append(f"{key} is {idle_after[key]} after the load stopped")
    if "kv_usage" in idle_after and idle_after["kv_usage"] > idle_before.get("kv_usage", 0) + 1e-6:
        problems.append(f"KV use {idle_after['kv_usage']} after the load, "
                        f"{idle_before.get('kv_usage', 0)} before")
    if "kv_free_blocks" in idle_after and \
            idle_after["kv_free_blocks"] < idle_before.get("kv_free_blocks", 0):
        problems.append("free KV blocks did not return to their idle count")
    if "kv_usage" not in idle_after and "kv_free_blocks" not in idle_after:
        print("note: /metrics exports no KV-cache gauge; KV use not checked")
    if load.counts["failed"]:
        problems.append(f"{load.counts['failed']} failed requests: {load.failures[:5]}")

    # SIGTERM with a fresh burst in flight: it must drain and exit 0
    burst = Load(url, min(4, args.streams), 0.0, args.seed + 1)
    for t in burst.threads:
        t.start()
    time.sleep(1.0)
    burst.stop.set()
    t_term = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        rc = server.wait()
    report["sigterm_exit_code"] = rc
    report["sigterm_exit_s"] = round(time.monotonic() - t_term, 2)
    if rc != 0:
        problems.append(f"exit code {rc} after SIGTERM")
    log.close()
    text = (work / "server.log").read_text(errors="replace")
    if "Traceback" in text:
        problems.append("tracebacks in the server log " + str(work / "server.log"))
    report["problems"] = problems
    report["samples"] = samples
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print("FAIL" if problems else "PASS", *problems, sep="\n  ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
