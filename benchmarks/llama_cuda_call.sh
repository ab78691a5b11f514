#!/bin/bash
# llama.cpp built with CUDA from the llama-cpp-python sdist, against waste on the same GPU (issue 14 item 4, docs/
# LEARNED.md §10l). The sources come carried as .lcp/lcp-src.tar.xz (the sdist's vendor/llama.cpp less its docs,
# models, tests and other backends: the GPU machine reaches no registry). STEPS, in order:
#   b  configure and build llama-bench (sm_90, FlashAttention kernels on), in .lcp/build: kept between calls while the
#      machine stays warm, so a build cut off by the limit goes on in the next call
#   g  write the random 48-layer Qwen3-30B-A3B-shaped GGUF (benchmarks/gguf_random.py: experts Q4_0, trunk f16)
#   k  the kernels' tests compiled, every fast launch checked against the JIT (tests/conftest.py sets CHECK)
#   l  the host's cost of a launch (benchmarks/launch_cost.py)
#   f  Kimi-Linear (27 layers) and GLM-5.3-Flash (28 layers) at real widths, arms ARMS (fused,nopdl,jit,cublas)
#   p  the peers, interleaved: llama-bench (all on the GPU; experts on the host, -ot exps=CPU) and waste's
#      gpu_profile (48 layers q4 resident), twice each
#   t  the GPU tests (TESTS, TEST_LIMIT), while the build runs
#   bash benchmarks/llama_cuda_call.sh OUT [STEPS] [LIMIT]   (repository root)
DEF_STEPS=bgk DEF_LIMIT=570
source "$(dirname "$0")/cuda_call_setup.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  $(ls .whl_tf/*.whl 2>/dev/null) 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site
SRC=$PWD/.lcp/src BUILD=$PWD/.lcp/build GGUF=/tmp/q30b-q4_0.gguf BENCH=$PWD/.lcp/build/bin/llama-bench
[[ -d $SRC ]] || tar xJf .lcp/lcp-src.tar.xz -C .lcp
left() { echo $(( LIMIT - SECONDS - ${1:-10} )); }
if [[ $STEPS == *b* ]]; then
  step "b: llama.cpp configure + build (log: $OUT/build.log)"
  if [[ ! -f $BUILD/CMakeCache.txt ]]; then
    cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$OUT/configure.log" 2>&1
    echo "configure rc $?"; tail -3 "$OUT/configure.log"
  fi
  (timeout $(left 60) nice -n 10 cmake --build "$BUILD" --target llama-bench -j16 > "$OUT/build.log" 2>&1; \
   echo "build rc $? at ${SECONDS}s" >> "$OUT/build.log") &
  BPID=$!
fi
if [[ $STEPS == *g* ]]; then
  step "g: the GGUF"
  [[ -s $GGUF ]] || timeout $(left 30) python3 benchmarks/gguf_random.py "$GGUF" --gguf-py "$SRC/gguf-py" 2>&1 | tail -2
  ls -la "$GGUF"
fi
if [[ $STEPS == *k* ]]; then
  step "k: the kernels' tests compiled, fast launches checked"
  timeout 200 python3 -m pytest -q -p no:cacheprovider ${KTESTS:-tests/test_decode_triton.py \
    tests/test_gemv_triton.py tests/test_q4_int8_rows.py} 2>&1 | tail -4
fi
if [[ $STEPS == *t* ]]; then
  step "t: the GPU tests"
  timeout ${TEST_LIMIT:-330} python3 -m pytest -rA -q -p no:cacheprovider ${TESTS:-tests/test_q4_int8_rows.py \
    tests/test_cuda.py tests/test_vram_tier.py tests/test_cuda_families.py tests/test_static_decode.py \
    tests/test_random_model.py tests/test_gemv_triton.py tests/test_decode_triton.py} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -40
fi
if [[ -n $BPID ]]; then
  wait $BPID; step "b: done"; tail -4 "$OUT/build.log"; ls -la "$BENCH" 2>&1
fi
if [[ $STEPS == *l* ]]; then
  step "l: the host's cost of a launch"
  timeout 60 python3 benchmarks/launch_cost.py 2>&1 | grep -v -i warn
fi
if [[ $STEPS == *f* ]]; then
  for spec in "kimi-linear-48b-a3b,experts=q4 -n 32 --rounds 4" "glm-5.3-flash,experts=q4,layers=28 -n 16 --rounds 2"
  do
    step "f: $spec: ${ARMS:-fused,nopdl,jit,cublas}"
    timeout 200 python3 benchmarks/gpu_profile.py random:$spec --profile 0 --arms ${ARMS:-fused,nopdl,jit,cublas} 2>&1 \
      | grep -v -i warn | grep -v "^    " | tail -6
  done
fi
if [[ $STEPS == *p* ]]; then
  for r in 1 2; do
    step "p.$r: llama-bench, all on the GPU"
    timeout 120 "$BENCH" -m "$GGUF" -ngl 99 -fa 1 -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "^\||error|failed" | tail -4
    step "p.$r: waste, 48 layers q4 resident"
    timeout 150 python3 benchmarks/gpu_profile.py random:qwen3-30b-a3b,experts=q4 -n 48 --rounds 2 --profile 0 \
      --arms ${PARMS:-fused,nopdl} --json "$OUT/waste$r.json" 2>&1 | grep -v -i warn | grep -v "^    " | tail -5
    step "p.$r: llama-bench, the experts on the host (-ot exps=CPU)"
    timeout 150 "$BENCH" -m "$GGUF" -ngl 99 -fa 1 -p 0 -n 32 -r 2 -ot "exps=CPU" -o md 2>&1 \
      | grep -E "^\||error|failed" | tail -4
  done
fi
step done
