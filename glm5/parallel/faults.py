"""Collective failures: a collective that does not complete raises `CollectiveError` (a
`CollectiveTimeout` when the timeout ran out, a `PeerLost` when a peer's connection broke) naming
the collective, this rank, the group's ranks, the timeout and, where the rendezvous store can
tell, the ranks that did not take part in it — never a silent hang.

How the culprits are found, at no cost to a collective that succeeds: every rank writes its
host and pid into the store at init (glm5.parallel.groups). A rank whose collective fails records
``fault/<group>/<call number>/<rank>`` in the store, then reads which other ranks of the group
recorded the same failure. A rank that did not is dead (its pid is gone, when on this host) or
did not reach the collective (it hangs, or is still waiting inside it): the error lists both.
A rank waits for the others' records until its own collective's start + timeout + `SLACK_S`,
so that a rank that is still inside its timed wait gets to report; it stops early once every
rank is accounted for (recorded the failure, or is known dead on this host)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from glm5.parallel.groups import STORE_PREFIX

SLACK_S = 1.0  # how long past the timeout a failing rank waits for the others' fault records
POLL_S = 0.05


class CollectiveError(RuntimeError):
    """A collective did not complete. Attributes: ``collective``, ``rank`` (this global rank),
    ``group_ranks``, ``timeout_s``, ``missing`` (global ranks that did not record this failure:
    dead, hung or still waiting; None when the store could not tell) and ``dead`` (those of
    them known to have exited)."""

    # The serving engine does not retry a step that raised this request by request: the
    # world is broken, not a request (glm5.engine.engine reads the flag, 503 for the server).
    fatal_to_step = True
    http_status = 503

    def __init__(self, message: str, *, collective: str, rank: int, group_ranks: tuple[int, ...],
                 timeout_s: float | None, missing: list[int] | None = None,
                 dead: list[int] | None = None) -> None:
        super().__init__(message)
        self.collective = collective
        self.rank = rank
        self.group_ranks = group_ranks
        self.timeout_s = timeout_s
        self.missing = missing
        self.dead = dead or []

    def __reduce__(self):  # picklable across processes with its attributes
        return (_rebuild, (type(self), self.args[0], self.collective, self.rank,
                           self.group_ranks, self.timeout_s, self.missing, self.dead))


def _rebuild(cls, message, collective, rank, group_ranks, timeout_s, missing, dead):
    return cls(message, collective=collective, rank=rank, group_ranks=group_ranks,
               timeout_s=timeout_s, missing=missing, dead=dead)


class CollectiveTimeout(CollectiveError):
    """The collective did not complete within the context's timeout."""


class PeerLost(CollectiveError):
    """A peer's connection broke during the collective (the peer exited or crashed)."""


_PEER_WORDS = ("connection", "closed by peer", "reset by peer", "broken pipe", "peer")


def _kind(err: BaseException) -> type[CollectiveError]:
    """Which failure ``err`` (raised by the transfer) reports, from its text: backends raise
    plain RuntimeErrors (gloo: "Timed out waiting 5000ms for recv operation", "Connection
    closed by peer", "Connection reset by peer")."""
    text = str(err).lower()
    if "timed out" in text or "timeout" in text:
        return CollectiveTimeout
    if any(w in text for w in _PEER_WORDS):
        return PeerLost
    return CollectiveError


def _pid_state(host_pid: str) -> str:
    """"dead", "alive" or "unknown" (another host, or unreadable) for ``host:pid``."""
    host, _, pid_s = host_pid.rpartition(":")
    if host != socket.gethostname():
        return "unknown"
    try:
        pid = int(pid_s)
    except ValueError:
        return "unknown"
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie (exited, not yet reaped by its launcher) is dead.
            state = f.read().rsplit(")", 1)[1].split()[0]
        return "dead" if state in ("Z", "X") else "alive"
    except FileNotFoundError:
        return "dead"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return "alive"
    except ProcessLookupError:
        return "dead"
    except OSError:
        return "unknown"


def _peer_report(store: Any, group_ranks: tuple[int, ...], me: int, seq: int, started: float,
                 timeout_s: float | None) -> tuple[list[int] | None, list[int], str]:
    """Record this rank's failure and collect the others': (missing ranks, dead ranks, note).
    ``missing`` is None when the store cannot be used."""

    tag = "-".join(map(str, group_ranks))
    key = f"{STORE_PREFIX}fault/{tag}/{seq}/"
    try:
        store.set(key + str(me), "1")
    except Exception as e:
        return None, [], (f"the rendezvous store is unreachable ({type(e).__name__}), so the "
                          f"ranks that failed cannot be told apart (the rank hosting it may be "
                          f"the one that died)")
    others = [r for r in group_ranks if r != me]
    deadline = started + (timeout_s or 0.0) + SLACK_S
    deadline = max(deadline, time.monotonic() + 2 * POLL_S)
    procs: dict[int, str] = {}
    reported: set[int] = set()
    dead: set[int] = set()
    try:
        while True:
            for r in others:
                if r not in reported and store.check([key + str(r)]):
                    reported.add(r)
            for r in others:
                if r in reported or r in dead:
                    continue
                if r not in procs:
                    pk = f"{STORE_PREFIX}proc/{r}"
                    procs[r] = store.get(pk).decode() if store.check([pk]) else ""
                if procs[r] and _pid_state(procs[r]) == "dead":
                    dead.add(r)
            if reported | dead == set(others) or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    except Exception as e:
        return None, sorted(dead), (f"the rendezvous store failed while reading the other "
                                    f"ranks' reports ({type(e).__name__})")
    missing = sorted(set(others) - reported)
    return missing, sorted(dead), ""


def collective_failed(err: BaseException, collective: str, group: Any, seq: int,
                      started: float) -> CollectiveError:
    """The `CollectiveError` for ``err`` raised by ``collective`` on ``group`` (a
    glm5.parallel Group), call number ``seq`` on that group, begun at ``started``
    (time.monotonic())."""
    ctx = group.ctx
    me = group.global_rank
    timeout_s = group.timeout_s
    store = getattr(ctx, "store", None) if ctx is not None else None
    missing: list[int] | None = None
    dead: list[int] = []
    note = "no rendezvous store to ask which ranks failed"
    if store is not None:
        missing, dead, note = _peer_report(store, group.ranks, me, seq, started, timeout_s)
    cls = _kind(err)
    if cls is CollectiveTimeout:
        what = (f"did not complete within the timeout of {timeout_s:g} s"
                if timeout_s is not None else "timed out")
    elif cls is PeerLost:
        what = "failed: a peer's connection broke"
    else:
        what = "failed"
    tmo = f"timeout {timeout_s:g} s" if timeout_s is not None else "no timeout set"
    msg = (f"glm5.parallel.{collective} {what} on rank {me} (group {group.name} of ranks "
           f"{list(group.ranks)}, call #{seq} on that group, {tmo})")
    if missing is not None:
        if missing:
            alive = [r for r in missing if r not in dead]
            parts = []
            if dead:
                parts.append(f"rank{'s' if len(dead) > 1 else ''} {_ranks(dead)} exited")
            if alive:
                parts.append(f"rank{'s' if len(alive) > 1 else ''} {_ranks(alive)} did not "
                             f"reach or fail this collective (hung, or still waiting in it)")
            msg += ": " + "; ".join(parts)
        else:
            msg += ": every rank of the group reached it and failed"
    elif note:
        msg += f" ({note})"
    msg += f". {type(err).__name__}: {err}"
    return cls(msg, collective=collective, rank=me, group_ranks=tuple(group.ranks),
               timeout_s=timeout_s, missing=missing, dead=dead)


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs))
