#!/usr/bin/env bash
# Builds colibri.engine._core with AddressSanitizer + UndefinedBehaviorSanitizer (COLIBRI_SANITIZE=1)
# in a throw-away copy of the tree, so the normal in-place build is left alone, then runs the
# default tests below (kernels, pool, thread pool, weight-file loader, weight faults) under it.
# Usage: scripts/asan.sh [extra pytest args]. Needs Cython (in the `test` extras) and gcc.
set -euo pipefail

. "$(dirname "$0")/sanitized_build.sh"
sanitized_build asan.sh 1 __asan_report

libasan="$(gcc -print-file-name=libasan.so)"
export LD_PRELOAD="$libasan"
export ASAN_OPTIONS=detect_leaks=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
DEFAULT_TESTS=(tests/test_kernels.py tests/test_pool.py tests/test_threadpool.py
               tests/test_model_files.py tests/test_reliability_files.py
               tests/test_expert_cache.py tests/test_expert_cache_warm.py tests/test_repack.py)
python -m pytest -q -p no:cacheprovider "${DEFAULT_TESTS[@]}" "$@"
