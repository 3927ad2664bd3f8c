"""Weight sync from a trainer whose ranks hold FSDP2 row shards (`glm5.rl.fsdp`): the same
updates a one-process `WeightPublisher` makes, by two routes (`sync.publish`).

- ``"shards"`` (`ShardedPublisher`): every rank keeps the snapshot of its own rows, diffs them,
  encodes its piece (xor, or sub where every rank's piece is exact) and checksums its rows; rank
  0 gathers the pieces and joins them (the payloads of one tensor's row pieces concatenate into
  the whole tensor's payload, since both encodings are elementwise). The checksum of a tensor is
  then its row ranges' ``[[start, stop, sha256], ...]`` (`glm5.engine.weight_sync.row_checksums`),
  which every receiver verifies. No rank ever holds the whole model: the snapshot, the diff and
  the hashing are split N ways; only changed tensors travel.
- ``"gathered"`` (`GatheredPublisher`): every parameter is all-gathered to rank 0
  (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), where a one-process
  `WeightPublisher` (a whole snapshot) diffs and hashes alone: whole-tensor checksums, one
  rank's memory and time.

Both are collective: every trainer rank calls each method in the same order; rank 0 gets the
results (others get None). Their `state_dict` is the one-process publisher's (version + whole
flat snapshot, on rank 0), so a checkpoint resumes under either route at any number of ranks
(the shard route's rows are cut from it again).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# the engine's encoders: a piece is encoded exactly as a whole tensor is
from glm5.engine.weight_sync import (WeightPublisher, WeightSyncError, WeightUpdate,
                                     encode_sub, flat_cpu, same_bits, tensor_bits,
                                     tensor_checksum)

PUBLISH_ROUTES = ("shards", "gathered")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(t, DTensor):
        if tuple(t.placements) != (Shard(0),):
            raise WeightSyncError(f"glm5 ShardedPublisher: expected parameters sharded by rows "
                                  f"(Shard(0)), got placements {t.placements}")
        return t.to_local()
    return t


class ShardedPublisher:
    """Each rank's rows of every sharded tensor; tensors FSDP leaves whole (buffers) are rank
    0's. ``group``: the trainer ranks' process group (None: the default group)."""

    def __init__(self, model: nn.Module, mode: str = "xor", group: Any = None) -> None:
        from torch.distributed.tensor import DTensor

        if mode not in ("xor", "sub"):
            raise WeightSyncError(f"glm5 ShardedPublisher: mode expected 'xor' or 'sub', got "
                                  f"{mode!r}")
        self.model, self.mode, self.group = model, mode, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        sd = model.state_dict()
        self.names = list(sd)
        self._shapes = {n: tuple(t.shape) for n, t in sd.items()}
        self._dtypes = {n: t.dtype for n, t in sd.items()}
        self._sharded = {n: isinstance(t, DTensor) for n, t in sd.items()}
        rows = {n: (_local(t).shape[0] if t.dim() else 1) for n, t in sd.items()
                if self._sharded[n]}
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, rows, group=group)
        # row boundaries of each sharded tensor over the ranks, in rank order
        self._bounds: dict[str, list[int]] = {}
        for n in rows:
            b = [0]
            for r in every:
                b.append(b[-1] + r[n])
            if b[-1] != (self._shapes[n][0] if self._shapes[n] else 1):
                raise WeightSyncError(f"glm5 ShardedPublisher: the ranks' rows of {n!r} sum to "
                                      f"{b[-1]}, the tensor has shape {self._shapes[n]}")
            self._bounds[n] = b
        self._snap = {n: flat_cpu(_local(t)).clone() for n, t in sd.items() if self._mine(n)}
        self._version = 0

    def _mine(self, name: str) -> bool:
        return self._sharded[name] or self.rank == 0

    def _row_elems(self, name: str) -> int:
        s = self._shapes[name]
        n = 1
        for x in s[1:]:
            n *= x
        return n

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ whole tensors on 0
    def _gather_snapshot(self) -> dict[str, torch.Tensor] | None:
        """The whole flat snapshot on rank 0 (pieces joined in rank order), None elsewhere."""
        pieces: list[Any] = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self._snap, pieces, dst=self._dst(), group=self.group)
        if self.rank != 0:
            return None
        out = {}
        for n in self.names:
            if self._sharded[n]:
                out[n] = torch.cat([p[n] for p in pieces])
            else:
                out[n] = pieces[0][n]
        return out

    def _dst(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def checksums(self) -> dict[str, str] | None:
        """Whole-tensor checksums of the published state, on rank 0 (gathers the snapshot)."""
        snap = self._gather_snapshot()
        return None if snap is None else {n: tensor_checksum(t) for n, t in snap.items()}

    def full_update(self) -> WeightUpdate | None:
        """Every tensor at `version` (mode "full"), on rank 0."""
        snap = self._gather_snapshot()
        if snap is None:
            return None
        return WeightUpdate(base_version=self._version, version=self._version, mode="full",
                            tensors={n: tensor_bits(t, n).clone() for n, t in snap.items()},
                            checksums={n: tensor_checksum(t) for n, t in snap.items()},
                            shapes=dict(self._shapes), dtypes=dict(self._dtypes),
                            modes={n: "full" for n in snap})

    # ------------------------------------------------------------------ one publish
    def publish(self) -> WeightUpdate | None:
        """The update from `version` to the live weights (rank 0; None elsewhere, and on rank 0
        when nothing changed). Every rank moves its snapshot and `version` on."""
        live = self.model.state_dict()
        if list(live) != self.names:
            raise WeightSyncError("glm5 ShardedPublisher.publish: the model's state_dict names "
                                  "changed since version 0")
        new: dict[str, torch.Tensor] = {}
        changed = torch.zeros(len(self.names), dtype=torch.int32)
        exact = torch.ones(len(self.names), dtype=torch.int32)  # sub reproduces every piece
        subs: dict[str, torch.Tensor | None] = {}
        for i, n in enumerate(self.names):
            if not self._mine(n):
                continue
            t = _local(live[n])
            f = flat_cpu(t)
            if f.data_ptr() == t.data_ptr():
                f = f.clone()  # a view of the live parameter: the snapshot must not move
            new[n] = f
            if not same_bits(f, self._snap[n]):
                changed[i] = 1
                if self.mode == "sub" and f.is_floating_point():
                    subs[n] = encode_sub(self._snap[n], f)
                    exact[i] = int(subs[n] is not None)
        # one tensor's pieces must agree: changed anywhere -> sent by all, sub only if exact
        # on every rank (pieces of one payload share its encoding)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(exact, op=dist.ReduceOp.MIN, group=self.group)
        if not bool(changed.any()):
            return None
        pieces: dict[str, tuple[str, torch.Tensor, str]] = {}
        for i, n in enumerate(self.names):
            if not changed[i] or not self._mine(n):
                continue
            f, old = new[n], self._snap[n]
            sub = (self.mode == "sub" and f.is_floating_point() and bool(exact[i]))
            if sub:
                pay = subs.get(n)
                pay = f - old if pay is None else pay  # unchanged here: an exact zero piece
                enc = "sub"
            else:
                pay, enc = tensor_bits(f, n) ^ tensor_bits(old, n), "xor"
            pieces[n] = (enc, pay, tensor_checksum(f))
            self._snap[n] = f
        got: list[Any] = [None] * self.world if self.rank == 0 else None
        dist.gather_object(pieces, got, dst=self._dst(), group=self.group)
        base = self._version
        self._version += 1
        if self.rank != 0:
            return None
        tensors, modes, sums = {}, {}, {}
        for i, n in enumerate(self.names):
            if not changed[i]:
                continue
            if not self._sharded[n]:
                modes[n], tensors[n], sums[n] = got[0][n]
                continue
            b = self._bounds[n]
            modes[n] = got[0][n][0]
            tensors[n] = torch.cat([p[n][1] for p in got])
            sums[n] = [[b[r], b[r + 1], got[r][n][2]] for r in range(self.world)
                       if b[r + 1] > b[r]]
        return WeightUpdate(base_version=base, version=base + 1, mode=self.mode,
                            tensors=tensors, checksums=sums,
                            shapes={n: self._shapes[n] for n in tensors},
                            dtypes={n: self._dtypes[n] for n in tensors}, modes=modes)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """The one-process publisher's state (version, whole flat snapshot) on rank 0."""
        snap = self._gather_snapshot()
        return None if snap is None else {"version": self._version, "snapshot": snap}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Rank 0 passes the state (any route's, any rank count); each rank takes its rows."""
        parts: list[Any] = [None] * self.world
        if self.rank == 0:
            snap = state["snapshot"]
            if list(snap) != self.names:
                raise WeightSyncError("glm5 ShardedPublisher.load_state_dict: the snapshot's "
                                      "tensor names differ from this model's")
            parts = [{} for _ in range(self.world)]
            for n in self.names:
                t = snap[n]
                if t.dtype != self._dtypes[n] or t.numel() != torch.Size(self._shapes[n]).numel():
                    raise WeightSyncError(f"glm5 ShardedPublisher.load_state_dict: tensor {n!r} "
                                          f"is {t.dtype} x {t.numel()}, expected "
                                          f"{self._dtypes[n]} of shape {self._shapes[n]}")
                if not self._sharded[n]:
                    parts[0][n] = t.clone()
                    continue
                b, k = self._bounds[n], self._row_elems(n)
                for r in range(self.world):
                    parts[r][n] = t[b[r] * k:b[r + 1] * k].clone()
            parts = [(int(state["version"]), p) for p in parts]
        box: list[Any] = [None]
        dist.scatter_object_list(box, parts if self.rank == 0 else None, src=self._dst(),
                                 group=self.group)
        self._version, self._snap = box[0]


class _StateView(nn.Module):
    """An nn.Module whose state_dict is a given mapping (the gathered whole state)."""

    def __init__(self) -> None:
        super().__init__()
        self.sd: dict[str, torch.Tensor] = {}

    def state_dict(self, *args: Any, **kwargs: Any  # type: ignore[override]
                   ) -> dict[str, torch.Tensor]:
        return self.sd


class GatheredPublisher:
    """Rank 0 gathers the whole state and publishes it with a one-process `WeightPublisher`."""

    def __init__(self, model: nn.Module, mode: str = "xor", group: Any = None) -> None:
        self.model, self.group = model, group
        self.rank = dist.get_rank(group)
        self._view = _StateView()
        self._view.sd = self._gather()
        self._pub = WeightPublisher(self._view, mode=mode) if self.rank == 0 else None

    def _gather(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        return get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))

    @property
    def version(self) -> int | None:
        return None if self._pub is None else self._pub.version

    def publish(self) -> WeightUpdate | None:
        sd = self._gather()
        if self._pub is None:
            return None
        self._view.sd = sd
        return self._pub.publish()

    def full_update(self) -> WeightUpdate | None:
        return None if self._pub is None else self._pub.full_update()

    def checksums(self) -> dict[str, str] | None:
        return None if self._pub is None else self._pub.checksums()

    def state_dict(self) -> dict[str, Any] | None:
        return None if self._pub is None else self._pub.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self._pub is not None:
            self._pub.load_state_dict(state)


def make_publisher(model: nn.Module, mode: str, route: str | None, group: Any = None) -> Any:
    """The publisher for a trainer: one process (``route`` None) a `WeightPublisher`; across
    ranks the ``route``'s."""
    if route is None:
        return WeightPublisher(model, mode=mode)
    if route not in PUBLISH_ROUTES:
        raise WeightSyncError(f"glm5 make_publisher: route expected one of "
                              f"{list(PUBLISH_ROUTES)}, got {route!r}")
    return (ShardedPublisher if route == "shards" else GatheredPublisher)(model, mode, group)
