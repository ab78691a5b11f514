# Sourced by the benchmarks/cuda_*_call.sh scripts: OUT, STEPS and LIMIT from their arguments (defaults DEF_STEPS,
# DEF_LIMIT), the environment a call's python needs, step() to mark the log, and the GPU's state first.
set -o pipefail
OUT=${1:-/tmp/cuda-call}
STEPS=${2:-$DEF_STEPS}
LIMIT=${3:-$DEF_LIMIT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
step() { echo "=== $(date +%T) ${SECONDS}s $*"; }
step setup
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
