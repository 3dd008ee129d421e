#!/usr/bin/env python3
"""Kernel micro-benchmark: how fast one matrix product streams its weights.

For each weight type, ISA path (and, with --prefetch, AVX-512 prefetch hint), thread count and
number of tokens it prints the product's time (timed in C by engine._core.matmul_bench, the
median of --reps calls), GB/s of weights streamed, GMAC/s, and a plain read of as many bytes on
the same threads (the bandwidth probe) with the product's GB/s as a % of it. It also prints
the thread pool's cost of one empty run (wake every worker, wait for all) and the ceiling of
each int8 product's arithmetic: its inner loop on data in L1, one core (on AVX2, also without
the q8 sign step: what exact signed int8 products cost there).

A virtual machine's read rate can drift by half from one minute to the next. With --rounds N
every point is measured N times, the variants and the plain read taking turns within each
round, and the medians are printed: % read and the last column (the first variant's time over
this one's, when several run) are medians of each round's own ratio, so they compare what ran
in the same minute.

A benchmark, not a test: it prints medians and asserts nothing. The machine should be quiet
(the load average is printed). Examples:

    python scripts/bench_kernels.py --rows 16384 --cols 4096 --tokens 1,4,8,16 --threads 1,2
    python scripts/bench_kernels.py --rows 32768 --types q8x8,q4x8 --tokens 1,8 --rounds 9
    python scripts/bench_kernels.py --rows 32768 --types q8x8 --isa avx512 --prefetch l2,nta \
        --tokens 1 --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from colibri.engine import _core  # noqa: E402
from colibri.engine.tools.bench import cpu_model  # noqa: E402


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def random_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> bytes:
    """A [rows, cols] MXFP4 matrix of random nibbles with exponents near 2^-7 (the C core has
    no MXFP4 quantizer: checkpoints ship the blocks; the values do not change the timing)."""
    from colibri.engine.format.quant import MXFP4_DTYPE, QK

    b = np.empty(rows * cols // QK, dtype=MXFP4_DTYPE)
    b["e"] = rng.integers(118, 123, b.size, dtype=np.uint8)
    b["qs"] = rng.integers(0, 256, (b.size, QK // 2), dtype=np.uint8)
    return b.tobytes()


def kernel_paths(isas: list[str], hints: list[str]) -> list[str]:
    """The variants to time: each ISA path, the AVX-512 one once per prefetch hint when several
    are asked for (as "avx512/nta")."""
    out: list[str] = []
    for isa in isas:
        out += [f"{isa}/{h}" for h in hints] if isa == "avx512" and len(hints) > 1 else [isa]
    return out


def use(path: str, hints: list[str]) -> None:
    """Make the products run as the variant `path` names."""
    isa, _, hint = path.partition("/")
    _core.isa_force(isa)
    _core.stream_hint_force(hint or hints[0])


def measure(name: str, w: bytes, args: argparse.Namespace, xs: list[np.ndarray], th: int,
            paths: list[str], hints: list[str]) -> list[dict[str, list[float]]]:
    """Seconds per product (median of --reps calls) of each variant and token count, and the
    plain read's seconds for the matrix's bytes, once per round; the variants take turns within
    a round (in reverse order every other round), so all of them see the same minutes of a
    machine whose memory bandwidth drifts."""
    rounds = []
    for r in range(args.rounds):
        secs: dict[str, list[float]] = {"read": [len(w) / (_core.bandwidth_probe(len(w), th, 3)
                                                           * 1e9)]}
        for path in paths if r % 2 == 0 else paths[::-1]:
            use(path, hints)
            secs[path] = [statistics.median(_core.matmul_bench(name, w, args.rows, args.cols, x,
                                                               th, args.reps + 1)[1:])
                          for x in xs]
        rounds.append(secs)
    return rounds


def report(name: str, w: bytes, args: argparse.Namespace, xs: list[np.ndarray], th: int,
           paths: list[str], rounds: list[dict[str, list[float]]]) -> None:
    """One line per variant and token count: medians over the rounds; % read and the ratio to
    the first variant are medians of each round's own ratio."""
    med = statistics.median
    read = med(len(w) / r["read"][0] / 1e9 for r in rounds)
    for path in paths:
        one = med(r[path][0] for r in rounds)
        for i, x in enumerate(xs):
            s = med(r[path][i] for r in rounds)
            pct = med(100 * r["read"][0] / r[path][i] for r in rounds)
            line = (f"{path:11}{name:6}{th:>4}{len(x):>5}{s * 1e3:>9.2f}{s / one:>9.2f}"
                    f"{len(w) / s / 1e9:>8.1f}{args.rows * args.cols * len(x) / s / 1e9:>8.1f}"
                    f"{read:>7.1f}{pct:>8.1f}")
            if len(paths) > 1:
                line += f"{med(r[paths[0]][i] / r[path][i] for r in rounds):>15.2f}"
            print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="output rows (default 16384)")
    p.add_argument("--cols", type=int, default=4096, help="input columns (default 4096)")
    p.add_argument("--types", default="q8,q4,q8x8,q4x8",
                   help="weight types; q8x8, q4x8 and mxfp4x8 are q8, q4 and mxfp4 in the 8-row "
                        "interleaved layout the SIMD paths repack to at load (mxfp4 takes "
                        "random blocks) (default q8,q4,q8x8,q4x8)")
    p.add_argument("--isa", default=None, help="ISA paths, e.g. avx512,avx2 (default: all)")
    p.add_argument("--tokens", default="1,2,4,8,16", help="rows of activations per product")
    p.add_argument("--threads", default="1,2", help="thread counts")
    p.add_argument("--reps", type=int, default=9, help="timed calls per point (median kept)")
    p.add_argument("--prefetch", default=None,
                   help="prefetch hints of the AVX-512 interleaved products, e.g. l2,nta: "
                        "several are timed as variants (default: the one picked at start)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every point this many times, the variants and the plain read "
                        "taking turns within each round, and print medians (default 1)")
    args = p.parse_args(argv)

    isas = args.isa.split(",") if args.isa else [i for i in _core.isa_supported() if i != "ref"]
    hints = args.prefetch.split(",") if args.prefetch else [_core.stream_hint_best()]
    for h in hints:
        if h not in _core.STREAM_HINTS:
            p.error(f"unknown prefetch hint {h!r}; choose from {', '.join(_core.STREAM_HINTS)}")
    paths = kernel_paths(isas, hints)
    print(f"cpu      {cpu_model()}")
    print(f"load     {os.getloadavg()[0]:.2f} (1-minute load average at start)")
    print(f"matrix   {args.rows} x {args.cols}")
    print(f"prefetch {', '.join(hints)} (AVX-512 interleaved products; picked at start: "
          f"{_core.stream_hint_best()})")
    for th in ints(args.threads):
        if th > 1:
            busy = _core.threadpool_bench(th, 20000, 0)
            idle = _core.threadpool_bench(th, 2000, 200)
            print(f"pool     {th} threads: empty run {busy / 1e3:.2f} us back to back, "
                  f"{idle / 1e3:.2f} us after 200 us of other work")
    have = _core.isa_supported()
    runs = [v for v, isa in zip(_core.INT8_LOOP_VARIANTS, _core.INT8_LOOP_ISA, strict=True)
            if isa in have]
    if runs:
        loop = ", ".join(f"{v} {_core.int8_loop_bench(v):.1f}" for v in runs)
        print(f"ceiling  int8 inner loop on L1 data, one core, GMAC/s (best of 15): {loop}")
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    versus = f"{'vs ' + paths[0]:>15}" if len(paths) > 1 else ""
    print(f"{'kernels':11}{'type':6}{'thr':>4}{'tok':>5}{'ms':>9}{'x 1 tok':>9}{'GB/s':>8}"
          f"{'GMAC/s':>8}{'read':>7}{'% read':>8}{versus}")
    for name in args.types.split(","):
        base = name.removesuffix("x8")
        w = (random_mxfp4(rng, args.rows, args.cols) if base == "mxfp4"
             else _core.quantize(base, w32))
        if base != name:
            w = _core.repack_x8(base, w, args.rows, args.cols)
        for th in ints(args.threads):
            xs = [rng.standard_normal((t, args.cols), dtype=np.float32) for t in ints(args.tokens)]
            runs = measure(name, w, args, xs, th, paths, hints)
            report(name, w, args, xs, th, paths, runs)
    _core.isa_force(_core.isa_best())
    _core.stream_hint_force(_core.stream_hint_best())
    print(f"load     {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
