#!/bin/bash
# One GPU call for issue 14 (docs/LEARNED.md §10b): the fused decode kernels checked compiled; where a decode step's
# time goes, the fused kernels against the torch path (8 and 48 layers of the Qwen3-30B-A3B shape, q4, generated in
# place); the GPU tests; a 4-layer release resident, streamed from the disk and through the VRAM tier, beside its
# transformers peers (last, in the time left of LIMIT seconds).
#   bash benchmarks/cuda_decode_call.sh OUT [STEPS] [LIMIT]   (repository root, waste installed; STEPS: of 12345)
DEF_STEPS=12345 DEF_LIMIT=560
source "$(dirname "$0")/cuda_call_setup.sh"
python3 -c "import torch, triton, transformers, accelerate; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
ARMS=torch
if [[ $STEPS == *1* ]]; then
  step "1: the fused kernels compiled, against the torch ops and each format's unpack"
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_decode_triton.py tests/test_moe_triton.py 2>&1 | tail -4 \
    && ARMS=fused,block,torch
fi
if [[ $STEPS == *2* ]]; then
  step "2: 8 layers, q4, arms $ARMS"
  timeout 90 python3 benchmarks/gpu_profile.py random:qwen3-30b-a3b,experts=q4,layers=8 -n 48 --rounds 3 --profile 2 \
    --arms $ARMS --json "$OUT/profile8.json" 2>&1 | grep -v -i warn
fi
if [[ $STEPS == *3* ]]; then
  step "3: all 48 layers, q4, arms $ARMS"
  timeout 140 python3 benchmarks/gpu_profile.py random:qwen3-30b-a3b,experts=q4 -n 48 --rounds 3 --profile ${PROF48:-1} \
    --arms $ARMS --json "$OUT/profile48.json" 2>&1 | grep -v -i warn
fi
if [[ $STEPS == *5* ]]; then
  step "5: the GPU tests"
  timeout 200 python3 -m pytest -rA -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_families.py \
    tests/test_moe_triton.py tests/test_static_decode.py tests/test_vram_tier.py tests/test_random_model.py \
    tests/test_decode_triton.py 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" | tail -80
fi
if [[ $STEPS == *4* ]]; then
  step "4: 4 layers from a release: resident, disk-streamed (budget a quarter), VRAM tier; transformers peers"
  timeout $((LIMIT - SECONDS)) python3 benchmarks/gpu_decode.py /tmp/g4 --layers 4 -n 24 --experts q4 --variants whole \
    --budget-frac 0.25 --vram-frac 0.25 --rounds 2 --peer --offload-peer 2>&1 | grep -v -i -E "warn|Loading weights"
fi
step done
