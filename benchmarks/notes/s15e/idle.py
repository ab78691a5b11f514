# s15c/idle.py's summary, then each arm's tok/s over the base arm's (else the first's) per round
import json, glob, re, runpy, statistics, sys, collections, os
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "s15c", "idle.py"), run_name="__main__")
skip, tps = set(sys.argv[2:]), collections.defaultdict(dict)
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    name, r = re.match(r".*/(.+)\.(\d+)\.json", f).groups()
    if f"{name}.{r}" not in skip:
        tps[name][int(r)] = json.load(open(f))["decode"]["tok_per_s"]
names = sorted(tps, key=lambda n: n != "base")
for n in names[1:]:
    q = [tps[n][k] / tps[names[0]][k] for k in sorted(tps[n]) if k in tps[names[0]]]
    if q:
        print(f"{n} / {names[0]} tok/s per round: median {statistics.median(q):.3f} ({min(q):.3f}-{max(q):.3f}), "
              f"{sum(x > 1 for x in q)} of {len(q)} above 1")
