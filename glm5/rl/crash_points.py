"""Named points in the RL loop where a test can kill the run (SIGKILL, no clean-up) to prove
that a resumed run loses nothing and trains nothing twice, whatever the moment.

``GLM5_RL_CRASH="point:n"`` (several, comma-separated) makes the process kill itself the n-th
time it reaches ``point`` (n counts from 1 in each process). The points:

- ``rollout``: a rollout worker's engine step has delivered its finished trajectories.
- ``train``: the trainer has stepped; the weights are not yet published.
- ``publish``: the weights are published; the step's checkpoint is not yet written.
- ``checkpoint``: half of the checkpoint's temporary file is on disk.
- ``journal``: half of a journal line is on disk (the rest never comes).

Unset (every user's run), `reached` is one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "GLM5_RL_CRASH"
POINTS = ("rollout", "train", "publish", "checkpoint", "journal")


def _parse(spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition(":")
        if name not in POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{ENV}: expected point:n with point one of {list(POINTS)} and "
                             f"n >= 1, got {part!r}")
        out[name] = int(n)
    return out


_ARMED = _parse(os.environ.get(ENV, ""))
_SEEN: dict[str, int] = {}


def armed(point: str) -> bool:
    """True when reaching ``point`` now must kill the process (counts the visit)."""
    if point not in _ARMED:
        return False
    _SEEN[point] = _SEEN.get(point, 0) + 1
    return _SEEN[point] == _ARMED[point]


def die() -> None:
    """SIGKILL this process: no finally blocks, no atexit, no flushing."""
    os.kill(os.getpid(), signal.SIGKILL)


def reached(point: str) -> None:
    """Kill the process here when ``point`` is armed for this visit."""
    if armed(point):
        die()
