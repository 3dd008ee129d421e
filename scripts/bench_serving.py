"""Serving benchmark in the manner of `vllm bench serve`: N concurrent streaming clients over
real HTTP against Colibri and its peers, on the same weights, in one run.

    python scripts/bench_serving.py [--concurrency 1,2,4,8,16] [--prompt-tokens 256]
        [--gen-tokens 128] [--requests-per-client 2] [--threads 2]
        [--engines colibri,llama-server,llama-cpp-python] [--llama-server PATH]
        [--probes 16] [--json OUT] [model shape flags as in compare_llamacpp.py]

Model: the random benchmark Mixtral of scripts/compare_llamacpp.py (same shape flags), as
Colibri q8 and GGUF Q8_0 (llama.cpp's own converter and quantizer). Peers: llama.cpp's
`llama-server` (pass --llama-server: built with cmake from the llama.cpp that the
llama-cpp-python source distribution vendors, GGML_NATIVE on; run with -np N and continuous
batching) and llama-cpp-python's own server (`python -m llama_cpp.server`). Every request
streams /v1/completions with a fixed prompt of about --prompt-tokens tokens and
--gen-tokens greedy tokens (EOS ignored). Reported per engine and concurrency: aggregate
output tokens/s (prompts included), output tokens/s while every stream decodes, the share of
the time before every stream had its first token, TTFT, inter-token latency and TPOT at
p50/p90/p99, failed requests; then the TTFT of a request that arrives while 7 streams
decode, against its TTFT on an idle server (--probes requests each). Every request of a run
sends a prompt no other request sent, so prompts are computed, never found in a prefix
cache, and every engine gets the same prompts in the same order.
Beside the measured throughput it prints the model's physical ceiling at each concurrency:
a step of B sequences touches E*(1-(1-k/E)^B) distinct experts per layer, which turns into
weight bytes per token and a tokens/s bound at the measured read bandwidth.
A benchmark, not a test: it asserts nothing. Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_llamacpp import Dims, _words, build_checkpoint, build_gguf, llama_source  # noqa: E402
from server_wait import wait_ready  # noqa: E402

from colibri.engine.tools.bench import measured_on  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- servers ----------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    ready_path: str
    model_name: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, workdir: Path, timeout: float = 300.0) -> None:
        self.log = workdir / f"{self.name}.log"
        # this checkout first, then the caller's path (a llama-cpp-python built with --target)
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT, env=env, cwd=workdir)
        try:
            wait_ready(self.proc, self.url, self.name, timeout, self.ready_path)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def colibri_server(model: Path, threads: int, max_seqs: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "colibri.app", "serve", "--model", str(model), "--port", str(port),
           "--threads", str(threads), "--max-num-seqs", str(max_seqs), "--n-ctx", str(n_ctx),
           "--max-queue", "64", "--served-model-name", "bench", "--log-level", "warning"]
    return Server("colibri", cmd, port, "/ready", "bench")


def llama_server(binary: str, gguf: Path, threads: int, n_par: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t",
           str(threads), "-tb", str(threads), "-np", str(n_par), "-c", str(n_ctx * n_par),
           "-cb", "--no-webui", "-a", "bench"]
    return Server("llama-server", cmd, port, "/health", "bench")


def llama_cpp_python_server(gguf: Path, threads: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host",
           "127.0.0.1", "--port", str(port), "--n_threads", str(threads), "--n_ctx",
           str(n_ctx), "--model_alias", "bench"]
    return Server("llama-cpp-python", cmd, port, "/v1/models", "bench")


# -- clients ----------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    n_out: int = 0
    itl: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of every content chunk
    error: str = ""


def fresh_connections(max_connections: int | None = None) -> httpx.Limits:
    """A new connection per request: llama-server closes a kept-alive connection after a
    stream, and a request sent on it just then fails with "Server disconnected"."""
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=0)


async def one_request(client: httpx.AsyncClient, srv: Server, prompt: str,
                      n_gen: int, first: asyncio.Event | None = None) -> Result:
    body = {"model": srv.model_name, "prompt": prompt, "max_tokens": n_gen, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    res = Result(ok=False)
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                if not data.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                    if first is not None:
                        first.set()
                else:
                    res.itl.append(now - last)
                last = now
                res.times.append(now)
                chunks += 1
    except httpx.HTTPError as exc:
        res.error = repr(exc)
        return res
    res.e2e = time.perf_counter() - t0
    res.n_out = int(usage_tokens) if usage_tokens else chunks
    res.ok = res.n_out > 0
    return res


async def run_level(srv: Server, prompts: Prompts, n_gen: int, conc: int,
                    per_client: int) -> dict[str, Any]:
    limits = fresh_connections(conc + 4)
    mine = [prompts.take(per_client) for _ in range(conc)]
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(w: int) -> list[Result]:
            out = []
            for prompt in mine[w]:
                out.append(await one_request(client, srv, prompt, n_gen))
            return out

        t0 = time.perf_counter()
        groups = await asyncio.gather(*(worker(w) for w in range(conc)))
        wall = time.perf_counter() - t0
    results = [r for g in groups for r in g]
    good = [r for r in results if r.ok]
    itl = [x for r in good for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.n_out - 1) for r in good if r.n_out > 1]
    ttft = [r.ttft for r in good]
    first_round = [g[0] for g in groups if g and g[0].ok]
    return {**decode_phase(first_round, t0, wall),
            "concurrency": conc, "requests": len(results), "failed": len(results) - len(good),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "wall_s": wall, "output_tokens": sum(r.n_out for r in good),
            "output_tok_s": sum(r.n_out for r in good) / wall,
            **{f"ttft_p{q}_ms": 1e3 * pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1e3 * pct(itl, q / 100) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": 1e3 * pct(tpot, q / 100) for q in (50, 90, 99)}}


def decode_phase(good: list[Result], t0: float, wall: float) -> dict[str, float]:
    """Over the first request of every client (they start together): output tokens/s while
    every stream decodes (from the last first token to the first last token) and the share of
    the wall time spent before every stream had its first token, the prompts' share of the
    throughput above."""
    if not good or any(not r.times for r in good):
        return {"decode_tok_s": float("nan"), "prefill_share": float("nan")}
    start = max(r.times[0] for r in good)
    end = min(r.times[-1] for r in good)
    n = sum(1 for r in good for t in r.times if start < t <= end)
    return {"decode_tok_s": n / (end - start) if end > start else float("nan"),
            "prefill_share": (start - t0) / wall}


async def ttft_under_load(srv: Server, prompts: Prompts, n_gen: int, probes: int,
                          background: int) -> dict[str, float]:
    """TTFT of a new request (a prompt no request sent before, so it is computed, not found in
    a prefix cache) on an idle server, then while `background` streams decode. Each probe
    waits for the previous one; the background streams start over with new prompts when they
    finish."""
    async with httpx.AsyncClient(timeout=600, limits=fresh_connections()) as client:
        idle = [(await one_request(client, srv, prompts.take(1)[0], 2)).ttft
                for _ in range(probes)]
        stop = asyncio.Event()
        started = [asyncio.Event() for _ in range(background)]

        async def decoder(i: int) -> None:
            while not stop.is_set():
                await one_request(client, srv, prompts.take(1)[0], n_gen * 4, started[i])

        tasks = [asyncio.create_task(decoder(i)) for i in range(background)]
        for ev in started:  # every background stream past its prompt, and decoding
            await ev.wait()
        await asyncio.sleep(0.5)
        busy = [(await one_request(client, srv, prompts.take(1)[0], 2)).ttft
                for _ in range(probes)]
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out = {"probes": float(probes)}
    for name, xs in (("idle", idle), ("busy", busy)):
        out.update({f"{name}_ttft_p{q}_ms": 1e3 * pct(xs, q / 100) for q in (50, 90, 99)})
    out.update({f"ratio_p{q}": out[f"busy_ttft_p{q}_ms"] / out[f"idle_ttft_p{q}_ms"]
                for q in (50, 90, 99)})
    return out


# -- the physical ceiling ---------------------------------------------------------------------

def ceiling(model_dir: Path, dims: Dims, threads: int, levels: list[int]) -> dict[str, Any]:
    """Weight bytes per token at each concurrency B and the bound at the measured bandwidth."""
    from colibri.engine import _core
    from colibri.engine.tools.bench import weight_bytes_per_token

    parts = weight_bytes_per_token(model_dir)
    expert_one = parts["experts"] / (dims.layers * dims.top_k)  # one expert's bytes
    fixed = parts["total"] - parts["experts"]
    gbps = float(_core.bandwidth_probe(1024 << 20, threads, 3))
    out = {"bandwidth_gb_s": gbps, "levels": {}}
    e, k = dims.experts, dims.top_k
    for b in levels:
        distinct = e * (1 - (1 - k / e) ** b)
        per_token = (fixed + dims.layers * distinct * expert_one) / b
        out["levels"][b] = {"distinct_experts_per_layer": distinct,
                            "bytes_per_token": per_token,
                            "bound_tok_s": gbps * 1e9 / per_token}
    return out


# -- main -------------------------------------------------------------------------------------

class Prompts:
    """Prompts of about n_tokens random words, each handed out once: no request of a run
    shares a prompt with another (the words are drawn at random), so every prompt is
    computed and no server's prefix cache changes what a concurrency level measures. The
    seed fixes the prompts, so Colibri and each peer server are sent the same ones in the
    same order; make() fills the pool ahead of the timed requests."""

    def __init__(self, tokenizer_dir: Path, n_tokens: int, seed: int) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self._rng = random.Random(seed)
        self._n = n_tokens
        self._made: list[str] = []
        self._next = 0

    def _one(self) -> str:
        words: list[str] = []
        while len(self._tok.encode(" ".join(words)).ids) < self._n:
            words += _words(self._rng, 16)
        while len(self._tok.encode(" ".join(words)).ids) > self._n:
            words.pop()
        return " ".join(words)

    def make(self, count: int) -> None:
        while len(self._made) < self._next + count:
            self._made.append(self._one())

    def take(self, count: int) -> list[str]:
        self.make(count)
        out = self._made[self._next:self._next + count]
        self._next += count
        return out

    def restart(self) -> None:
        """The next engine gets the same prompts, from the first."""
        self._next = 0


def render(res: dict[str, Any]) -> str:
    lines = [f"CPU: {res['cpu']}  threads: {res['threads']}  model: {res['model']}",
             f"prompt ~{res['prompt_tokens']} tokens, {res['gen_tokens']} output tokens, "
             f"greedy, EOS ignored; read bandwidth {res['ceiling']['bandwidth_gb_s']:.1f} GB/s",
             "", "| engine | conc | out tok/s | x vs 1 | ceiling tok/s | decode tok/s | "
             "before all first tokens | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
             "TPOT p50/p90/p99 ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for eng, levels in res["engines"].items():
        base = levels[0]["output_tok_s"] if levels else float("nan")
        for lv in levels:
            c = lv["concurrency"]
            ceil = res["ceiling"]["levels"].get(str(c), res["ceiling"]["levels"].get(c, {}))
            lines.append(
                f"| {eng} | {c} | {lv['output_tok_s']:.1f} | {lv['output_tok_s'] / base:.2f} | "
                f"{ceil.get('bound_tok_s', float('nan')):.0f} | "
                f"{lv.get('decode_tok_s', float('nan')):.1f} | "
                f"{100 * lv.get('prefill_share', float('nan')):.0f}% | "
                f"{lv['ttft_p50_ms']:.0f}/{lv['ttft_p90_ms']:.0f}/{lv['ttft_p99_ms']:.0f} | "
                f"{lv['itl_p50_ms']:.1f}/{lv['itl_p90_ms']:.1f}/{lv['itl_p99_ms']:.1f} | "
                f"{lv['tpot_p50_ms']:.1f}/{lv['tpot_p90_ms']:.1f}/{lv['tpot_p99_ms']:.1f} | "
                f"{lv['failed']} |")
    lines.append("")
    for eng, t in res.get("ttft_under_load", {}).items():
        qs = (50, 90, 99)
        lines.append(f"{eng}: TTFT of a new prompt ({t['probes']:.0f} probes), p50/p90/p99: idle "
                     + "/".join(f"{t[f'idle_ttft_p{q}_ms']:.0f}" for q in qs)
                     + " ms, with 7 streams decoding "
                     + "/".join(f"{t[f'busy_ttft_p{q}_ms']:.0f}" for q in qs) + " ms (x"
                     + "/x".join(f"{t[f'ratio_p{q}']:.2f}" for q in qs) + ")")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    dflt = Dims(hidden=1024, intermediate=1536, layers=8, experts=16, top_k=4, heads=16,
                kv_heads=4)
    for name in ("vocab", "hidden", "intermediate", "layers", "experts", "heads", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(dflt, name))
    p.add_argument("--top-k", type=int, default=dflt.top_k)
    p.add_argument("--kv-heads", type=int, default=dflt.kv_heads)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engines", default="colibri,llama-server,llama-cpp-python")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary (llama.cpp built with cmake, GGML_NATIVE=ON)")
    p.add_argument("--no-ttft-load", action="store_true", help="skip the TTFT-under-load run")
    p.add_argument("--probes", type=int, default=16,
                   help="requests timed for TTFT, on the idle server and under load (default 16)")
    p.add_argument("--workdir", default="/tmp/colibri_compare")
    p.add_argument("--llama-src", default=None)
    p.add_argument("--json", default=None, metavar="OUT")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dims = Dims(vocab=args.vocab, hidden=args.hidden, intermediate=args.intermediate,
                layers=args.layers, experts=args.experts, top_k=args.top_k, heads=args.heads,
                kv_heads=args.kv_heads, seed=args.seed)
    levels = [int(x) for x in args.concurrency.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    work = Path(args.workdir) / dims.tag()
    work.mkdir(parents=True, exist_ok=True)
    hf = build_checkpoint(work / "hf", dims)
    from colibri.engine.format.convert import convert

    col = work / "colibri-q8"
    if not (col / "config.json").is_file():
        convert(hf, col, "q8", progress=True)
    n_ctx = args.prompt_tokens + args.gen_tokens * 4 + 64
    gguf = None
    if any(e != "colibri" for e in engines):
        gguf = build_gguf(hf, work / "gguf", llama_source(work, args.llama_src))["Q8_0"]
    prompts = Prompts(hf, args.prompt_tokens, dims.seed)
    background = 7
    prompts.make(1 + sum(levels) * args.requests_per_client + 2 * args.probes + 2 * background)
    res: dict[str, Any] = {**measured_on(), "threads": args.threads, "model": dims.tag(),
                           "dims": asdict(dims), "prompt_tokens": args.prompt_tokens,
                           "gen_tokens": args.gen_tokens, "engines": {},
                           "ttft_under_load": {},
                           "ceiling": ceiling(col, dims, args.threads, levels)}
    for eng in engines:
        if eng == "colibri":
            srv = colibri_server(col, args.threads, max(levels), n_ctx)
        elif eng == "llama-server":
            if not args.llama_server:
                print("llama-server: skipped (no --llama-server binary given)", flush=True)
                continue
            assert gguf is not None
            srv = llama_server(args.llama_server, gguf, args.threads, max(levels), n_ctx)
        elif eng == "llama-cpp-python":
            assert gguf is not None
            srv = llama_cpp_python_server(gguf, args.threads, n_ctx)
        else:
            raise SystemExit(f"unknown engine {eng}")
        print(f"starting {eng} ...", flush=True)
        try:
            srv.start(work)
            prompts.restart()
            asyncio.run(run_level(srv, prompts, 8, 1, 1))  # warm-up
            out = []
            for c in levels:
                lv = asyncio.run(run_level(srv, prompts, args.gen_tokens, c,
                                           args.requests_per_client))
                print(f"  {eng} c={c}: {lv['output_tok_s']:.1f} tok/s, failed {lv['failed']}",
                      flush=True)
                out.append(lv)
            res["engines"][eng] = out
            if not args.no_ttft_load:
                res["ttft_under_load"][eng] = asyncio.run(
                    ttft_under_load(srv, prompts, args.gen_tokens, args.probes, background))
        finally:
            srv.stop()
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
