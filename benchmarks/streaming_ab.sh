#!/bin/bash
# Trees A/B on issue 15's benchmark (docs/LEARNED.md §3l, §3m): `waste bench` of the 26-layer 30B-shaped build,
# cold under `laptop --drop-caches 4G`, uniform routing, random feed, 16 tokens; arms interleaved over ROUNDS, each
# arm a tree on PYTHONPATH (a worktree of the commit before, and this one); every run holds /tmp/waste-bench.lock.
#   bash benchmarks/streaming_ab.sh ROUNDS OUTDIR NAME:TREE ...      (MODEL= the container; QUIET= a wrapper command)
# PYTHONSAFEPATH=1: `python -m` puts the current directory first on sys.path, so without it a run from a checkout's
# root imports that checkout's waste whatever PYTHONPATH says, and every arm measures the same tree (§3n)
R=$1; O=$2; shift 2; mkdir -p "$O"
MODEL=${MODEL:-/tmp/s31/q30b/q30b.waste}
LAPTOP=$(dirname "$0")/../../shared/tools/laptop
for r in $(seq 1 "$R"); do
  for arm in "$@"; do
    name=${arm%%:*}; tree=${arm#*:}
    flock /tmp/waste-bench.lock $QUIET env PYTHONSAFEPATH=1 PYTHONPATH="$tree" OPENBLAS_NUM_THREADS=1 "$LAPTOP" \
      --drop-caches 4G -- \
      python -m waste bench "$MODEL" -n 16 --prompt-len 16 --feed random --routing uniform --json \
      > "$O/$name.$r.json" 2> "$O/$name.$r.err"
    python3 - "$O/$name.$r.json" "$name" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["decode"]
print(f"{sys.argv[2]} round {sys.argv[3]}: {d['tok_per_s']:.2f} tok/s, disk busy {100 * d['disk_busy_share']:.1f}% "
      f"of decode, I/O bound {d['io_bound_tok_per_s']:.2f} tok/s")
PY
  done
done
