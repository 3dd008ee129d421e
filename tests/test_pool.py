"""Memory pool (csrc/pool.c): alignment, size classes, exact statistics, multi-threaded use."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from colibri.engine import _core as core

KIB, MIB = 1 << 10, 1 << 20
# (size, class) across every boundary: small < 4 KiB <= medium < 1 MiB <= large
SIZES = [
    (1, "small"), (63, "small"), (64, "small"), (65, "small"), (4095, "small"),
    (4096, "medium"), (4097, "medium"), (100 * KIB, "medium"), (MIB - 1, "medium"),
    (MIB, "large"), (3 * MIB + 7, "large"),
]


def test_alignment_and_distinct_blocks() -> None:
    pool = core.Pool()
    blocks = []
    for i, (size, _) in enumerate(SIZES * 3):
        addr = pool.alloc(size)
        assert addr != 0 and addr % 64 == 0, size
        pool.fill(addr, size, i & 0xFF)
        blocks.append((addr, size, i & 0xFF))
    # no block overlaps another: every pattern is intact after all writes
    for addr, size, tag in blocks:
        assert pool.check(addr, size, tag)
    spans = sorted((a, a + s) for a, s, _ in blocks)
    assert all(prev_end <= start for (_, prev_end), (start, _) in pairwise(spans))
    for addr, _, _ in blocks:
        pool.free(addr)
    assert pool.stats()["total"] == 0


def test_zero_size_is_refused() -> None:
    pool = core.Pool()
    assert pool.alloc(0) == 0
    pool.free(0)  # freeing NULL is a no-op
    assert pool.stats()["n_alloc"] == 0 and pool.stats()["n_free"] == 0


def test_stats_are_exact_per_class() -> None:
    pool = core.Pool()
    want = {"small": 0, "medium": 0, "large": 0}
    addrs = []
    for size, cls in SIZES:
        addrs.append(pool.alloc(size))
        want[cls] += size
        s = pool.stats()
        assert {k: s[k] for k in want} == want
        assert s["total"] == sum(want.values()) == s["peak"]
    peak = pool.stats()["peak"]
    for addr in addrs:
        pool.free(addr)
    s = pool.stats()
    assert s["small"] == s["medium"] == s["large"] == s["total"] == 0
    assert s["peak"] == peak
    assert s["n_alloc"] == s["n_free"] == len(SIZES)


def test_peak_tracks_the_high_water_mark() -> None:
    pool = core.Pool()
    a = pool.alloc(3000)
    b = pool.alloc(200 * KIB)
    pool.free(a)
    c = pool.alloc(100)
    assert pool.stats()["peak"] == 3000 + 200 * KIB
    assert pool.stats()["total"] == 200 * KIB + 100
    pool.free(b)
    pool.free(c)
    d = pool.alloc(2 * MIB)
    assert pool.stats()["peak"] == 2 * MIB
    pool.free(d)


def test_freed_blocks_are_reused() -> None:
    pool = core.Pool()
    for size in (100, 5000, 300 * KIB):
        a = pool.alloc(size)
        pool.free(a)
        assert pool.alloc(size) == a  # same size class, served from its free list


def test_free_all_releases_live_blocks() -> None:
    pool = core.Pool()
    for size, _ in SIZES:
        pool.alloc(size)
    del pool  # clb_pool_free_all with blocks of every class still live (checked under ASan)


def test_multithreaded_stress() -> None:
    for n_threads in (2, 4):
        errors, stats = core.pool_stress(n_threads, 10_000, max_size=64 * KIB)
        assert np.all(errors == 0), errors
        assert stats["total"] == 0 and stats["small"] == stats["medium"] == stats["large"] == 0
        assert stats["n_alloc"] == stats["n_free"] > 0
        assert stats["peak"] > 0
