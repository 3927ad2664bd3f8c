"""`topk_indices` for the cpu backend (docs/ops.md, DSA): the k largest finite scores per row,
descending, ties to the smaller index, −1 tail.

Per block of rows (the block's int64 keys stay under ``BLOCK_BYTES``):

1. keys (TVM, ``score_keys``): the fp32 score's bits mapped to an order-preserving int32 (±0.0
   both mapped to 0; negative scores with their 31 low bits flipped) in the high 32 bits,
   ``2**32 − 1 − s`` in the low 32 bits, so every key is distinct and the integer order *is*
   the op's order; non-finite scores get INT64_MIN (the keys of the fused `indexer_topk`);
2. selection of the ``min(k, S)`` largest keys, sorted: rows of at least ``RADIX_MIN`` scores go
   to the radix-select kernel of ``select.py`` ("tvm"); shorter rows to ``torch.topk`` on the
   keys ("torch:topk"; exact, the keys being distinct), because the radix passes clear a
   2048-bin histogram per row and pass, which costs more than a short row's partial sort;
3. decode (TVM, the fused indexer's ``decode``): ``s = 2**32 − 1 − low 32 bits``, INT64_MIN ->
   −1; columns past S stay −1.

bf16 / fp16 scores widen to fp32 exactly (on the host), so the order is theirs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.tvm import select
from glm5.kernels.tvm.indexer import build_decode
from glm5.kernels.tvm.tirlib import cached

REV = 1  # bump when the generated code changes (part of the build-cache key)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT64_MIN = -(2**63)
BLOCK_BYTES = 8 * 2**20  # int64 keys of one block of rows (and as much selection scratch)
RADIX_MIN = 1024  # row length from which the radix select beats torch.topk (measured below)
_LOW = 2**32 - 1  # the low 32 bits of a key: 2**32 - 1 - column


def build_keys() -> Any:
    """``score_keys(x[R, S] fp32, keys[R, S] int64)``."""
    from tvm.script import tirx as T

    @T.prim_func
    def score_keys(x_h: T.handle, k_h: T.handle):
        T.func_attr({"global_symbol": "score_keys", "tirx.noalias": True})
        R = T.int32()
        S = T.int32()
        # align=4: a block of rows is a view at any offset (TVM assumes 64-byte alignment)
        X = T.match_buffer(x_h, (R, S), "float32", align=4)
        K = T.match_buffer(k_h, (R, S), "int64")
        for r in T.parallel(R):
            for s in range(S):
                b = T.reinterpret("int32", X[r, s])
                u = T.if_then_else(X[r, s] == T.float32(0), 0,
                                   T.if_then_else(b < 0, T.bitwise_xor(b, 0x7FFFFFFF), b))
                K[r, s] = T.if_then_else(
                    T.isfinite(X[r, s]),
                    T.bitwise_or(T.shift_left(T.Cast("int64", u), T.int64(32)),
                                 T.int64(_LOW) - T.Cast("int64", s)),
                    T.min_value("int64"))

    return score_keys


def build_module() -> Any:
    import tvm

    return tvm.IRModule({"score_keys": build_keys(), "decode": build_decode()})


def _fns(context: Callable[[], Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    ctx = context()
    return tuple(cached(ctx, ("topk_indices", REV, s),
                        lambda s=s: ctx.kernel("topk_indices", {"rev": REV}, build_module, s))
                 for s in ("score_keys", "decode"))


def score_keys(context: Callable[[], Any], scores: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """scores [R, S] (fp32 / bf16 / fp16) -> distinct int64 keys [R, S] (into ``out`` when
    given) whose integer order is the op's order (score descending, ties to the smaller
    column); non-finite -> INT64_MIN."""
    keys = torch.empty(scores.shape, dtype=torch.int64) if out is None else out
    if keys.numel():
        _fns(context)[0](scores.to(torch.float32).contiguous(), keys)
    return keys


def path(S: int) -> str:
    """The selection `topk_indices` uses for rows of S scores."""
    return "tvm" if S >= RADIX_MIN else "torch:topk"


def topk_indices(context: Callable[[], Any], scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, S] -> idx [T, k] int32 (−1 where a row has fewer than k finite scores)."""
    T_, S = scores.shape
    idx = torch.full((T_, k), -1, dtype=torch.int32)
    kb = min(k, S)
    if T_ == 0 or kb == 0:
        return idx
    radix = path(S) == "tvm"
    decode = _fns(context)[1]
    rows = min(T_, max(1, BLOCK_BYTES // (8 * S)))
    keys = torch.empty(rows * S, dtype=torch.int64)  # scratch, viewed per block of rows
    if radix:
        pick = select.select_kernel(context)
        kp = select.pow2_at_least(kb)
        tmp = torch.empty(rows * S, dtype=torch.int64)
        best = torch.empty(rows * kp, dtype=torch.int64)
    for r0 in range(0, T_, rows):
        n = min(rows, T_ - r0)
        kb_ = score_keys(context, scores[r0: r0 + n], keys[: n * S].view(n, S))
        if radix:
            top = best[: n * kp].view(n, kp)
            pick(kb_, tmp[: n * S].view(n, S), top, kb, 1)
        else:
            top = torch.topk(kb_, kb, dim=1).values  # distinct keys: exact, sorted
        decode(top, idx, r0, kb)
    return idx


def _supports(scores, k) -> bool:
    return (scores.dtype in DTYPES and scores.device.type == "cpu" and scores.dim() == 2
            and min(k, scores.shape[1]) <= select.MAX_KP and scores.shape[1] < 2**31)


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    return [("topk_indices", lambda scores, k: topk_indices(context, scores, k), DTYPES,
             _supports)]
