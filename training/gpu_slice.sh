#!/usr/bin/env bash
# v1 (replaced by gpu_slice_v2.sh; kept to reproduce tiny-py-moe v1, whose shape and batch were train.py's
# defaults then and are passed explicitly now).
# One GPU slice (about 5 minutes on one H200): train the tiny model twice, for 5 and for 10 epochs of
# the corpus, keep the run whose chosen weights have the lower validation loss, and pack the result
# into $OUT as few files as possible (model.safetensors split under 16 MB, everything else in one tar).
#
#   CORPUS=.scratch/stdlib-3.11.7.tar.gz OUT=/tmp/slice-out bash training/gpu_slice.sh
#
# Each train.py invocation resumes from its own checkpoint if the slice is cut short: run it again.
set -euo pipefail
export PYTHONUNBUFFERED=1
CORPUS=${CORPUS:-.scratch/stdlib-3.11.7.tar.gz}
RUNS=${RUNS:-/tmp/tiny-py-moe-runs}
OUT=${OUT:-$RUNS/out}
EPOCHS=${EPOCHS:-"5 10"}
mkdir -p "$RUNS" "$OUT"
T0=$(date +%s)
for EP in $EPOCHS; do
  python3 training/train.py --out "$RUNS/ep$EP" --corpus "$CORPUS" --max-epochs "$EP" --budget-min 3.5 \
      --hidden 256 --heads 8 --kv-heads 4 --batch 32 \
      --eval-every 100 --finalize-partial ${TRAIN_ARGS:-} 2>&1 | grep --line-buffered -v 'Writing model shards' | tee "$RUNS/ep$EP.log"
done
echo "slice wall seconds: $(( $(date +%s) - T0 ))" | tee "$RUNS/slice.txt"
BEST=$(python3 - "$RUNS" $EPOCHS <<'EOF'
import json, sys
runs, eps = sys.argv[1], sys.argv[2:]
val = {ep: json.load(open(f"{runs}/ep{ep}/record.json"))["eval"]["val_loss"] for ep in eps}
print(min(val, key=val.get))
EOF
)
echo "chosen run: ep$BEST" | tee -a "$RUNS/slice.txt"
M="$RUNS/ep$BEST/model"
split -b 15000000 -d "$M/model.safetensors" "$OUT/model.safetensors.part"
sha256sum "$M/model.safetensors" > "$RUNS/model.sha256"
tar czf "$OUT/bundle.tar.gz" -C "$RUNS" slice.txt model.sha256 \
    $(for EP in $EPOCHS; do echo "ep$EP.log ep$EP/record.json"; done) \
    "ep$BEST/model/config.json" "ep$BEST/model/generation_config.json" "ep$BEST/model/tokenizer.json" \
    "ep$BEST/model/tokenizer_config.json" "ep$BEST/corpus/manifest.tsv" "ep$BEST/corpus/summary.json" \
    "ep$BEST/routing_trace_test.npy"
ls -la "$OUT"
