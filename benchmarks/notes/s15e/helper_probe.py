"""streaming_timeline.py's run with each shared q8 row's helper timed: submit -> the helper's Python running, and
whether it started before the calling thread had finished the row alone (it then took chunks). Not a test."""
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import streaming_timeline  # noqa: E402

from waste import numba_ptr  # noqa: E402

lat, early = [], []
# --pin: the caller on cpu 0 (and every thread started after it), the helper on cpu 1; --pin-worker: the helper only
PIN = "--pin" in sys.argv or "--pin-worker" in sys.argv
if "--pin" in sys.argv:
    sys.argv.remove("--pin")
    os.sched_setaffinity(0, {0})     # this thread (Linux: the calling thread's mask); threads started later inherit
if "--pin-worker" in sys.argv:
    sys.argv.remove("--pin-worker")
pinned = set()


def call(self, x):
    x = x if x.is_contiguous() else x.contiguous()
    out = np.empty((1, self.N), np.float32)
    pool = getattr(numba_ptr._helper, "pool", None)
    if pool is not None and self.shared is not None:
        q = np.zeros(2, np.int64)
        args = (x.data_ptr(), *self.args, out.ctypes.data, q.ctypes.data)
        t0, end = time.perf_counter(), [None]

        def helper():
            t = time.perf_counter()
            if PIN and threading.get_ident() not in pinned:
                pinned.add(threading.get_ident())
                os.sched_setaffinity(0, {1})
            lat.append(t - t0)
            early.append(end[0] is None)
            self.shared(*args, True)
        pool.submit(helper)._keep = (x, out, q)
        self.shared(*args, False)
        end[0] = time.perf_counter()
        return torch.from_numpy(out)
    return orig(self, x)


orig = numba_ptr.BoundRow.__call__
numba_ptr.BoundRow.__call__ = call
streaming_timeline.main()
v = lat[len(lat) // 3:]
e = early[len(early) // 3:]
print(f"helper start: {len(v)} calls, median {1e3 * statistics.median(v):.3f} ms, mean {1e3 * statistics.fmean(v):.3f}, "
      f"started before the caller finished: {100 * sum(e) / len(e):.0f}%")
