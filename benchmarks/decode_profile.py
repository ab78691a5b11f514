"""Wall ms per decode token of a resident model (the model's own step, greedy, 64 tokens after a 128-token prompt,
3 runs), then a cProfile of one run sorted by own time: where a decode step's time goes between numba kernels,
torch and Python (docs/LEARNED.md §10a).

    python benchmarks/decode_profile.py CONTAINER [THREADS]
"""
import cProfile
import pstats
import sys
import time

import torch

from waste.engine import Engine
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
eng = Engine.load(sys.argv[1]); eng.experts.wait_fill()
m = eng.model
ids = torch.tensor(eng.encode("def fibonacci(n):\n" * 40)[:128])
def run(n):
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
run(8)
print("ms/token", [round(run(64) * 1e3, 3) for _ in range(3)])
pr = cProfile.Profile(); pr.enable(); run(64); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
