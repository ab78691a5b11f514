#!/bin/bash
# One call on the 2-GPU machine (docs/LEARNED.md §11): the NCCL bit-identity tests, then decode on 1 GPU against 2
# (expert parallel) for the Qwen3-30B shape and K3 at real widths, random weights generated in place.
#   bash benchmarks/expert_parallel_gpu_call.sh OUT      (run from the repository root, with waste installed)
set -o pipefail
OUT=${1:-/tmp/ep-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
T="torchrun --standalone --nproc-per-node 2"
B=benchmarks/expert_parallel_gpu.py
step() { echo "=== $(date +%T) $*"; }
step setup
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
G=$(python3 -c "import torch; print(torch.cuda.device_count())")
two() { if [ "$G" -ge 2 ]; then "$@"; else echo "skipped (one GPU): $*"; fi; }
step tests
two timeout 80 python3 -m pytest -rA -q -p no:cacheprovider tests/test_random_model.py -k gpus 2>&1 | tail -8
one() { if [ "$G" -lt 2 ]; then "$@"; else echo "skipped (two GPUs: done on one before): $*"; fi; }
step "one GPU: the same spec generated twice gives the same bits (fresh processes, float32)"
W="q=random:qwen3-30b-a3b,layers=2,experts=q4 k=random:kimi-k3,layers=2,experts=mxfp4"
mkdir -p "$OUT/a" "$OUT/b"
one timeout 60 python3 tests/ep_worker.py "$OUT/a" --device cuda $W 2>&1 | tail -3
one timeout 60 python3 tests/ep_worker.py "$OUT/b" --device cuda $W 2>&1 | tail -3
[ "$G" -ge 2 ] || python3 -c "
import torch
for n in 'qk':
    a, b = (torch.load(f'$OUT/{d}/{n}.pt') for d in 'ab')
    print(n, {k: torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)}, 'greedy', a['greedy'].tolist())
"
rm -rf "$OUT/a" "$OUT/b"
Q=random:qwen3-30b-a3b,experts=q4
K=random:kimi-k3,experts=mxfp4
step "qwen3-30b 48 layers q4: 1 GPU, 2 GPUs"
timeout 70 python3 $B $Q -n 32 --repeat 3 2>&1 | grep -v "^W" | tail -6
two timeout 80 $T $B $Q -n 32 --repeat 3 2>&1 | grep -v "^W" | tail -6
step "kimi-k3 8 layers (7 MoE) mxfp4: 1 GPU, 2 GPUs; 15 layers on 2 GPUs"
timeout 80 python3 $B $K,layers=8 -n 16 --repeat 3 2>&1 | grep -v "^W" | tail -6
two timeout 90 $T $B $K,layers=8 -n 16 --repeat 3 2>&1 | grep -v "^W" | tail -6
step "exchange alone (no compute): 2048 wide top-8, then K3's latent 3584 top-16"
two timeout 40 $T benchmarks/expert_parallel.py --device cuda --iters 300 2>&1 | grep -v "^W"
two timeout 40 $T benchmarks/expert_parallel.py --device cuda --hidden 3584 --top-k 16 --iters 300 2>&1 | grep -v "^W"
two timeout 100 $T $B $K,layers=15 -n 16 --repeat 3 2>&1 | grep -v "^W" | tail -6
step "one GPU: qwen3-30b 48 layers bf16"
[ "$G" -ge 2 ] || timeout 90 python3 $B random:qwen3-30b-a3b,experts=bf16 -n 32 --repeat 3 2>&1 | grep -v "^W" | tail -6
step "families' NCCL test (transformers fixtures)"
two timeout 150 python3 -m pytest -rA -q -p no:cacheprovider tests/test_expert_parallel.py -k two_gpus 2>&1 | tail -12
step done
