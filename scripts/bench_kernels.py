#!/usr/bin/env python3
"""Kernel micro-benchmark: GB/s of weights streamed and GMAC/s of one matrix product, per
weight type, ISA path, thread count and number of tokens, timed in C (engine._core.matmul_bench),
plus the thread pool's cost of one empty run (wake every worker, wait for all), a plain read
of as many bytes as the matrix on the same threads (the bandwidth probe, the higher of one run
before and one after each type's rows: how close the product comes to reading alone, in the
same minute) and, on AVX2 CPUs, the ceiling of the q8 products' arithmetic: their inner loop
on data in L1, one core, as computed and without its sign step (what exact signed int8
products cost on AVX2).

A benchmark, not a test: it prints medians and asserts nothing. The machine should be quiet
(the load average is printed). Example, the table of the README's performance section:

    python scripts/bench_kernels.py --rows 16384 --cols 4096 --tokens 1,4,8,16 --threads 1,2
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

from engine import _core  # noqa: E402
from engine.tools.bench import cpu_model  # noqa: E402


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384, help="output rows (default 16384)")
    p.add_argument("--cols", type=int, default=4096, help="input columns (default 4096)")
    p.add_argument("--types", default="q8,q4,q8x8,q4x8",
                   help="weight types; q8x8 and q4x8 are q8 and q4 in the 8-row interleaved "
                        "layout the SIMD paths repack to at load (default q8,q4,q8x8,q4x8)")
    p.add_argument("--isa", default=None, help="ISA paths, e.g. avx512,avx2 (default: all)")
    p.add_argument("--tokens", default="1,2,4,8,16", help="rows of activations per product")
    p.add_argument("--threads", default="1,2", help="thread counts")
    p.add_argument("--reps", type=int, default=9, help="timed calls per point (median kept)")
    args = p.parse_args(argv)

    isas = args.isa.split(",") if args.isa else [i for i in _core.isa_supported() if i != "ref"]
    print(f"cpu      {cpu_model()}")
    print(f"load     {os.getloadavg()[0]:.2f} (1-minute load average at start)")
    print(f"matrix   {args.rows} x {args.cols}")
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
    print(f"{'isa':8}{'type':6}{'thr':>4}{'tok':>5}{'ms':>9}{'x 1 tok':>9}{'GB/s':>8}"
          f"{'GMAC/s':>8}{'read':>7}{'% read':>8}")
    for isa in isas:
        _core.isa_force(isa)
        for name in args.types.split(","):
            base = name.removesuffix("x8")
            w = _core.quantize(base, w32)
            if base != name:
                w = _core.repack_x8(base, w, args.rows, args.cols)
            for th in ints(args.threads):
                one = None
                before = _core.bandwidth_probe(len(w), th, 3)
                rows = []
                for t in ints(args.tokens):
                    x = rng.standard_normal((t, args.cols), dtype=np.float32)
                    secs = _core.matmul_bench(name, w, args.rows, args.cols, x, th,
                                              args.reps + 1)[1:]
                    s = statistics.median(secs)
                    one = s if t == 1 or one is None else one
                    rows.append((t, s, s / one))
                read = max(before, _core.bandwidth_probe(len(w), th, 3))
                for t, s, ratio in rows:
                    gbs = len(w) / s / 1e9
                    print(f"{isa:8}{name:6}{th:>4}{t:>5}{s * 1e3:>9.2f}{ratio:>9.2f}"
                          f"{gbs:>8.1f}{args.rows * args.cols * t / s / 1e9:>8.1f}"
                          f"{read:>7.1f}{100 * gbs / read:>8.1f}", flush=True)
    _core.isa_force(_core.isa_best())
    print(f"load     {os.getloadavg()[0]:.2f} at end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
