"""Communication ops: all_reduce, reduce_scatter, all_gather, all_to_all — a catalog of their
own (`COMM_OPS`), apart from `glm5.ir.catalog.OPS`.

Why apart: an op of the main catalog is one call on one process (its reference takes that
call's arguments, the conformance kit runs it single-process, it is bound as
``torch.ops.glm5.<name>``). A collective is one call on each of ``n`` ranks. So a `CommOpDef`
has the same parts in the form a collective needs: a signature, a shape function of one rank's
input and the group size, a **cost in link bytes per rank** (what the planner divides by a
link's bandwidth), and a float64 **reference over the list of every rank's input** that
returns every rank's output, so the semantics are checkable in one process. The
implementations (torch.distributed by default, a backend's own where registered) are in
glm5.parallel.comm. docs/ops.md lists these ops in its "Communication" section (checked against
this catalog by tests/test_dist_comm.py).

Link-byte costs are per rank, of ``B`` = the bytes of one rank's input ``x`` (``n`` = group
size), for the bandwidth-optimal ring algorithms:

- all_reduce: ``2 (n-1)/n B`` (a reduce-scatter then an all-gather);
- reduce_scatter: ``(n-1)/n B``;
- all_gather: ``(n-1)/n`` of the output, ``(n-1) B``;
- all_to_all: the bytes this rank sends to other ranks, ``sum_{j != rank} send_counts[j] * row``.

Layering: imports only glm5.ir.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from glm5.ir.numerics import MARGIN, floor, unit_roundoff

INT8_QMAX = 127  # the symmetric int8 code range of quantize_per_token(bits=8)
SCALE_BYTES = 4  # one float32 scale per token travels with an int8 row


@dataclass(frozen=True)
class CommParam:
    """One argument of a collective as docs/ops.md lists it."""

    name: str
    kind: str  # "tensor", "int", "list[int]", "group", "str"
    doc: str
    default: Any = None
    has_default: bool = False


@dataclass(frozen=True)
class CommOpDef:
    """One collective. ``out_shape(shape, n, **attrs)`` is one rank's output shape from its
    input shape and the group size; ``link_bytes(shape, dtype, n, **attrs)`` its bytes on the
    links (sent by this rank); ``reference(xs, **attrs)`` maps every rank's input (a list,
    rank order) to every rank's output, in float64. ``attrs`` names the keyword attributes
    these three take; ``cost_text`` is the link-byte formula as docs/ops.md prints it."""

    name: str
    summary: str
    params: tuple[CommParam, ...]
    out_shape: Callable[..., tuple[int, ...]]
    link_bytes: Callable[..., float]
    reference: Callable[..., list[torch.Tensor]]
    cost_text: str
    attrs: tuple[str, ...] = ()

    def call_text(self) -> str:
        parts = [p.name if not p.has_default else f"{p.name}={p.default!r}" for p in self.params]
        return f"glm5.parallel.{self.name}({', '.join(parts)})"


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> float:
    n = 1
    for d in shape:
        n *= int(d)
    return float(n * torch.empty((), dtype=dtype).element_size())


def _dim(shape: Sequence[int], dim: int) -> int:
    nd = len(shape)
    if not -nd <= dim < nd:
        raise IndexError(f"dim {dim} out of range for {nd} dims")
    return dim % nd


def _f64(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x.to(torch.float64) for x in xs]


# --------------------------------------------------------------------------- all_reduce
def all_reduce_ref(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    s = torch.stack(_f64(xs)).sum(0)
    return [s.clone() for _ in xs]


ALL_REDUCE = CommOpDef(
    name="all_reduce",
    summary="every rank gets the elementwise sum of every rank's x",
    params=(CommParam("x", "tensor", "this rank's addend; any shape, same on every rank"),
            CommParam("group", "group", "None or a group of 1: the identity")),
    out_shape=lambda shape, n: tuple(shape),
    link_bytes=lambda shape, dtype, n: 2.0 * (n - 1) / n * _nbytes(shape, dtype),
    reference=all_reduce_ref,
    cost_text="2 (n-1)/n B",
)


# --------------------------------------------------------------------------- reduce_scatter
def reduce_scatter_ref(xs: Sequence[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    s = torch.stack(_f64(xs)).sum(0)
    return [c.clone() for c in s.chunk(len(xs), dim=dim)]


def _rs_shape(shape: Sequence[int], n: int, dim: int = 0) -> tuple[int, ...]:
    d = _dim(shape, dim)
    if shape[d] % n:
        raise ValueError(f"reduce_scatter: x.shape[{dim}] = {shape[d]} is not a multiple of "
                         f"the group size {n}")
    out = list(shape)
    out[d] //= n
    return tuple(out)


REDUCE_SCATTER = CommOpDef(
    name="reduce_scatter",
    summary="the sum of every rank's x, split in n equal chunks along dim; rank i gets chunk i",
    params=(CommParam("x", "tensor", "this rank's addend; x.shape[dim] a multiple of n (pad "
                                     "first)"),
            CommParam("group", "group", "None or a group of 1: the identity"),
            CommParam("dim", "int", "the dimension split", 0, True)),
    out_shape=_rs_shape,
    link_bytes=lambda shape, dtype, n, dim=0: (n - 1) / n * _nbytes(shape, dtype),
    reference=reduce_scatter_ref,
    cost_text="(n-1)/n B",
    attrs=("dim",),
)


# --------------------------------------------------------------------------- all_gather
def all_gather_ref(xs: Sequence[torch.Tensor], dim: int = 0) -> list[torch.Tensor]:
    cat = torch.cat(_f64(xs), dim=dim)
    return [cat.clone() for _ in xs]


def _ag_shape(shape: Sequence[int], n: int, dim: int = 0, quant: str | None = None
              ) -> tuple[int, ...]:
    d = _dim(shape, dim)
    out = list(shape)
    out[d] *= n
    return tuple(out)


def _ag_bytes(shape: Sequence[int], dtype: torch.dtype, n: int, dim: int = 0,
              quant: str | None = None) -> float:
    if quant is None:
        return float(n - 1) * _nbytes(shape, dtype)
    if quant != "int8":
        raise ValueError(f"all_gather: quant expected None or 'int8', got {quant!r}")
    rows = _nbytes(shape[:-1], torch.uint8) if len(shape) > 1 else 1.0
    return float(n - 1) * (_nbytes(shape, torch.int8) + SCALE_BYTES * rows)


ALL_GATHER = CommOpDef(
    name="all_gather",
    summary="every rank's x concatenated along dim in rank order (equal shapes); quant='int8' "
            "sends per-token int8 codes and a float32 scale, dequantized after the gather",
    params=(CommParam("x", "tensor", "this rank's part; the same shape on every rank"),
            CommParam("group", "group", "None or a group of 1: the identity"),
            CommParam("dim", "int", "the dimension concatenated", 0, True),
            CommParam("quant", "str", "None (exact) or 'int8' (tokens = rows over the last "
                                      "dim; error bound `int8_gather_bound`)", None, True)),
    out_shape=_ag_shape,
    link_bytes=_ag_bytes,
    reference=all_gather_ref,
    cost_text="(n-1) B; int8: (n-1) (numel + 4 rows)",
    attrs=("dim", "quant"),
)


# --------------------------------------------------------------------------- all_to_all
def all_to_all_ref(xs: Sequence[torch.Tensor], send_counts: Sequence[Sequence[int]]
                   ) -> list[torch.Tensor]:
    """``send_counts[s][r]``: the rows rank ``s`` sends rank ``r`` (consecutive rows of
    ``xs[s]``, in destination order). Rank ``r`` receives ``send_counts[s][r]`` rows from each
    ``s``, concatenated in source-rank order."""
    n = len(xs)
    parts = [list(x.to(torch.float64).split(list(send_counts[s]), dim=0))
             for s, x in enumerate(xs)]
    return [torch.cat([parts[s][r] for s in range(n)], dim=0) for r in range(n)]


def _a2a_shape(shape: Sequence[int], n: int, recv_counts: Sequence[int] = ()) -> tuple[int, ...]:
    return (int(sum(recv_counts)), *shape[1:])


def _a2a_bytes(shape: Sequence[int], dtype: torch.dtype, n: int,
               send_counts: Sequence[int] = (), rank: int = 0) -> float:
    row = _nbytes(shape[1:], dtype)
    return float(sum(c for j, c in enumerate(send_counts) if j != rank)) * row


ALL_TO_ALL = CommOpDef(
    name="all_to_all",
    summary="rows of x split by send_counts go to ranks 0..n-1; returns the rows received, "
            "concatenated in rank order",
    params=(CommParam("x", "tensor", "[sum(send_counts), ...] rows, grouped by destination"),
            CommParam("send_counts", "list[int]", "rows for each rank (n entries, >= 0)"),
            CommParam("recv_counts", "list[int]", "rows from each rank (n entries, >= 0); rank "
                                                  "r's recv_counts[s] = rank s's "
                                                  "send_counts[r]"),
            CommParam("group", "group", "None or a group of 1: the identity")),
    out_shape=_a2a_shape,
    link_bytes=_a2a_bytes,
    reference=all_to_all_ref,
    cost_text="sum_{j != rank} send_counts[j] * row bytes",
    attrs=("send_counts", "recv_counts", "rank"),
)

COMM_OPS: dict[str, CommOpDef] = {op.name: op for op in
                                  (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL)}


def get_comm_op(name: str) -> CommOpDef:
    """The CommOpDef called ``name``; a KeyError lists the known ones."""
    try:
        return COMM_OPS[name]
    except KeyError:
        raise KeyError(f"glm5: unknown collective {name!r}; known collectives: "
                       f"{', '.join(COMM_OPS)}") from None


# --------------------------------------------------------------------------- error bounds
def sum_bound(xs: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |a collective sum in ``dtype`` - the float64 sum| for n addends:
    any order of n-1 additions in ``dtype`` rounds each partial sum once (at most u times a
    partial sum, itself at most sum|x_r|), worst case (n - 1) u sum|x_r|, MARGIN for the
    second-order part, plus the floor for underflow. n is a group size (small): the
    worst case is the right bound here, not the sqrt(n) of long dot products."""
    a = torch.stack([x.to(torch.float64).abs() for x in xs]).sum(0)
    n = len(xs)
    return MARGIN * (n - 1) * unit_roundoff(dtype) * a + floor(dtype, dtype)


def int8_gather_bound(x: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |all_gather(x, quant='int8') - x| for one rank's part ``x``
    (float64 result, x's shape).

    Per token (row over the last dim) s = amax|x| / 127 and x ~ q s with q = round(x / s):
    round to nearest misses by at most s / 2 (the int8 budget, 0.39 % of the row's amax).
    Arithmetic: s and x / s in fp32 (relative u32 each, the quotient at most 127.5 so at most
    about 128 u32 s), q s in fp32 (at most 127 u32 s): 400 u32 s covers them. The result is
    rounded to x's dtype: u(x.dtype) (|x| + s). An all-zero row is sent exactly (bound 0)."""
    xf = x.to(torch.float64)
    if xf.dim() == 0:
        xf = xf.reshape(1)
    amax = xf.abs().amax(-1, keepdim=True)
    s = amax / INT8_QMAX
    u32 = unit_roundoff(torch.float32)
    uo = unit_roundoff(x.dtype) if x.dtype != torch.float64 else 0.0
    b = s * (0.5 + 400.0 * u32) + uo * (xf.abs() + s)
    return b.reshape(x.shape)
