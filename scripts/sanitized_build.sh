# Sourced by scripts/asan.sh and scripts/tsan.sh: sanitized_build NAME MODE SYMBOL builds
# colibri.engine._core with COLIBRI_SANITIZE=MODE in a throw-away copy of the tree (the normal
# in-place build is left alone), checks that the library carries SYMBOL (so an uninstrumented
# build never reports green), and leaves the shell in that copy with $work set. Needs Cython
# (in the `test` extras) and gcc.
# point_names_at DIR: the code imports itself as colibri.app / colibri.engine; make those names
# reach the copy in DIR (ahead of an installed or editable colibri) through PYTHONPATH.
point_names_at() {
    mkdir -p "$1/_names/colibri"
    : > "$1/_names/colibri/__init__.py"
    ln -sfn "$1/app" "$1/_names/colibri/app"
    ln -sfn "$1/engine" "$1/_names/colibri/engine"
    export PYTHONPATH="$1/_names${PYTHONPATH:+:$PYTHONPATH}"
}

sanitized_build() {
    local name="$1" mode="$2" symbol="$3"
    python -c "import Cython" 2>/dev/null || {
        echo "scripts/$name needs Cython to build the extension: pip install -e '.[test]'" >&2
        exit 1
    }
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    work="$(mktemp -d "/tmp/colibri_${name%.sh}.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    # tracked + untracked-but-not-ignored files only: no build outputs, no stale .so
    (cd "$repo" && git ls-files -co --exclude-standard -z | xargs -0 tar cf -) \
        | (cd "$work" && tar xf -)
    cd "$work"
    COLIBRI_SANITIZE="$mode" python setup.py build_ext --inplace -j 1 --build-temp "$work/build" \
        > "$work/build.log" 2>&1 || { tail -50 "$work/build.log"; exit 1; }
    grep -q "$symbol" <<<"$(nm -D engine/_core*.so)" || { echo "build is not instrumented"; exit 1; }
    point_names_at "$work"
}
