"""The OpenAI-compatible HTTP server (`waste serve`): FastAPI on uvicorn in front of the engine worker. This module
assembles it (exception handlers, middleware, the draining uvicorn server); the parts are state.py (loading),
middleware.py, routes.py (the handlers), stream.py (the job's transport, SSE) and shapes.py (OpenAI's bodies).

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

import logging
import sys
import threading
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..version import __version__
from .errors import APIError, bad_request, from_exception
from .middleware import APIKeyAuth, CountRequests, RefuseLarge, ReleaseAfterLarge
from . import anthropic
from .routes import router
from .state import GRACE, MAX_BODY, ServerState

log = logging.getLogger("waste.serve")


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
    app.include_router(router)
    app.include_router(anthropic.router)

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

    anthropic.reshape_errors(app)         # Anthropic's error shape on its own routes
    app.add_middleware(ReleaseAfterLarge)
    if state.api_key:
        app.add_middleware(APIKeyAuth, key=state.api_key)
    app.add_middleware(RefuseLarge, limit=state.max_body)
    app.add_middleware(CountRequests, metrics=state.metrics)     # outermost: counts the 401s and 413s too
    return app


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
          max_body: int = MAX_BODY, grace: float = GRACE, image_urls: bool = True) -> None:
    """Serve on `sock` (bound by the caller: waste/serve/listen.py) or bind host:port; load the model in the
    background (/health says 503 until it is ready), serve until interrupted or SIGTERM (which drains, see
    ServerState.drain). Raises the load error (a WasteError for a bad path or a damaged container) after the server
    stops."""
    import uvicorn

    from .listen import bind

    if sock is None:
        sock = bind(host, port)
    state = ServerState(model, api_key=api_key, max_queue=max_queue, max_batch=max_batch, model_name=model_name,
                        load=load, max_body=max_body, grace=grace, image_urls=image_urls)
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
