#!/usr/bin/env bash
# On a machine with a CUDA GPU and PyTorch for CUDA (plus the test extras but torch, installed
# beforehand: it reaches no network): builds the C extension in place, runs the torch backend's
# tests on the GPU, then prints the GPU figures (scripts/device_check.py): decode tokens/s all on
# the GPU beside the HBM bound, a --gpu-memory-mb run holding the non-expert weights and a
# quarter of the experts against the CPU-only decode, and predicted against measured step time
# at three budgets. Meant to finish in under 8 minutes. Usage: scripts/device_check.sh [cuda:N]
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE="${1:-cuda:0}"
START=$SECONDS

python - <<'PY'
import importlib, sys
missing = [m for m in ("numpy", "torch", "transformers", "pytest", "Cython", "safetensors")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"device_check: install these first: {', '.join(missing)}")
import torch
if not torch.cuda.is_available():
    sys.exit("device_check: torch sees no CUDA device")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0)}", flush=True)
PY

echo "== build (C extension in place)"
python setup.py build_ext --inplace -j "$(nproc)" > /tmp/colibri_device_build.log 2>&1 \
    || { tail -40 /tmp/colibri_device_build.log; exit 1; }
# the package imports itself as colibri.*: a link to the tree when it is not installed
if ! python -c "import colibri.engine" 2>/dev/null; then
    mkdir -p /tmp/colibri_site && ln -sfn "$PWD" /tmp/colibri_site/colibri
    export PYTHONPATH="/tmp/colibri_site${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "   $((SECONDS - START)) s"

echo "== the torch backend's tests on $DEVICE"
COLIBRI_TEST_TORCH_DEVICE="$DEVICE" timeout 240 python -m pytest -q -x -p no:cacheprovider \
    tests/test_torch_backend.py -k "f32 or split or paged or linear" 2>&1 | tail -5
echo "== routed experts split between $DEVICE and the C core, and the GPU tier"
COLIBRI_TEST_TORCH_DEVICE="$DEVICE" timeout 120 python -m pytest -q -x -p no:cacheprovider \
    tests/test_expert_split.py -m "not slow" 2>&1 | tail -3
echo "   $((SECONDS - START)) s"

echo "== figures"
timeout 240 python scripts/device_check.py --device "$DEVICE"
echo "   $((SECONDS - START)) s in all"
