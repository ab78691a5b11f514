"""The transport of one generation request: its job on the scheduler, its events read from an asyncio queue, the
race with a client that goes away, and the two ways out: one JSON body, or Server-Sent Events (a 200 committed
only once the first event is in, pings while there is nothing to say, an error event and [DONE] at the end)."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..version import __version__
from .errors import APIError, from_exception
from .scheduler import Delta, Done, Failed, Job, QueueFull, share_prefill
from .shapes import sse, usage
from .state import RETRY_AFTER, ServerState

PING_SECONDS = 15.0        # an SSE comment line while a stream has nothing to say (long prefill, a queue)


class ClientGone(Exception):
    pass


class Choices:
    """The jobs of one request (one per choice): cancelled together."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def cancel(self) -> None:
        for j in self.jobs:
            j.cancel()


class Stream:
    """One generation request: its id, its job on the scheduler, its events, the race with a disconnect."""

    def __init__(self, state: ServerState, request: Request, prefix: str, obj: str, include_usage: bool):
        self.state, self.request, self.obj, self.include_usage = state, request, obj, include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()

    async def submit(self, prompt_ids, decoding, *more) -> Job:
        """Queue the request's job (its choices' jobs, with `more` Decodings: n > 1, admitted together and
        sharing the prefill); each event reaches the queue as (choice index, event)."""
        loop, q = asyncio.get_running_loop(), self.queue
        jobs = [Job(prompt_ids, d, lambda ev, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, ev)))
                for i, d in enumerate((decoding, *more))]
        if more:
            share_prefill(jobs)
        try:
            self.state.scheduler.submit(*jobs)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry shortly", None, "queue_full",
                           headers={"Retry-After": RETRY_AFTER}) from None
        job = Choices(jobs)
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
        raise ClientGone()

    async def collect(self, job: Job, shaper, *more) -> Response:
        """One JSON body; with `more` shapers (n > 1), their choices merged into it."""
        shapers, dones = (shaper, *more), {}

        async def run():
            while True:
                i, ev = await self.queue.get()
                if isinstance(ev, Delta):
                    shapers[i].feed(ev)
                elif isinstance(ev, Failed):
                    raise from_exception(ev.error)
                elif isinstance(ev, Done):
                    dones[i] = ev
                    if ev.finish_reason == "cancelled" or len(dones) == len(shapers):
                        return ev

        try:
            done = await self.race(run(), job)
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.state.live.discard(job)
        if done.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled: the server is shutting down", None, "cancelled")
        bodies = [s.whole(dones[i]) for i, s in enumerate(shapers)]
        body = bodies[0]
        if more:
            body = {"choices": [c for b in bodies for c in b["choices"]], "usage": usage(*dones.values())}
        return JSONResponse({**self.base(), **body})

    async def respond(self, job: Job, shaper, *more) -> Response:
        """Commit to a 200 only once the first event is in (an error before it is still an HTTP error)."""
        shapers, dones = (shaper, *more), {}
        try:
            first = await self.race(self.queue.get(), job)
        except ClientGone:
            self.state.live.discard(job)
            return Response(status_code=499)
        if isinstance(first[1], Failed):
            self.state.live.discard(job)
            raise from_exception(first[1].error)

        async def events():
            i, ev = first
            try:
                for s in shapers:
                    yield s.opening()
                while True:
                    if ev is None:
                        yield ": ping\n\n"
                    elif isinstance(ev, Delta):
                        for line in shapers[i].delta(ev):
                            yield line
                    elif isinstance(ev, Failed):
                        yield shapers[i].error(from_exception(ev.error)) if hasattr(shapers[i], "error") \
                            else sse(from_exception(ev.error).body())
                        break
                    elif isinstance(ev, Done):
                        if ev.finish_reason == "cancelled":
                            err = APIError(503, "the request was cancelled: the server is shutting down", None,
                                           "cancelled")
                            yield shapers[i].error(err) if hasattr(shapers[i], "error") else sse(err.body())
                            break
                        dones[i] = ev
                        for line in shapers[i].closing(ev):
                            yield line
                        if len(dones) == len(shapers):
                            if self.include_usage:
                                yield sse({**self.base(), "choices": [], "usage": usage(*dones.values())})
                            break
                    try:
                        i, ev = await asyncio.wait_for(self.queue.get(), PING_SECONDS)
                    except asyncio.TimeoutError:
                        i, ev = 0, None
            finally:
                job.cancel()          # the client went away (or the stream ended: then a no-op)
                self.state.live.discard(job)
            if getattr(shaper, "done_line", True):
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
