"""The server's loading state: the model behind the app (loaded in a background thread, or handed in ready), its
scheduler, what it serves under which names, its sampling defaults, the SIGTERM drain."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

from ..images.sources import FetchPolicy
from .errors import APIError
from .metrics import Metrics
from .scheduler import Job, Scheduler

log = logging.getLogger("waste.serve")

RETRY_AFTER = "1"          # seconds a client is asked to wait when the queue is full or the model is loading
MAX_BODY = 4 << 20         # bytes of a request body (--max-body); a 128K-token prompt is about 0.5 MB of JSON
GRACE = 30.0               # seconds running requests get to finish after SIGTERM (--shutdown-grace)


class ServerState:
    """The model behind the app: loaded in a background thread (or handed in ready), its scheduler, counters."""

    def __init__(self, model=None, engine=None, api_key: str | None = None, max_queue: int = 64,
                 max_batch: int = 8, model_name: str | None = None, load=None, max_body: int = MAX_BODY,
                 grace: float = GRACE, image_urls: bool = True):
        self.model_arg, self.api_key, self.max_queue, self.max_batch = model, api_key, max_queue, max_batch
        self.image_policy = FetchPolicy(allow_urls=image_urls)     # image_url parts: http(s) fetched or refused
        self.max_body, self.grace = max_body, grace
        self.live: set[Job] = set()       # jobs whose responses are not finished (the drain waits for them)
        self.draining = False
        self.model_name = model_name
        self._load = load                 # callable(model) -> Engine; default Engine.load
        self.metrics = Metrics(model=lambda: self.model_id, live=self._live)
        self.engine = self.scheduler = None
        self.error: BaseException | None = None
        self.model_id = model_name or (model_id(model) if model is not None else "waste")
        self.aliases: set[str] = set()
        self.created = int(time.time())
        self.on_failure = None            # called when loading fails (the CLI stops the server)
        self._thread = None
        self._owns_engine = engine is None
        if engine is not None:
            self._ready(engine)

    def _live(self):
        engine = self.engine
        return self.ready, self.scheduler, engine.experts if engine is not None else None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def start_loading(self) -> None:
        if self.ready or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load_engine, name="waste-load", daemon=True)
        self._thread.start()

    def _load_engine(self) -> None:
        try:
            if self._load is not None:
                engine = self._load(self.model_arg)
            else:
                from ..engine import Engine

                engine = Engine.load(self.model_arg)
            self._ready(engine)
        except BaseException as e:        # reported by /health and by the CLI, which exits
            self.error = e
            log.error("loading the model failed: %s", e)
            if self.on_failure is not None:
                self.on_failure(e)
            return

    def _ready(self, engine) -> None:
        from ..chat import chat_support, context_length

        self.engine = engine
        root = Path(engine.container.root)
        self.model_id = self.model_name or model_id(root)
        self.aliases = {self.model_id, root.name, str(root), str(self.model_arg) if self.model_arg else ""} - {""}
        self.context = context_length(engine)
        self.chat_reasons = chat_support(engine)
        self.defaults = generation_defaults(engine)
        self.scheduler = Scheduler(engine, self.max_queue, self.max_batch, self.metrics)

    def close(self, timeout: float = 10.0) -> None:
        stopped = self.scheduler.close(timeout) if self.scheduler is not None else True
        if not stopped:     # a long step is still running: leave the engine to the process's exit
            log.warning("the engine is still inside a step; not waiting for it")
        elif self.engine is not None and self._owns_engine:
            self.engine.close()
        self.scheduler = self.engine = None

    def require_ready(self) -> None:
        if self.error is not None:
            raise APIError(503, f"the model failed to load: {self.error}", None, "model_load_failed")
        if not self.ready:
            raise APIError(503, "the model is loading; retry shortly", None, "model_loading",
                           headers={"Retry-After": RETRY_AFTER})

    def require_open(self) -> None:
        """Generation endpoints: ready, and not draining (a kept-alive connection may still send a request)."""
        self.require_ready()
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "shutting_down")

    async def drain(self, force=lambda: False) -> None:
        """SIGTERM: refuse new work, let live requests finish for `grace` seconds, then cancel the rest; each
        cancelled stream ends with an error event and [DONE] (the scheduler ends a cancelled job at its next
        step), so wait a little for those to be written."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + self.grace
        while self.live and loop.time() < end and not force():
            await asyncio.sleep(0.05)
        if self.live:
            log.warning("shutting down: cancelling %d request(s) still running after %.0f s", len(self.live),
                        self.grace)
        for job in list(self.live):
            job.cancel()
        end = loop.time() + 5.0
        while self.live and loop.time() < end and not force():
            await asyncio.sleep(0.05)

    def check_model(self, name: str | None) -> None:
        if name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_id!r} "
                                "(GET /v1/models)", "model", "model_not_found")


def model_id(path) -> str:
    name = Path(str(path)).name
    return name[:-len(".waste")] if name.endswith(".waste") and len(name) > len(".waste") else name


def generation_defaults(engine) -> dict:
    """Sampling defaults from the release's generation_config.json, as vLLM takes them; do_sample false means
    greedy. Without one, OpenAI's defaults (temperature 1, top_p 1)."""
    path = engine.container.text_file("generation_config")
    try:
        cfg = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p") if isinstance(cfg.get(k), (int, float))}
    return out
