#!/usr/bin/env bash
# Builds engine._core with AddressSanitizer + UndefinedBehaviorSanitizer (COLIBRI_SANITIZE=1)
# in a throw-away copy of the tree, so the normal in-place build is left alone, then runs the
# default tests below (kernels, pool, thread pool, weight-file loader, weight faults) under it.
# Usage: scripts/asan.sh [extra pytest args]. Needs Cython (in the `test` extras) and gcc.
set -euo pipefail

python -c "import Cython" 2>/dev/null || {
    echo "scripts/asan.sh needs Cython to build the extension: pip install -e '.[test]'" >&2
    exit 1
}

repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/colibri_asan.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# tracked + untracked-but-not-ignored files only: no build outputs, no stale .so
(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) | (cd "$work" && tar xf -)

cd "$work"
COLIBRI_SANITIZE=1 python setup.py build_ext --inplace -j 1 --build-temp "$work/build" \
    > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }

# refuse to report green from an uninstrumented build
syms="$(nm -D engine/_core*.so)"
grep -q __asan_report <<<"$syms" || { echo "build is not instrumented"; exit 1; }

libasan="$(gcc -print-file-name=libasan.so)"
export LD_PRELOAD="$libasan"
export ASAN_OPTIONS=detect_leaks=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
DEFAULT_TESTS=(tests/test_kernels.py tests/test_pool.py tests/test_threadpool.py
               tests/test_model_files.py tests/test_reliability_files.py
               tests/test_expert_cache.py)
python -m pytest -q -p no:cacheprovider "${DEFAULT_TESTS[@]}" "$@"
