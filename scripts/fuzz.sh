#!/usr/bin/env bash
# Coverage-guided fuzzing of the two parsers a model folder reaches first, under
# AddressSanitizer + UBSan, for a fixed number of runs per target:
#   wfile-c   libFuzzer on csrc/wfile.c itself (scripts/fuzz/wfile_fuzzer.c, needs clang)
#   wfile     the same parser through colibri.engine._core (atheris; an ASan build made in a copy)
#   config    config.json reading and checking (colibri.engine.format.jsonfile + colibri.engine.models.config, atheris)
# Usage: scripts/fuzz.sh [RUNS per target, default 20000]. Needs atheris and Cython (pip) and
# gcc; clang for wfile-c (skipped with a note without it). Exit status is non-zero on a
# finding; libFuzzer leaves the input that crashed as crash-* in the current folder.
set -euo pipefail

runs="${1:-20000}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d /tmp/colibri_fuzz.XXXXXX)"
trap 'rm -rf "$work"' EXIT
python -c "import atheris, Cython" 2>/dev/null || {
    echo "scripts/fuzz.sh needs atheris and Cython: pip install atheris Cython" >&2; exit 1; }

(cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) | (cd "$work" && tar xf -)
cd "$work"
COLIBRI_SANITIZE=1 python setup.py build_ext --inplace -j 1 --build-temp "$work/build" \
    > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
syms="$(nm -D engine/_core*.so)"
grep -q __asan_report <<<"$syms" || { echo "build is not instrumented"; exit 1; }
. "$repo/scripts/sanitized_build.sh"
point_names_at "$work"

export LD_PRELOAD="$(gcc -print-file-name=libasan.so)"
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

# seeds: a small valid file and the demo model's converted weight files
mkdir -p "$work/corpus-wfile"
python - "$work/corpus-wfile" <<'PY'
import shutil, sys
from pathlib import Path
from colibri.engine.format.convert import ensure_converted
from colibri.engine.llm import default_model_path
out = Path(sys.argv[1])
sys.argv = ["fuzz_loader"]
import importlib.util
spec = importlib.util.spec_from_file_location("fl", "scripts/fuzz_loader.py")
fl = importlib.util.module_from_spec(spec); spec.loader.exec_module(fl)
(out / "seed.bin").write_bytes(fl._seed_weight_file())
for p in sorted(ensure_converted(default_model_path(), "q8").rglob("*.bin")):
    if p.stat().st_size <= 1 << 16:
        shutil.copy(p, out / p.name)
PY

if command -v clang >/dev/null; then
    echo "== wfile-c: $runs runs"
    clang -g -O1 -std=c11 -Wall -Wextra -fsanitize=fuzzer,address,undefined \
        -fno-sanitize-recover=undefined -Icsrc scripts/fuzz/wfile_fuzzer.c csrc/wfile.c \
        csrc/wfault.c csrc/types.c csrc/util.c -lm -o "$work/wfile_fuzzer"
    env -u LD_PRELOAD ASAN_OPTIONS=detect_leaks=1 "$work/wfile_fuzzer" -runs="$runs" -max_len=65536 \
        -print_final_stats=1 "$work/corpus-wfile" 2>&1 | tail -12
    test "${PIPESTATUS[0]}" -eq 0
else
    echo "== wfile-c: skipped (no clang)"
fi

for target in wfile config; do
    echo "== $target: $runs runs"
    # config reading is pure Python: run it without the sanitizer runtime, which keeps
    # atheris' coverage feedback working (the wfile target goes through the ASan build)
    pre=()
    [ "$target" = config ] && pre=(env -u LD_PRELOAD)
    "${pre[@]}" python scripts/fuzz_loader.py "$target" -runs="$runs" \
        -max_len=65536 -timeout=10 -print_final_stats=1 2>&1 | tail -12
    test "${PIPESTATUS[0]}" -eq 0
done
