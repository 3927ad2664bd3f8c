"""What an API request's engine requests come back as: the `Choices` (``n`` per prompt, their
outputs merged into one stream, with the backlog and abort rules), the SSE response that always
closes its generator, and the errors answered as OpenAI error bodies (`APIError`). Used by
`glm5.serve.app`; the module docstring there says how a request maps onto the engine."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from glm5.engine.engine import RequestRejected
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SamplingParams
from glm5.serve.http import STALLED
from glm5.serve.protocol import error_body


class APIError(Exception):
    """An error answered as an OpenAI error body with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = (status, message, param,
                                                                   retry_after)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(error_body(self.status, self.message, self.param), self.status,
                            headers=headers)


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestRejected):
        return APIError(e.status, str(e), e.param, e.retry_after)
    return APIError(500, f"glm5 serve: the request failed: {type(e).__name__}: {e}")


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An SSE response that always closes its body generator when it ends: Starlette cancels
    the sending task when the client disconnects, which can leave the generator suspended at a
    ``yield`` with its engine requests still running; closing it runs its ``finally`` (abort)."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Choices:
    """The engine requests of one API request (``n`` per prompt), their outputs merged into one
    stream of ``(choice index, RequestOutput)``. `start` waits until every choice has its
    first output (or raises the `APIError` of one the engine refused, aborting the others);
    `close` aborts whatever has not finished and counts the HTTP request as aborted (by
    ``reason``, see `ServerMetrics.abort`) unless it completed or failed.

    Memory is bounded per choice: the engine sends deltas (``output_kind="delta"``), the merge
    queue holds at most ``n`` outputs, and a choice whose unread outputs reach ``backlog`` is
    aborted by the engine (`AsyncEngine.generate`'s ``max_backlog``): a client that stops
    reading never makes generation run further ahead of it."""

    def __init__(self, srv: Any, subs: Sequence[tuple[str, Any, SamplingParams]],
                 scope: dict) -> None:
        self.n = len(subs)
        self._srv, self._scope = srv, scope
        self._q: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue(
            maxsize=max(1, self.n))
        self.backlogged = False  # a choice was aborted: its reader fell `backlog` behind
        self._gens = [srv.engine.generate(rid, prompt, sp, output_kind="delta",
                                          max_backlog=srv.limits.stream_backlog,
                                          on_stall=self._on_stall)
                      for rid, prompt, sp in subs]
        self._tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self._gens)]
        self._buf: list[tuple[int, RequestOutput]] = []
        self.stop: APIError | None = None  # set at the graceful timeout: ends the response
        self.ended: str | None = None  # "done" | "failed" once the response has its end
        self._closed = False
        srv.open_choices.add(self)

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await self._q.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers it
            await self._q.put((i, e))

    def end(self, error: APIError) -> None:
        """End the response with ``error`` (the server is shutting down); the consumer sees it
        at its next output, or now if it waits for one."""
        self.stop = error
        try:
            self._q.put_nowait((-1, error))
        except asyncio.QueueFull:
            pass  # the consumer is not waiting: it checks `stop` after each output

    async def start(self) -> None:
        started: set[int] = set()
        while len(started) < self.n:
            i, x = await self._q.get()
            if isinstance(x, BaseException):
                self.ended = "failed"
                await self.close()
                raise engine_error(x)
            started.add(i)
            self._buf.append((i, x))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        done = 0
        buf, self._buf = self._buf, []
        while done < self.n:
            if self.stop is not None:
                raise self.stop
            if buf:
                i, x = buf.pop(0)
            else:
                i, x = await self._q.get()
            if isinstance(x, BaseException):
                if i >= 0:
                    self.ended = "failed"
                raise engine_error(x)
            if x.finished:
                done += 1
                if x.finish_reason == "error" or (x.finish_reason == "abort"
                                                  and not x.error):
                    self.ended = "failed"
            yield i, x
        if self.ended is None:
            self.ended = "done"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._srv.open_choices.discard(self)
        # Counted before any await: a response cancelled by a disconnect (anyio cancels
        # again at every await of its cancelled scope) may not get past the first one.
        if self.ended is None or self.stop is not None:
            reason = ("shutdown" if self.stop is not None
                      else "stalled" if self._scope.get(STALLED) or self.backlogged
                      else "client_gone")
            self._srv.metrics.abort(reason)
        for t in self._tasks:
            t.cancel()  # a generator cancelled while waiting aborts its request
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self._gens:
            await g.aclose()  # one never started (or suspended at a yield) aborts here

    def _on_stall(self) -> None:
        self.backlogged = True


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work) -> Any:
    """Run ``work`` (a coroutine); cancel it if the client disconnects first (its engine
    requests are aborted by its cleanup). Returns its result, or None after a disconnect."""
    task = asyncio.create_task(work)
    watch = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watch, task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def check_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(out.error_status or 500,
                       f"glm5 serve: generation failed in the engine: {out.error}")
    if out.finish_reason == "abort":
        raise APIError(500, f"glm5 serve: the request was aborted by the engine"
                       f"{': ' + out.error if out.error else ''}")
