"""uvicorn under `glm5 serve`'s limits (`glm5.serve.limits.ServeLimits`): the connection-level
ones in an h11 protocol of our own (`protocol_class`), the body ones in an ASGI middleware
(`BodyLimit`), the graceful shutdown in a `Server`. `make_server` puts them together; both
`glm5 serve` and the tests run the app through it.

Connection level (uvicorn has none of these):

- over ``max_connections`` open connections, a new one gets a 503 and is closed before any of
  it is read (the descriptors stay below the process's limit: no ``EMFILE`` on accept);
- a request line and headers must arrive within ``header_timeout`` of the connection (or of the
  previous response, on a kept-alive one), however slowly the bytes trickle in; a partial
  request then gets a 408;
- a socket that stays unwritable (its client stopped reading) for ``stall_timeout`` is dropped
  (``transport.abort()``: the buffered bytes are discarded, the request's engine work aborted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from typing import Any, Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from glm5.serve.limits import ServeLimits
from glm5.serve.metrics import ServerMetrics
from glm5.serve.protocol import error_body

log = logging.getLogger("glm5.serve")

# The scope key the protocol sets before it drops a stalled connection: the app then counts
# the request as stalled, not as a client that left.
STALLED = "glm5.stalled"

_PHRASES = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
            503: "Service Unavailable"}


def raw_error(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection (written straight to a
    transport, where no request cycle exists to answer through)."""
    body = json.dumps(error_body(status, message)).encode()
    return (f"HTTP/1.1 {status} {_PHRASES[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def protocol_class(limits: ServeLimits, metrics: ServerMetrics) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection cap, the header timeout and the stall
    watchdog of ``limits``; what it refuses or drops is counted in ``metrics``."""
    cap = limits.connection_cap()
    refused = raw_error(503, f"glm5 serve: the server has {cap} connections open (its "
                             f"max_connections); retry later")

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._refused = False
            self._read_timer: asyncio.TimerHandle | None = None
            self._armed_cycle: Any = None
            self._stall_timer: asyncio.TimerHandle | None = None

        # ------------------------------------------------------------ connections
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:
                self._refused = True
                self.transport = transport
                metrics.connections_refused.inc()
                transport.write(refused)
                transport.close()
                return
            super().connection_made(transport)
            if limits.send_buffer_bytes is not None:
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
            metrics.connections_open.set(len(self.connections))
            self._arm_read()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._cancel_timers()
            super().connection_lost(exc)
            metrics.connections_open.set(len(self.connections))

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._read_timer is not None and self.cycle is not self._armed_cycle:
                self._read_timer.cancel()  # a request's headers are in
                self._read_timer = None

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is done:
                self._arm_read()  # (a pipelined request already in has its headers)

        def shutdown(self) -> None:
            if not self._refused:
                super().shutdown()

        # ------------------------------------------------------------ header timeout
        def _arm_read(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._armed_cycle = self.cycle
            self._read_timer = self.loop.call_later(limits.header_timeout, self._read_timeout)

        def _read_timeout(self) -> None:
            self._read_timer = None
            if self.cycle is not self._armed_cycle or self.transport.is_closing():
                return
            partial, _ = self.conn.trailing_data
            if partial:
                metrics.abort("timeout")
                metrics.error(408)
                self.transport.write(raw_error(408, f"glm5 serve: the request's headers did "
                                                    f"not arrive within {limits.header_timeout:g} "
                                                    f"s (header_timeout)"))
            self.transport.close()

        # ------------------------------------------------------------ stalled readers
        def pause_writing(self) -> None:
            super().pause_writing()
            if not self._refused and self._stall_timer is None:
                self._stall_timer = self.loop.call_later(limits.stall_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            if self.cycle is not None:
                self.cycle.scope[STALLED] = True
            log.warning("glm5 serve: %s stopped reading for %g s (stall_timeout): dropped",
                        "%s:%d" % tuple(self.client[:2]) if self.client else "a client",
                        limits.stall_timeout)
            self.transport.abort()

        def _cancel_timers(self) -> None:
            for t in (self._read_timer, self._stall_timer):
                if t is not None:
                    t.cancel()
            self._read_timer = self._stall_timer = None

    return GuardedH11Protocol


class BodyLimit:
    """ASGI middleware: reads a request's whole body before the app sees it, refusing one over
    ``limits.max_body_bytes`` with a 413 (from its Content-Length, before reading it; a chunked
    one once it passes the limit) and one that does not arrive within ``limits.body_timeout``
    with a 408; both close the connection. Paths in ``exempt`` are passed through as they
    are (the RL weight endpoint, whose updates are large and whose clients are trusted)."""

    def __init__(self, app: Any, limits: ServeLimits, metrics: ServerMetrics,
                 exempt: tuple[str, ...] = ()) -> None:
        self.app, self.limits, self.metrics, self.exempt = app, limits, metrics, exempt

    async def _refuse(self, send: Callable, status: int, reason: str, message: str) -> None:
        self.metrics.abort(reason)
        self.metrics.error(status)
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        too_large = (f"glm5 serve: the request body is larger than {limit} bytes "
                     f"(max_body_bytes)")
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                await self._refuse(send, 413, "too_large", too_large + f": {int(v)} bytes")
                return
        chunks, total = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # nothing was started: nothing to abort
                    chunk = message.get("body", b"")
                    total += len(chunk)
                    if total > limit:
                        await self._refuse(send, 413, "too_large", too_large)
                        return
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            await self._refuse(send, 408, "timeout", f"glm5 serve: the request body did not "
                               f"arrive within {self.limits.body_timeout:g} s (body_timeout)")
            return
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # from now on: only the disconnect

        await self.app(scope, replay, send)


class Server(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins (``on_shutdown``, before
    uvicorn waits for open connections): the app then ends what is still open at its
    graceful timeout."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None):
        super().__init__(config)
        self._on_shutdown = on_shutdown
        # uvicorn raises a SIGINT / SIGTERM it shut down for again once it is done (the
        # process then ends as the signal says); rank 0 of a multi-rank server sets this False
        # to end cleanly instead (its launcher raises the signal itself, after every rank)
        self.reraise_signals = True

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        with super().capture_signals():
            yield
            if not self.reraise_signals:
                self._captured_signals.clear()

    async def shutdown(self, sockets: Any = None) -> None:
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets)


# What uvicorn may still take to cancel the stragglers after the app has ended its streams.
SHUTDOWN_MARGIN_S = 5.0


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 0,
                log_level: str = "info") -> Server:
    """A `Server` running ``app`` (from `glm5.serve.app.build_app`, which holds its
    `ServeLimits` and metrics) with the limits applied."""
    srv = app.state.server
    limits: ServeLimits = srv.limits
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=protocol_class(limits, srv.metrics),
        timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=limits.max_header_bytes,
        timeout_graceful_shutdown=limits.graceful_timeout + SHUTDOWN_MARGIN_S,  # type: ignore[arg-type]
        lifespan="on")
    return Server(config, on_shutdown=srv.begin_shutdown)
