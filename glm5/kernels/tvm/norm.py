"""TVM (llvm, host CPU) kernels for `rms_norm`, `layer_norm`, `rope` and `silu_mul` (docs/ops.md,
normalisation).

Loop-level TensorIR, one work item per row (``T.parallel``), fp32 math in registers. Each
kernel has a second build with the row loop ``T.serial`` (otherwise the same TIR, so the same
bits), which calls on fewer than ``tirlib.SERIAL_MAX[op]`` elements take: there, waking TVM's
thread pool costs more than the rows' work (`tirlib.serial`).

* rms_norm: ``x[N, D]`` (leading dims flattened) — sum of squares in ``VL`` fp32 lanes plus a
  scalar tail, one horizontal sum, ``r = 1 / sqrt(mean + eps)``, then ``y = (x · r) · w`` (the
  reference's order) vectorised the same way. ``w`` goes in as fp32.
* layer_norm: ``x[N, D]`` — two passes for the moments (the mean, then the sum of squared
  deviations from it: no cancellation when the mean is large against the spread, where
  E[x²] − mean² loses every digit), ``r = 1 / sqrt(var + eps)``, then
  ``y = ((x − mean) · r) · w + b``. ``w`` and ``b`` go in as fp32.
* rope: ``x[T, H, R]`` (middle dims flattened to H, 1 when absent), ``cos``/``sin[T, R/2]`` fp32.
  NeoX pairs ``(x[i], x[i + R/2])`` are two contiguous vectors; interleaved pairs
  ``(x[2i], x[2i+1])`` are handled VL/2 pairs at a time: ``y[r] = x[r]·c2[r] + x[r^1]·s2[r]``
  with per-lane tables ``c2``/``s2`` [T, R] built on the host (sin negated on even lanes) and
  ``x[r^1]`` a lane blend of the contiguous vectors at ``r+1`` and ``r-1``.
* silu_mul: ``x[N, 2I] -> [N, I]``, ``silu(a) = a / (1 + exp(-a))`` with a vectorisable
  polynomial exp (``fexp``: Cephes expf, ~2 ulp).

Every length (rows, D, R, I) is symbolic: one build per (op, dtype[, interleaved]) serves any
shape. bf16 is bound as its uint16 bits (a free view) and widened with a shift; the output is
rounded to nearest even in-kernel (``widen`` / ``narrow`` from ``tirlib``, shared by the other
cpu kernels of this package). Vectors are ``VL = 16`` fp32 lanes: one AVX-512 register, or two
AVX2 registers on an AVX2-only host (the llvm target TVM detects at run time).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from glm5.kernels.tvm.tirlib import bits, cached, fexp, narrow, serial, storage, widen

REV = 3  # bump when the generated code changes (part of the build-cache key)
VL = 16  # fp32 lanes per vector (one AVX-512 / two AVX2 registers)
DTYPES = (torch.float32, torch.bfloat16)
_TVM = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
ALIGN = {"float32": 4, "bfloat16": 2}  # bytes of one element (see build_layer_norm)


# --------------------------------------------------------------------------- builders
def build_rms_norm(dt: str, serial: bool = False) -> Any:
    from tvm.script import tirx as T

    sdt = storage(dt)
    rows = T.serial if serial else T.parallel  # the row loop (see `serial`)

    @T.prim_func
    def rms_norm(x_h: T.handle, w_h: T.handle, y_h: T.handle, eps: T.float32):
        T.func_attr({"global_symbol": "rms_norm", "tirx.noalias": True})
        N = T.int32()
        D = T.int32()
        X = T.match_buffer(x_h, (N, D), sdt)
        W = T.match_buffer(w_h, (D,), "float32")
        Y = T.match_buffer(y_h, (N, D), sdt)
        for n in rows(N):
            acc = T.alloc_buffer((VL,), "float32", scope="local")
            tot = T.alloc_buffer((1,), "float32", scope="local")
            for ll in T.vectorized(VL):
                acc[ll] = T.float32(0)
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    acc[ll] = acc[ll] + widen(T, X[n, c * VL + ll], dt) * widen(
                        T, X[n, c * VL + ll], dt)
            tot[0] = T.float32(0)
            for ll in T.unroll(VL):
                tot[0] = tot[0] + acc[ll]
            for j in range(D % VL):
                tot[0] = tot[0] + widen(T, X[n, D // VL * VL + j], dt) * widen(
                    T, X[n, D // VL * VL + j], dt)
            r = T.float32(1) / T.sqrt(tot[0] / T.Cast("float32", D) + eps)
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    Y[n, c * VL + ll] = narrow(
                        T, widen(T, X[n, c * VL + ll], dt) * r * W[c * VL + ll], dt)
            for j in range(D % VL):
                Y[n, D // VL * VL + j] = narrow(
                    T, widen(T, X[n, D // VL * VL + j], dt) * r * W[D // VL * VL + j], dt)

    return rms_norm


def build_layer_norm(dt: str, serial: bool = False) -> Any:
    from tvm.script import tirx as T

    sdt = storage(dt)
    rows = T.serial if serial else T.parallel  # the row loop (see `serial`)

    @T.prim_func
    def layer_norm(x_h: T.handle, w_h: T.handle, b_h: T.handle, y_h: T.handle,
                   eps: T.float32):
        T.func_attr({"global_symbol": "layer_norm", "tirx.noalias": True})
        N = T.int32()
        D = T.int32()
        # align: element alignment only. Weights read from a checkpoint, and row views, need
        # not start on the 64-byte boundary TVM assumes by default (its aligned vector loads
        # then fault).
        X = T.match_buffer(x_h, (N, D), sdt, align=ALIGN[dt])
        W = T.match_buffer(w_h, (D,), "float32", align=4)
        B = T.match_buffer(b_h, (D,), "float32", align=4)
        Y = T.match_buffer(y_h, (N, D), sdt, align=ALIGN[dt])
        for n in rows(N):
            acc = T.alloc_buffer((VL,), "float32", scope="local")
            tot = T.alloc_buffer((2,), "float32", scope="local")  # mean, then 1/std
            # pass 1: the mean
            for ll in T.vectorized(VL):
                acc[ll] = T.float32(0)
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    acc[ll] = acc[ll] + widen(T, X[n, c * VL + ll], dt)
            tot[0] = T.float32(0)
            for ll in T.unroll(VL):
                tot[0] = tot[0] + acc[ll]
            for j in range(D % VL):
                tot[0] = tot[0] + widen(T, X[n, D // VL * VL + j], dt)
            tot[0] = tot[0] / T.Cast("float32", D)
            # pass 2: the variance, as the mean of squared deviations
            for ll in T.vectorized(VL):
                acc[ll] = T.float32(0)
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    acc[ll] = acc[ll] + (widen(T, X[n, c * VL + ll], dt) - tot[0]) * (
                        widen(T, X[n, c * VL + ll], dt) - tot[0])
            tot[1] = T.float32(0)
            for ll in T.unroll(VL):
                tot[1] = tot[1] + acc[ll]
            for j in range(D % VL):
                tot[1] = tot[1] + (widen(T, X[n, D // VL * VL + j], dt) - tot[0]) * (
                    widen(T, X[n, D // VL * VL + j], dt) - tot[0])
            tot[1] = T.float32(1) / T.sqrt(tot[1] / T.Cast("float32", D) + eps)
            # pass 3: normalise, scale, shift
            for c in range(D // VL):
                for ll in T.vectorized(VL):
                    Y[n, c * VL + ll] = narrow(
                        T, (widen(T, X[n, c * VL + ll], dt) - tot[0]) * tot[1] * W[c * VL + ll]
                        + B[c * VL + ll], dt)
            for j in range(D % VL):
                Y[n, D // VL * VL + j] = narrow(
                    T, (widen(T, X[n, D // VL * VL + j], dt) - tot[0]) * tot[1]
                    * W[D // VL * VL + j] + B[D // VL * VL + j], dt)

    return layer_norm


def build_rope(dt: str, interleaved: bool, serial: bool = False) -> Any:
    from tvm.script import tirx as T

    sdt = storage(dt)
    rows = T.serial if serial else T.parallel  # the row loop (see `serial`)

    if interleaved:
        # C2/S2 [T, R]: cos/sin repeated per lane pair, S2 signed (-sin on even lanes), so
        # y[r] = x[r]·C2[r] + x[r ^ 1]·S2[r], and x[r ^ 1] is a blend of the two shifted
        # contiguous vectors x[r + 1] / x[r - 1]. Both are loaded whole: the first and last
        # row of the tensor (whose shifted vectors would step outside it) take the scalar path.
        @T.prim_func
        def rope(x_h: T.handle, c_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": "rope", "tirx.noalias": True})
            Tn = T.int32()
            H = T.int32()
            R = T.int32()
            X = T.match_buffer(x_h, (Tn, H, R), sdt)
            C = T.match_buffer(c_h, (Tn, R), "float32")
            S = T.match_buffer(s_h, (Tn, R), "float32")
            Y = T.match_buffer(y_h, (Tn, H, R), sdt)
            for p in rows(Tn * H):
                t = p // H
                h = p % H
                # rows whose shifted vectors stay inside the tensor: whole vectors first
                inner = p > 0 and p < Tn * H - 1
                if inner:
                    for c in range(R // VL):
                        for ll in T.vectorized(VL):
                            Y[t, h, c * VL + ll] = narrow(
                                T, widen(T, X[t, h, c * VL + ll], dt) * C[t, c * VL + ll]
                                + T.Select(ll % 2 == 0, widen(T, X[t, h, c * VL + ll + 1], dt),
                                           widen(T, X[t, h, c * VL + ll - 1], dt))
                                * S[t, c * VL + ll], dt)
                # the pairs left (all of them on the first and last row), one at a time
                for i in range(T.Select(inner, R // VL * (VL // 2), 0), R // 2):
                    Y[t, h, 2 * i] = narrow(T, widen(T, X[t, h, 2 * i], dt) * C[t, 2 * i]
                                            + widen(T, X[t, h, 2 * i + 1], dt)
                                            * S[t, 2 * i], dt)
                    Y[t, h, 2 * i + 1] = narrow(
                        T, widen(T, X[t, h, 2 * i + 1], dt) * C[t, 2 * i + 1]
                        + widen(T, X[t, h, 2 * i], dt) * S[t, 2 * i + 1], dt)
    else:
        @T.prim_func
        def rope(x_h: T.handle, c_h: T.handle, s_h: T.handle, y_h: T.handle):
            T.func_attr({"global_symbol": "rope", "tirx.noalias": True})
            Tn = T.int32()
            H = T.int32()
            R2 = T.int32()
            X = T.match_buffer(x_h, (Tn, H, R2 * 2), sdt)
            C = T.match_buffer(c_h, (Tn, R2), "float32")
            S = T.match_buffer(s_h, (Tn, R2), "float32")
            Y = T.match_buffer(y_h, (Tn, H, R2 * 2), sdt)
            for p in rows(Tn * H):
                t = p // H
                h = p % H
                for c in range(R2 // VL):
                    for ll in T.vectorized(VL):
                        Y[t, h, c * VL + ll] = narrow(
                            T, widen(T, X[t, h, c * VL + ll], dt) * C[t, c * VL + ll]
                            - widen(T, X[t, h, R2 + c * VL + ll], dt) * S[t, c * VL + ll], dt)
                        Y[t, h, R2 + c * VL + ll] = narrow(
                            T, widen(T, X[t, h, R2 + c * VL + ll], dt) * C[t, c * VL + ll]
                            + widen(T, X[t, h, c * VL + ll], dt) * S[t, c * VL + ll], dt)
                for i in range(R2 // VL * VL, R2):
                    a = widen(T, X[t, h, i], dt)
                    b = widen(T, X[t, h, R2 + i], dt)
                    Y[t, h, i] = narrow(T, a * C[t, i] - b * S[t, i], dt)
                    Y[t, h, R2 + i] = narrow(T, b * C[t, i] + a * S[t, i], dt)

    return rope


def build_silu_mul(dt: str, serial: bool = False) -> Any:
    from tvm.script import tirx as T

    sdt = storage(dt)
    rows = T.serial if serial else T.parallel  # the row loop (see `serial`)

    @T.prim_func
    def silu_mul(x_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "silu_mul", "tirx.noalias": True})
        N = T.int32()
        I = T.int32()
        X = T.match_buffer(x_h, (N, I * 2), sdt)
        Y = T.match_buffer(y_h, (N, I), sdt)
        for n in rows(N):
            for c in range(I // VL):
                for ll in T.vectorized(VL):
                    Y[n, c * VL + ll] = narrow(
                        T, widen(T, X[n, c * VL + ll], dt)
                        / (T.float32(1) + fexp(T, -widen(T, X[n, c * VL + ll], dt)))
                        * widen(T, X[n, I + c * VL + ll], dt), dt)
            for i in range(I // VL * VL, I):
                Y[n, i] = narrow(T, widen(T, X[n, i], dt)
                                 / (T.float32(1) + fexp(T, -widen(T, X[n, i], dt)))
                                 * widen(T, X[n, I + i], dt), dt)

    return silu_mul


def _fn(context: Callable[[], Any], op: str, dtype: torch.dtype, build: Callable[[], Any],
        **key: Any) -> Callable[..., Any]:
    ctx = context()
    k = {"dtype": _TVM[dtype], "vl": VL, "rev": REV, **key}
    return cached(ctx, (op, _TVM[dtype], tuple(sorted(key.items()))),
                  lambda: ctx.kernel(op, k, build, op))


# --------------------------------------------------------------------------- the ops
def rms_norm(context: Callable[[], Any], x: torch.Tensor, weight: torch.Tensor,
             eps: float) -> torch.Tensor:
    """x [..., D] fp32/bf16, weight [D] -> [..., D] in x's dtype (fp32 math)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    if x2.numel():
        s = serial("rms_norm", x2.numel())
        fn = _fn(context, "rms_norm", x.dtype, lambda: build_rms_norm(_TVM[x.dtype], s),
                 serial=s)
        fn(bits(x2), weight.to(torch.float32).contiguous(), bits(y), float(eps))
    return y.view(x.shape)


def layer_norm(context: Callable[[], Any], x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] fp32/bf16, weight / bias [D] -> [..., D] in x's dtype (fp32 math)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2)
    if x2.numel():
        s = serial("layer_norm", x2.numel())
        fn = _fn(context, "layer_norm", x.dtype, lambda: build_layer_norm(_TVM[x.dtype], s),
                 serial=s)
        fn(bits(x2), weight.to(torch.float32).contiguous(), bias.to(torch.float32).contiguous(),
           bits(y), float(eps))
    return y.view(x.shape)


def rope(context: Callable[[], Any], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         interleaved: bool) -> torch.Tensor:
    """x [T, ..., R] fp32/bf16, cos/sin [T, R/2] -> like x."""
    T_, R = x.shape[0], x.shape[-1]
    x3 = x.reshape(T_, -1, R).contiguous() if x.numel() else x.reshape(T_, 0, R)
    y = torch.empty_like(x3)
    if x3.numel():
        s = serial("rope", x3.numel())
        fn = _fn(context, "rope", x.dtype,
                 lambda: build_rope(_TVM[x.dtype], bool(interleaved), s),
                 interleaved=bool(interleaved), serial=s)
        c, s = _lane_tables(cos, sin) if interleaved else (
            cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous())
        fn(bits(x3), c, s, bits(y))
    return y.view(x.shape)


_tables = threading.local()


def _lane_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The interleaved kernel's per-lane tables [T, R] fp32 (see build_rope): cos repeated per
    lane pair, sin likewise with -sin on even lanes. A forward passes the same cos / sin to
    every layer's ropes (a dozen calls a decode step), so the last pair's tables are kept
    (per thread) and reused while both tensors are the same objects, unmodified (their
    version counters unchanged). Inference tensors have no version counter: theirs are
    built on every call."""
    track = not (cos.is_inference() or sin.is_inference())
    key = (cos._version, sin._version) if track else None
    last = getattr(_tables, "last", None)
    if track and last is not None and last[0] is cos and last[1] is sin and last[2] == key:
        return last[3], last[4]
    c = cos.to(torch.float32).repeat_interleave(2, dim=-1)
    s = sin.to(torch.float32).repeat_interleave(2, dim=-1)
    s[..., 0::2].neg_()
    _tables.last = (cos, sin, key, c, s) if track else None
    return c, s


def silu_mul(context: Callable[[], Any], x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] fp32/bf16 -> [..., I]."""
    I = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I).contiguous()
    y = torch.empty(x2.shape[0], I, dtype=x.dtype)
    if y.numel():
        s = serial("silu_mul", x2.numel())
        fn = _fn(context, "silu_mul", x.dtype, lambda: build_silu_mul(_TVM[x.dtype], s),
                 serial=s)
        fn(bits(x2), bits(y))
    return y.view(*x.shape[:-1], I)


def _cpu(*ts: Any) -> bool:
    return all(t.device.type == "cpu" for t in ts if isinstance(t, torch.Tensor))


def _small(x: torch.Tensor) -> bool:
    """Row and element counts fit the kernels' int32 indexing."""
    return x.numel() < 2**31


def _rms_supports(x, weight, eps) -> bool:
    return (x.dtype in DTYPES and weight.dtype in DTYPES + (torch.float64,) and _cpu(x, weight)
            and x.dim() >= 1 and _small(x))


def _layer_norm_supports(x, weight, bias, eps) -> bool:
    return (x.dtype in DTYPES and weight.dtype in DTYPES + (torch.float64,)
            and bias.dtype in DTYPES + (torch.float64,) and _cpu(x, weight, bias)
            and x.dim() >= 1 and _small(x))


def _rope_supports(x, cos, sin, interleaved) -> bool:
    return (x.dtype in DTYPES and cos.dtype in DTYPES and sin.dtype in DTYPES
            and _cpu(x, cos, sin) and x.dim() >= 2 and x.shape[-1] % 2 == 0 and _small(x))


def _silu_supports(x) -> bool:
    return x.dtype in DTYPES and _cpu(x) and x.dim() >= 1 and x.shape[-1] % 2 == 0 and _small(x)


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    return [
        ("rms_norm", lambda x, weight, eps: rms_norm(context, x, weight, eps), DTYPES,
         _rms_supports),
        ("layer_norm", lambda x, weight, bias, eps: layer_norm(context, x, weight, bias, eps),
         DTYPES, _layer_norm_supports),
        ("rope", lambda x, cos, sin, interleaved: rope(context, x, cos, sin, interleaved),
         DTYPES, _rope_supports),
        ("silu_mul", lambda x: silu_mul(context, x), DTYPES, _silu_supports),
    ]
