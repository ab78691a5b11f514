"""Where a GPU decode step's time goes when experts miss the budget and are read from disk (issue 14 item 4(c)).

    python benchmarks/disk_tier_timeline.py DIR [--layers 4] [-n 24] [--budget-frac 0.25] [--threads 4] [ARM flags]

Builds (or reuses) gpu_decode.py's container DIR/q30b{layers}-q4.waste, drops the page cache, loads it on the GPU
with an expert budget of --budget-frac of the bank and decodes -n tokens fed seeded random ids, as gpu_decode.py's
disk arm does. Every piece of a MoE layer call is stamped on the host (perf_counter): the layer's MLP call, the
residency call, its reads on the reader threads (the pread itself and the checksum apart), the main thread's waits
for them, the copy up to the GPU's slab and the q4 rewrite there. CUDA events at the MLP call's start and end give
the GPU's own time. Prints per-piece medians and means per layer call, and the disk's share of the token. Not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import waste  # noqa: E402
from waste.container import open_container  # noqa: E402
from waste.runtime import bankio, cache  # noqa: E402
from gpu_decode import aio_probe, build, decode, disk_rate  # noqa: E402

MARKS: list[tuple[str, int, float, float]] = []      # (piece, thread id, start, end)
ON = threading.Event()


def mark(name: str, t0: float, t1: float) -> None:
    if ON.is_set():
        MARKS.append((name, threading.get_ident(), t0, t1))


def wrap(obj, attr: str, name: str) -> None:
    f = getattr(obj, attr)

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            mark(name, t0, time.perf_counter())
    setattr(obj, attr, timed)


def split_reads(pieces: int) -> None:
    """Arm: each record read as `pieces` O_DIRECT preads in flight at once (a pool of its own), not one."""
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(4 * pieces, thread_name_prefix="piece")

    def read(self, expert, slot, verify=True):
        b, mv = self.bank, memoryview(slot.numpy())
        off, n = b.offset(expert), b.record_bytes
        step = (-(-n // pieces) + 4095) // 4096 * 4096
        t0 = time.perf_counter()
        futs = [pool.submit(os.preadv, self.fd, [mv[j:min(j + step, n)]], off + j) for j in range(0, n, step)]
        if sum(f.result() for f in futs) != n:
            raise RuntimeError("short read")
        dt = time.perf_counter() - t0
        if verify:
            b.check(expert, mv)
        return dt
    bankio.BankReader.read = read


def sync_up() -> None:
    """Arm: the mirror's copies up with a host wait (what main did before §10n: the host waited for the copy and
    for every launch queued before it)."""
    flush = cache.ExpertCache._flush

    def _flush(self):
        dirty = bool(self._dirty)
        flush(self)
        if dirty and not self.tiered:
            torch.cuda.current_stream().synchronize()
    cache.ExpertCache._flush = _flush


def instrument() -> None:
    read = bankio.BankReader.read
    landed = getattr(cache.ExpertCache, "_landed_direct", None)

    def timed_landed(self, key, slot, fut, t0, res):      # a Linux AIO read: io_submit -> reaped, then its landing
        t1 = time.perf_counter()
        try:
            return landed(self, key, slot, fut, t0, res)
        finally:
            fut._t_set = t2 = time.perf_counter()     # the future is set: the decoding thread may wake from here
            mark("aio read (submit -> reaped)", t0, t1)
            mark("aio landing (check, land)", t1, t2)
    if landed is not None:
        cache.ExpertCache._landed_direct = timed_landed

    def timed_read(self, expert, slot, verify=True):      # the pread apart from the checksum
        t0 = time.perf_counter()
        dt = read(self, expert, slot, False)
        t1 = time.perf_counter()
        mark("pread", t0, t0 + dt)
        if verify:
            self.bank.check(expert, memoryview(slot.numpy()))
            mark("crc", t1, time.perf_counter())
        return dt
    bankio.BankReader.read = timed_read
    wrap(cache.ExpertCache, "_read", "read (thread)")
    wrap(cache.ExpertCache, "_make_resident", "make_resident")
    wrap(cache.ExpertCache, "_flush", "flush (copy up + rewrite)")
    wrap(bankio.DirectAio, "submit", "aio submit (io_submit)")
    wait_ = cache.wait

    def timed_wait(fs, *a, **k):          # the decoding thread's wait, and its wake-up after the landing that ended it
        t0 = time.perf_counter()
        try:
            done, rest = wait_(fs, *a, **k)
        finally:
            t1 = time.perf_counter()
            mark("wait for a read", t0, t1)
        ts = [f._t_set for f in done if hasattr(f, "_t_set")]
        if ts and min(ts) > t0:
            mark("wake after a landing", min(ts), t1)
        return done, rest
    cache.wait = timed_wait
    res = cache.ExpertCache.resident

    def timed_resident(self, *a, **k):     # a generator: each resume to its next yield is the store's time
        it, name = res(self, *a, **k), "resident: to its first group"    # the ids to the host, the reads queued
        while True:
            t0 = time.perf_counter()
            try:
                g = next(it)
            except StopIteration:
                mark("resident: after its last group", t0, time.perf_counter())
                return
            t1 = time.perf_counter()
            mark(name, t0, t1)
            name = "resident: to a later group"          # a read's wait, the copy up
            yield g
            mark("a group's experts (launches)", t1, time.perf_counter())
    cache.ExpertCache.resident = timed_resident


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--budget-frac", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--prefetch", action="store_true", help="next-layer prefetch on (waste.load's prefetch)")
    ap.add_argument("--split", type=int, default=1, help="arm: a record read as this many preads at once")
    ap.add_argument("--sync-up", action="store_true", help="arm: the copies up to the GPU with a host wait")
    ap.add_argument("--no-cut", action="store_true", help="arm: the step eager, not graphs cut at the MoE layers")
    ap.add_argument("--no-group-graphs", action="store_true",
                    help="arm: each group of a layer's experts launched eagerly, not replayed (row_graphs.py)")
    ap.add_argument("--eager-rewrite", action="store_true", help="arm: the q4 rewrite as torch operators, no graph")
    ap.add_argument("--no-aio", action="store_true", help="arm: demand reads on the reader threads (WASTE_AIO=0)")
    ap.add_argument("--jit", action="store_true", help="arm: every triton launch through triton's JIT (no Fast)")
    ap.add_argument("--switch", type=float, default=None,
                    help="arm: sys.setswitchinterval (s): how long a thread waits for the GIL before asking for it")
    ap.add_argument("--no-verify", action="store_true", help="diagnostic arm: no CRC-32 of the records read")
    ap.add_argument("--aio-depth", type=int, default=None, help="arm: Linux AIO reads in flight (cache.AIO_DEPTH)")
    ap.add_argument("--probe", type=float, default=0.4,
                    help="seconds per depth of the AIO probe (random records, depths 1, 2, 4) before and after decode")
    ap.add_argument("--device", default="cuda", help="cpu: the same pieces without a GPU (to try the script)")
    a = ap.parse_args()
    if a.device == "cpu":
        torch.cuda.synchronize = lambda *_: None      # gpu_decode.decode syncs the GPU around each step
    out = build(a.dir, a.layers, "q4")
    if a.split > 1:
        split_reads(a.split)
    if a.sync_up:
        sync_up()
    if a.eager_rewrite:
        from waste.layers import q4_rows
        q4_rows.GRAPHED = 0
    if a.no_aio:
        os.environ["WASTE_AIO"] = "0"
    if a.jit:
        from waste import triton_launch
        triton_launch.ENABLED = False
    if a.switch is not None:
        sys.setswitchinterval(a.switch)
    if a.aio_depth is not None:
        cache.AIO_DEPTH = a.aio_depth
    instrument()
    drop = subprocess.run("sync && echo 3 > /proc/sys/vm/drop_caches", shell=True).returncode == 0
    banks = sorted(p for p in (out / "experts").iterdir() if p.is_file())
    disk = disk_rate(banks)
    c = open_container(out)
    bank_bytes = c.manifest["experts"]["record_bytes"] * sum(b.num_experts for b in c.banks.values())
    probes = [aio_probe(c, a.probe)] if a.probe > 0 else []
    with waste.load(out, device=a.device, dtype="bfloat16", threads=a.threads, prefetch=a.prefetch,
                    verify=not a.no_verify, budget=int(bank_bytes * a.budget_frac)) as eng:
        m, gpu, cuda = eng.model, [], a.device != "cpu"
        if a.no_cut and m.graphs is not None:
            m.graphs.cut_on = False
        if a.no_group_graphs and m.graphs is not None:
            m.graphs.rows.on = False
        mlp = m.mlp_many

        def timed_mlp(i, xs, hs=None):
            t0 = time.perf_counter()
            if m.graphs is not None and m.graphs.cutting:     # inside a cut step's warm-up or capture: no marks
                return mlp(i, xs, hs)
            if not cuda:
                y = mlp(i, xs, hs)
                mark("mlp call", t0, time.perf_counter())
                return y
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            y = mlp(i, xs, hs)
            e.record()
            mark("mlp call", t0, time.perf_counter())
            if ON.is_set():
                gpu.append((s, e))
            return y
        m.mlp_many = timed_mlp
        fwd, count = m.forward, [0]

        def timed_step(*args, **kw):    # (a frame of its own: benchmarks/spy_fold.py --under timed_step)
            t0 = time.perf_counter()
            y = fwd(*args, **kw)
            if cuda:
                torch.cuda.synchronize()
            mark("token", t0, time.perf_counter())
            return y

        def timed_forward(*args, **kw):
            count[0] += 1
            if count[0] == 10:         # the prompt, 8 warm-up steps (gpu_decode.decode's), then the timed ones
                ON.set()
            return timed_step(*args, **kw) if ON.is_set() else fwd(*args, **kw)
        m.forward = timed_forward
        snap = []

        steps, _ = decode(m, a.n, torch.Generator().manual_seed(0), lambda: snap.append(eng.experts.stats.snapshot()))
        ON.clear()
        st = eng.experts.stats
        if cuda:
            torch.cuda.synchronize()
        gpu_ms = [s.elapsed_time(e) for s, e in gpu]
        if a.probe > 0:
            probes.append(aio_probe(c, a.probe))
    calls = len(steps) + 8
    read = (st.bytes_read - snap[0].bytes_read) / calls
    med = statistics.median(steps)
    arm = (f"{a.threads} reader threads, split {a.split}, sync up {a.sync_up}, cut graphs {not a.no_cut}, group "
           f"graphs {not a.no_group_graphs}, graphed rewrite {not a.eager_rewrite}, jit {a.jit}, AIO {not a.no_aio}, "
           f"AIO depth {cache.AIO_DEPTH}, checksums {not a.no_verify}, switch interval {sys.getswitchinterval()} s")
    print(f"{a.layers} layers q4, budget {a.budget_frac:.2f} of the {bank_bytes / 1e9:.2f} GB bank, {arm}, prefetch "
          f"{'on' if a.prefetch else 'off'} (precision {st.predicted_right / max(st.predicted, 1):.2f}, recall "
          f"{st.predicted_right / max(st.predicted_needed, 1):.2f}), page cache dropped: {drop}; disk (8 MiB O_DIRECT "
          f"reads) {disk / 1e9:.2f} GB/s", flush=True)
    print(f"decode {1 / med:.1f} tok/s ({1e3 * med:.2f} ms a token median); {read / 1e6:.1f} MB read a token "
          f"({read / eng.experts.record_bytes:.2f} records); disk bound {disk / read:.1f} tok/s "
          f"({read / med / disk * 100:.0f}% of it)", flush=True)
    for when, pr in zip(("before", "after"), probes):
        print(f"AIO probe {when} decode (random records, depth: GB/s, ms a record): " + ", ".join(
            f"{d}: {g:.2f} GB/s {ms:.2f} ms" for d, (g, ms) in pr.items()), flush=True)
    if probes:
        best = max(g for pr in probes for g, _ in pr.values())
        print(f"decode read {read * med ** -1 / 1e9:.2f} GB/s: {100 * read / med / 1e9 / best:.0f}% of the probes' "
              f"best {best:.2f} GB/s", flush=True)
    by = defaultdict(list)
    for name, _, t0, t1 in MARKS:
        by[name].append(1e3 * (t1 - t0))
    n_tok = max(1, len(by["token"]))
    print(f"{'piece':<28}{'count/token':>12}{'median ms':>11}{'mean ms':>9}{'ms/token':>10}")
    for name, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:<28}{len(v) / n_tok:>12.2f}{statistics.median(v):>11.3f}{statistics.mean(v):>9.3f}"
              f"{sum(v) / n_tok:>10.2f}")
    if gpu_ms:
        print(f"GPU time of an MLP call (events): median {statistics.median(gpu_ms):.3f} ms, mean "
              f"{statistics.mean(gpu_ms):.3f}", flush=True)
    gaps(MARKS)


def gaps(marks) -> None:
    """On the decoding thread: between MLP calls (attention, norms, the router, the head), and within an MLP call
    before its first read starts, between the last read's end and the call's end (the tail)."""
    main = threading.main_thread().ident
    mlps = sorted((t0, t1) for n, th, t0, t1 in marks if n == "mlp call" and th == main)
    reads = sorted((t0, t1) for n, _, t0, t1 in marks if n in ("pread", "aio read (submit -> reaped)"))
    between = [1e3 * (b[0] - a[1]) for a, b in zip(mlps, mlps[1:]) if b[0] - a[1] < 0.05]
    first, tail, span, busy = [], [], [], []
    for t0, t1 in mlps:
        inside = [r for r in reads if t0 <= r[0] <= t1]
        if not inside:
            continue
        first.append(1e3 * (inside[0][0] - t0))
        tail.append(1e3 * (t1 - max(r[1] for r in inside)))
        span.append(1e3 * (t1 - t0))
        busy.append(1e3 * (max(r[1] for r in inside) - inside[0][0]))
    for name, v in (("between MLP calls", between), ("MLP call start -> first pread", first),
                    ("first pread -> last pread end", busy), ("last pread end -> MLP call end", tail),
                    ("MLP call with reads", span)):
        if v:
            print(f"{name:<34} median {statistics.median(v):.3f} ms, mean {statistics.mean(v):.3f} ({len(v)})")


if __name__ == "__main__":
    main()
