"""w8a16 on bf16 x through torch's bf16 GEMM (oneDNN): a TVM pass dequantizes a block of
weight rows to bf16 into a reused scratch, ``W[n, k] = bf16(q[n, k] · s[n])`` (one fp32 product,
rounded to nearest even: the rounding the op's contract allows for a dequantized weight), and
``torch.nn.functional.linear`` multiplies x by it, one block of rows after the other.

On an AVX-512 BF16 CPU without AMX (AMD Zen 4/5) oneDNN's bf16 GEMM runs closer to the core's
``vdpbf16ps`` peak than the register-tiled GEMM of `quant_vgemm`, which widens the codes inside
its loop. Dequantizing first costs one pass over the codes, repaid from a few dozen rows on:
`quant.PATHS` says where (the measurements: docs/performance.md, "Numbers that used to live in
source comments").
The block is 4 MiB of bf16 (2^21 codes): it stays in L2/L3 between the dequantization and
the GEMM and is not a fresh allocation per call (`tirlib.scratch`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from glm5.kernels.tvm import tirlib
from glm5.kernels.tvm.tirlib import cached, narrow

REV = 1
BLOCK = 2**21  # codes per block of dequantized rows (4 MiB of bf16)
VEC = 64  # codes per vector step; a row's last K % VEC codes take scalar steps


def build() -> Any:
    """``deq(w[n, K] int8, s[n] fp32, out[n, K] uint16 bf16 bits, n, K)``."""
    from tvm.script import tirx as T

    @T.prim_func
    def deq(w_h: T.handle, s_h: T.handle, o_h: T.handle, n: T.int32, K: T.int32):
        T.func_attr({"global_symbol": "deq", "tirx.noalias": True})
        ws = T.int32()
        W = T.match_buffer(w_h, (n, K), "int8", strides=(ws, 1))
        S = T.match_buffer(s_h, (n,), "float32")
        O = T.match_buffer(o_h, (n, K), "uint16")
        for i in T.parallel(n):
            for k0 in range(K // VEC):
                for k in T.vectorized(VEC):
                    O[i, k0 * VEC + k] = narrow(
                        T, T.Cast("float32", W[i, k0 * VEC + k]) * S[i], "bfloat16")
            for k in range(K - K // VEC * VEC):
                kk = K // VEC * VEC + k
                O[i, kk] = narrow(T, T.Cast("float32", W[i, kk]) * S[i], "bfloat16")

    return deq


def _fn(context: Callable[[], Any]) -> Callable[..., Any]:
    ctx = context()
    return cached(ctx, ("w8a16_deq_bf16",), lambda: ctx.kernel(
        "w8a16_deq_bf16", {"rev": REV, "vec": VEC}, build, "deq"))


def dequantize_rows(context: Callable[[], Any], w_packed: torch.Tensor,
                    w_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """w8a16 codes w_packed [n, K] int8 (rows may be strided), w_scale [n] fp32 -> ``out``
    [n, K] bf16 (contiguous), ``bf16(code · scale)`` rounded to nearest even."""
    n, K = out.shape
    if n and K:
        _fn(context)(w_packed, w_scale.contiguous(), out.view(torch.uint16), n, K)
    return out


def gemm(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
         w_scale: torch.Tensor) -> torch.Tensor:
    """w8a16 on bf16 x [M, K]: canonical packed weight [N, K] int8 with scales [N] ->
    bf16 ``[M, N]`` without bias (y rounded once, by the GEMM; M, N, K > 0)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"glm5 quant_linear (onednn path): argument 'x' expected bfloat16, "
                         f"got {x.dtype}")
    M, K = x.shape
    N = w_packed.shape[0]
    rows = max(1, min(N, BLOCK // K))
    buf = tirlib.scratch("w8a16_bf16_rows", (rows, K), torch.bfloat16)
    scale = w_scale.to(torch.float32)
    x = x.contiguous()
    if rows == N:
        return F.linear(x, dequantize_rows(context, w_packed[:, :K], scale, buf))
    y = tirlib.fresh((M, N), torch.bfloat16)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        blk = dequantize_rows(context, w_packed[n0:n1, :K], scale[n0:n1], buf[: n1 - n0])
        y[:, n0:n1] = F.linear(x, blk)
    return y
