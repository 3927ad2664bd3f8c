"""The engine on a background thread, for asyncio callers (the HTTP server).

One thread owns the `LLMEngine` and steps it while it has work; coroutines add requests and
receive each request's outputs through an asyncio queue. A caller that stops listening (a
client that disconnects mid-stream) aborts its request, which frees its pages in the next step.
A caller that stops reading (a stalled stream) is bounded: with ``max_backlog``, a request
whose undelivered outputs reach that many is aborted (counted in ``stalled``), so generation
never runs more than ``max_backlog`` steps ahead of its reader.
`shutdown` stops taking requests and lets the running ones finish (drain).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import AsyncIterator, Callable, Sequence, TypeVar

from glm5.engine.engine import LLMEngine, RequestRejected
from glm5.engine.outputs import RequestOutput
from glm5.engine.sampling import SamplingParams

T = TypeVar("T")


class _Listener:
    """Where one request's outputs go: a queue on the caller's loop, and its backlog bound."""

    __slots__ = ("loop", "queue", "max_backlog", "on_stall", "stalled")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue,
                 max_backlog: int | None, on_stall: Callable[[], None] | None) -> None:
        self.loop, self.queue, self.max_backlog, self.on_stall = loop, queue, max_backlog, on_stall
        self.stalled: str | None = None  # the abort's reason, once the reader fell behind


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # one thread in the engine at a time
        self._queues: dict[str, _Listener] = {}
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self.fatal: str | None = None  # why the engine stopped for good (see `_die`)
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.step_errors = 0
        self.stalled = 0  # requests aborted because their reader fell max_backlog behind
        self._thread = threading.Thread(target=self._loop, name="glm5-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop:
            try:
                with self._lock:
                    busy = self.engine.has_unfinished()
                    if not busy and hasattr(self.engine, "idle"):
                        self.engine.idle()  # e.g. a rank front's heartbeat to its ranks
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                with self._lock:
                    outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the engine isolates requests; this is a bug
                self.step_errors += 1
                if getattr(e, "fatal_to_step", False):  # the engine cannot step again
                    self._die(e)
                    return
                outs = self._fail_all(f"{type(e).__name__}: {e}")
            for o in outs:
                self._deliver(o)

    def _die(self, e: BaseException) -> None:
        """The engine cannot go on (a rank of a multi-rank server was lost): every request ends
        with the error (and its HTTP status, ``e.http_status``: 503), new ones are refused,
        and ``on_fatal`` (the server's exit) is called."""
        self.fatal = f"{type(e).__name__}: {e}"
        self._accepting = False
        status = getattr(e, "http_status", 500)
        outs = self._fail_all(self.fatal)
        for o in outs:
            o.error_status = status
            self._deliver(o)
        if self.on_fatal is not None:
            self.on_fatal(e)

    def _fail_all(self, msg: str) -> list[RequestOutput]:
        with self._lock:
            return self.engine.fail_all(f"glm5 engine step failed: {msg}")

    def _deliver(self, o: RequestOutput) -> None:
        entry = self._queues.get(o.request_id)
        if entry is not None:
            try:
                entry.loop.call_soon_threadsafe(self._put, entry, o)
            except RuntimeError:  # the caller's loop is closed: nobody listens
                pass

    def _put(self, entry: "_Listener", o: RequestOutput) -> None:
        """On the caller's loop: queue ``o``, unless the reader is ``max_backlog`` behind; then
        the request is aborted (once) and only its final output is still queued."""
        if entry.stalled:
            if o.finished:
                o.error = entry.stalled
                entry.queue.put_nowait(o)
            return
        if (entry.max_backlog is not None and not o.finished
                and entry.queue.qsize() >= entry.max_backlog):
            entry.stalled = (f"glm5 engine: request {o.request_id!r} aborted: its reader fell "
                             f"{entry.max_backlog} outputs behind (a client that stopped "
                             f"reading its stream)")
            self.stalled += 1
            self.abort(o.request_id)
            if entry.on_stall is not None:
                entry.on_stall()
            return
        entry.queue.put_nowait(o)

    def between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the calling thread while no step runs (e.g. a weight update
        followed by ``engine.set_weights_version``) and return its result."""
        with self._lock:
            return fn(self.engine)

    # ------------------------------------------------------------------ callers
    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       params: SamplingParams, *, output_kind: str = "cumulative",
                       max_backlog: int | None = None,
                       on_stall: Callable[[], None] | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request, the last with ``finished`` set. Raises `RequestRejected`
        before the first output when the request is not taken. Closing the iterator early
        (a disconnected client) aborts the request. ``output_kind``: see
        `LLMEngine.add_request`. ``max_backlog``: abort the request once this many of its
        outputs wait unread (its final output, finish_reason "abort", says so in ``error``), and
        call ``on_stall()`` (on the caller's loop) when it does."""
        if max_backlog is not None and (isinstance(max_backlog, bool)
                                        or not isinstance(max_backlog, int) or max_backlog < 1):
            raise ValueError(f"glm5 AsyncEngine.generate: max_backlog expected None or an int "
                             f">= 1, got {max_backlog!r}")
        if not self._accepting:
            raise RequestRejected(503, f"glm5 engine: the engine stopped: {self.fatal}"
                                  if self.fatal else "glm5 engine: the server is shutting down")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if request_id in self._queues:
            raise RequestRejected(400, f"glm5 engine: request id {request_id!r} is already in use",
                                  param="request_id")
        self._queues[request_id] = _Listener(loop, q, max_backlog, on_stall)
        finished = False
        # The add runs to its end even when the caller is cancelled meanwhile: an abort sent
        # before the request is in the engine would be lost (and the request run unheard).
        add = asyncio.ensure_future(asyncio.to_thread(self._add, request_id, prompt, params,
                                                      output_kind))
        try:
            await asyncio.shield(add)
            self._wake.set()
            while True:
                o = await q.get()
                finished = o.finished
                yield o
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                if add.done():
                    self.abort(request_id)
                else:
                    add.add_done_callback(lambda _: self.abort(request_id))

    def _add(self, request_id: str, prompt, params: SamplingParams, output_kind: str) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt, params, output_kind=output_kind)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)  # a list append: safe from any thread
        self._wake.set()

    def stats(self) -> dict:
        """A consistent snapshot of the engine's gauges and counters."""
        with self._lock:
            return {**self.engine.snapshot(), "stalled": self.stalled}

    def stop_accepting(self) -> None:
        """From now on `generate` refuses new requests (503); running ones go on."""
        self._accepting = False

    async def shutdown(self, timeout: float = 60.0) -> bool:
        """Stop taking requests, wait (up to ``timeout`` s) for the running ones to finish,
        then stop the engine thread. True when everything finished."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self.engine.has_unfinished():
                    break
            await asyncio.sleep(0.02)
        with self._lock:
            drained = not self.engine.has_unfinished()
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 5.0)
        return drained
