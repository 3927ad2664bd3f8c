"""Collectives as ops: `all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`.

Each is defined once in the IR (glm5.ir.ops_comm: signature, shape function, link-byte cost,
float64 reference over every rank's input) and served here: by torch.distributed by default,
or by a backend's own implementation (a fused or quantized collective) registered with
`register_collective`. Which implementation serves a call follows the backend selection rule
(`glm5.backends.selection.ranked`: `glm5.use_backend` / ``GLM5_BACKEND``, plugins.toml
``[ops.<collective>] order`` and ``[selection] order``, then priority): the first backend that
serves the tensor's device type, is available and allowed, and registered an implementation
for the collective; torch.distributed otherwise.

Conventions:

- ``group`` is a glm5.parallel `Group` (from `DistContext.new_groups` or ``ctx.world``), a
  torch.distributed ProcessGroup, or None. **None, or a group of one rank, is the identity**:
  the input is returned as it is (no copy) and torch.distributed is never called — unlike
  torch.distributed, where None means the world. Otherwise the result is a new tensor and
  ``x`` is unchanged.
- Every rank of the group must make the same calls on it in the same order (as with any
  collective).
- A collective that does not complete within the context's timeout raises
  `glm5.parallel.CollectiveError` (`CollectiveTimeout`, `PeerLost`) naming the collective, this
  rank, the group's ranks, the timeout and the ranks that did not take part (glm5.parallel.faults).
- Not differentiable: these are inference collectives (autograd does not see them).
"""

from __future__ import annotations

import datetime
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

import glm5.ops
from glm5.backends.policy import get_policy
from glm5.backends.registry import get_registry
from glm5.backends.selection import current_override, ranked
from glm5.ir.ops_comm import COMM_OPS, get_comm_op
from glm5.parallel.faults import CollectiveError, collective_failed
from glm5.parallel.groups import Group, as_group

TORCH = "torch.distributed"  # the name of the default implementation (see `collective_impl`)

# (collective, backend name) -> implementation; bumped generation invalidates the cache.
_impls: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
_generation = 0
_cache: dict[tuple, tuple[str, Callable[..., torch.Tensor]]] = {}


class CommArgumentError(ValueError):
    """Bad input to a collective (shape, counts, dim): raised before anything is sent."""


# --------------------------------------------------------------------------- byte counter
@dataclass(frozen=True)
class CommCall:
    """One collective call this rank made while a `count_bytes` block was active.

    ``op``: "all_reduce", "reduce_scatter", "all_gather" or "all_to_all"; ``group_size`` and
    ``rank`` (this rank's index in the group); ``shape`` / ``dtype``: the caller's ``x``;
    ``quant``: None or "int8" (all_gather); ``send_counts``: the rows sent to each rank
    (all_to_all, else None); ``link_bytes``: the bytes this rank put on the links, the
    `glm5.ir.ops_comm` cost of this call's real shape, dtype and send counts (all_to_all: only
    the rows for other ranks, never its own); ``wire_bytes``: this rank's buffer as handed to
    torch.distributed — for all_gather the tensor gathered (int8: the real codes + fp32 scales;
    link_bytes = (n-1) wire_bytes), for all_to_all the real rows split off for other ranks
    (link_bytes = wire_bytes), else the reduced tensor's bytes B (link_bytes = 2 (n-1)/n B,
    (n-1)/n B); None when a backend's own implementation served the call; ``scope``: the
    record's ``scope`` when the call was made (e.g. a layer index set by a forward pre-hook)."""

    op: str
    group_size: int
    rank: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant: str | None
    send_counts: tuple[int, ...] | None
    link_bytes: float
    wire_bytes: int | None
    scope: Any = None


@dataclass
class ByteCount:
    """What `count_bytes` yields: ``calls`` in the order made; set ``scope`` to tag the calls
    that follow (the test and bench set it to the layer index from a forward pre-hook)."""

    calls: list[CommCall] = field(default_factory=list)
    scope: Any = None

    def total(self, scope: Any = ...) -> float:
        """Link bytes of every call (or of the calls tagged ``scope``)."""
        return float(sum(c.link_bytes for c in self.calls if scope is ... or c.scope == scope))

    def by_scope(self) -> dict[Any, list[CommCall]]:
        """scope -> its calls, in order."""
        out: dict[Any, list[CommCall]] = {}
        for c in self.calls:
            out.setdefault(c.scope, []).append(c)
        return out


# the active counters (nested blocks each see every call); empty: the calls pay one test
_counters: list[ByteCount] = []
# wire bytes the torch.distributed implementation reports for the call in flight
_wire: list[int] = []


@contextmanager
def count_bytes() -> Iterator[ByteCount]:
    """While the block runs, every collective this rank makes over a group of two or more ranks
    (the identity calls send nothing and are not recorded) appends a `CommCall` to the yielded
    `ByteCount`. Next to no cost outside a block: a truth test of a module-level list before
    and after the transfer."""
    rec = ByteCount()
    _counters.append(rec)
    try:
        yield rec
    finally:
        _counters.remove(rec)


def _note_wire(nbytes: int) -> None:
    """Called by the torch.distributed implementations with the bytes of the buffer they hand
    over (only while a counter is active)."""
    if _counters:
        _wire.append(int(nbytes))


def _record(name: str, g: Group, x: torch.Tensor, args: tuple[Any, ...]) -> None:
    attrs: dict[str, Any] = {}
    quant = counts = None
    if name in ("reduce_scatter", "all_gather"):
        attrs["dim"] = args[0]
    if name == "all_gather":
        quant = attrs["quant"] = args[1]
    if name == "all_to_all":
        counts = tuple(args[0])
        attrs["send_counts"] = counts
    lb = link_bytes(name, x, g, **attrs)
    wire = sum(_wire) if _wire else None
    _wire.clear()
    call = CommCall(name, g.size, g.rank, tuple(x.shape), x.dtype, quant, counts, lb, wire)
    for rec in _counters:
        rec.calls.append(call if rec.scope is None else
                         CommCall(**{**call.__dict__, "scope": rec.scope}))


# --------------------------------------------------------------------------- registry
def register_collective(name: str, fn: Callable[..., torch.Tensor] | None = None, *,
                        backend: str) -> Any:
    """Register ``fn`` as backend ``backend``'s implementation of collective ``name``
    ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"). Usable as a decorator
    (``@register_collective("all_reduce", backend="acme")``) or called with ``fn``.

    ``fn`` takes the public function's arguments exactly (``fn(x, group)``,
    ``fn(x, group, dim)``, ``fn(x, group, dim, quant)``,
    ``fn(x, send_counts, recv_counts, group)``) with ``group`` a glm5.parallel `Group` of two or
    more ranks (``group.pg`` is its torch.distributed group) and the arguments already checked,
    and returns the result as the default implementation would (a new tensor); raising
    RuntimeError on a failed transfer. It serves calls on the devices ``backend`` serves,
    while the backend is available and selected (glm5.backends.selection.ranked)."""
    if name not in COMM_OPS:
        raise KeyError(f"glm5.parallel.register_collective: argument 'name' expected one of "
                       f"{', '.join(COMM_OPS)}, got {name!r}")
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"glm5.parallel.register_collective: argument 'backend' expected a "
                        f"backend name, got {backend!r}")

    def deco(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        global _generation
        if not callable(f):
            raise TypeError(f"glm5.parallel.register_collective: argument 'fn' expected a "
                            f"callable, got {type(f).__name__}")
        _impls[(name, backend)] = f
        _generation += 1
        _cache.clear()
        return f

    return deco if fn is None else deco(fn)


def unregister_collective(name: str, backend: str) -> None:
    """Remove ``backend``'s implementation of ``name`` (no-op when absent)."""
    global _generation
    if _impls.pop((name, backend), None) is not None:
        _generation += 1
        _cache.clear()


def collective_impl(name: str, device_type: str) -> tuple[str, Callable[..., torch.Tensor]]:
    """(who, fn): the implementation that serves collective ``name`` for tensors on
    ``device_type`` — a backend's name, or ``"torch.distributed"`` for the default."""

    reg = get_registry()
    key = (name, device_type, current_override(), os.environ.get("GLM5_PLUGINS"),
           _generation, id(reg))
    hit = _cache.get(key)
    if hit is not None:
        return hit
    out: tuple[str, Callable[..., torch.Tensor]] = (TORCH, _DEFAULTS[name])
    if any(k[0] == name for k in _impls):
        pol = get_policy()
        ordered, _ = ranked(name)
        for b in ordered:
            fn = _impls.get((name, b.name))
            if (fn is not None and pol.allowed(b.name) and b.serves_device(device_type)
                    and b.is_available()[0]):
                out = (b.name, fn)
                break
    _cache[key] = out
    return out


# --------------------------------------------------------------------------- the calls
def _trivial(group: Any, where: str) -> Group | None:
    """The Group to communicate over, or None when the call is the identity."""
    g = as_group(group, where)
    if g is None or g.size == 1:
        return None
    if g.ctx is not None:  # before the pg test: a destroyed context has released its groups
        g.ctx._check_alive(where.rsplit(".", 1)[-1])
    if g.pg is None:
        return None
    return g


def _check_tensor(x: Any, where: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: argument 'x' expected a torch.Tensor, got {type(x).__name__}")


def _check_dim(x: torch.Tensor, dim: Any, where: str) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{where}: argument 'dim' expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < max(x.dim(), 1) or x.dim() == 0:
        raise CommArgumentError(f"{where}: argument 'dim' expected in [{-x.dim()}, {x.dim()}) "
                                f"for x of shape {list(x.shape)}, got {dim}")
    return dim % x.dim()


def _run(name: str, g: Group, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """Serve one collective through the selected implementation, turning a failed or
    timed-out transfer into a CollectiveError."""
    _, fn = collective_impl(name, x.device.type)
    seq = g.next_seq()
    started = time.monotonic()
    try:
        if _counters:
            _wire.clear()
        if name == "all_to_all":
            y = fn(x, args[0], args[1], g)
        else:
            y = fn(x, g, *args)
        if _counters:  # after the transfer: a failed call moved no accountable bytes
            _record(name, g, x, args)
        return y
    except CollectiveError:
        raise
    except RuntimeError as e:
        raise collective_failed(e, name, g, seq, started) from e


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The elementwise sum of every rank's ``x`` (any shape and dtype, the same on every rank),
    on every rank. A new tensor; ``x`` is unchanged. Identity for ``group`` None or of size 1.
    Link bytes per rank: 2 (n-1)/n of x's bytes."""
    where = "glm5.parallel.all_reduce"
    _check_tensor(x, where)
    g = _trivial(group, where)
    if g is None:
        return x
    return _run("all_reduce", g, x)


def reduce_scatter(x: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """The sum of every rank's ``x``, cut into n equal chunks along ``dim``: rank i (its index
    in the group) gets chunk i, of shape x.shape with ``dim`` divided by n. ``x.shape[dim]``
    must be a multiple of the group size (padding is the caller's job). Identity for ``group``
    None or of size 1. Link bytes per rank: (n-1)/n of x's bytes."""
    where = "glm5.parallel.reduce_scatter"
    _check_tensor(x, where)
    d = _check_dim(x, dim, where)
    g = _trivial(group, where)
    if g is None:
        return x
    if x.shape[d] % g.size:
        raise CommArgumentError(
            f"{where}: argument 'x' expected x.shape[{dim}] to be a multiple of the group "
            f"size {g.size}, got {x.shape[d]} (shape {list(x.shape)}; pad it first)")
    return _run("reduce_scatter", g, x, d)


def all_gather(x: torch.Tensor, group: Any, dim: int = 0, quant: str | None = None
               ) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (x has the same shape on
    every rank; not checked, that would cost a collective). Identity for ``group`` None or of
    size 1.

    ``quant="int8"``: each rank sends its tokens (rows over the last dim) as int8 codes with
    one float32 scale per token (glm5.ops.quantize_per_token, bits 8) and every part is
    dequantized after the gather, in x's dtype: per element within
    `glm5.ir.ops_comm.int8_gather_bound` (amax of the token / 254, plus rounding) of the
    exact gather, for (K + 4) / (K * itemsize) of the bytes. Link bytes per rank: (n-1) times
    x's bytes; int8: (n-1) (numel + 4 rows)."""
    where = "glm5.parallel.all_gather"
    _check_tensor(x, where)
    d = _check_dim(x, dim, where)
    if quant is not None and quant != "int8":
        raise CommArgumentError(f"{where}: argument 'quant' expected None or 'int8', got "
                                f"{quant!r}")
    if quant is not None and not x.is_floating_point():
        raise CommArgumentError(f"{where}: argument 'x' expected a floating dtype with "
                                f"quant='int8', got {x.dtype}")
    g = _trivial(group, where)
    if g is None:
        return x
    return _run("all_gather", g, x, d, quant)


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Any
               ) -> torch.Tensor:
    """Rows of ``x`` (dim 0), split by ``send_counts`` (n entries summing to x.shape[0]), go to
    ranks 0..n-1 of the group in order; returns the rows received, ``recv_counts[s]`` from each
    rank s, concatenated in rank order: shape [sum(recv_counts), *x.shape[1:]]. A count may be
    0. ``recv_counts[s]`` must equal what rank s sends this rank (exchange the counts first
    when they are not known, e.g. with an all_to_all of the counts). Identity for ``group``
    None or of size 1 (both counts then [x.shape[0]]). Link bytes per rank: the rows sent to
    other ranks."""
    where = "glm5.parallel.all_to_all"
    _check_tensor(x, where)
    g = as_group(group, where)
    n = 1 if g is None else g.size
    if x.dim() == 0:
        raise CommArgumentError(f"{where}: argument 'x' expected at least 1 dim (rows), got a "
                                f"0-dim tensor")
    for arg, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if (not isinstance(counts, (list, tuple))
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                           for c in counts)):
            raise CommArgumentError(f"{where}: argument {arg!r} expected a list of {n} "
                                    f"non-negative ints, got {counts!r}")
        if len(counts) != n:
            raise CommArgumentError(f"{where}: argument {arg!r} expected {n} entries (the group "
                                    f"size), got {len(counts)}")
    if sum(send_counts) != x.shape[0]:
        raise CommArgumentError(f"{where}: argument 'send_counts' expected to sum to "
                                f"x.shape[0] = {x.shape[0]}, got sum {sum(send_counts)}")
    if n == 1:
        if list(recv_counts) != [x.shape[0]]:
            raise CommArgumentError(f"{where}: argument 'recv_counts' expected [{x.shape[0]}] "
                                    f"for a group of one rank, got {list(recv_counts)}")
        return x
    g = _trivial(g, where)
    if g is None:
        return x
    return _run("all_to_all", g, x, list(send_counts), list(recv_counts))


# --------------------------------------------------------------------------- torch.distributed
def _wait(work: Any, g: Group) -> None:
    # A timed wait on every backend: gloo also honours the group's own timeout, and NCCL blocks
    # the calling thread until completion or this timeout when one is given.
    t = g.timeout_s
    if t is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=t))


def _torch_all_reduce(x: torch.Tensor, g: Group) -> torch.Tensor:
    import torch.distributed as dist

    y = x.clone(memory_format=torch.contiguous_format)
    _note_wire(y.nbytes)
    _wait(dist.all_reduce(y, op=dist.ReduceOp.SUM, group=g.pg, async_op=True), g)
    return y


def _torch_reduce_scatter(x: torch.Tensor, g: Group, dim: int = 0) -> torch.Tensor:
    import torch.distributed as dist

    xt = x.movedim(dim, 0).contiguous()
    out = xt.new_empty((xt.shape[0] // g.size, *xt.shape[1:]))
    _note_wire(xt.nbytes)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _wait(rs(out, xt, op=dist.ReduceOp.SUM, group=g.pg, async_op=True), g)
    return out.movedim(0, dim)


def _gather0(xt: torch.Tensor, g: Group) -> torch.Tensor:
    """Exact all-gather along dim 0 of a contiguous tensor."""
    import torch.distributed as dist

    out = xt.new_empty((xt.shape[0] * g.size, *xt.shape[1:]))
    _note_wire(xt.nbytes)  # int8: the codes + scales payload itself
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _wait(ag(out, xt, group=g.pg, async_op=True), g)
    return out


def _torch_all_gather(x: torch.Tensor, g: Group, dim: int = 0, quant: str | None = None
                      ) -> torch.Tensor:
    if quant == "int8":
        return _int8_all_gather(x, g, dim)
    xt = x.movedim(dim, 0).contiguous()
    return _gather0(xt, g).movedim(0, dim)


def _int8_all_gather(x: torch.Tensor, g: Group, dim: int) -> torch.Tensor:
    shape = tuple(x.shape)
    K = shape[-1] if x.dim() else 1
    rows = x.reshape(-1, K)
    q, s = glm5.ops.quantize_per_token(rows, 8)
    # One transfer: each token's K int8 codes followed by its float32 scale's 4 bytes.
    payload = torch.cat([q.view(torch.uint8), s.to(torch.float32).contiguous()
                         .view(torch.uint8).reshape(-1, 4)], dim=1)
    got = _gather0(payload, g)
    codes = got[:, :K].contiguous().view(torch.int8)
    scales = got[:, K:].contiguous().view(torch.float32)
    parts = (codes.to(torch.float32) * scales).to(x.dtype).reshape(g.size, *shape)
    return torch.cat(parts.unbind(0), dim=dim)


def _torch_all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                      g: Group) -> torch.Tensor:
    import torch.distributed as dist

    xc = x.contiguous()
    out = xc.new_empty((sum(recv_counts), *xc.shape[1:]))
    if _counters:  # the rows really split off for the other ranks (this rank's own stay)
        _note_wire(sum(p.nbytes for j, p in enumerate(xc.split(send_counts)) if j != g.rank))
    _wait(dist.all_to_all_single(out, xc, output_split_sizes=recv_counts,
                                 input_split_sizes=send_counts, group=g.pg, async_op=True), g)
    return out


_DEFAULTS: dict[str, Callable[..., torch.Tensor]] = {
    "all_reduce": _torch_all_reduce,
    "reduce_scatter": _torch_reduce_scatter,
    "all_gather": _torch_all_gather,
    "all_to_all": _torch_all_to_all,
}


def link_bytes(name: str, x: torch.Tensor, group: Any, **attrs: Any) -> float:
    """Bytes this rank puts on the links for collective ``name`` of ``x`` over ``group`` (0 for
    the identity): `glm5.ir.ops_comm` cost of the call. ``attrs``: ``dim``/``quant``
    (all_gather), ``dim`` (reduce_scatter), ``send_counts`` (all_to_all; ``rank`` is the
    group's)."""

    op = get_comm_op(name)
    g = as_group(group, f"glm5.parallel.link_bytes({name!r})")
    if g is None or g.size == 1:
        return 0.0
    if name == "all_to_all":
        attrs = {"send_counts": attrs.get("send_counts", ()), "rank": g.rank}
    return op.link_bytes(tuple(x.shape), x.dtype, g.size, **attrs)
