"""Attention-heavy timing per KV cache type: a 2000-token prefill and one-token decode steps
at position 1999 on one thread, min over repeats of process CPU time (steadier than wall time
on a shared machine).

Usage: python scripts/bench_kv.py MODEL_DIR [f32|f16|q8|default ...]
("default" loads without choosing a KV type, for comparing with older builds).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from colibri.engine.executor.model import Model

N = 2000


def main(path: str, kinds: list[str]) -> None:
    ids = np.random.default_rng(0).integers(0, 320, N).astype(np.int32)
    for ty in kinds:
        kw = {} if ty == "default" else {"kv_type": ty}
        m = Model.load(path, threads=1, n_ctx=2048, **kw)
        pre, dec = [], []
        for _ in range(5):
            m.reset(0)
            t0 = time.process_time()
            m.forward(ids, np.zeros(N, np.int32), np.arange(N, dtype=np.int32), np.zeros(N, bool))
            pre.append(time.process_time() - t0)
            for _ in range(20):
                t0 = time.process_time()
                m.forward(ids[:1], np.zeros(1, np.int32), np.array([N - 1], np.int32))
                dec.append(time.process_time() - t0)
        print(f"{ty}: prefill {N} tokens min {min(pre):.3f} s; decode step at {N - 1} "
              f"min {min(dec) * 1e3:.3f} ms, median {np.median(dec) * 1e3:.3f} ms")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["f32", "f16", "q8"])
