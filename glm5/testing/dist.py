"""Multi-process tests on one machine: a world of N processes on gloo, started fast, bounded in
time, every child reaped.

    results = run_multiprocess(fn, 4, 60.0, arg1, arg2)   # fn(ctx, arg1, arg2) on ranks 0..3

    with DistPool(4) as pool:                              # one world, many checks
        a = pool.run(check_a, x)
        b = pool.run(check_b, y, timeout_s=20)

``fn`` is a module-level (picklable) function; with ``init=True`` (the default) each rank calls
``fn(ctx, *args)`` with ``ctx`` its `glm5.parallel.DistContext` (backend gloo, device cpu, the
collective timeout ``comm_timeout_s``); with ``init=False`` it calls ``fn(*args)`` with
torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
``fn`` initializes itself. The result is one entry per rank, in rank order: what ``fn``
returned (picklable), or a `RankError` (an exception *returned*, not raised) saying that the
rank raised (``.exception`` holds the original where it could be pickled), exited, or did not
finish within ``timeout_s``. `values(results)` returns the values or raises one
AssertionError listing every rank's failure.

Speed: the children are forked from a forkserver that imported torch and glm5.parallel once (the
first world pays for that import, later worlds start much faster); each child gets the
parent's environment of the moment and one torch thread. The rendezvous store is hosted by
this (the parent) process, as torchrun's agent hosts it, so it outlives any rank (the fault
reports of glm5.parallel.faults read it).

Bounds: every wait has a deadline; a pool whose world may be inconsistent (a rank failed,
exited or timed out) is closed and its `broken` says why; closing terminates, then kills,
then joins every child.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
import weakref
from typing import Any, Callable

PRELOAD = ["torch", "torch.distributed", "glm5.parallel", "glm5.testing.dist"]
POLL_S = 0.05


class RankError(Exception):
    """Rank ``rank`` did not return a value: ``kind`` is "raised" (``exception`` is the
    original exception when it could be pickled, ``type_name``/``message``/``traceback``
    always), "exited" (``exitcode``) or "timeout"."""

    def __init__(self, rank: int, kind: str, message: str, type_name: str = "",
                 tb: str = "", exitcode: int | None = None,
                 exception: BaseException | None = None) -> None:
        super().__init__(f"rank {rank} {kind}: {type_name + ': ' if type_name else ''}{message}")
        self.rank, self.kind, self.message, self.type_name = rank, kind, message, type_name
        self.traceback, self.exitcode, self.exception = tb, exitcode, exception

    def __reduce__(self):
        return (RankError, (self.rank, self.kind, self.message, self.type_name, self.traceback,
                            self.exitcode, self.exception))


class HarnessError(RuntimeError):
    """The harness itself could not run the world (start-up failed, the pool is closed)."""


def values(results: list[Any]) -> list[Any]:
    """The per-rank values, or one AssertionError listing every `RankError` (with the
    tracebacks)."""
    bad = [r for r in results if isinstance(r, RankError)]
    if bad:
        detail = "\n".join(f"--- {e}\n{e.traceback}" if e.traceback else f"--- {e}" for e in bad)
        raise AssertionError(f"{len(bad)} of {len(results)} ranks failed:\n{detail}")
    return results


# --------------------------------------------------------------------------- the child
def _raised(rank: int, e: BaseException) -> RankError:
    tb = traceback.format_exc()
    try:
        pickle.dumps(e)
        exc: BaseException | None = e
    except Exception:
        exc = None
    return RankError(rank, "raised", str(e), type(e).__name__, tb, exception=exc)


def _send(q: Any, msg: tuple, rank: int) -> None:
    try:
        data = pickle.dumps(msg)
    except Exception as e:  # an unpicklable result is this rank's failure, not a lost message
        data = pickle.dumps(msg[:-1] + (RankError(rank, "raised", f"the result could not be "
                                                  f"pickled: {e}", type(e).__name__),))
    q.put(data)


def _worker(rank: int, world_size: int, port: int, environ: dict[str, str], init: bool,
            comm_timeout_s: float, tasks: Any, results: Any) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    import torch

    torch.set_num_threads(1)  # N ranks share the machine's cores
    ctx = None
    try:
        if init:
            # lazy: keeps glm5.testing.dist light in the parent; the ranks load glm5.parallel
            from glm5.parallel import init_distributed

            ctx = init_distributed(backend="gloo", timeout_s=comm_timeout_s, device="cpu")
        _send(results, ("ready", -1, rank, None), rank)
    except BaseException as e:
        _send(results, ("ready", -1, rank, _raised(rank, e)), rank)
        return
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args = pickle.loads(task)
            try:
                value = fn(ctx, *args) if init else fn(*args)
            except BaseException as e:
                value = _raised(rank, e)
            _send(results, ("result", task_id, rank, value), rank)
    finally:
        if ctx is not None:
            try:
                ctx.destroy()
            except Exception:
                pass


# --------------------------------------------------------------------------- the parent
_forkserver_ready = False


def _context() -> Any:
    global _forkserver_ready
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    if not _forkserver_ready:
        ctx.set_forkserver_preload(PRELOAD)
        _forkserver_ready = True
    return ctx


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


class DistPool:
    """A world of ``world_size`` processes kept alive to run several checks (see the module
    docstring). ``comm_timeout_s``: the collectives' timeout in the children;
    ``start_timeout_s``: how long start-up may take; ``env``: variables added to the children's
    environment."""

    def __init__(self, world_size: int, *, comm_timeout_s: float = 30.0, init: bool = True,
                 start_timeout_s: float = 120.0, env: dict[str, str] | None = None) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"glm5.testing.dist.DistPool: argument 'world_size' expected an "
                             f"int >= 1, got {world_size!r}")
        import torch.distributed as dist

        self.world_size = world_size
        self.init = init
        self.broken: str | None = None
        self._task = 0
        self._procs: list[Any] = []
        ctx = _context()
        # Hosted here, like torchrun's agent store: it outlives every rank.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=start_timeout_s))
        environ = {**os.environ, **(env or {})}
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._finalizer = weakref.finalize(self, _reap, self._procs)
        for r in range(world_size):
            p = ctx.Process(target=_worker, name=f"glm5-rank{r}", daemon=True,
                            args=(r, world_size, self._store.port, environ, init,
                                  float(comm_timeout_s), self._tasks[r], self._results))
            p.start()
            self._procs.append(p)
        got = self._collect(-1, time.monotonic() + start_timeout_s, None)
        bad = [v for v in got if isinstance(v, RankError)]
        if bad:
            self.broken = f"start-up failed: {bad[0]}"
            self._finalizer()
            raise HarnessError("glm5.testing.dist.DistPool: start-up failed:\n" + "\n".join(
                f"--- {e}\n{e.traceback}" for e in bad))

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0,
            after_failure_s: float | None = 5.0) -> list[Any]:
        """``fn(ctx, *args)`` (or ``fn(*args)`` without init) on every rank; one entry per
        rank (a value or a `RankError`) within ``timeout_s``. Once a rank has failed, the
        others get at most ``after_failure_s`` more (None: until ``timeout_s``) — a rank
        blocked in a collective with the failed one would otherwise wait its whole
        collective timeout. After a failure the pool is closed (`broken` says why)."""
        if self.broken:
            raise HarnessError(f"glm5.testing.dist.DistPool.run: the pool is closed "
                               f"({self.broken}); start a new one")
        self._task += 1
        task = pickle.dumps((self._task, fn, args))
        for q in self._tasks:
            q.put(task)
        out = self._collect(self._task, time.monotonic() + timeout_s, after_failure_s)
        bad = [v for v in out if isinstance(v, RankError)]
        if bad:  # the world may be inconsistent or stuck: no polite stop, terminate it now
            self.broken = f"a task failed: {bad[0]}"
            self._finalizer()
        return out

    def _collect(self, task_id: int, deadline: float, after_failure_s: float | None
                 ) -> list[Any]:
        kind = "ready" if task_id < 0 else "result"
        out: dict[int, Any] = {}
        why = "did not finish within the harness's time limit (terminated)"
        while len(out) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                data = self._results.get(timeout=min(POLL_S, deadline - now))
                k, tid, rank, value = pickle.loads(data)
                if k == kind and tid == task_id:
                    out[rank] = value
                    if isinstance(value, RankError) and after_failure_s is not None:
                        deadline = min(deadline, time.monotonic() + after_failure_s)
                        why = (f"did not finish within {after_failure_s:g} s after rank {rank} "
                               f"failed (terminated)")
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(self._procs):
                if r not in out and p.exitcode is not None:
                    out[r] = RankError(r, "exited", f"exited with code {p.exitcode} without a "
                                       f"result", exitcode=p.exitcode)
                    if after_failure_s is not None:
                        deadline = min(deadline, time.monotonic() + after_failure_s)
                        why = (f"did not finish within {after_failure_s:g} s after rank {r} "
                               f"exited (terminated)")
        for r in range(self.world_size):
            if r not in out:
                out[r] = RankError(r, "timeout", why)
        return [out[r] for r in range(self.world_size)]

    def close(self, why: str = "closed") -> None:
        """Stop every child (a polite stop, then terminate, then kill) and join them."""
        if self.broken is None:
            self.broken = why
        if all(p.exitcode is not None for p in self._procs):
            return
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        end = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        self._finalizer()

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_multiprocess(fn: Callable[..., Any], world_size: int, timeout_s: float, *args: Any,
                     comm_timeout_s: float | None = None, init: bool = True,
                     after_failure_s: float | None = 5.0,
                     env: dict[str, str] | None = None) -> list[Any]:
    """Start a world of ``world_size`` processes, run ``fn`` on every rank (see the module
    docstring), stop the world; all within ``timeout_s`` (start-up included) plus the reaping.
    ``comm_timeout_s`` defaults to ``timeout_s``."""
    end = time.monotonic() + timeout_s
    pool = DistPool(world_size, comm_timeout_s=comm_timeout_s or timeout_s, init=init,
                    start_timeout_s=timeout_s, env=env)
    try:
        return pool.run(fn, *args, timeout_s=max(0.1, end - time.monotonic()),
                        after_failure_s=after_failure_s)
    finally:
        pool.close()
