"""Weight sync in the RL loop: the engine's delta updates (`glm5.engine.weight_sync`: publisher,
receiver, wire format, checksums) and the staleness rule for trajectories sampled by older
weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from glm5.engine.weight_sync import (ChecksumMismatchError, StaleUpdateError, WeightPublisher,
                                     WeightReceiver, WeightSyncError, WeightUpdate,
                                     apply_to_engine, state_checksums, tensor_checksum,
                                     weights_equal)

if TYPE_CHECKING:  # pragma: no cover
    from glm5.rl.trajectory import Trajectory

__all__ = [
    "WeightSyncError", "StaleUpdateError", "ChecksumMismatchError", "WeightUpdate",
    "WeightPublisher", "WeightReceiver", "apply_to_engine", "tensor_checksum",
    "state_checksums", "weights_equal", "staleness_weights",
]

STALE_POLICIES = ("drop", "downweight")


def staleness_weights(trajs: Sequence["Trajectory"], current_version: int, max_staleness: int,
                      policy: str = "drop") -> list[float]:
    """The loss weight of each trajectory by its staleness, ``current_version -
    traj.min_version`` (versions behind the trainer of its oldest token).

    Within ``max_staleness`` the weight is 1. Beyond it, ``"drop"``: 0; ``"downweight"``:
    ``0.5 ** (staleness - max_staleness)``. A trajectory newer than ``current_version`` is an
    error (its versions come from another run).
    """
    if policy not in STALE_POLICIES:
        raise ValueError(f"glm5 staleness_weights: policy expected one of {list(STALE_POLICIES)}"
                         f", got {policy!r}")
    for k, v in (("current_version", current_version), ("max_staleness", max_staleness)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"glm5 staleness_weights: {k} expected an int >= 0, got {v!r}")
    out = []
    for t in trajs:
        s = current_version - t.min_version
        if s < 0:
            raise ValueError(f"glm5 staleness_weights: trajectory {t.traj_id!r} has version "
                             f"{t.min_version}, newer than current_version {current_version}")
        if s <= max_staleness:
            out.append(1.0)
        else:
            out.append(0.0 if policy == "drop" else 0.5 ** (s - max_staleness))
    return out
