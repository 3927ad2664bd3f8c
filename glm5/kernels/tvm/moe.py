"""`moe_experts` for the cpu backend: tokens sorted by expert, grouped GEMMs, TVM silu_mul and
a TVM weighted combine.

Pipeline for ``x[T, D]``, ``ids/weights[T, k]``, ``w13[E, 2I, D]``, ``w2[E, D, I]``:

1. sort (torch): the T·k routed slots, −1 dropped, stably by expert -> per expert a contiguous
   run of rows; ``pos[t, j]`` = the row of slot (t, j) (−1 when skipped); ``xs = x[token of row]``.
2. grouped GEMM 1: ``h13[rows of e] = xs[rows of e] · w13[e]ᵀ`` into one ``[R, 2I]`` buffer
   (``torch.mm(..., out=)`` on the contiguous run: oneDNN/MKL sgemm).
3. ``hs = silu_mul(h13)``: one parallel TVM call over all R rows (`norm.build_silu_mul`).
4. grouped GEMM 2: ``o[rows of e] = hs[rows of e] · w2[e]ᵀ`` into ``[R, D]``.
5. combine (TVM): ``y[t] = Σ_j weights[t, j] · o[pos[t, j]]`` summed in j order, −1 skipped,
   fp32 accumulation, written in x's dtype — deterministic, no atomics, no index_add.

Used up to ``ROWS_TVM`` routed rows (decode / short prefill; token chunks keep every scratch
buffer under ``SCRATCH_BYTES``). Above, `_experts_torch`: per expert F.linear, silu·mul,
F.linear, index_add_ — measured level with the reference at the long-context shape (T=8192,
D=512, E=16, k=4, I=256; docs/performance.md, "cpu backend: norms, MoE ...").

Why torch GEMMs and no TVM grouped GEMM: the GEMMs are the whole cost at that shape and the
reference already runs them close to the fp32 matmul ceiling measured in the same bench run,
so a TIR GEMM could at best match oneDNN's sgemm (a TIR GEMM was not written or measured);
the issue's rule is "torch's own CPU kernels where they measure faster".

All stages compute in fp32 (x and, per expert, the weights of a bf16 call are widened to fp32
as the reference does: torch 2.13's bf16 CPU GEMM measured slower than widening + sgemm here);
only the combine's output is written in x's dtype (rounded to nearest even in-kernel).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.tvm.norm import VL, build_silu_mul
from glm5.kernels.tvm.tirlib import bits, cached, narrow, storage

REV = 1
DTYPES = (torch.float32, torch.bfloat16)
# Routed rows (T·k) up to which the TVM pipeline runs; above, `_experts_torch` (measured:
# docs/performance.md, "moe_experts").
ROWS_TVM = 1024
SCRATCH_BYTES = 16 * 2**20  # largest scratch buffer per token chunk (below glibc's mmap cap)
_TVM = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def build_combine(dt: str) -> Any:
    """``combine(o[R, D] fp32, pos[T, k] int32, w[T, k] fp32, y[T, D])``, y of dtype ``dt``."""
    from tvm.script import tirx as T

    sdt = storage(dt)

    @T.prim_func
    def combine(o_h: T.handle, p_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "combine", "tirx.noalias": True})
        R = T.int32()
        D = T.int32()
        Tn = T.int32()
        K = T.int32()
        O = T.match_buffer(o_h, (R, D), "float32")
        P = T.match_buffer(p_h, (Tn, K), "int32")
        W = T.match_buffer(w_h, (Tn, K), "float32")
        Y = T.match_buffer(y_h, (Tn, D), sdt)
        for t in T.parallel(Tn):
            acc = T.alloc_buffer((D,), "float32")
            for d in range(D):
                acc[d] = T.float32(0)
            for j in range(K):
                if P[t, j] >= 0:
                    for c in range(D // VL):
                        for ll in T.vectorized(VL):
                            acc[c * VL + ll] = acc[c * VL + ll] + W[t, j] * O[P[t, j], c * VL + ll]
                    for d in range(D // VL * VL, D):
                        acc[d] = acc[d] + W[t, j] * O[P[t, j], d]
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    Y[t, c * VL + ll] = narrow(T, acc[c * VL + ll], dt)
            for d in range(D // VL * VL, D):
                Y[t, d] = narrow(T, acc[d], dt)

    return combine


def build_module(dt: str) -> Any:
    import tvm

    return tvm.IRModule({"combine": build_combine(dt), "silu_mul": build_silu_mul("float32")})


def _fns(context: Callable[[], Any], dtype: torch.dtype) -> tuple[Callable, Callable]:
    dt = _TVM[dtype]
    key = {"dtype": dt, "vl": VL, "rev": REV}
    ctx = context()
    return tuple(cached(ctx, ("moe_experts", dt, s),
                        lambda s=s: ctx.kernel("moe_experts", key, lambda: build_module(dt), s))
                 for s in ("combine", "silu_mul"))


def route_rows(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The routed slots sorted by expert: (token of each row [R] int64, pos [T, k] int32 with
    −1 for skipped slots, rows per expert [E])."""
    T_, k = ids.shape
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, E)  # skipped slots sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E + 1)
    R = int(T_ * k - counts[E])
    rows = order[:R]
    pos = torch.full((T_ * k,), -1, dtype=torch.int32)
    pos[rows] = torch.arange(R, dtype=torch.int32)
    return rows // k, pos.view(T_, k), counts[:E].tolist()


def grouped_linear(xs: torch.Tensor, w: torch.Tensor, counts: list[int],
                   out: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = xs[rows of e] · w[e]ᵀ`` for each expert's contiguous run of rows."""
    a = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(xs[a: a + n], w[e].to(out.dtype).T, out=out[a: a + n])
            a += n
    return out


def moe_experts(context: Callable[[], Any], x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, D], ids [T, k] int (−1 skipped), weights [T, k], w13 [E, 2I, D], w2 [E, D, I]
    (x's dtype, fp32 or bf16) -> [T, D] in x's dtype.

    Tokens go through in chunks whose scratch buffers stay under ``SCRATCH_BYTES`` each:
    glibc serves larger blocks with fresh mmap()s, so every call would page-fault its buffers
    in again (docs/performance.md, moe_experts)."""
    T_, D = x.shape
    y = torch.empty(T_, D, dtype=x.dtype)
    if T_ == 0 or D == 0:
        return y
    k, I2 = ids.shape[1], w13.shape[1]
    if T_ * k > ROWS_TVM:
        return _experts_torch(x, ids, weights, w13, w2)
    chunk = max(1, SCRATCH_BYTES // (4 * max(k, 1) * max(D, I2, 1)))
    fns = _fns(context, x.dtype)
    wts = weights.to(torch.float32)
    for t0 in range(0, T_, chunk):
        t1 = min(T_, t0 + chunk)
        _experts_chunk(fns, x[t0:t1], ids[t0:t1], wts[t0:t1].contiguous(), w13, w2, y[t0:t1])
    return y


def _experts_torch(x, ids, weights, w13, w2) -> torch.Tensor:
    """Many routed rows: the GEMMs are the whole cost (the reference runs close to the
    measured fp32 matmul peak at T=8192), and every TVM call between two oneDNN GEMMs costs a
    thread-pool hand-over on a small machine, so the pipeline is torch's own: rows sorted by
    expert, per expert F.linear, silu·mul, F.linear and one index_add_ (fp32; deterministic:
    a serial scatter per expert, experts in order)."""
    import torch.nn.functional as F

    E, I = w13.shape[0], w13.shape[1] // 2
    f32 = torch.float32
    tok, pos, counts = route_rows(ids, E)
    slot = torch.argsort(torch.where(pos >= 0, pos, 2**31 - 1).reshape(-1).long())
    wflat = weights.to(f32).reshape(-1)[slot[: tok.shape[0]]]
    y = torch.zeros(x.shape, dtype=f32)
    xf = x.to(f32)
    a = 0
    for e, n in enumerate(counts):
        if n:
            t = tok[a: a + n]
            h = F.linear(xf[t], w13[e].to(f32))
            g = F.silu(h[:, :I]).mul_(h[:, I:])
            y.index_add_(0, t, F.linear(g, w2[e].to(f32)).mul_(wflat[a: a + n, None]))
            a += n
    return y.to(x.dtype)


def _experts_chunk(fns, x, ids, wts, w13, w2, y) -> None:
    combine, silu = fns
    E, I2 = w13.shape[0], w13.shape[1]
    tok, pos, counts = route_rows(ids, E)
    R = tok.shape[0]
    f32 = torch.float32
    xs = x.to(f32)[tok]
    h13 = torch.empty(R, I2, dtype=f32)
    hs = torch.empty(R, I2 // 2, dtype=f32)
    o = torch.empty(R, x.shape[1], dtype=f32)
    if R:
        grouped_linear(xs, w13, counts, h13)
        if I2:
            silu(h13, hs)
            grouped_linear(hs, w2, counts, o)
        else:
            o.zero_()
    combine(o, pos, wts, bits(y))


def _supports(x, ids, weights, w13, w2) -> bool:
    return (x.dtype in DTYPES and w13.dtype == x.dtype and w2.dtype == x.dtype
            and all(t.device.type == "cpu" for t in (x, ids, weights, w13, w2))
            and x.numel() < 2**31 and ids.numel() < 2**31 and w13.shape[1] % 2 == 0)


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    return [("moe_experts",
             lambda x, ids, weights, w13, w2: moe_experts(context, x, ids, weights, w13, w2),
             DTYPES, _supports)]
