#!/usr/bin/env bash
# Builds engine._core with ThreadSanitizer (COLIBRI_SANITIZE=thread) in a throw-away copy of
# the tree, then runs the tests of the threaded C code under it: the thread pool and the expert
# cache with its prefetch thread. Fails on any data race report.
# Usage: scripts/tsan.sh [extra pytest args]. Needs Cython (in the `test` extras) and gcc.
set -euo pipefail

python -c "import Cython" 2>/dev/null || {
    echo "scripts/tsan.sh needs Cython to build the extension: pip install -e '.[test]'" >&2
    exit 1
}

repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/colibri_tsan.XXXXXX)"
trap 'rm -rf "$work"' EXIT

(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) | (cd "$work" && tar xf -)

cd "$work"
COLIBRI_SANITIZE=thread python setup.py build_ext --inplace -j 1 --build-temp "$work/build" \
    > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }

syms="$(nm -D engine/_core*.so)"
grep -q __tsan_ <<<"$syms" || { echo "build is not instrumented"; exit 1; }

libtsan="$(gcc -print-file-name=libtsan.so)"
export LD_PRELOAD="$libtsan"
# report races in Colibri's C code; the uninstrumented interpreter and numpy are not checked
# third-party thread pools (the tokenizers' and torch's, used to build test checkpoints) are
# not instrumented and would report false races: run them single-threaded
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0 log_path=$work/tsan"
DEFAULT_TESTS=(tests/test_threadpool.py tests/test_expert_cache.py)
status=0
python -m pytest -q -p no:cacheprovider "${DEFAULT_TESTS[@]}" "$@" || status=$?
if ls "$work"/tsan.* >/dev/null 2>&1; then
    cat "$work"/tsan.*
    echo "ThreadSanitizer reported the above" >&2
    exit 1
fi
exit "$status"
