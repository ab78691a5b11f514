"""ASGI middleware of the server (pure ASGI: BaseHTTPMiddleware breaks disconnect detection): the API key, the
body limit, giving memory back after a large body, counting requests by endpoint and status."""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import secrets

from starlette.concurrency import run_in_threadpool

from .errors import APIError
from .metrics import Metrics

ENDPOINTS = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/metrics", "/v1/messages")
KEYED = ("/v1", "/tokenize", "/detokenize")   # behind --api-key: everything but /health and /metrics
TRIM_AFTER = 1 << 20       # a body this large is followed by giving freed memory back to the system


class APIKeyAuth:
    """/v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` or `x-api-key: KEY` (compared in constant
    time); /health and /metrics stay open."""

    def __init__(self, app, key: str):
        self.app, self.digest = app, hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(KEYED) and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth and b"x-api-key" in headers:    # Anthropic's clients and agents send the key so
                auth = "Bearer " + headers[b"x-api-key"].decode("latin-1")
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
