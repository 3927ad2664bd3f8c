"""RL weight updates on a server whose model is cut over ranks (`glm5 serve --tp N | --ep N
[--dp-attention] --allow-weight-updates`): every rank applies each update to its own cut of
each tensor, all ranks or none, between two lockstep steps.

A `WeightUpdate` names WHOLE tensors (the single-process model's ``state_dict()`` names and
shapes). Rank 0 receives it over HTTP and sends its bytes to every rank in a weights round
(`glm5.engine.lockstep.RankFront.weights_round`); then every rank runs `RankWeights.apply`:

1. parse and check the update against the whole tensors' shapes and dtypes (the table every
   rank builds at start from all ranks' ``state_dict`` and ``model.shard_spec``), and compute
   its new cut of each tensor into a CPU temporary: the payload reshaped to the whole tensor
   and cut as `glm5.parallel.layouts` cut the tensor (``(dim, start, stop)`` in the
   checkpoint tensor's coordinates: rows, columns, experts, packed code columns) — ``xor`` and
   ``full`` on the bits, ``sub`` in the tensor's dtype: all elementwise, so a cut of the
   result is the result of the cut; a tensor without a cut (replicated: norms, router,
   embeddings) is computed whole on every rank that holds it;
2. agree: any rank's failure so far is every rank's (an all-gather of errors);
3. verify: each cut tensor's new cuts are gathered to rank 0 (one tensor at a time),
   assembled into the whole tensor and checked with `glm5.engine.weight_sync.checksum_matches`
   against the trainer's checksum (whole sha256 or row ranges); rank 0 broadcasts the verdict;
4. commit: every rank copies its temporaries into its parameters and buffers (a rank that
   fails restores its own and tells the others, who restore theirs: all or nothing), then
   sets its engine's weights version (`LLMEngine.set_weights_version`: tokens carry it, the
   prefix cache is emptied).

A refusal (stale, corrupt, malformed) is raised on every rank alike with ``every_rank`` set
(the round completed; `glm5.engine.lockstep.agreed`): followers go on, rank 0's caller answers
as a single-process server does (409 stale, 400 otherwise); no rank's weights or version
changed. `RankWeights.checksums` assembles every tensor the same way: the whole-tensor
checksums a single-process server holding the same weights reports.

A row-parallel part of a quantized linear with quantized activations holds its checkpoint
slice widened by one column (`glm5.parallel.layouts.RowParallelQuantLinear`): its cut is the
first ``stop - start`` columns, and the extra column is left as it is. A model whose quantized
weights a backend repacked at load holds them in the backend's layout, not the checkpoint's:
`RankWeights` refuses it (`RankWeightsError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from glm5.engine.engine import LLMEngine
from glm5.engine.weight_sync import (ChecksumMismatchError, StaleUpdateError, WeightSyncError,
                                     WeightUpdate, check_update, checksum_matches,
                                     tensor_checksum)

_WHO = "glm5 RankWeights"
_ERRORS = {c.__name__: c for c in (WeightSyncError, StaleUpdateError, ChecksumMismatchError)}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Cut = Optional[tuple[int, int, int]]  # (dim, start, stop) of the whole tensor; None: all of it


class RankWeightsError(ValueError):
    """Weight updates cannot work on this model across ranks (said at start, on every rank)."""


@dataclass(frozen=True)
class Whole:
    """A state_dict tensor of the single-process model: its ``shape`` and ``dtype``, and the
    cut each rank that holds part of it keeps (``cuts``: rank -> `Cut`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    cuts: dict[int, Cut]

    @property
    def local_on_rank0(self) -> bool:
        """Rank 0 holds all of it (nothing to gather)."""
        return 0 in self.cuts and self.cuts[0] is None


def _agreed(e: Exception) -> Exception:
    """Mark ``e`` as raised alike on every rank (`glm5.engine.lockstep.agreed`)."""
    e.every_rank = True  # type: ignore[attr-defined]
    return e


def _int_dtype(dtype: torch.dtype, name: str) -> torch.dtype:
    width = torch.empty((), dtype=dtype).element_size()
    if width not in _INT_OF_WIDTH:
        raise WeightSyncError(f"{_WHO}.apply: tensor {name!r} has dtype {dtype} of {width} bytes "
                              f"per element; expected 1, 2, 4 or 8 across ranks")
    return _INT_OF_WIDTH[width]


def whole_table(infos: list[dict[str, tuple[Cut, tuple[int, ...], torch.dtype]]]
                ) -> dict[str, Whole]:
    """{name: `Whole`} from every rank's ``{name: (cut, local shape, dtype)}`` (rank order);
    names in order of first appearance. Raises `RankWeightsError` where the ranks' tensors do
    not make one whole tensor (dtypes or whole shapes that differ, cuts that leave a gap)."""
    held: dict[str, list[tuple[int, Cut, tuple[int, ...], torch.dtype]]] = {}
    for r, info in enumerate(infos):
        for name, (cut, shape, dtype) in info.items():
            held.setdefault(name, []).append((r, cut, tuple(shape), dtype))
    table: dict[str, Whole] = {}
    for name, parts in held.items():
        dtypes = {p[3] for p in parts}
        if len(dtypes) > 1:
            raise RankWeightsError(f"{_WHO}: tensor {name!r} has dtypes {sorted(map(str, dtypes))} "
                                   f"on different ranks; expected one")
        wholes = {p[2] for p in parts if p[1] is None}
        cut = [p for p in parts if p[1] is not None]
        if cut:
            dims = {p[1][0] for p in cut}
            if len(dims) > 1:
                raise RankWeightsError(f"{_WHO}: tensor {name!r} is cut along dims "
                                       f"{sorted(dims)} on different ranks; expected one")
            d = dims.pop()
            at = 0
            for _, (_, a, b), shape, _ in sorted(cut, key=lambda p: p[1][1:]):
                if a > at or shape[d] < b - a:
                    raise RankWeightsError(f"{_WHO}: tensor {name!r}: the ranks' cuts of dim {d} "
                                           f"leave rows {at}..{a} uncovered or hold fewer than "
                                           f"their range; cannot assemble it")
                at = max(at, b)
            shape = list(cut[0][2])
            shape[d] = at
            others = {tuple(s for i, s in enumerate(p[2]) if i != d) for p in cut}
            if len(others) > 1:
                raise RankWeightsError(f"{_WHO}: tensor {name!r}: the ranks' cuts differ outside "
                                       f"dim {d}; cannot assemble it")
            wholes.add(tuple(shape))
        if len(wholes) > 1:
            raise RankWeightsError(f"{_WHO}: tensor {name!r} makes whole shapes "
                                   f"{sorted(wholes)} on different ranks; expected one")
        table[name] = Whole(wholes.pop(), dtypes.pop(), {p[0]: p[1] for p in parts})
    return table


def local_part(t: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The elements of this rank's tensor ``t`` that are its cut of the whole tensor (a view):
    all of ``t``, or its first ``stop - start`` along the cut dim (a widened buffer, see the
    module docstring)."""
    if cut is None:
        return t
    d, a, b = cut
    return t if t.shape[d] == b - a else t.narrow(d, 0, b - a)


def cut_payload(payload: torch.Tensor, mode: str, w: Whole, cut: Cut) -> torch.Tensor:
    """This rank's cut of a whole tensor's update payload (1-D), shaped like its cut: ``sub``
    in the tensor's dtype, ``xor`` / ``full`` as the bits viewed in the tensor's dtype."""
    p = payload.detach().to("cpu")
    p = (p if mode == "sub" else p.view(w.dtype)).reshape(w.shape)
    if cut is not None:
        d, a, b = cut
        p = p.narrow(d, a, b - a)
    return p.contiguous()


class RankWeights:
    """One rank's side of weight updates on its engine's model (a model cut by
    `glm5.parallel`, ``model.shard_spec``). Built on every rank alike (collective: an
    all-gather of each rank's tensors); ``handle`` is the `glm5.engine.lockstep` weights
    handler. Raises `RankWeightsError` (on every rank) for a model it cannot update."""

    def __init__(self, engine: LLMEngine) -> None:
        if not hasattr(engine, "model") or not hasattr(engine, "set_weights_version"):
            raise TypeError(f"{_WHO}: engine expected an LLMEngine, got {type(engine).__name__}")
        self.engine = engine
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        model = engine.model
        spec = getattr(model, "shard_spec", None) or {}
        mine = {n: (None if spec.get(n) is None else tuple(int(x) for x in spec[n]),
                    tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
        repacked = sorted(((getattr(model, "quantization", None) or {}).get("repacked")
                           or {}))
        infos: list[Any] = [None] * self.world
        dist.all_gather_object(infos, (mine, repacked))
        for r, (_, rp) in enumerate(infos):
            if rp:
                raise RankWeightsError(
                    f"{_WHO}: argument 'allow_weight_updates': rank {r}'s backend repacked the "
                    f"quantized weights of {rp[0]} (and {len(rp) - 1} more) into its own layout; "
                    f"a weight update names checkpoint-layout tensors, which cannot be cut into "
                    f"repacked ones (serve without --allow-weight-updates, or on a backend "
                    f"that does not repack)")
        self.table = whole_table([i[0] for i in infos])

    # ------------------------------------------------------------------ the round
    def handle(self, op: str, data: Any) -> Any:
        """The weights handler: ``("apply", update bytes)`` -> the new version;
        ``("checksums", None)`` -> {name: sha256} on rank 0 (None on the others)."""
        if op == "apply":
            return self.apply(data)
        if op == "checksums":
            return self.checksums()
        raise _agreed(WeightSyncError(f"{_WHO}.handle: op expected 'apply' or 'checksums', got "
                                      f"{op!r}"))

    @property
    def version(self) -> int:
        return self.engine.weights_version

    def apply(self, data: bytes) -> int:
        """Apply the `WeightUpdate` in ``data`` (its `to_bytes`) to this rank's cuts; every rank
        calls it with the same bytes. Returns the new version; raises (alike on every rank,
        nothing changed) `StaleUpdateError`, `ChecksumMismatchError` or `WeightSyncError`."""
        live = self.engine.model.state_dict(keep_vars=True)
        news: dict[str, torch.Tensor] = {}
        olds: dict[str, torch.Tensor] = {}
        err: Exception | None = None
        update = None
        try:
            update = WeightUpdate.from_bytes(data)
            self._check(update)
            self._compute(update, live, olds, news)
        except WeightSyncError as e:
            err = e
        except Exception as e:  # noqa: BLE001 - one rank's failure must reach every rank
            err = WeightSyncError(f"{_WHO}.apply: rank {self.rank} could not compute its cut of "
                                  f"the update ({type(e).__name__}: {e})")
        self._agree(self._all_errors(err))
        assert update is not None  # no error on any rank
        bad: Exception | None = None
        for name in sorted(update.tensors):  # one order on every rank (a parsed update's
            # dict order may differ per process)
            pieces = self._gather(name, news.get(name))
            if self.rank == 0 and bad is None:
                try:
                    why = checksum_matches(update.checksums[name], self._join(name, pieces),
                                           update.shapes[name])
                except Exception as e:  # noqa: BLE001 - rank 0's alone: the verdict must
                    why = f"no checksum ({type(e).__name__}: {e})"  # still reach every rank
                if why is not None:
                    bad = ChecksumMismatchError(
                        f"{_WHO}.apply: tensor {name!r} computed from the update "
                        f"({update.base_version} -> {update.version}, {update.modes[name]}) has "
                        f"{why}; nothing was applied on any rank (version stays "
                        f"{self.version})")
        box = [None if bad is None else (type(bad).__name__, str(bad))]
        dist.broadcast_object_list(box, src=0)
        self._agree([box[0]])
        failed = self._commit(update, live, olds, news)
        fails = [None] * self.world
        dist.all_gather_object(fails, failed)
        if any(fails):
            if failed is None:
                self._write(update, live, olds, list(olds))  # undo: another rank failed
            r = next(i for i, f in enumerate(fails) if f)
            raise _agreed(WeightSyncError(f"{_WHO}.apply: rank {r} could not write the new "
                                          f"weights ({fails[r]}); every rank restored its own "
                                          f"(version stays {self.version})"))
        self.engine.set_weights_version(update.version)
        return update.version

    def checksums(self) -> dict[str, str] | None:
        """{name: sha256 of the whole tensor} of the model as every rank holds it now (the
        single-process `state_checksums`), on rank 0; None on the others. Collective."""
        live = self.engine.model.state_dict()
        out: dict[str, str] = {}
        failed = ""
        for name, w in self.table.items():
            mine = None
            if self.rank in w.cuts:
                mine = local_part(live[name], w.cuts[self.rank]).detach().to("cpu")
            pieces = self._gather(name, mine)
            if self.rank == 0 and not failed:
                try:
                    out[name] = tensor_checksum(self._join(name, pieces))
                except Exception as e:  # noqa: BLE001 - rank 0's alone, reported at the end
                    failed = f"tensor {name!r}: {type(e).__name__}: {e}"
        if failed:  # every rank has sent: the round completed
            raise _agreed(WeightSyncError(f"{_WHO}.checksums: cannot assemble {failed}"))
        return out if self.rank == 0 else None

    # ------------------------------------------------------------------ the parts
    def _check(self, update: WeightUpdate) -> None:
        """What `glm5.engine.weight_sync.WeightReceiver` checks, against the whole tensors."""
        check_update(update, {n: (w.shape, w.dtype) for n, w in self.table.items()},
                     self.version, f"{_WHO}.apply", "this server")

    def _compute(self, update: WeightUpdate, live: dict[str, torch.Tensor],
                 olds: dict[str, torch.Tensor], news: dict[str, torch.Tensor]) -> None:
        """This rank's new cut of every tensor it holds, into CPU temporaries (``news``; the
        cuts as they are now in ``olds``, for a rollback)."""
        for name, payload in update.tensors.items():
            w = self.table[name]
            if self.rank not in w.cuts:
                continue  # this rank holds none of it (a row-parallel bias off tp rank 0)
            cut = w.cuts[self.rank]
            old = local_part(live[name], cut).detach().to("cpu").contiguous().clone()
            mode = update.modes[name]
            p = cut_payload(payload, mode, w, cut)
            if mode == "full":
                new = p.clone()
            elif mode == "xor":
                it = _int_dtype(w.dtype, name)
                new = (old.view(it) ^ p.view(it)).view(w.dtype)
            else:
                new = old + p
            olds[name], news[name] = old, new

    def _gather(self, name: str, mine: torch.Tensor | None) -> list[Any] | None:
        """Every holder's cut of tensor ``name`` on rank 0 (``mine``: this rank's, None where it
        holds none), in rank order; None on the other ranks. Collective unless rank 0 holds all
        of it (then no rank sends and rank 0's list holds its own only)."""
        if self.table[name].local_on_rank0:
            return [mine] if self.rank == 0 else None
        pieces: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        return pieces

    def _join(self, name: str, pieces: list[Any]) -> torch.Tensor:
        """Rank 0: the whole tensor ``name`` from `_gather`'s cuts (laid out per the table)."""
        w = self.table[name]
        if w.local_on_rank0:
            return pieces[0]
        whole = torch.empty(w.shape, dtype=w.dtype)
        for r, piece in enumerate(pieces):
            if r not in w.cuts:
                continue
            cut = w.cuts[r]
            if cut is None:
                return piece
            d, a, b = cut
            whole.narrow(d, a, b - a).copy_(piece)
        return whole

    def _all_errors(self, err: Exception | None) -> list[Any]:
        errs: list[Any] = [None] * self.world
        dist.all_gather_object(errs, None if err is None else (type(err).__name__, str(err)))
        return errs

    def _agree(self, errs: list[Any]) -> None:
        """Raise the first rank's error (rebuilt as its class) on this rank, if any rank had
        one."""
        for e in errs:
            if e is not None:
                raise _agreed(_ERRORS.get(e[0], WeightSyncError)(e[1]))

    def _write(self, update: WeightUpdate, live: dict[str, torch.Tensor],
               src: dict[str, torch.Tensor], names: list[str]) -> None:
        with torch.no_grad():
            for name in names:
                part = local_part(live[name], self.table[name].cuts[self.rank])
                part.copy_(src[name].view(part.shape))

    def _commit(self, update: WeightUpdate, live: dict[str, torch.Tensor],
                olds: dict[str, torch.Tensor], news: dict[str, torch.Tensor]) -> str | None:
        """Copy ``news`` into this rank's tensors; on a failure restore every one touched and
        return what failed (None: all written)."""
        tried: list[str] = []
        try:
            for name in news:
                tried.append(name)  # a copy_ can fail after writing: undo it too
                self._write(update, live, news, [name])
        except Exception as e:  # noqa: BLE001 - reported to every rank, then all restore
            for name in tried:
                try:
                    self._write(update, live, olds, [name])
                except Exception:  # noqa: BLE001 - restore the rest; the first error wins
                    pass
            return f"{type(e).__name__}: {e}"
        return None
