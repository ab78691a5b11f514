#!/bin/bash
# One GPU call for issue 14's item 4(d) and item 6 (docs/LEARNED.md §10i): GLM-5.3-Flash at real widths (as many
# layers as VRAM holds, generated in place) fused against torch, and every family's oracle fixture on CUDA with the
# packages the GPU machine lacks (transformers 5.24 for glm5_next's config, the openai client and fastapi for mixtral's
# and glm4_moe's test modules) put first on the path from wheels carried in .whl/extra and .whl/oa.
#   bash benchmarks/cuda_families_call.sh OUT [STEPS] [LIMIT]   (repository root; STEPS of 123: GLM-5.3, the
#   tests (TESTS: more test files; TESTS_ONLY: these instead), Kimi-Linear; PROFILE=N: torch.profiler over N steps of GLM-5.3's arms)
DEF_STEPS=12 DEF_LIMIT=540
source "$(dirname "$0")/cuda_call_setup.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 .whl/oa/*.whl \
  .whl/extra/*.whl 2>&1 | tail -2
if [[ $STEPS == *1* ]]; then
  for L in 28 16; do
    step "1: GLM-5.3-Flash, q4, $L layers: fused / torch"
    timeout 260 python3 benchmarks/gpu_profile.py random:glm-5.3-flash,experts=q4,layers=$L -n 16 --rounds 2 \
      --profile ${PROFILE:-0} --arms fused,kdaeager,torch --json "$OUT/glm5_$L.json" 2>&1 | grep -v -i warn | tail -30 && break
  done
fi
if [[ $STEPS == *3* ]]; then
  step "3: Kimi-Linear, q4, 27 layers: fused / torch"
  timeout 200 python3 benchmarks/gpu_profile.py random:kimi-linear-48b-a3b,experts=q4 -n 32 --rounds 2 --profile 0 \
    --arms fused,kdaeager,torch --json "$OUT/kimi.json" 2>&1 | grep -v -i warn | tail -30
fi
if [[ $STEPS == *2* ]]; then
  step "2: every family's oracle fixture on CUDA (transformers, openai and fastapi from the carried wheels)"
  PYTHONPATH=/tmp/site2:$PYTHONPATH timeout $((LIMIT - SECONDS - 10)) python3 -m pytest -rA -q -p no:cacheprovider \
    ${TESTS_ONLY:-tests/test_cuda_families.py tests/test_cuda.py ${TESTS:-}} 2>&1 | tee "$OUT/families.txt" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" | tail -60
fi
step done
