#!/bin/bash
# streaming_ab.sh with extra bench flags per arm: NAME:TREE[:FLAGS]; prints a summary line per run
R=$1; O=$2; shift 2; mkdir -p "$O"
MODEL=${MODEL:-/tmp/s31/q30b/q30b.waste}
LAPTOP=/work/shared/tools/laptop
N=${N:-16}
cd /tmp
for r in $(seq 1 "$R"); do
  for arm in "$@"; do
    name=${arm%%:*}; rest=${arm#*:}; tree=${rest%%:*}; flags=""; [ "$rest" != "$tree" ] && flags=${rest#*:}; tree=${tree//+/:}
    flock /tmp/waste-bench.lock /tmp/quiet.sh env PYTHONSAFEPATH=1 PYTHONPATH="$tree" OPENBLAS_NUM_THREADS=1 $ENVX "$LAPTOP" \
      --drop-caches 4G -- \
      python -m waste bench "$MODEL" -n $N --prompt-len 16 --feed random --routing uniform --json $flags \
      > "$O/$name.$r.json" 2> "$O/$name.$r.err"
    python3 - "$O/$name.$r.json" "$name" "$r" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); d = j["decode"]
busy = d.get("disk_busy_seconds"); 
print(f"{sys.argv[2]} r{sys.argv[3]}: {d['tok_per_s']:.2f} tok/s, bound {d['io_bound_tok_per_s']:.2f} "
      f"({100*d['tok_per_s']/d['io_bound_tok_per_s']:.1f}%), busy {100 * d['disk_busy_share']:.1f}%, hit {100*d.get('hit_rate',0):.1f}% "
      f"bw {j['disk_bandwidth_gb_per_s']:.2f}, busyrate {d['bytes_read']/1e9/max(d['disk_busy_seconds'],1e-9):.2f} GB/s, budget {j['budget_bytes']/1e9:.2f} GB, cpu {1e3*d['cpu_seconds']/d['tokens']:.0f} ms/tok", flush=True)
PY
  done
done
