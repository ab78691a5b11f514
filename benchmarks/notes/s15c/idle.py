import json, sys, glob, statistics, re, collections
d = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    name, r = re.match(r".*/(.+)\.(\d+)\.json", f).groups()
    j = json.load(open(f)); x = j["decode"]
    idle = (x["seconds"] - x["disk_busy_seconds"]) / x["tokens"] * 1e3
    d[name].append((int(r), idle, x["tok_per_s"], 100 * x["tok_per_s"] / x["io_bound_tok_per_s"], 100 * x["disk_busy_share"],
                    x["bytes_read"] / 1e9 / x["disk_busy_seconds"], j["disk_bandwidth_gb_per_s"], 1e3 * x["cpu_seconds"] / x["tokens"]))
skip = set(sys.argv[2:])
for name, rows in d.items():
    rows = [r for r in rows if f"{name}.{r[0]}" not in skip]
    def m(i): 
        v = [r[i] for r in rows]; return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
    print(f"{name} ({len(rows)} runs): idle ms/token {m(1)}, tok/s {m(2)}, of bound {m(3)}%, busy {m(4)}%, GB/s busy {m(5)}, bench GB/s {m(6)}, cpu ms/tok {m(7)}")
