"""`waste serve` soaked: N requests (default 1000) at C concurrent (default 16), with the server's RSS sampled before
and after, plus a hostile phase: oversize bodies (declared and chunked), and prompts far past the context sent while /health is
timed. Not a test (tests/test_serve_hardening.py holds the bounded checks); docs/LEARNED.md §8 has the
figures.

    python benchmarks/serve_soak.py                       # the default model, 1000 requests, 16 at a time
    python benchmarks/serve_soak.py MODEL.waste -n 2000 -c 32

The mix, by request number: completions blocking (1 in 3), completions streamed (1 in 3), /tokenize (1 in 6),
and a refused request (1 in 6: a 400 for a bad field, or a prompt past the context). Every answer is checked: 200s
must finish, refusals must be 400s in the API's error shape. RSS is read from /proc after a warm-up of C * 4
requests (the allocator settles there) and after the last request.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BANNER = re.compile(r"waste: serving .* at (http://127\.0\.0\.1:\d+)/v1")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "waste", "serve", *([model] if model else []), "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        m = BANNER.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit("the server did not start")


async def one(ac: httpx.AsyncClient, i: int) -> str:
    kind = i % 6
    if kind in (0, 1):
        r = await ac.post("/v1/completions", json={"prompt": f"def f{i}(x):", "max_tokens": 8, "temperature": 0.7,
                                                   "seed": i})
        return "ok" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else f"bad {r.status_code}"
    if kind in (2, 3):
        async with ac.stream("POST", "/v1/completions", json={"prompt": f"class C{i}:", "max_tokens": 8,
                                                              "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        return "ok" if r.status_code == 200 and lines[-1] == "data: [DONE]" else f"bad stream {r.status_code}"
    if kind == 4:
        r = await ac.post("/tokenize", json={"prompt": f"import os  # {i}"})
        return "ok" if r.status_code == 200 and r.json()["count"] > 0 else f"bad tokenize {r.status_code}"
    if i % 12 == 5:
        r = await ac.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                          headers={"Content-Type": "application/json"})
    else:                                  # 80 KB of prompt: far past the default model's 1024-token context
        r = await ac.post("/v1/completions", json={"prompt": "pad " * 20000})
    ok = r.status_code == 400 and r.json()["error"]["code"]
    return "ok" if ok else f"bad refusal {r.status_code}"


async def soak(url: str, n: int, c: int, start_at: int = 0) -> tuple[list[str], float]:
    sem = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as ac:
        async def bounded(i):
            async with sem:
                try:
                    return await one(ac, i)
                except Exception as e:        # counted, not raised: the soak reports every failure
                    return f"error {type(e).__name__}: {e}"
        t0 = time.perf_counter()
        out = await asyncio.gather(*[bounded(start_at + i) for i in range(n)])
        return out, time.perf_counter() - t0


def hostile(url: str) -> dict:
    """/health timed alone, then while oversize bodies are refused (Content-Length 200 MB never sent; 20 MB offered
    chunked), and while 3.9 MB prompts far past the context are refused, by /v1/completions and by /tokenize."""
    host, port = url.removeprefix("http://").split(":")
    ms = lambda xs: f"median {statistics.median(xs) * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms"   # noqa: E731

    def timed(fn, at_least: float = 3.0) -> tuple[list[float], float]:
        """fn run again and again for at_least seconds while /health is probed: the probe latencies and the
        seconds one run of fn took (median)."""
        lat, stop = [], threading.Event()

        def probe():
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get(url + "/health")
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.01)

        th = threading.Thread(target=probe, daemon=True)
        th.start()
        runs, end = [], time.perf_counter() + at_least
        while time.perf_counter() < end or not runs:
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        stop.set()
        th.join()
        return lat, statistics.median(runs)

    def post(headers: str, pieces) -> None:
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}\r\n"
                      .encode())
            try:
                for p in pieces:
                    s.sendall(p)
            except OSError:
                pass
            assert b" 413 " in s.recv(4096)

    mb = b"x" * (1 << 20)
    big = "def f(x):\n    return x + 1\n" * 140_000            # 3.9 MB
    out = {}
    lat, _ = timed(lambda: time.sleep(0.1))
    out["/health alone"] = ms(lat)
    lat, took = timed(lambda: post("Content-Length: 200000000\r\n", [b"{"]))
    out[f"/health during declared 200 MB bodies (413 each in {took * 1e3:.1f} ms)"] = ms(lat)
    lat, took = timed(lambda: post("Transfer-Encoding: chunked\r\n",
                                   (b"%x\r\n%s\r\n" % (len(mb), mb) for _ in range(20))))
    out[f"/health during chunked 20 MB bodies (413 each in {took * 1e3:.1f} ms)"] = ms(lat)
    with httpx.Client(base_url=url, timeout=600) as c:
        def past_context():
            r = c.post("/v1/completions", json={"prompt": big})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        lat, took = timed(past_context)
        out[f"/health during 3.9 MB prompts past the context (400 each in {took * 1e3:.0f} ms)"] = ms(lat)
        lat, took = timed(lambda: c.post("/tokenize", json={"prompt": big}).status_code == 400 or 1 / 0)
        out[f"/health during /tokenize of 3.9 MB, past the context (400 each in {took * 1e3:.0f} ms)"] = ms(lat)
        fits = big[:7000]                   # under (context + 1) * 8 characters: tokenized whole
        lat, took = timed(lambda: c.post("/tokenize", json={"prompt": fits}).raise_for_status())
        out[f"/health during /tokenize of 7 KB ({took * 1e3:.0f} ms each)"] = ms(lat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-n", type=int, default=1000)
    ap.add_argument("-c", type=int, default=16)
    ap.add_argument("--hostile-only", action="store_true", help="skip the soak")
    a = ap.parse_args()
    proc, url = start(a.model, ["--max-queue", str(max(64, a.c * 2))])
    try:
        warm, _ = asyncio.run(soak(url, a.c * 4, a.c)) if not a.hostile_only else (["ok"], 0)
        assert all(r == "ok" for r in warm), [r for r in warm if r != "ok"][:5]
        before = rss(proc.pid)
        got, dt, series = [], 0.0, []
        n = a.n if not a.hostile_only else 0
        for q in range(4):                  # in quarters, RSS after each: growth that goes on is a leak
            part, t = asyncio.run(soak(url, n // 4, a.c, start_at=a.c * 4 + q * (n // 4)))
            got, dt = got + part, dt + t
            series.append(rss(proc.pid))
        after = series[-1]
        bad = [r for r in got if r != "ok"]
        print(f"{len(got)} requests, {a.c} concurrent: {dt:.1f} s ({len(got) / max(dt, 1e-9):.1f} req/s), {len(bad)} failed"
              + (f": {bad[:5]}" if bad else ""))
        print(f"server RSS after warm-up {before / 2**20:.1f} MiB; after each quarter "
              + ", ".join(f"{x / 2**20:.1f}" for x in series) + f" MiB ({(after - before) / 2**20:+.1f} MiB)")
        before = rss(proc.pid)
        for k, v in hostile(url).items():
            print(f"{k}: {v}")
        print(f"server RSS after the hostile bodies {rss(proc.pid) / 2**20:.1f} MiB "
              f"({(rss(proc.pid) - before) / 2**20:+.1f} MiB)")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
