"""What waste's checks cost a download (docs/LEARNED.md §9): one shard served over loopback by tests/hub_server.py
(in its own process), fetched four ways, interleaved, medians of 3:

  raw      huggingface_hub's http_get into a plain file (the client alone, no checks)
  waste    waste/hub/fetch.py: the same client through waste's sink (sha256 as bytes arrive), then the rename
  thread   the same with the hash on a thread of its own (hashlib lets go of the GIL): the variant not taken
  resume   the same, from a partial holding half the file: the half already here is re-hashed first

plus sha256 and git's sha1 of the same bytes in memory, and sha256 over the file from the page cache.

    OPENBLAS_NUM_THREADS=1 python benchmarks/fetch_loopback.py [--mib 512]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAME = "model-00000.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fetch-bench-"))
    src = tmp / "src"
    src.mkdir()
    data = os.urandom(a.mib << 20)
    (src / NAME).write_bytes(data)
    (src / "config.json").write_text("{}")
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hub_server.py"), str(src), "bench/one"],
                              stdout=subprocess.PIPE, text=True)
    try:
        os.environ["HF_ENDPOINT"] = server.stdout.readline().strip()
        run(tmp, data, a.repeats)
    finally:
        server.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


def threaded_sink():
    import queue
    import threading

    from waste.hub import fetch

    class ThreadedSink(fetch._Sink):
        def write(self, b) -> int:
            self.f.write(b)
            if self.h is not None:
                if getattr(self, "q", None) is None:
                    self.q = queue.Queue(maxsize=8)
                    self.t = threading.Thread(target=self._hash, args=(self.q, self.h), daemon=True)
                    self.t.start()
                self.q.put(b)
            self.bar.update(len(b))
            return len(b)

        @staticmethod
        def _hash(q, h) -> None:
            while (b := q.get()) is not None:
                h.update(b)

        def digest(self):
            if getattr(self, "q", None) is not None:
                self.q.put(None)
                self.t.join()
                self.q = None
            return super().digest()

    return ThreadedSink


def run(tmp: Path, data: bytes, repeats: int) -> None:
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    from waste.hub import fetch
    from waste.hub.remote import Remote, _Silent

    ThreadedSink = threaded_sink()
    remote = Remote("bench/one").describe()
    rf = remote.files[NAME]
    size = len(data)
    times = {"raw": [], "waste": [], "thread": [], "resume": []}
    inline = fetch._Sink
    for _ in range(repeats):
        for arm in times:
            root = tmp / f"dst-{arm}"
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            if arm == "resume":
                rel = fetch.Release(root, remote)
                rel.partial(rf).parent.mkdir(parents=True)
                rel.partial(rf).write_bytes(data[:size // 2])
            fetch._Sink = ThreadedSink if arm == "thread" else inline
            t = time.perf_counter()
            if arm == "raw":
                headers = build_hf_headers()
                headers["Accept-Encoding"] = "identity"
                with open(root / NAME, "wb") as f:
                    http_get(remote.url(NAME), f, headers=headers, expected_size=size, tqdm_class=_Silent)
            else:
                fetch.fetch_release(remote, root, [rf], progress=False)
            times[arm].append(time.perf_counter() - t)
            assert (root / NAME).stat().st_size == size
    mb = size / 1e6
    for arm, ts in times.items():
        moved = mb / 2 if arm == "resume" else mb
        print(f"{arm:7s} {statistics.median(ts):6.2f} s  {mb / statistics.median(ts):7.0f} MB/s of file, "
              f"{moved / statistics.median(ts):7.0f} MB/s over the network   (runs {', '.join(f'{t:.2f}' for t in ts)})")
    for label, h in (("sha256", hashlib.sha256()), ("git sha1", hashlib.sha1())):
        t = time.perf_counter()
        h.update(data)
        print(f"{label:9s} in memory {mb / (time.perf_counter() - t):7.0f} MB/s")
    t = time.perf_counter()
    fetch.hash_file(tmp / "dst-raw" / NAME, rf)
    print(f"sha256 of the file (page cache) {mb / (time.perf_counter() - t):7.0f} MB/s")


if __name__ == "__main__":
    main()
