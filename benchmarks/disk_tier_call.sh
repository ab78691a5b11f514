#!/bin/bash
# Issue 14 item 4(c) on the GPU machine: where a token's time goes when experts are read from disk (docs/LEARNED.md
# §10m, §10n). STEPS, in order:
#   q  the disk by request size and requests in flight (benchmarks/disk_depth.py) on the 4-layer bank
#   t  the timeline of the disk arm (benchmarks/disk_tier_timeline.py), arms ARMS (its flags) interleaved, ROUNDS rounds (2)
#   s  the timeline's first arm under py-spy (its wheel carried in .whl), folded by benchmarks/spy_fold.py
#   g  gpu_decode.py's 4 layers: eager and whole-graph resident steps, its disk arm cut into graphs and eager (GROUNDS rounds)
#   T  the GPU tests (TESTS, TEST_LIMIT), in the background from the start; their output at the end
#   F  the same tests in the foreground after the measurements (figures taken on a quiet machine)
#   bash benchmarks/disk_tier_call.sh OUT [STEPS] [LIMIT]   (repository root; wheels carried in .whl)
DEF_STEPS=qtg DEF_LIMIT=570
source "$(dirname "$0")/cuda_call_setup.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
D=/tmp/g4
# ARMS: the timeline's arms, separated by "|" (the first also the py-spy step's)
IFS="|" read -r -a ARMS <<< "${ARMS:---threads 4|--no-cut|--sync-up|--prefetch}"
left() { echo $(( LIMIT - SECONDS - ${1:-10} )); }
gpu_tests() {
  timeout ${1:-330} nice python3 -m pytest -rA -p no:cacheprovider ${TESTS:-tests/test_q4_int8_rows.py \
    tests/test_cuda.py tests/test_vram_tier.py tests/test_cuda_families.py tests/test_static_decode.py \
    tests/test_random_model.py tests/test_gemv_triton.py tests/test_decode_triton.py tests/test_q4_rows.py} \
    > "$OUT/gpu_tests.txt" 2>&1
}
if [[ $STEPS == *T* ]]; then
  step "T: the GPU tests, in the background (log: $OUT/gpu_tests.txt)"
  gpu_tests ${TEST_LIMIT:-330} &
  TPID=$!
fi
if [[ $STEPS == *[qtsg]* ]]; then
  step "build (once per machine)"
  timeout $(left) python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from gpu_decode import build; print(build(Path('$D'), 4, 'q4'))" 2>&1 | tail -3
fi
if [[ $STEPS == *q* ]]; then
  step "q: disk depth"
  timeout $(left) python3 benchmarks/disk_depth.py $D/q30b4-q4.waste/experts --seconds 1 --threads 1,2,4,8 \
    --split 1,2,4,8 2>&1 | tail -20 | tee "$OUT/depth.txt"
fi
if [[ $STEPS == *t* ]]; then
  for r in $(seq 1 ${ROUNDS:-2}); do
    for args in "${ARMS[@]}"; do
      (( $(left) > 90 )) || break 2
      step "t.$r: timeline $args"
      timeout $(left) python3 benchmarks/disk_tier_timeline.py $D --layers 4 -n ${TOKENS:-32} $args \
        > "$OUT/tl.$r.${args// /}.txt" 2>&1
      if (( r == 1 )); then grep -v -i warn "$OUT/tl.$r.${args// /}.txt" | tail -26
      else grep -E "^(decode|AIO probe)|Error|error" "$OUT/tl.$r.${args// /}.txt"; fi
    done
  done
fi
if [[ $STEPS == *s* ]]; then
  step "s: py-spy of the timeline, ${ARMS[0]}"
  timeout $(left) /tmp/site/bin/py-spy record --idle -r 1000 -f raw -o "$OUT/spy.txt" -- python3 \
    benchmarks/disk_tier_timeline.py $D --layers 4 -n ${TOKENS:-32} ${ARMS[0]} > "$OUT/spy.log" 2>&1
  grep -E "^decode|py-spy>.*(Error|error|Samples)" "$OUT/spy.log" | tail -3
  python3 benchmarks/spy_fold.py "$OUT/spy.txt" --under timed_step --top ${SPY_TOP:-60}
fi
if [[ $STEPS == *g* ]]; then
  step "g: gpu_decode 4 layers"
  timeout $(left) python3 benchmarks/gpu_decode.py $D --layers 4 -n 24 --experts q4 --variants triton,whole \
    --budget-frac 0.25 --rounds ${GROUNDS:-3} 2>&1 | grep -v Warning | tail -20 | tee "$OUT/gpu_decode.txt"
fi
if [[ $STEPS == *F* ]]; then
  step "F: the GPU tests (log: $OUT/gpu_tests.txt)"
  gpu_tests $(left 5)
fi
if [[ -n $TPID || $STEPS == *F* ]]; then
  [[ -n $TPID ]] && wait $TPID
  step "the GPU tests"
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.txt" | tail -40
fi
step done
