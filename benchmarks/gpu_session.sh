#!/usr/bin/env bash
# Everything GPU-side in one run (a lent GPU's time is short): the kernel tests compiled for the GPU,
# the kernel benchmark, and a quick hardware profile of Llama-3-8B (random weights) for profiles/.
#   bash benchmarks/gpu_session.sh [OUT_DIR]
# The device image has torch and triton but not all of skistune's dependencies, so the checkout is
# imported through a shim of symlinks instead of being installed (only torch/triton/numpy/scipy/rich/
# typer/pyyaml are needed for these three jobs).
set -u
export PYTHONUNBUFFERED=1
OUT_DIR=${1:-${OUT:-/tmp/skistune-gpu}}
mkdir -p "$OUT_DIR"
SHIM=$(mktemp -d)
mkdir -p "$SHIM/skistune"
for f in "$PWD"/skistune/*; do ln -s "$f" "$SHIM/skistune/"; done
ln -s "$PWD/runtime" "$SHIM/skistune/runtime"
ln -s "$PWD/kernels" "$SHIM/skistune/kernels"
ln -s "$PWD/searchspace" "$SHIM/skistune/searchspaces"
export PYTHONPATH="$SHIM"
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT_DIR/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT_DIR/gpu.txt"

echo "== kernel tests (compiled Triton)"
timeout 240 $PY -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -25 | tee "$OUT_DIR/tests.txt"

echo "== kernel benchmark"
timeout 240 $PY benchmarks/kernels.py --json 2>&1 | tee "$OUT_DIR/kernels.txt"

echo "== hardware profile, llama-3-8b, quick"
timeout 300 $PY -m skistune profile --device cuda --model llama-3-8b --quick \
    --out "$OUT_DIR/cuda-llama-3-8b-quick.json" 2>&1 | tail -40 | tee "$OUT_DIR/profile.txt"
