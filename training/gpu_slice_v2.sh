#!/usr/bin/env bash
# One GPU slice for tiny-py-moe v2 (about 9 minutes on one H200, inside one 10-minute device command):
# train once on the stdlib + packages corpus for a wall-clock budget, keep the lowest-validation weights,
# evaluate, export, and pack the result into $OUT as few files as possible (model.safetensors split under
# 16 MB, everything else in one tar).
#
#   CORPUS=.scratch/pycode-v2.tar.xz TOKENIZER=.scratch/prep-v2/model COMPARE=waste/bundled/tiny-py-moe \
#       OUT=/tmp/slice-out bash training/gpu_slice_v2.sh
#
# TOKENIZER (optional): a folder holding tokenizer.json + tokenizer_config.json made beforehand by
#   python3 training/train.py --out .scratch/prep-v2 --corpus .scratch/pycode-v2.tar.xz --prepare-only
# on any CPU machine (the same tarball gives the same bytes); without it train.py trains the tokenizer itself.
# COMPARE (optional): an HF model folder whose held-out bits per byte is measured on the same text.
# The training loop stops after BUDGET_MIN minutes or UNTIL_S seconds after train.py started, whichever
# comes first, so that evaluation and export still fit in the command's limit.
set -uo pipefail
export PYTHONUNBUFFERED=1
CORPUS=${CORPUS:-.scratch/pycode-v2.tar.xz}
TOKENIZER=${TOKENIZER:-}
COMPARE=${COMPARE:-}
RUNS=${RUNS:-/tmp/tiny-py-moe-v2-runs}
OUT=${OUT:-$RUNS/out}
BUDGET_MIN=${BUDGET_MIN:-6.3}
UNTIL_S=${UNTIL_S:-450}
RUN="$RUNS/v2"
mkdir -p "$RUN/model" "$OUT"
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ -n "$TOKENIZER" ] && [ ! -e "$RUN/model/tokenizer.json" ]; then
  cp "$TOKENIZER/tokenizer.json" "$TOKENIZER/tokenizer_config.json" "$RUN/model/"
fi
python3 training/train.py --out "$RUN" --corpus "$CORPUS" --budget-min "$BUDGET_MIN" --train-until-s "$UNTIL_S" \
    --finalize-partial ${COMPARE:+--compare-model "$COMPARE"} ${TRAIN_ARGS:-} 2>&1 \
    | grep --line-buffered -v 'Writing model shards' | tee "$RUNS/v2.log"
RC=${PIPESTATUS[0]}
echo "train.py exit status $RC; slice wall seconds: $(( $(date +%s) - T0 ))" | tee "$RUNS/slice.txt"
cp "$RUNS/v2.log" "$OUT/v2.log"
M="$RUN/model"
if [ -f "$M/model.safetensors" ]; then
  split -b 15000000 -d "$M/model.safetensors" "$OUT/model.safetensors.part"
  (cd "$M" && sha256sum model.safetensors) > "$RUNS/model.sha256"
fi
tar czf "$OUT/bundle.tar.gz" -C "$RUNS" --ignore-failed-read slice.txt model.sha256 v2.log v2/record.json \
    v2/model/config.json v2/model/generation_config.json v2/model/tokenizer.json v2/model/tokenizer_config.json \
    v2/corpus/manifest.tsv v2/corpus/summary.json
ls -la "$OUT"
exit "$RC"
