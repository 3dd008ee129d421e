#!/usr/bin/env bash
# Builds colibri.engine._core with ThreadSanitizer (COLIBRI_SANITIZE=thread) in a throw-away copy of
# the tree, then runs the tests of the threaded C code under it: the thread pool and the expert
# cache with its reader threads and the thread that pre-faults its slots. Fails on any data
# race report.
# Usage: scripts/tsan.sh [extra pytest args]. Needs Cython (in the `test` extras) and gcc.
set -euo pipefail

. "$(dirname "$0")/sanitized_build.sh"
sanitized_build tsan.sh thread __tsan_

libtsan="$(gcc -print-file-name=libtsan.so)"
# the interpreter itself, not a launcher script in front of it (pyenv's shims crash under
# the preloaded runtime)
py="$(python -c 'import sys; print(sys.executable)')"
export LD_PRELOAD="$libtsan"
# report races in Colibri's C code; the uninstrumented interpreter and numpy are not checked
# third-party thread pools (the tokenizers' and torch's, used to build test checkpoints) are
# not instrumented and would report false races: run them single-threaded
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0 log_path=$work/tsan"
DEFAULT_TESTS=(tests/test_threadpool.py tests/test_expert_cache.py tests/test_expert_cache_warm.py)
status=0
"$py" -m pytest -q -p no:cacheprovider "${DEFAULT_TESTS[@]}" "$@" || status=$?
if ls "$work"/tsan.* >/dev/null 2>&1; then
    cat "$work"/tsan.*
    echo "ThreadSanitizer reported the above" >&2
    exit 1
fi
exit "$status"
