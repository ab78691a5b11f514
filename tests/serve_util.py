"""Starting `waste serve` for the tests: as a subprocess (the real CLI, one torch thread) or in this process on a
uvicorn thread (where a test can force the model's output). Loopback only, on a port the system picks."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"   # release chat templates (SOURCES.md)
QWEN3 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
BANNER = re.compile(r"waste: serving .* at (http://127\.0\.0\.1:\d+)/v1")


def qwen3_container(releases, root: Path) -> Path:
    """The Qwen3-MoE fixture release with Qwen3's own chat template (think + hermes tool calls), converted."""
    from waste.convert.convert import convert

    src = root / "src"
    shutil.copytree(releases["qwen3_moe"][1], src)
    shutil.copy(QWEN3, src / "chat_template.jinja")
    cfg = json.loads((src / "config.json").read_text())   # room for Qwen3's tool prompt in this tiny vocabulary
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    return convert(src, root / "q.waste", progress=False)


class ProcessServer:
    """`python -m waste serve CONTAINER --port 0 ...` with OMP_NUM_THREADS=1 (docs/LEARNED.md §2: a tiny model on
    a loaded 2-core box is many times slower with two). The URL comes from its banner."""

    def __init__(self, container, *args: str, timeout: float = 120.0):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "WASTE_PRELOAD": "1"}
        cmd = [sys.executable, "-m", "waste", "serve", str(container), "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url = None
        found = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = BANNER.search(line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=drain, daemon=True).start()
        if not found.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("waste serve did not start:\n" + "".join(self.lines[-30:]))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class ThreadServer:
    """The app on a uvicorn thread of this process (port 0), torch at one thread while it runs."""

    def __init__(self, state):
        import uvicorn

        from waste.serve.app import create_app

        self.state = state
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > 30 or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        torch.set_num_threads(self._threads)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def metric(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            lab = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}")]))
            if all(lab.get(k) == str(v) for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def sse_events(lines) -> list:
    """The data events of an SSE stream (comments skipped), JSON-decoded; "[DONE]" kept as is."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
