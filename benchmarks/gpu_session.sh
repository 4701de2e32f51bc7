#!/usr/bin/env bash
# Everything GPU-side in one run (a lent GPU's time is short; each step has its own time limit, and one that
# fails or runs out does not stop the next):
#   1. the Triton kernel tests compiled for the GPU;
#   2. a hardware profile of Llama-3-8B (random weights) for profiles/ (the quick grid unless PROFILE_GRID=full);
#   3. the simulator's fidelity on the GPU against that profile, and its per-step errors on one replay;
#   4. where a step's time goes (torch.profiler: kernels, launches, synchronisations per step);
#   5. the kernel benchmark (decode at 16/8/4/2 bits, the Triton prefill, quantize-on-append).
#     [SKISTUNE_TRACES=DIR] bash benchmarks/gpu_session.sh [OUT_DIR]
# The device image has torch and triton but not all of skistune's dependencies (no optuna, pulp or gguf),
# so the checkout is not installed: symlinks inside this (throw-away) copy's skistune/ map runtime/,
# kernels/ and searchspace/ where the installed package has them. PYTHONPATH names a scratch folder holding
# one link, skistune -> this copy's skistune/, not the repository root: tests/conftest.py takes the root off
# sys.path (from there the root's kernels/ would shadow Hugging Face's `kernels` package), and the kernel
# tests would then find no skistune.
# The links are made only once every check below passed, and removed when the script exits, however it exits:
# left behind, they sat in a checkout as untracked files (a tester's --help had run the whole session).
set -u
usage() {
    cat <<'USAGE'
usage: [SKISTUNE_TRACES=DIR] [PROFILE_GRID=full] [PYTHON=python3] bash benchmarks/gpu_session.sh [OUT_DIR]

Everything GPU-side in one run, on a machine with an NVIDIA GPU, from the repository's root: the Triton
kernel tests, a hardware profile of Llama-3-8B (random weights), the simulator's fidelity against it (and
step by step), where a step's time goes, and the kernel benchmark. Each step's output is written to
OUT_DIR (default $OUT, else /tmp/skistune-gpu).

  -h, --help  show this help and exit
USAGE
}
refuse() {  # bad input or the wrong machine: one line, exit code 2, nothing made or written
    echo "error: $*" >&2
    exit 2
}
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    -*) refuse "unknown option $1 (bash benchmarks/gpu_session.sh --help)" ;;
esac
[ $# -le 1 ] || refuse "one OUT_DIR at most, not $# arguments (bash benchmarks/gpu_session.sh --help)"
[ -d skistune ] && [ -d runtime ] && [ -f benchmarks/gpu_session.sh ] \
    || refuse "run it from the repository's root (no skistune/, runtime/ or benchmarks/ here)"
# every step times or compiles for an NVIDIA GPU: without one the session measures nothing (it had run on a
# CPU-only machine for minutes and exited 0)
command -v nvidia-smi > /dev/null 2>&1 || refuse "no NVIDIA GPU here (no nvidia-smi): this session runs on one"
nvidia-smi -L > /dev/null 2>&1 || refuse "no NVIDIA GPU here (nvidia-smi -L failed): this session runs on one"
export PYTHONUNBUFFERED=1
OUT_DIR=${1:-${OUT:-/tmp/skistune-gpu}}
mkdir -p "$OUT_DIR" || refuse "OUT_DIR $OUT_DIR: cannot make that folder"
LINKS=()
IMPORT_DIR=""
cleanup() {
    local link
    for link in ${LINKS[@]+"${LINKS[@]}"}; do rm -f "$link"; done
    if [ -n "$IMPORT_DIR" ]; then rm -rf "$IMPORT_DIR"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
link() {  # ln -s TARGET NAME, replacing a link (one an older run of this script left) but never a folder
    if [ -L "$2" ] || [ ! -e "$2" ]; then
        ln -sfn "$1" "$2" && LINKS+=("$2")
    fi
}
link ../runtime skistune/runtime
link ../kernels skistune/kernels
link ../searchspace skistune/searchspaces
IMPORT_DIR=$(mktemp -d)
ln -sfn "$PWD/skistune" "$IMPORT_DIR/skistune"
export PYTHONPATH="$IMPORT_DIR"
PY=${PYTHON:-python3}
MODEL=llama-3-8b
# the Azure and Mooncake samples: ../shared does not travel to a lent GPU machine, so a copy is carried there
TRACES=${SKISTUNE_TRACES:-../shared/traces}
# fidelity.py's configs but int8 and no-chunking (int4 and chunk32 cover those families), to fit the time
FIDELITY_CONFIGS="default seqs4 chunk32 no-prefix tight-kv-edf int4 int4-tight-kv h2o-50 snapkv-30-pyramid
    host-prefetch-blocks host-prefetch-layers"
SECONDS=0
# each step's header carries the GPU's clocks and power as it begins: on 2026-12-04 the same runtime steps
# timed 2.2x apart within one process (fidelity's speed checks), and the clocks are the first suspect
step() {
    echo "== [$SECONDS s] $*"
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader 2>&1 \
        | sed 's/^/   gpu now (SM clock, memory clock, power, temperature): /'
}

step "machine" | tee "$OUT_DIR/gpu.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT_DIR/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT_DIR/gpu.txt"

step "kernel tests (compiled Triton)" | tee -a "$OUT_DIR/gpu.txt"
timeout 100 $PY -m pytest -q --tb=line -p no:cacheprovider tests/kernels/test_triton.py tests/kernels/test_quant.py 2>&1 \
    | tail -30 | tee -a "$OUT_DIR/gpu.txt"

# the quick grid by default: on 2026-12-04 the full grid did not finish in 180 s (the quick one took 22 s)
step "hardware profile, $MODEL (PROFILE_GRID=full for the full grid, with a longer limit)"
QUICK=--quick; LIMIT=120
if [ "${PROFILE_GRID:-quick}" = full ]; then QUICK=""; LIMIT=400; fi
PROFILE="$OUT_DIR/cuda-$MODEL${QUICK:+-quick}.json"
timeout $LIMIT $PY -m skistune profile --device cuda --model $MODEL $QUICK --out "$PROFILE" > "$OUT_DIR/profile.txt" 2>&1
echo "exit $?" >> "$OUT_DIR/profile.txt"
tail -45 "$OUT_DIR/profile.txt"
if [ ! -s "$PROFILE" ]; then  # the simulator still needs a profile of this GPU: the one shipped
    echo "no new profile: fidelity reads profiles/cuda-$MODEL-quick.json"; PROFILE="profiles/cuda-$MODEL-quick.json"
fi

step "fidelity on the GPU"
timeout 150 $PY benchmarks/fidelity.py --model $MODEL --device cuda --profile "$PROFILE" --requests 12 \
    --rate-scale 12 --traces "$TRACES" --configs $FIDELITY_CONFIGS --json 2>&1 | tee "$OUT_DIR/fidelity.txt"
step "fidelity step by step: bursty-chat, default"
timeout 25 $PY benchmarks/fidelity_steps.py --model $MODEL --device cuda --profile "$PROFILE" \
    --traces "$TRACES" --workload bursty-chat --requests 12 --rate-scale 12 --replays 1 --json 2>&1 | tee "$OUT_DIR/steps.txt"

step "where a step's time goes"
timeout 40 $PY benchmarks/step_trace.py --model $MODEL --device cuda --json 2>&1 | tee "$OUT_DIR/trace.txt"

step "kernel benchmark"
timeout 50 $PY benchmarks/kernel_timing.py --shapes 1x65536 32x8192 64x16384 --json 2>&1 | tee "$OUT_DIR/kernels.txt"
step "done"
