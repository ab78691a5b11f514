#!/bin/bash
# One GPU call for issue 14's decode kernels (docs/LEARNED.md §10j, §10k). STEPS of 12345, in that order: 1 the
# kernels' tests compiled; 2 the q4 launches alone, every tile of q4_int8_rows (benchmarks/q4_tiles.py; SET_DEFAULT=1:
# the fastest written into q4_int8_rows' defaults for the later steps), then the trunk's matvecs and the router
# (benchmarks/gemv_tiles.py: the fastest tiles a shape into $OUT/gemv.json, which step 3 reads); 3 all 48 layers of
# the 30B shape, q4, this tree's arms and AB_TREE's (the tree before, default .ab/main, fused only) in alternating
# processes; 4 the GPU tests; 5 Kimi-Linear (27 layers) and GLM-5.3-Flash (28 layers) at real widths, q4, this tree
# against AB_TREE. Wheels of what the GPU machine lacks (platformdirs, isal, fastapi, the openai client, ...) come
# from .whl, transformers 5.24 from .whl_tf where carried (the tests' oracles).
#   bash benchmarks/cuda_rows_call.sh OUT [STEPS] [LIMIT]   (repository root)
DEF_STEPS=12345 DEF_LIMIT=570
source "$(dirname "$0")/cuda_call_setup.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  $(ls .whl_tf/*.whl 2>/dev/null) 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
AB_TREE=${AB_TREE:-.ab/main}
MODEL=random:qwen3-30b-a3b,experts=q4
if [[ $STEPS == *1* ]]; then
  step "1: the row kernels compiled, against the unpacked matrices"
  timeout 150 python3 -m pytest -q -p no:cacheprovider ${KTESTS:-tests/test_q4_int8_rows.py tests/test_gemv_triton.py \
    tests/test_decode_triton.py} 2>&1 | tail -6
fi
TILES=${TILES:-}
if [[ $STEPS == *2* ]]; then
  step "2: the launches alone, every tile"
  timeout 200 python3 benchmarks/q4_tiles.py --best "$OUT/best.txt" 2>&1 | tee "$OUT/tiles.txt" \
    | grep -E "HBM copy|float|fastest|top|best|per pair|rror"
  [[ -z $TILES && -s $OUT/best.txt ]] && TILES=$(cat "$OUT/best.txt")
  if [[ -n $TILES && -n $SET_DEFAULT ]]; then
    python3 - "$TILES" <<'PY'
import pathlib, re, sys
gu, down = (tuple(int(v) for v in part.split(".")) for part in sys.argv[1].split("/"))
p = pathlib.Path("waste/layers/q4_int8_rows.py")
s = re.sub(r"^GATE_UP = .*$", f"GATE_UP = {gu}", p.read_text(), count=1, flags=re.M)
p.write_text(re.sub(r"^DOWN = .*$", f"DOWN = {down}", s, count=1, flags=re.M))
print("defaults now: GATE_UP =", gu, "DOWN =", down)
PY
  fi
  [[ ${GEMV:-1} == 1 ]] && timeout 150 python3 benchmarks/gemv_tiles.py --best "$OUT/gemv.json" 2>&1 \
    | tee "$OUT/gemv.txt" | grep -E "HBM copy|cuBLAS|default|best|router|rror"
fi
if [[ $STEPS == *3* ]]; then
  for r in 1 2; do
    step "3.$r: 48 layers, this tree: ${ARMS:-fused,f32q4,cublas}"
    timeout 150 python3 benchmarks/gpu_profile.py $MODEL -n 48 --rounds 2 --profile $((r == 1)) \
      --arms ${ARMS:-fused,f32q4,cublas} --gemv-tiles "$OUT/gemv.json" --json "$OUT/new$r.json" 2>&1 | grep -v -i warn | grep -v "^    " | tail -12
    step "3.$r: 48 layers, $AB_TREE: fused"
    PYTHONPATH=$AB_TREE:/tmp/site timeout 120 python3 $AB_TREE/benchmarks/gpu_profile.py $MODEL -n 48 --rounds 2 \
      --profile 0 --arms fused --json "$OUT/old$r.json" 2>&1 | grep -v -i warn | tail -4
  done
fi
if [[ $STEPS == *4* ]]; then
  step "4: the GPU tests"
  timeout ${TEST_LIMIT:-240} python3 -m pytest -rA -q -p no:cacheprovider ${TESTS:-tests/test_cuda.py \
    tests/test_vram_tier.py tests/test_cuda_families.py tests/test_static_decode.py tests/test_random_model.py} \
    2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -40
fi
if [[ $STEPS == *5* ]]; then
  for spec in "kimi-linear-48b-a3b,experts=q4 -n 32" "glm-5.3-flash,experts=q4,layers=28 -n 16"; do
    set -- $spec
    for tree in . $AB_TREE; do
      step "5: $1, $tree: fused"
      PYTHONPATH=$tree:/tmp/site timeout $(( (LIMIT - SECONDS - 10) / 2 )) python3 $tree/benchmarks/gpu_profile.py \
        random:$1 $2 $3 --rounds 2 --profile 0 --arms fused 2>&1 | grep -v -i warn | tail -3
    done
  done
fi
step done
