"""fp8 e4m3 rows for the cpu indexer, as bf16 (every value involved is exact in bf16).

`dequantized_rows`: rows of an fp8 key pool, ``out[i] = k[rows[i]] · scale[rows[i]]`` from e4m3
codes (``float8_e4m3fn`` [S, Di]) and one fp32 scale per row, written as bf16 bits.
`e4m3_rows`: rows of fp32 / bf16 values quantized per row exactly as `glm5.ir.fp8` does
(power-of-two scale from the row's amax, rounding to nearest even) and dequantized.

One TVM pass, vectorized over Di: each code's bits become its fp32 value by integer arithmetic
(normal codes: the exponent re-biased from 7 to 127 and the 3 mantissa bits moved up; codes
with exponent field 0 are subnormal, ``m · 2^-9``), times the row's scale. The product is exact
(a 4-bit significand times a power of two, as `glm5.ir.fp8` makes the scales), so its bf16 bits
are its fp32 bits' upper half: no rounding. torch's own float8 -> bf16 conversion took as
long as the indexer's selection over the codes (docs/performance.md). The NaN codes
(0x7F, 0xFF) are not mapped to NaN: `glm5.ir.fp8` makes them only from non-finite inputs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.tvm.tirlib import cached

REV = 2
ROUND_REV = 1


def build(Di: int) -> Any:
    """``deq(codes[S, Di] uint8, scale[S] fp32, rows[n] int64, out[n, Di] uint16, n)``."""
    from tvm.script import tirx as T

    def value(code: Any) -> Any:
        """An e4m3 code's fp32 value (inline expressions: a let-bound temporary in the
        vectorized loop miscompiled, every lane reading the same code)."""
        bi = T.Cast("int32", code)
        e = T.shift_right(bi, 3) & 15
        sign = T.shift_right(bi, 7)
        normal = T.reinterpret("float32", T.shift_left(sign, 31) | T.shift_left(e + 120, 23)
                               | T.shift_left(bi & 7, 20))
        sub = T.Cast("float32", bi & 7) * T.float32(2.0 ** -9) * T.Cast("float32", 1 - 2 * sign)
        return T.Select(e == 0, sub, normal)

    @T.prim_func
    def deq(c_h: T.handle, s_h: T.handle, r_h: T.handle, o_h: T.handle, n: T.int32):
        T.func_attr({"global_symbol": "deq", "tirx.noalias": True})
        S = T.int64()
        C = T.match_buffer(c_h, (S, Di), "uint8")
        SC = T.match_buffer(s_h, (S,), "float32")
        R = T.match_buffer(r_h, (n,), "int64")
        O = T.match_buffer(o_h, (n, Di), "uint16")
        for i in T.parallel(n):
            for d in T.vectorized(Di):
                O[i, d] = T.Cast("uint16", T.shift_right(T.reinterpret(
                    "uint32", value(C[R[i], d]) * SC[R[i]]), T.uint32(16)))

    return deq


def _fn(context: Callable[[], Any], Di: int) -> Callable:
    ctx = context()
    return cached(ctx, ("fp8_rows", Di), lambda: ctx.kernel(
        "fp8_rows", {"Di": Di, "rev": REV}, lambda: build(Di), "deq"))


def dequantized_rows(context: Callable[[], Any], codes: torch.Tensor, scale: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """codes [S, Di] float8_e4m3fn, scale [S] fp32, rows [n] int64 (each in [0, S)) ->
    [n, Di] bf16: ``codes[rows] · scale[rows]``, exact."""
    n, Di = rows.numel(), codes.shape[1]
    out = torch.empty(n, Di, dtype=torch.bfloat16)
    if n and Di:
        _fn(context, Di)(codes.contiguous().view(torch.uint8), scale.contiguous(),
                         rows.contiguous(), out.view(torch.uint16), n)
    return out


def build_roundtrip(Di: int, bf16_in: bool) -> Any:
    """``rt(x[n, Di] fp32 / bf16 bits, out[n, Di] uint16 bf16 bits, n)``: `glm5.ir.fp8`'s
    quantization, by fp32 bit arithmetic: the scale ``2^ceil(log2(max(amax, 1e-4) / 448))``
    from the quotient's exponent field (one up unless its mantissa bits are 0), then each
    ``y = x / s`` rounded to e4m3: to a multiple of ``2^(max(exponent(y), -6) - 3)``, ties to
    even (``nearbyint``), times s."""
    from tvm.script import tirx as T

    def val(X: Any, i: Any, d: Any) -> Any:
        if bf16_in:
            return T.reinterpret("float32", T.shift_left(T.Cast("uint32", X[i, d]),
                                                         T.uint32(16)))
        return X[i, d]

    def pow2(e: Any) -> Any:  # 2^e for an int32 e in the normal range
        return T.reinterpret("float32", T.shift_left(e + 127, 23))

    def rounded(y: Any) -> Any:
        ey = T.shift_right(T.reinterpret("int32", y), 23) & 255  # |y|'s biased exponent
        ulp = pow2(T.max(ey - 127, -6) - 3)
        return T.nearbyint(y / ulp) * ulp

    @T.prim_func
    def rt(x_h: T.handle, o_h: T.handle, n: T.int32):
        T.func_attr({"global_symbol": "rt", "tirx.noalias": True})
        X = T.match_buffer(x_h, (n, Di), "uint16" if bf16_in else "float32")
        O = T.match_buffer(o_h, (n, Di), "uint16")
        for i in T.parallel(n):
            amax = T.alloc_buffer((1,), "float32", scope="local")
            sc = T.alloc_buffer((1,), "float32", scope="local")
            amax[0] = T.float32(1e-4)
            for d in range(Di):
                amax[0] = T.max(amax[0], T.fabs(val(X, i, d)))
            r = amax[0] / T.float32(448.0)
            # ceil(log2 r): the exponent, one more unless r is a power of two
            sc[0] = pow2(T.shift_right(T.reinterpret("int32", r), 23) - 127 + T.Select(
                (T.reinterpret("int32", r) & 0x7FFFFF) == 0, 0, 1))
            for d in T.vectorized(Di):
                O[i, d] = T.Cast("uint16", T.shift_right(T.reinterpret(
                    "uint32", rounded(val(X, i, d) / sc[0]) * sc[0]), T.uint32(16)))

    return rt


def e4m3_rows(context: Callable[[], Any], x: torch.Tensor) -> torch.Tensor:
    """x [..., Di] fp32 / bf16 -> `glm5.ir.fp8.e4m3_rows(x)` as bf16 (exact), one TVM pass."""
    Di = x.shape[-1]
    bf = x.dtype == torch.bfloat16
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"glm5 cpu e4m3_rows: argument 'x' expected float32 or bfloat16, got "
                         f"{x.dtype}")
    flat = x.reshape(-1, Di).contiguous()
    out = torch.empty(flat.shape, dtype=torch.bfloat16)
    if flat.numel():
        ctx = context()
        fn = cached(ctx, ("fp8_roundtrip", Di, bf), lambda: ctx.kernel(
            "fp8_roundtrip", {"Di": Di, "bf16": bf, "rev": ROUND_REV},
            lambda: build_roundtrip(Di, bf), "rt"))
        fn(flat.view(torch.uint16) if bf else flat, out.view(torch.uint16), flat.shape[0])
    return out.view(x.shape)
