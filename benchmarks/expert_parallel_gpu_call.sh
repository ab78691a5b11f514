#!/bin/bash
# One call on the 2-GPU machine (docs/LEARNED.md §11): NCCL's zero-size splits and the exchange alone, then decode
# on 2 GPUs (expert parallel) against 1 for the Qwen3-30B shape and K3 at real widths (random weights generated in
# place), the NCCL bit-identity tests. Most wanted first; every step has its own time limit and says so when cut,
# and the whole call stops starting steps once BUDGET seconds (default 300) are spent.
#   bash benchmarks/expert_parallel_gpu_call.sh OUT      (run from the repository root, with waste installed)
set -o pipefail
OUT=${1:-/tmp/ep-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-} WASTE_EP_TIMEOUT=${WASTE_EP_TIMEOUT:-60}
END=$((SECONDS + ${BUDGET:-300}))
T="torchrun --standalone --nproc-per-node 2"
B=benchmarks/expert_parallel_gpu.py
Q=random:qwen3-30b-a3b,experts=q4
K=random:kimi-k3,experts=mxfp4
G=${GPUS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}     # GPUS=N: a dry run of the steps
# step LIMIT NEED WHAT CMD...: CMD under `timeout LIMIT` (less if the call's time runs short), its output kept in
# OUT/log; NEED 2: only where 2 GPUs are. A cut step says so; the progress lines above it say where it was.
step() {
    local limit=$1 need=$2 what=$3 left=$((END - SECONDS))
    shift 3
    echo "=== $(date +%T) [$((SECONDS))s] $what"
    if [ "$need" -gt "$G" ]; then echo "skipped: needs $need GPUs, this machine has $G"; return; fi
    if [ "$left" -lt 20 ]; then echo "skipped: the call's time is spent"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 5 "$limit" "$@" 2>&1 | grep -v "^W[0-9]* \|^  warnings.warn\|^\*\*\*\*\|OMP_NUM_THREADS"
    local rc=$?
    [ "$rc" -eq 124 ] && echo "CUT: '$what' still running after its $limit s limit (its last progress lines are above)"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && echo "FAILED ($rc): $what"
}
{
step 20 1 setup bash -c "nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -4; \
python3 -c \"import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', \
torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())\""
step 45 2 "NCCL: zero-size splits, then the exchange alone at 2048 wide top-8 (no compute)" \
    $T benchmarks/expert_parallel.py --device cuda --iters 300
step 120 2 "qwen3-30b 48 layers q4 on 2 GPUs" $T $B $Q -n 8 --repeat 3
step 60 1 "qwen3-30b 48 layers q4 on 1 GPU" python3 $B $Q -n 8 --repeat 3
step 120 2 "NCCL bit-identity on random models (tiny qwen3_moe bf16 and q4, K3 mxfp4): one process vs 2 GPUs" \
    python3 -m pytest -rA -q -p no:cacheprovider tests/test_random_model.py -k gpus
step 40 2 "the exchange alone at K3's latent 3584 wide top-16" \
    $T benchmarks/expert_parallel.py --device cuda --hidden 3584 --top-k 16 --iters 300
step 100 2 "kimi-k3 8 layers (7 MoE) mxfp4 on 2 GPUs" $T $B $K,layers=8 -n 8 --repeat 3
step 60 1 "kimi-k3 8 layers (7 MoE) mxfp4 on 1 GPU" python3 $B $K,layers=8 -n 8 --repeat 3
step 120 2 "kimi-k3 17 layers mxfp4 on 2 GPUs (what 2 hold, the trunk on rank 0 alone)" $T $B $K,layers=17 -n 8 --repeat 3
step 120 2 "qwen3-30b 48 layers q4 on 2 GPUs, -n 32" $T $B $Q -n 32 --repeat 3
step 150 2 "families' NCCL bit-identity (transformers fixtures)" \
    python3 -m pytest -rA -q -p no:cacheprovider tests/test_expert_parallel.py -k two_gpus
echo "=== $(date +%T) [$((SECONDS))s] done"
} 2>&1 | tee "$OUT/log"
