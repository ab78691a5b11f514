"""What a streamed decode step's layer spends on its decoding thread, piece by piece: streaming_timeline.py's run (its
idle pieces per layer) with the functions between a layer's last read and the next layer's first wrapped in timers,
per-call medians over the last two thirds of the calls (docs/LEARNED.md §3l).

    ../shared/tools/laptop --drop-caches 4G -- python benchmarks/streaming_pieces.py /tmp/s31/q30b/q30b.waste [--dtype float32]

Nothing here is a test.
"""
import statistics
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import streaming_timeline  # noqa: E402

from waste.layers import attention, attention_cpu, moe  # noqa: E402
from waste.models import base  # noqa: E402
from waste.runtime import cache, policy  # noqa: E402

took = defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if threading.current_thread() is threading.main_thread():
                took[label].append(time.perf_counter() - t)
    setattr(owner, name, wrapper)


for owner, name, label in ((attention, "linear", "attention's q/k/v and o rows (each)"),
                           (attention_cpu, "gqa_row", "gqa_row"), (base, "rms_norm", "rms_norm (the block's)"),
                           (moe, "weighted_sum", "weighted_sum"), (moe, "expert_pairs", "expert_pairs (this thread)"),
                           (cache.ExpertCache, "_make_resident", "_make_resident"),
                           (cache.ExpertCache, "_take_slots", "_take_slots"), (policy.LFRU, "victims", "victims")):
    timed(owner, name, label)
streaming_timeline.main()
for label, v in took.items():
    v = v[len(v) // 3:]
    print(f"{label}: {len(v)} calls, median {1e3 * statistics.median(v):.3f} ms, mean {1e3 * statistics.fmean(v):.3f}")
