"""The engine on a background thread, for asyncio callers (the HTTP server).

One thread owns the `LLMEngine` and steps it while it has work; coroutines add requests and
receive each request's outputs through an asyncio queue. A caller that stops listening (a
client that disconnects mid-stream) aborts its request, which frees its pages in the next step.
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


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # one thread in the engine at a time
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self.step_errors = 0
        self._thread = threading.Thread(target=self._loop, name="glm5-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - the engine isolates requests; this is a bug
                self.step_errors += 1
                outs = self._fail_all(f"{type(e).__name__}: {e}")
            for o in outs:
                self._deliver(o)

    def _fail_all(self, msg: str) -> list[RequestOutput]:
        outs = []
        with self._lock:
            for req in list(self.engine.requests.values()):
                req.error = f"glm5 engine step failed: {msg}"
                self.engine._finish(req, "error")
            outs, self.engine._outputs = self.engine._outputs, []
        return outs

    def _deliver(self, o: RequestOutput) -> None:
        entry = self._queues.get(o.request_id)
        if entry is not None:
            loop, q = entry
            try:
                loop.call_soon_threadsafe(q.put_nowait, o)
            except RuntimeError:  # the caller's loop is closed: nobody listens
                pass

    def between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the calling thread while no step runs (e.g. a weight update
        followed by ``engine.set_weights_version``) and return its result."""
        with self._lock:
            return fn(self.engine)

    # ------------------------------------------------------------------ callers
    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The outputs of one request, the last with ``finished`` set. Raises `RequestRejected`
        before the first output when the request is not taken. Closing the iterator early
        (a disconnected client) aborts the request."""
        if not self._accepting:
            raise RequestRejected(503, "glm5 engine: the server is shutting down")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        if request_id in self._queues:
            raise RequestRejected(400, f"glm5 engine: request id {request_id!r} is already in use",
                                  param="request_id")
        self._queues[request_id] = (loop, q)
        finished = False
        # The add runs to its end even when the caller is cancelled meanwhile: an abort sent
        # before the request is in the engine would be lost (and the request run unheard).
        add = asyncio.ensure_future(asyncio.to_thread(self._add, request_id, prompt, params))
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

    def _add(self, request_id: str, prompt, params: SamplingParams) -> None:
        with self._lock:
            self.engine.add_request(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)  # a list append: safe from any thread
        self._wake.set()

    def stats(self) -> dict:
        """A consistent snapshot of the engine's gauges and counters."""
        with self._lock:
            e = self.engine
            s = e.scheduler.stats
            return {"waiting": e.num_waiting, "running": e.num_running,
                    "free_pages": e.allocator.num_free, "num_pages": e.allocator.num_pages,
                    "cached_pages": e.radix.num_cached_pages,
                    "prefix_queried_tokens": s.prompt_tokens_queried,
                    "prefix_hit_tokens": s.prompt_tokens_hit, "prefill_tokens": s.prefill_tokens,
                    "preemptions": s.preemptions, **vars(e.stats)}

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
