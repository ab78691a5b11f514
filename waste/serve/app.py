"""The OpenAI-compatible HTTP server (`waste serve`): FastAPI on uvicorn in front of the engine worker.

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (blocking, and SSE streaming),
POST /tokenize, POST /detokenize, GET /metrics. The contract is ../shared/reference/openai-server.md §0.

Every request is validated whole, the chat prompt rendered included, before any 200 is sent: a refusal is a
400 in OpenAI's error shape naming the field. The port is bound before the model loads: /health answers 503
until it is ready, and so does every endpoint that needs the model. Handlers never touch the model: they queue
a Job on the scheduler (scheduler.py) and read its events from an asyncio queue; a client that goes away
cancels its job, which stops within one decode step.

A hostile client costs bounded time and memory: bodies past `max_body` are refused with 413 before they are
read whole (RefuseLarge), prompts are tokenized on a worker thread and a prompt far past the context is refused
after tokenizing a prefix of it, and memory freed by a large body goes back to the system. SIGTERM drains: the
port closes, running requests get `grace` seconds to finish, and whatever is left ends with an error event.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hashlib
import json
import logging
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import params
from ..version import __version__
from ..text.parsers import Content, Reasoning, ToolCall
from .errors import APIError, bad_request, from_exception, unsupported
from .metrics import Metrics
from .scheduler import Delta, Done, Failed, Job, QueueFull, Scheduler
from .schemas import (MAX_TOP_LOGPROBS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                      TokenizeRequest, common_checks, max_tokens_of, param_errors, sampling_args, stop_list)

log = logging.getLogger("waste.serve")

PING_SECONDS = 15.0        # an SSE comment line while a stream has nothing to say (long prefill, a queue)
RETRY_AFTER = "1"          # seconds a client is asked to wait when the queue is full or the model is loading
ARG_PIECE = 24             # a tool call's arguments stream in pieces of this many characters
ENDPOINTS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/metrics")
KEYED = ("/v1", "/tokenize", "/detokenize")   # behind --api-key: everything but /health and /metrics
MAX_BODY = 4 << 20         # bytes of a request body (--max-body); a 128K-token prompt is about 0.5 MB of JSON
GRACE = 30.0               # seconds running requests get to finish after SIGTERM (--shutdown-grace)
TRIM_AFTER = 1 << 20       # a body this large is followed by giving freed memory back to the system
CHARS_PER_TOKEN = 8        # a long prompt's first (context + 1) * 8 characters are tokenized first (_encode)


class ServerState:
    """The model behind the app: loaded in a background thread (or handed in ready), its scheduler, counters."""

    def __init__(self, model=None, engine=None, api_key: str | None = None, max_queue: int = 64,
                 max_batch: int = 8, model_name: str | None = None, load=None, max_body: int = MAX_BODY,
                 grace: float = GRACE):
        self.model_arg, self.api_key, self.max_queue, self.max_batch = model, api_key, max_queue, max_batch
        self.max_body, self.grace = max_body, grace
        self.live: set[Job] = set()       # jobs whose responses are not finished (the drain waits for them)
        self.draining = False
        self.model_name = model_name
        self._load = load                 # callable(model) -> Engine; default Engine.load
        self.metrics = Metrics()
        self.engine = self.scheduler = None
        self.error: BaseException | None = None
        self.model_id = model_name or (_model_id(model) if model is not None else "waste")
        self.aliases: set[str] = set()
        self.created = int(time.time())
        self.on_failure = None            # called when loading fails (the CLI stops the server)
        self._thread = None
        self._owns_engine = engine is None
        if engine is not None:
            self._ready(engine)

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
        self.model_id = self.model_name or _model_id(root)
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


def _model_id(path) -> str:
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


# -- ASGI middleware (pure ASGI: BaseHTTPMiddleware breaks disconnect detection) -------------------------------
class APIKeyAuth:
    """/v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` (compared in constant time); /health and
    /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.digest = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(KEYED) and scope["method"] != "OPTIONS":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.strip().partition(" ")
            given = hashlib.sha256(token.strip().encode()).digest()
            if scheme.lower() != "bearer" or not secrets.compare_digest(given, self.digest):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", None,
                               "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _libc_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):      # not glibc: nothing to call
        trim = None
    return trim


_MALLOC_TRIM = _libc_trim()


def release_memory() -> None:
    """Give freed memory back to the system: tokenizing a 3.9 MB prompt peaks 560 MiB over the base and leaves 530 MiB
    in the allocator once freed; malloc_trim returns it (70 ms, outside the GIL: ctypes releases it). No gc.collect:
    what a request frees goes by reference count, and a collection holds the GIL for 230 ms (docs/LEARNED.md §8)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class RefuseLarge:
    """A body over the limit gets 413 in the API's shape, never read whole: a Content-Length over it is refused before
    a byte is read; a chunked body is held (at most the limit) and refused once it grows past it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    def _refuse(self, what: str):
        return APIError(413, f"the request body is {what}, over the server's limit of {self.limit} bytes (waste serve "
                             "--max-body)", None, "request_too_large", headers={"Connection": "close"}).response()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:            # uvicorn holds the body to its declared length
            if length.strip().isdigit() and int(length) > self.limit:
                return await self._refuse(f"{int(length)} bytes")(scope, receive, send)
            return await self.app(scope, receive, send)
        held, size = [], 0
        while True:                       # chunked (or no body): read it here, up to the limit
            msg = await receive()
            held.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.limit:
                held.clear()
                return await self._refuse(f"more than {self.limit} bytes")(scope, receive, send)
            if not msg.get("more_body"):
                break
        held.reverse()

        async def replay():
            return held.pop() if held else await receive()

        await self.app(scope, replay, send)


class ReleaseAfterLarge:
    """After a request whose body was large, release_memory() on a worker thread."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        size = [0]

        async def counted():
            msg = await receive()
            if msg["type"] == "http.request":
                size[0] += len(msg.get("body", b""))
            return msg

        try:
            await self.app(scope, counted, send)
        finally:
            if size[0] >= TRIM_AFTER:
                await run_in_threadpool(release_memory)


class CountRequests:
    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        endpoint = path if path in ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"
        status = [500]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.metrics.request(endpoint, status[0])


# -- the app -------------------------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        state.start_loading()
        yield
        state.close()

    app = FastAPI(title="waste", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.waste = state

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")).response()
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None      # the field (a Union adds the alternative that failed after it)
        msg = first.get("msg", "invalid request")
        if param is None:
            return bad_request(f"the body must be a JSON object ({msg})").response()
        if first.get("type") == "missing":
            return bad_request(f"{param} is required", param).response()
        return bad_request(f"{param}: {msg}", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        if e.status_code == 404:
            return APIError(404, f"no such endpoint: {request.method} {request.url.path}", None,
                            "not_found").response()
        if e.status_code == 405:
            return APIError(405, f"{request.method} is not allowed on {request.url.path}", None,
                            "method_not_allowed").response()
        if e.status_code == 400:      # FastAPI could not read the body: not UTF-8, or JSON nested too deep
            return bad_request("the body could not be read as JSON: it must be UTF-8 text, nested at most a few "
                               "hundred levels deep").response()
        return APIError(e.status_code, str(e.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return from_exception(e).response()

    # -- operations ------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.error is not None:
            return APIError(503, f"the model failed to load: {state.error}", None, "model_load_failed").response()
        if not state.ready:
            return APIError(503, "the model is loading", None, "model_loading",
                            headers={"Retry-After": RETRY_AFTER}).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = state.metrics.render(state.model_id, state.scheduler,
                                    state.engine.experts if state.engine is not None else None, state.ready)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "waste",
                "max_model_len": state.context}

    @app.get("/v1/models")
    async def models():
        state.require_ready()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        state.require_ready()
        state.check_model(name)
        return model_card()

    # -- tokens ----------------------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        state.require_ready()
        state.check_model(req.model)
        eng = state.engine
        if req.messages is not None:
            if state.chat_reasons:
                raise _no_chat(state)
            if not req.add_generation_prompt:
                raise unsupported("add_generation_prompt", "only true (the prompt a reply would continue)")
            try:
                c = await run_in_threadpool(eng.chat, req.messages, tools=req.tools, stream=True,
                                            chat_template_kwargs=req.chat_template_kwargs)
            except Exception as e:
                raise from_exception(e) from None
            ids = c.prompt_ids
        else:
            text = req.prompt if req.prompt is not None else req.content
            if text is None:
                raise bad_request("give prompt (text) or messages", "prompt")
            ids = await _encode(eng, text, state.context)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state.require_ready()
        state.check_model(req.model)
        _check_ids(req.tokens, state.engine.tokenizer.vocab_size, "tokens")
        text = state.engine.tokenizer.decode(req.tokens)
        return {"prompt": text, "content": text}

    # -- generation ------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        state.require_open()
        state.check_model(req.model)
        common_checks(req)
        eng = state.engine
        if req.echo:
            raise unsupported("echo", "not supported yet")
        if req.suffix:
            raise unsupported("suffix", "fill-in-the-middle is not supported")
        if req.best_of not in (None, 1):
            raise unsupported("best_of", "only 1 is supported")
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise unsupported("response_format", "structured output needs constrained decoding, which this engine "
                              "does not have (and a completion has no chat template to ask for JSON)")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be 0 to {MAX_TOP_LOGPROBS}", "logprobs")
        want = max_tokens_of(req, "max_tokens")
        sampling = sampling_args(req, state.defaults)
        ids = await _prompt_ids(eng, req.prompt, state.context)
        with param_errors():
            room = params.room(len(ids), None, state.context)
        from ..engine import Generation
        from ..runtime.sampling import SamplingParams

        try:
            gen = Generation(eng, ids, room if want is None else min(want, room), SamplingParams(**sampling),
                             stop_list(req.stop), logprobs=req.logprobs)
        except Exception as e:
            raise from_exception(e) from None
        stream = _Stream(state, request, "cmpl", "text_completion",
                         bool(req.stream_options and req.stream_options.include_usage))
        job = await stream.submit(ids, gen.decoding)
        tok = eng.tokenizer
        if req.stream:
            return await stream.respond(job, _CompletionChunks(stream, tok, req.logprobs))
        return await stream.collect(job, _CompletionChunks(stream, tok, req.logprobs))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        state.require_open()
        state.check_model(req.model)
        common_checks(req)
        if state.chat_reasons:
            raise _no_chat(state)
        eng = state.engine
        kwargs = dict(req.chat_template_kwargs or {})
        _response_format(req.response_format, eng, kwargs)
        if req.parallel_tool_calls is False:
            raise unsupported("parallel_tool_calls", "false cannot be enforced without constrained decoding; "
                              "leave it out (the model decides)")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        want = max_tokens_of(req, "max_completion_tokens", "max_tokens")
        sampling = sampling_args(req, state.defaults)
        stop = stop_list(req.stop)
        try:
            c = await run_in_threadpool(eng.chat, req.messages, tools=req.tools, max_tokens=want, stop=stop,
                                        stream=True, reasoning_effort=req.reasoning_effort,
                                        chat_template_kwargs=kwargs or None, tool_choice=req.tool_choice, **sampling)
        except Exception as e:
            raise from_exception(e) from None
        c.generation.decoding.logprobs = (req.top_logprobs or 0) if req.logprobs else None
        stream = _Stream(state, request, "chatcmpl", "chat.completion",
                         bool(req.stream_options and req.stream_options.include_usage))
        job = await stream.submit(c.prompt_ids, c.generation.decoding)
        shaper = _ChatChunks(stream, eng.tokenizer, c.rendered.parser, bool(req.logprobs))
        if req.stream:
            return await stream.respond(job, shaper)
        return await stream.collect(job, shaper)

    app.add_middleware(ReleaseAfterLarge)
    if state.api_key:
        app.add_middleware(APIKeyAuth, key=state.api_key)
    app.add_middleware(RefuseLarge, limit=state.max_body)
    app.add_middleware(CountRequests, metrics=state.metrics)     # outermost: counts the 401s and 413s too
    return app


def _no_chat(state: ServerState) -> APIError:
    return APIError(400, "this model has no usable chat format: " + "; ".join(state.chat_reasons)
                    + " (/v1/completions serves it)", "messages", "unsupported_chat_format",
                    extra={"reasons": list(state.chat_reasons)})


def _response_format(rf, engine, kwargs: dict) -> None:
    """text: nothing to do. json_object: handed to a chat template that reads `response_format` (it asks the
    model for JSON); refused where the template has no such setting. json_schema: needs constrained decoding."""
    if rf is None:
        return
    kind = rf.get("type")
    if kind in (None, "text"):
        return
    if kind == "json_schema":
        raise unsupported("response_format", "json_schema needs constrained decoding, which this engine does not "
                          "have yet")
    if kind != "json_object":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                          "response_format")

    fmt = engine.chat_format()
    template = getattr(fmt, "template", None)
    if template is None or "response_format" not in template.variables:
        raise unsupported("response_format", "json_object: this model's chat format has no response_format "
                          "setting, and without constrained decoding the engine cannot enforce JSON")
    kwargs["response_format"] = {"type": "json_object"}


async def _encode(engine, text: str, context: int | None = None) -> list[int]:
    """A text's token ids, tokenized on a worker thread. With a context: a text much longer than the context can
    hold is refused once a prefix of (context + 1) * CHARS_PER_TOKEN characters, cut at a space, is over it by a
    margin (the tokens of a prefix cut at a space are the whole text's but for the last word or two)."""
    cut = None if context is None else (context + 1) * CHARS_PER_TOKEN
    if cut is not None and len(text) > cut:
        space = text.rfind(" ", cut // 2, cut)
        head = text[:space if space > 0 else cut]
        n = len(await run_in_threadpool(engine.tokenizer.encode, head, True))
        if n > context + 16:
            raise APIError(400, f"the prompt is more than {n - 16} tokens and the context is {context}", "prompt",
                           "context_length_exceeded")
    return await run_in_threadpool(engine.tokenizer.encode, text, True)


async def _prompt_ids(engine, prompt, context: int | None = None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await _encode(engine, prompt, context)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        _check_ids(prompt, engine.tokenizer.vocab_size, "prompt")
        ids = list(prompt)
    else:
        raise unsupported("prompt", "one prompt per request (a string or a list of token ids); send a batch as "
                          "several requests")
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    return ids


def _check_ids(ids, vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})", param)


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class _ClientGone(Exception):
    pass


class _Stream:
    """One generation request: its id, its job on the scheduler, its events, the race with a disconnect."""

    def __init__(self, state: ServerState, request: Request, prefix: str, obj: str, include_usage: bool):
        self.state, self.request, self.obj, self.include_usage = state, request, obj, include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()

    async def submit(self, prompt_ids, decoding) -> Job:
        loop, q = asyncio.get_running_loop(), self.queue
        job = Job(prompt_ids, decoding, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        try:
            self.state.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry shortly", None, "queue_full",
                           headers={"Retry-After": RETRY_AFTER}) from None
        self.state.live.add(job)
        return job

    def base(self) -> dict:
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.state.model_id,
                "system_fingerprint": f"waste-{__version__}"}

    async def _disconnected(self) -> None:
        while True:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                return

    async def race(self, coro, job: Job):
        """coro's result, unless the client disconnects first: then the job is cancelled."""
        task = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(self._disconnected())
        try:
            done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            job.cancel()
            raise
        finally:
            watch.cancel()
        if task in done:
            return task.result()
        task.cancel()
        job.cancel()
        raise _ClientGone()

    async def collect(self, job: Job, shaper) -> Response:
        async def run():
            while True:
                ev = await self.queue.get()
                if isinstance(ev, Delta):
                    shaper.feed(ev)
                elif isinstance(ev, Failed):
                    raise from_exception(ev.error)
                elif isinstance(ev, Done):
                    return ev

        try:
            done = await self.race(run(), job)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            self.state.live.discard(job)
        if done.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down", None, "cancelled")
        return JSONResponse({**self.base(), **shaper.whole(done)})

    async def respond(self, job: Job, shaper) -> Response:
        """Commit to a 200 only once the first event is in (an error before it is still an HTTP error)."""
        try:
            first = await self.race(self.queue.get(), job)
        except _ClientGone:
            self.state.live.discard(job)
            return Response(status_code=499)
        if isinstance(first, Failed):
            self.state.live.discard(job)
            raise from_exception(first.error)

        async def events():
            ev = first
            try:
                yield shaper.opening()
                while True:
                    if ev is None:
                        yield ": ping\n\n"
                    elif isinstance(ev, Delta):
                        for line in shaper.delta(ev):
                            yield line
                    elif isinstance(ev, Failed):
                        yield _sse(from_exception(ev.error).body())
                        break
                    elif isinstance(ev, Done):
                        if ev.finish_reason == "cancelled":
                            yield _sse(APIError(503, "the request was cancelled: the server is shutting down",
                                                None, "cancelled").body())
                            break
                        for line in shaper.closing(ev):
                            yield line
                        if self.include_usage:
                            yield _sse({**self.base(), "choices": [], "usage": _usage(ev)})
                        break
                    try:
                        ev = await asyncio.wait_for(self.queue.get(), PING_SECONDS)
                    except asyncio.TimeoutError:
                        ev = None
            finally:
                job.cancel()          # the client went away (or the stream ended: then a no-op)
                self.state.live.discard(job)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _token_bytes(tokenizer, tid: int) -> list[int]:
    if hasattr(tokenizer, "token_bytes"):
        return list(tokenizer.token_bytes(tid))
    piece = tokenizer.id_to_token(tid)
    if piece is not None and piece not in getattr(tokenizer, "added_tokens", {}) and all(c in _BYTE_OF for c in piece):
        return [_BYTE_OF[c] for c in piece]
    return list(tokenizer.decode([tid]).encode())


def _byte_table() -> dict[str, int]:
    from ..text.tokenizer import _byte_chars

    return {c: b for b, c in enumerate(_byte_chars())}


_BYTE_OF = _byte_table()


class _ChatChunks:
    """Scheduler events -> chat.completion(.chunk) bodies: the parser splits content, reasoning and tool calls."""

    def __init__(self, stream: _Stream, tokenizer, parser, logprobs: bool):
        self.s, self.tok, self.parser, self.want_lp = stream, tokenizer, parser, logprobs
        self.events: list = []
        self.lps: list = []          # logprob entries not yet sent (streaming)

    def _lp_entries(self, lps) -> list[dict]:
        out = []
        for tid, lp, alts in lps:
            out.append({"token": self.tok.decode([tid]), "logprob": lp, "bytes": _token_bytes(self.tok, tid),
                        "top_logprobs": [{"token": self.tok.decode([a]), "logprob": v,
                                          "bytes": _token_bytes(self.tok, a)} for a, v in alts]})
        return out

    def feed(self, ev: Delta) -> list:
        evs = self.parser.feed(ev.text) if ev.text else []
        self.events += evs
        if self.want_lp:
            self.lps += self._lp_entries(ev.logprobs)
        return evs

    def finish(self) -> list:
        evs = self.parser.finish()
        self.events += evs
        return evs

    def _finish_reason(self, done: Done) -> str:
        if done.finish_reason == "stop" and any(isinstance(e, ToolCall) for e in self.events):
            return "tool_calls"
        return done.finish_reason

    # blocking
    def whole(self, done: Done) -> dict:
        self.finish()
        content = "".join(e.text for e in self.events if isinstance(e, Content))
        reasoning = "".join(e.text for e in self.events if isinstance(e, Reasoning))
        calls = [e.as_openai() for e in self.events if isinstance(e, ToolCall)]
        msg = {"role": "assistant", "content": content or (None if calls else "")}
        if reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        logprobs = {"content": self.lps, "refusal": None} if self.want_lp else None
        return {"choices": [{"index": 0, "message": msg, "logprobs": logprobs,
                             "finish_reason": self._finish_reason(done)}], "usage": _usage(done)}

    # streaming
    def _chunk(self, delta: dict, finish=None, with_lp: bool = False) -> str:
        lp = None
        if self.want_lp and with_lp:
            lp, self.lps = {"content": self.lps, "refusal": None}, []
        body = {**self.s.base(), "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if self.s.include_usage:
            body["usage"] = None
        return _sse(body)

    def opening(self) -> str:
        return self._chunk({"role": "assistant", "content": ""})

    def _lines(self, evs) -> list[str]:
        out = []
        for e in evs:
            if isinstance(e, Content):
                out.append(self._chunk({"content": e.text}, with_lp=True))
            elif isinstance(e, Reasoning):
                out.append(self._chunk({"reasoning_content": e.text, "reasoning": e.text}, with_lp=True))
            elif isinstance(e, ToolCall):
                out.append(self._chunk({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                        "function": {"name": e.name, "arguments": ""}}]}))
                for i in range(0, len(e.arguments), ARG_PIECE):
                    out.append(self._chunk({"tool_calls": [{"index": e.index, "function": {
                        "arguments": e.arguments[i:i + ARG_PIECE]}}]}, with_lp=True))
        return out

    def delta(self, ev: Delta) -> list[str]:
        return self._lines(self.feed(ev))

    def closing(self, done: Done) -> list[str]:
        out = self._lines(self.finish())
        out.append(self._chunk({}, self._finish_reason(done), with_lp=True))
        return out


class _CompletionChunks:
    """Scheduler events -> text_completion bodies; logprobs in the legacy shape (tokens, token_logprobs,
    top_logprobs, text_offset)."""

    def __init__(self, stream: _Stream, tokenizer, logprobs: int | None):
        self.s, self.tok, self.want_lp = stream, tokenizer, logprobs
        self.text = ""
        self.lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self._offset = 0

    def _logprobs(self, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, alts in lps:
            piece = self.tok.decode([tid])
            out["tokens"].append(piece)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self.tok.decode([a]): v for a, v in alts})
            out["text_offset"].append(self._offset)
            self._offset += len(piece)
        return out

    def feed(self, ev: Delta):
        self.text += ev.text
        if self.want_lp is not None:
            part = self._logprobs(ev.logprobs)
            for k in self.lp:
                self.lp[k] += part[k]
            return part
        return None

    def whole(self, done: Done) -> dict:
        return {"choices": [{"index": 0, "text": self.text, "logprobs": self.lp if self.want_lp is not None else None,
                             "finish_reason": done.finish_reason}], "usage": _usage(done)}

    def _chunk(self, text: str, finish=None, lp=None) -> str:
        body = {**self.s.base(), "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}
        if self.s.include_usage:
            body["usage"] = None
        return _sse(body)

    def opening(self) -> str:
        return ": waste\n\n"          # a completion stream has no role chunk: a comment commits the response

    def delta(self, ev: Delta) -> list[str]:
        part = self.feed(ev)
        return [self._chunk(ev.text, lp=part)] if ev.text or part else []

    def closing(self, done: Done) -> list[str]:
        return [self._chunk("", done.finish_reason)]


# -- running it ----------------------------------------------------------------------------------------------
def _server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's shutdown (stop accepting, close idle connections, wait, cancel) with the drain first: the
        listening sockets close at once, then the state's live requests get their grace period."""
        state: ServerState | None = None

        async def shutdown(self, sockets=None):
            for srv in getattr(self, "servers", []):
                srv.close()
            for sock in sockets or []:
                sock.close()
            if self.state is not None:
                await self.state.drain(lambda: self.force_exit)
            await super().shutdown(sockets)

    return DrainingServer


def serve(model=None, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, max_queue: int = 64,
          max_batch: int = 8, model_name: str | None = None, load=None, log_level: str = "info", sock=None,
          max_body: int = MAX_BODY, grace: float = GRACE) -> None:
    """Serve on `sock` (bound by the caller: waste/serve/listen.py) or bind host:port; load the model in the
    background (/health says 503 until it is ready), serve until interrupted or SIGTERM (which drains, see
    ServerState.drain). Raises the load error (a WasteError for a bad path or a damaged container) after the server
    stops."""
    import uvicorn

    from .listen import bind

    if sock is None:
        sock = bind(host, port)
    state = ServerState(model, api_key=api_key, max_queue=max_queue, max_batch=max_batch, model_name=model_name,
                        load=load, max_body=max_body, grace=grace)
    app = create_app(state)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = _server_class()(config)
    server.state = state

    def failed(e):
        server.should_exit = True

    def announce():
        """One line once the port is bound and the model loaded (with --port 0, the port the system chose)."""
        while not (server.started and state.ready) and not server.should_exit:
            time.sleep(0.05)
        if server.should_exit:
            return
        bound = sock.getsockname()[1]
        batch = state.scheduler.max_batch
        note = f" (of {max_batch}: the expert cache holds {batch} working sets)" if batch < max_batch else ""
        print(f"waste: serving {state.model_id!r} at http://{host}:{bound}/v1 (max {batch} at once{note}, "
              f"{max_queue} waiting)", file=sys.stderr, flush=True)

    state.on_failure = failed
    threading.Thread(target=announce, name="waste-announce", daemon=True).start()
    server.run(sockets=[sock])
    if state.error is not None:
        raise state.error
