"""A rollout worker that is an engine server over HTTP (`glm5 serve --allow-weight-updates`):
the scaled-out form of `glm5.rl.services.WorkerService`, with exactly its methods.

Token in, token out: each pending member of a group is one ``POST /v1/completions`` with the
prompt as token ids, ``n`` = 1, the member's seed and the group's sampling settings (both from
`PromptGroup.params`, the one definition the in-process worker uses too) and the glm5 extension
``return_token_ids``, so the trajectory keeps the exact sampled ids, the engine's logprob of
each and the weights version of each — nothing is re-tokenized. A seeded request samples the
same tokens whatever else is in the server's batch, so a rollout over HTTP equals the in-process
one for the same group and seed.

Requests run concurrently on one background thread (an asyncio loop with an ``httpx``
client): a thread pool would cap the requests in flight, and with them the server's batch, at
its size. `step` hands back what finished since the last call. A request that fails for any
reason (an HTTP error, a timeout, a refused connection, a server killed mid-episode) comes back
in ``failed`` for the orchestrator to re-queue; a server that cannot be reached for a weight
update or its version raises `ServiceDied` naming its URL. Weight updates go as the
`WeightUpdate.to_bytes` wire format to ``POST /glm5/v1/weights``.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

from glm5.rl.rollout import PromptGroup, trajectory_from_output
from glm5.rl.services import ServiceDied
from glm5.rl.trajectory import Trajectory
from glm5.rl.weight_sync import StaleUpdateError, WeightSyncError

__all__ = ["HTTPWorkerService", "RemoteWorkerError"]

WEIGHTS_PATH = "/glm5/v1/weights"  # glm5.serve.app.WEIGHTS_PATH (not imported: rl sits below serve)
STEP_WAIT_S = 0.05  # how long `step` waits for a result when none is ready


class RemoteWorkerError(RuntimeError):
    """The engine server answered something a rollout worker cannot use (weight updates off,
    an internal error, a reply that is not what the API promises)."""


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:  # pragma: no cover - httpx ships with the dev / rl installs
        raise ImportError("glm5.rl.remote.HTTPWorkerService needs httpx: pip install httpx") \
            from None
    return httpx


def _error_message(r: Any) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    try:
        return str(r.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not the error body we know: show what came
        return r.text[:300]


class HTTPWorkerService:
    """`WorkerService`'s interface over an engine server at ``url`` (e.g.
    ``http://10.0.0.5:8000``, the server's root, not ``/v1``).

    ``timeout``: seconds a request may wait for the server (a completion: its whole generation;
    a weight update: parsing, checking and applying it) before it counts as failed; connecting
    gets at most 30 s of it. ``model``: the served model name (default: asked from ``/v1/models``
    at construction). ``max_in_flight``: requests open at once (the rest wait on the client;
    the server batches at most its ``--max-num-seqs``). Call `close` when done (or use it as a
    context manager).
    """

    def __init__(self, url: str, worker_id: str, timeout: float = 600.0,
                 model: str | None = None, max_in_flight: int = 256) -> None:
        httpx = _httpx()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"glm5 HTTPWorkerService: url expected an http:// or https:// URL "
                             f"of an engine server, got {url!r}")
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"glm5 HTTPWorkerService: worker_id expected a non-empty string, "
                             f"got {worker_id!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"glm5 HTTPWorkerService: timeout expected seconds > 0, got "
                             f"{timeout!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or \
                max_in_flight < 1:
            raise ValueError(f"glm5 HTTPWorkerService: max_in_flight expected an int >= 1, got "
                             f"{max_in_flight!r}")
        self.url, self.worker_id = url.rstrip("/"), worker_id
        self._timeout = httpx.Timeout(float(timeout), connect=min(float(timeout), 30.0))
        self._limits = httpx.Limits(max_connections=max_in_flight,
                                    max_keepalive_connections=max_in_flight)
        self._http = httpx.Client(base_url=self.url, timeout=self._timeout)
        self._cond = threading.Condition()
        self._open: dict[str, tuple[PromptGroup, int]] = {}  # traj id -> (group, member)
        self._done: list[Trajectory] = []
        self._failed: list[tuple[PromptGroup, int, str]] = []
        self._futures: set[Future] = set()
        self._tokens = 0
        self._closed = False
        try:
            self.model = model if model is not None else self._served_model()
        except BaseException:
            self._http.close()
            raise
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"glm5-http-worker-{worker_id}")
        self._thread.start()
        self._aclient = asyncio.run_coroutine_threadsafe(self._make_client(), self._loop).result()

    # ------------------------------------------------------------------ plumbing
    async def _make_client(self) -> Any:
        httpx = _httpx()
        return httpx.AsyncClient(base_url=self.url, timeout=self._timeout, limits=self._limits)

    def _call(self, method: str, what: str, path: str, **kw: Any) -> Any:
        """A request to the server on the caller's thread; unreachable -> ServiceDied."""
        httpx = _httpx()
        try:
            return self._http.request(method, path, **kw)
        except httpx.TransportError as e:  # refused, reset, timed out, DNS, ...
            raise ServiceDied(f"glm5 HTTPWorkerService {self.worker_id}: the engine server at "
                              f"{self.url} is unreachable ({what}: {type(e).__name__}: {e})") \
                from e

    def _served_model(self) -> str:
        r = self._call("GET", "/v1/models", "/v1/models")
        try:
            r.raise_for_status()
            return str(r.json()["data"][0]["id"])
        except Exception as e:  # noqa: BLE001 - whatever it is, it is not our server
            raise RemoteWorkerError(f"glm5 HTTPWorkerService: {self.url}/v1/models did not list "
                                    f"a model (HTTP {r.status_code}: {_error_message(r)}); is "
                                    f"it a `glm5 serve` server?") from e

    def _weights_reply(self, r: Any, what: str) -> dict[str, Any]:
        if r.status_code == 200:
            return r.json()
        msg = _error_message(r)
        if r.status_code == 409:
            raise StaleUpdateError(f"glm5 HTTPWorkerService {self.worker_id} ({self.url}): {msg}")
        if r.status_code == 400:
            raise WeightSyncError(f"glm5 HTTPWorkerService {self.worker_id} ({self.url}): {msg}")
        raise RemoteWorkerError(f"glm5 HTTPWorkerService {self.worker_id}: {what} at "
                                f"{self.url}{WEIGHTS_PATH} answered HTTP {r.status_code}: {msg}")

    # ------------------------------------------------------------------ rollouts
    def _body(self, group: PromptGroup, member: int) -> dict[str, Any]:
        sp = group.params(member)
        return {"model": self.model, "prompt": list(group.prompt_ids), "n": 1,
                "max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                "stop_token_ids": list(sp.stop_token_ids), "seed": sp.seed,
                "return_token_ids": True}

    async def _complete(self, group: PromptGroup, member: int) -> Trajectory:
        """One member's trajectory; raises (any exception) when there is none."""
        r = await self._aclient.post("/v1/completions", json=self._body(group, member))
        if r.status_code != 200:
            raise RemoteWorkerError(f"HTTP {r.status_code}: {_error_message(r)}")
        c = r.json()["choices"][0]
        ids, lps, versions = c["token_ids"], c["token_logprobs"], c["token_versions"]
        if not len(ids) == len(lps) == len(versions):
            raise RemoteWorkerError(f"the reply has {len(ids)} token_ids, {len(lps)} "
                                    f"token_logprobs and {len(versions)} token_versions")
        if c["finish_reason"] not in ("stop", "length"):
            raise RemoteWorkerError(f"finish_reason {c['finish_reason']!r}")
        return trajectory_from_output(group, member, ids, lps, versions, c["finish_reason"])

    async def _run(self, group: PromptGroup, member: int) -> None:
        tid = group.traj_id(member)
        try:
            traj = await self._complete(group, member)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure re-queues the member
            err = f"{self.url}: {type(e).__name__}: {e}"
            with self._cond:
                if tid in self._open:
                    self._failed.append((group, member, err))
                self._cond.notify_all()
            return
        with self._cond:
            if tid in self._open:
                self._done.append(traj)
            self._cond.notify_all()

    def submit(self, group: PromptGroup) -> None:
        """Start a request for each of ``group.pending``; returns at once."""
        if self._closed:
            raise RuntimeError(f"glm5 HTTPWorkerService.submit: worker {self.worker_id} is "
                               f"closed")
        if not isinstance(group, PromptGroup):
            raise TypeError(f"glm5 HTTPWorkerService.submit: group expected a PromptGroup, got "
                            f"{type(group).__name__}")
        with self._cond:
            busy = [m for m in group.pending if group.traj_id(m) in self._open]
            if busy:
                raise ValueError(f"glm5 HTTPWorkerService.submit: member {busy[0]} of group "
                                 f"{group.group_id!r} is already in flight on worker "
                                 f"{self.worker_id}")
            for m in group.pending:
                self._open[group.traj_id(m)] = (group, m)
        for m in group.pending:
            fut = asyncio.run_coroutine_threadsafe(self._run(group, m), self._loop)
            self._futures.add(fut)
            fut.add_done_callback(self._futures.discard)

    def step(self) -> tuple[list[Trajectory], list[tuple[PromptGroup, int, str]]]:
        """(trajectories finished since the last call, failed (group, member, error)); waits up
        to `STEP_WAIT_S` for one when none is ready and requests are open."""
        with self._cond:
            if not self._done and not self._failed and self._open:
                self._cond.wait(STEP_WAIT_S)
            done, self._done = self._done, []
            failed, self._failed = self._failed, []
            # a member stays open until handed back, as in the in-process worker: a caller
            # that steps `while num_open()` gets every result
            for t in done:
                del self._open[t.traj_id]
                self._tokens += len(t.completion_ids)
            for g, m, _ in failed:
                del self._open[g.traj_id(m)]
        return done, failed

    def num_open(self) -> int:
        """Members submitted whose trajectory (or failure) `step` has not handed back."""
        with self._cond:
            return len(self._open)

    def tokens_generated(self) -> int:
        """Completion tokens of the trajectories this worker delivered."""
        with self._cond:
            return self._tokens

    # ------------------------------------------------------------------ weights
    def apply_update(self, data: bytes) -> int:
        """Send a `WeightUpdate` (its `to_bytes`) to the server; returns its new version.
        Raises `StaleUpdateError` (HTTP 409) / `WeightSyncError` (400) with the server's
        message (its weights unchanged), `ServiceDied` when it cannot be reached."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"glm5 HTTPWorkerService.apply_update: data expected bytes "
                            f"(WeightUpdate.to_bytes()), got {type(data).__name__}")
        r = self._call("POST", "apply_update", WEIGHTS_PATH, content=bytes(data),
                       headers={"Content-Type": "application/octet-stream"})
        return int(self._weights_reply(r, "apply_update")["version"])

    def version(self) -> int:
        """The weights version the server's engine holds."""
        r = self._call("GET", "version", WEIGHTS_PATH, params={"checksums": "false"})
        return int(self._weights_reply(r, "version")["version"])

    def checksums(self) -> dict[str, str]:
        """`state_checksums` of the server's model."""
        r = self._call("GET", "checksums", WEIGHTS_PATH)
        return dict(self._weights_reply(r, "checksums")["checksums"])

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Cancel the open requests (they are not reported) and close the connections."""
        if self._closed:
            return
        self._closed = True
        for fut in list(self._futures):
            fut.cancel()

        async def shut() -> None:
            await self._aclient.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self._http.close()
            with self._cond:
                self._open.clear()

    def __enter__(self) -> "HTTPWorkerService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
