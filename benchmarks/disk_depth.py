"""How fast this disk reads a bank's records by request size and requests in flight (O_DIRECT, page cache bypassed).

    python benchmarks/disk_depth.py BANK_DIR [--seconds 1] [--threads 1,2,4,8] [--split 1,2,4]

For each (records split into S requests, T threads), T threads read whole records at random record offsets of
the bank files for --seconds, each record as S O_DIRECT preads of record/S bytes issued together (S > 1: the
pieces go to a pool of S threads per reader, so a record's pieces are in flight at once). Prints GB/s and the median
ms a record takes. What a layer call that misses one record can get from the disk (S pieces, T = 1), against what a
layer that misses many gets (T records at once). Not a test.
"""
from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from waste.container.bank import BankFile  # noqa: E402


def run(banks, seconds: float, threads: int, split: int) -> tuple[float, float]:
    stop, total, lat, lock = time.perf_counter() + seconds, [0], [], threading.Lock()
    rec = banks[0].record_bytes
    piece = (-(-rec // split) + 4095) // 4096 * 4096 if split > 1 else rec   # aligned pieces, the last one short

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        fds = [os.open(b.path, os.O_RDONLY | os.O_DIRECT) for b in banks]
        buf = mmap.mmap(-1, split * piece)
        mv = memoryview(buf)
        pool = ThreadPoolExecutor(split) if split > 1 else None
        n, mine = 0, []
        try:
            while time.perf_counter() < stop:
                i = rng.randrange(len(banks))
                b, fd = banks[i], fds[i]
                off = b.offset(rng.randrange(b.num_experts))
                t0 = time.perf_counter()
                if pool is None:
                    n += os.preadv(fd, [mv[:rec]], off)
                else:
                    futs = [pool.submit(os.preadv, fd, [mv[j * piece:min((j + 1) * piece, rec)]], off + j * piece)
                            for j in range(split) if j * piece < rec]
                    n += sum(f.result() for f in futs)
                mine.append(time.perf_counter() - t0)
        finally:
            if pool is not None:
                pool.shutdown()
            mv.release()
            buf.close()
            for fd in fds:
                os.close(fd)
        with lock:
            total[0] += n
            lat.extend(mine)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total[0] / (time.perf_counter() - t0), statistics.median(lat)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path, help="a container's experts/ folder")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--split", default="1,2,4")
    a = ap.parse_args()
    banks = [BankFile(str(p)) for p in sorted(a.dir.iterdir())
             if p.is_file()]
    print(f"{len(banks)} bank files, records of {banks[0].record_bytes / 1e6:.2f} MB", flush=True)
    for split in map(int, a.split.split(",")):
        for threads in map(int, a.threads.split(",")):
            rate, med = run(banks, a.seconds, threads, split)
            print(f"split {split}, threads {threads}: {rate / 1e9:.2f} GB/s, a record {1e3 * med:.2f} ms median",
                  flush=True)


if __name__ == "__main__":
    main()
