"""Where a resident model's time goes between numba kernels, torch and Python (docs/LEARNED.md §10a).

Decode (the default): wall ms per decode token (the model's own step, greedy, 64 tokens after a 128-token prompt,
3 runs), then a cProfile of one run sorted by own time. `--prefill`: ms of a 128-token prefill (median of 7 after a
warm-up), then a cProfile of 5 prefills.

    python benchmarks/decode_profile.py CONTAINER [THREADS] [--prefill]
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from waste.engine import Engine

args = [a for a in sys.argv[1:] if a != "--prefill"]
torch.set_num_threads(int(args[1]) if len(args) > 1 else 2)
eng = Engine.load(args[0])
eng.experts.wait_fill()
m = eng.model
ids = torch.tensor(eng.encode("def fibonacci(n):\n" * 40)[:128])


def decode(n: int) -> float:
    st = m.new_state()
    with torch.inference_mode():
        logits = m.forward(ids, st, 0, last_only=True)[-1]
        pos = len(ids)
        t = time.perf_counter()
        for _ in range(n):
            nxt = int(torch.argmax(logits))
            logits = m.forward(torch.tensor([nxt]), st, pos, last_only=True)[-1]
            pos += 1
        return (time.perf_counter() - t) / n


def prefill(_: int = 0) -> float:
    st = m.new_state()               # outside the timing, as benchmarks/peers.py does
    with torch.inference_mode():
        t = time.perf_counter()
        m.forward(ids, st, 0, last_only=True)
        return time.perf_counter() - t


if "--prefill" in sys.argv:
    prefill()
    print("prefill ms", round(statistics.median(prefill() for _ in range(7)) * 1e3, 2))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        prefill()
else:
    decode(8)
    print("ms/token", [round(decode(64) * 1e3, 3) for _ in range(3)])
    pr = cProfile.Profile()
    pr.enable()
    decode(64)
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
