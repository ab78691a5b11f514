#!/bin/bash
# One GPU call for issue 14's q4 tiles (docs/LEARNED.md §10g): the kernels' tests compiled, the launches alone
# (benchmarks/q4_tiles.py: every tile against the kernels before), ncu on the fastest, all 48 layers with it against
# the fused kernels before and the torch path, the GPU tests, Kimi-Linear (STEPS: of 123456, in that order 1 2 6 3 5
# 4; LIMIT seconds in all). SET_DEFAULT=1: the fastest tiles written into q4_tiled.py's defaults before steps 3-5.
#   bash benchmarks/cuda_q4_call.sh OUT [STEPS] [LIMIT]   (repository root, waste installed)
DEF_STEPS=1234 DEF_LIMIT=540
source "$(dirname "$0")/cuda_call_setup.sh"
TILES=${TILES:-}
if [[ $STEPS == *1* ]]; then
  step "1: the tiled kernels compiled, against the unpacked matrices and the kernels before"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_q4_tiled.py tests/test_decode_triton.py \
    tests/test_moe_triton.py 2>&1 | tail -4
fi
if [[ $STEPS == *2* ]]; then
  step "2: the launches alone, every tile"
  timeout 150 python3 benchmarks/q4_tiles.py --best "$OUT/best.txt" 2>&1 | tee "$OUT/tiles.txt" | grep -E "HBM copy|untiled|block|top|best|rror"
  [[ -z $TILES && -s $OUT/best.txt ]] && TILES=$(cat "$OUT/best.txt")
  if [[ -n $TILES && -n $SET_DEFAULT ]]; then     # the fastest tiles as the defaults the later steps and tests run
    python3 - "$TILES" <<'PY'
import pathlib, re, sys
gu, down = (tuple(int(v) for v in part.split(".")) for part in sys.argv[1].split("/"))
p = pathlib.Path("waste/layers/q4_tiled.py")
s = re.sub(r"^GU = .*$", f"GU = {gu}", p.read_text(), count=1, flags=re.M)
p.write_text(re.sub(r"^DOWN = .*$", f"DOWN = {down}", s, count=1, flags=re.M))
print("defaults now: GU =", gu, "DOWN =", down)
PY
  fi
fi
TARG=${TILES:+--q4-tiles $TILES}
if [[ $STEPS == *6* ]]; then
  step "6: the tiled kernels' registers and spills, their IR; ncu on one gate + up and one down launch"
  python3 - "$OUT" <<'PY'
import json, pathlib, sys, tarfile
root = pathlib.Path.home() / ".triton" / "cache"
with tarfile.open(pathlib.Path(sys.argv[1]) / "triton_ir.tgz", "w:gz") as tf:
    for meta in root.glob("*/_tiled.json"):
        m = json.loads(meta.read_text())
        print(meta.parent.name[:8], {k: m.get(k) for k in ("num_warps", "n_regs", "n_spills", "shared")}, m.get("constants", ""))
        for f in meta.parent.iterdir():
            if f.suffix in (".ttgir", ".ptx", ".json"):
                tf.add(f, arcname=f"{meta.parent.name[:8]}/{f.name}")
PY
  timeout 120 ncu --clock-control none -k regex:_tiled --launch-count 2 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/q4_tiles.py --tiles ${TILES:-4.1.4/1.4.8} > "$OUT/ncu.txt" 2>&1
  grep -E "_tiled|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles|Issued|Eligible|spill|Bandwidth" "$OUT/ncu.txt" | head -70
fi
if [[ $STEPS == *3* ]]; then
  step "3: all 48 layers, q4, fused (tiled $TILES) / untiled / prev / torch"
  timeout 170 python3 benchmarks/gpu_profile.py random:qwen3-30b-a3b,experts=q4 -n 48 --rounds 3 --profile 1 \
    --arms fused,untiled,prev,torch $TARG --json "$OUT/profile48.json" 2>&1 | grep -v -i warn
fi
if [[ $STEPS == *5* ]]; then
  step "5: the GPU tests"
  timeout $((LIMIT - SECONDS - 10)) python3 -m pytest -rA -q -p no:cacheprovider tests/test_cuda.py \
    tests/test_cuda_families.py tests/test_moe_triton.py tests/test_static_decode.py tests/test_vram_tier.py \
    tests/test_decode_triton.py tests/test_q4_tiled.py 2>&1 | tee "$OUT/gpu_tests.txt" \
    | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" | tail -80
fi
if [[ $STEPS == *4* ]]; then
  step "4: Kimi-Linear, q4, fused / untiled / torch (in the time left)"
  timeout $((LIMIT - SECONDS - 5)) python3 benchmarks/gpu_profile.py random:kimi-linear-48b-a3b,experts=q4 -n 32 \
    --rounds 2 --profile 0 --arms fused,untiled,torch $TARG --json "$OUT/kimi.json" 2>&1 | grep -v -i warn
fi
step done
