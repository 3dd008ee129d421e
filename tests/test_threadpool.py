"""Thread pool (csrc/threadpool.c): every worker index runs exactly once per run."""

from __future__ import annotations

import os

import numpy as np
import pytest

from colibri.engine import _core as core

CLB_E_ARG = -5


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4, 8])
def test_each_worker_runs_once_per_run(n_threads: int) -> None:
    counts, nth_seen = core.threadpool_exercise(n_threads, 500)
    assert counts.shape == (500, n_threads)
    assert np.all(counts == 1)
    assert np.all(nth_seen == n_threads)


def test_nested_run_is_refused() -> None:
    for n_threads in (1, 3):
        assert np.all(core.threadpool_nested_status(n_threads) == CLB_E_ARG)


def test_bad_sizes_are_refused() -> None:
    for n in (0, -1, 100_000):
        with pytest.raises(ValueError):
            core.ThreadPool(n)


def test_physical_cores() -> None:
    n = core.physical_cores()
    assert 1 <= n <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)


def test_physical_cores_are_counted_within_the_affinity_mask() -> None:
    """Under taskset or a container's cpuset the default thread count is the cores this
    process may run on, not every core of the machine."""
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    code = "from colibri.engine import _core; print(_core.physical_cores())"
    for mask, want in (({cpus[-1]}, 1), (set(cpus), core.physical_cores())):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, preexec_fn=lambda m=mask: os.sched_setaffinity(0, m))
        assert int(out.stdout) == want, mask
