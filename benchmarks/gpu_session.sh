#!/usr/bin/env bash
# Everything GPU-side in one run (a lent GPU's time is short): the kernel tests compiled for the GPU,
# the kernel benchmark, and a quick hardware profile of Llama-3-8B (random weights) for profiles/.
#   bash benchmarks/gpu_session.sh [OUT_DIR]
# The device image has torch and triton but not all of skistune's dependencies, so the checkout is
# not installed: symlinks inside this (throw-away) copy's skistune/ map runtime/, kernels/ and
# searchspace/ where the installed package has them (only torch/triton/numpy/scipy/rich/typer/pyyaml
# are needed for these three jobs). PYTHONPATH names a scratch folder holding one link, skistune ->
# this copy's skistune/, not the repository root: tests/conftest.py takes the root off sys.path (from
# there the root's kernels/ would shadow Hugging Face's `kernels` package), and the kernel tests
# would then find no skistune.
set -u
export PYTHONUNBUFFERED=1
OUT_DIR=${1:-${OUT:-/tmp/skistune-gpu}}
mkdir -p "$OUT_DIR"
ln -sfn ../runtime skistune/runtime
ln -sfn ../kernels skistune/kernels
ln -sfn ../searchspace skistune/searchspaces
IMPORT_DIR=$(mktemp -d)
ln -sfn "$PWD/skistune" "$IMPORT_DIR/skistune"
export PYTHONPATH="$IMPORT_DIR"
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT_DIR/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT_DIR/gpu.txt"

echo "== kernel tests (compiled Triton)"
timeout 120 $PY -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -25 | tee "$OUT_DIR/tests.txt"

echo "== kernel benchmark"
timeout 240 $PY benchmarks/kernel_timing.py --sweep --json 2>&1 | tee "$OUT_DIR/kernels.txt"

echo "== hardware profile, llama-3-8b (PROFILE_GRID=quick for the quick grid)"
QUICK=""; NAME=cuda-llama-3-8b
if [ "${PROFILE_GRID:-full}" = quick ]; then QUICK=--quick; NAME=$NAME-quick; fi
timeout 240 $PY -m skistune profile --device cuda --model llama-3-8b $QUICK \
    --out "$OUT_DIR/$NAME.json" 2>&1 | tail -40 | tee "$OUT_DIR/profile.txt"
