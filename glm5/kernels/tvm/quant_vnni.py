"""`quant_linear` for few rows on AVX-512 VNNI (detected at run time): GEMV kernels that read
the canonical packed weight once, straight into registers (no scratch, no repacking).

Activation schemes (w8a8, w4a8, w6a12) use ``vpdpbusd`` (64 byte products per instruction,
summed four at a time into 16 int32 lanes). Its first factor is unsigned, so the weight goes
in *biased*: ``w + 128`` (int8: the byte XOR 0x80), ``w + 8`` (an int4 nibble XOR 8),
``w + 32`` (an int6 field XOR 32); x goes in as signed int8 codes (w6a12's 12-bit codes as
two planes, ``q = 16·(q >> 4) + (q & 15)``). The bias is taken back out per lane:
``corr[m, g, lane] = bias · Σ x`` over the codes that lane saw, computed with x's codes by the
preparing pass (`build_prep`: the reference quantizer's codes, bit for bit). Lanes are then
exact integer partial sums of the op's group sums;
``acc += s_w[n, g] · float(lanes)`` in fp32, a horizontal sum per output, ``y = s_x[m] · acc``.

Per 64-byte load: int8 64 codes; int4 128 codes (low nibbles = even k, high = odd k: x is
laid out per 128 codes as its even then its odd codes); int6 16 units of 3 bytes, spread to
one 32-bit lane each by one byte permute (``vpermb``), the four 6-bit fields moved to the
lane's four bytes by one multishift (`int6_fields`). A row's last partial chunk is copied to a
zeroed local buffer first (x is zero there, so the padding adds nothing).

w8a16 (float activations): ``y = s_w[n] · Σ x · w_q`` in fp32 (int8 widened in registers, two
FMA chains per row and x row), the scale factored out as in the portable kernel.

Each step takes ``8 / MB`` weight rows against ``MB`` rows of x (1 or 4): every loaded x vector
serves all of them, and the accumulators stay in registers. Rows of x go in chunks of at most
``XCHUNK`` bytes, so x stays in L2 while the weight streams past. Only M, N, K are runtime
values.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.host_cpu import missing
from glm5.ir.quant_formats import GROUP, SCHEMES
from glm5.kernels.tvm import tirlib
from glm5.kernels.tvm.tirlib import bits, cached, storage, widen

REV = 1
CB = 64  # bytes per weight vector
BIAS = {8: 128, 4: 8, 6: 32}


def vnni_available() -> tuple[bool, str]:
    """(True, why) where the CPU has AVX-512 VNNI, BW and VBMI (/proc/cpuinfo flags)."""
    why = missing("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")
    return (False, why) if why else (True, "AVX-512 VNNI")


def _vals_per_vec(bits: int) -> int:
    """Codes of x consumed per 64-byte weight load (int6: 48 bytes = 64 codes)."""
    return {8: 64, 4: 128, 6: 64}[bits]


def _bytes_per_vec(bits: int) -> int:
    return {8: 64, 4: 64, 6: 48}[bits]


def _x_permutation(bits: int, Kv: int) -> torch.Tensor:
    """For position i of the x layout the K index it holds (int4: per 128 codes, even k then
    odd k; else natural order)."""
    k = torch.arange(Kv)
    if bits != 4:
        return k
    c, i = k // 128, k % 128
    return c * 128 + torch.where(i < 64, 2 * i, 2 * (i - 64) + 1)


# vpdpbusd's byte operands: <64 x i8> in recent LLVM (TVM 0.27 ships LLVM 22), <16 x i32> in
# older releases; the first that LLVM's verifier accepts is used (`_fn`)
BYTE_OPERANDS = ("int8x64", "int32x16")


def build(scheme: str, MB: int, bdt: str = BYTE_OPERANDS[0]) -> Any:
    """``qgemv(xq[P, Mp, Kv] int8, corr[Mp, G, 16] int32, w[N, Pk], sw[N, G], sx[Mp],
    y[Mp, N], K, mrows)`` for the activation schemes; ``qgemv(x[Mp, K] fp32, w[N, K], sw[N],
    y[Mp, N], K, mrows)`` for w8a16. Kv: K padded to whole weight vectors (x zero there);
    mrows: rows of x per L2-sized chunk (a multiple of MB); bdt: the type vpdpbusd's byte
    operands are passed as (`BYTE_OPERANDS`)."""
    from tvm.script import tirx as T

    sc = SCHEMES[scheme]
    wb = sc.weight_bits
    wdt = "int8" if wb == 8 else "uint8"
    NR = 8 // MB  # weight rows per step: NR·MB(·P) accumulator vectors in registers
    if sc.act_bits is None:
        return _build_fp(T, MB, NR)
    P = 2 if sc.act_bits == 12 else 1
    VV = _vals_per_vec(wb)  # x codes per weight vector
    BV = _bytes_per_vec(wb)
    # vectors per scale group (int4: one; int6: two; int8: all of K, one group)
    gvec = GROUP // VV if sc.grouped else 0
    def dp(acc: Any, u: Any, x: Any) -> Any:
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc,
                                       T.reinterpret(bdt, u), T.reinterpret(bdt, x))

    def i32(v: Any) -> Any:
        return T.broadcast(T.int32(v), 16)

    def wvecs(v: Any) -> list[Any]:
        return biased(T, v, wb)

    # x vectors (int8x64) per weight factor j: int4's odd codes follow its even ones
    def xvec(X: Any, p: Any, m: Any, v: Any, j: int) -> Any:
        return X[p, m, T.ramp(v * VV + 64 * j, 1, 64)]

    nf = 2 if wb == 4 else 1  # factors per weight vector

    def vlo(g: Any) -> Any:
        return g * gvec if gvec else 0

    def whole(g: Any, full: Any) -> Any:
        """Group g's vectors all inside the row (grouped schemes; w8a8 has one long group)."""
        return vlo(g) + gvec <= full if gvec else T.bool(False)

    def vhi(g: Any, nvec: Any) -> Any:
        return T.min((g + 1) * gvec, nvec) if gvec else nvec

    @T.macro
    def _step(W: Any, X: Any, iacc: Any, nn: Any, mb: Any, v: Any, N: Any) -> None:
        """Weight vector v of NR rows (whole, inside the row) against MB rows of x."""
        for r in T.unroll(NR):
            for p in T.unroll(P):
                for mi in T.unroll(MB):
                    iacc[r, p, mi, T.ramp(0, 1, 16)] = _chain(
                        dp, iacc[r, p, mi, T.ramp(0, 1, 16)],
                        wvecs(T.reinterpret("uint8x64", W[T.min(
                            nn * NR + r, N - 1), T.ramp(v * BV, 1, CB)])),
                        [xvec(X, p, mb * MB + mi, v, j) for j in range(nf)])

    @T.prim_func
    def qgemv(x_h: T.handle, c_h: T.handle, w_h: T.handle, s_h: T.handle, sx_h: T.handle,
              y_h: T.handle, K: T.int32, mrows: T.int32):
        T.func_attr({"global_symbol": "qgemv", "tirx.noalias": True})
        Mp = T.int32()
        Kv = T.int32()
        G = T.int32()
        N = T.int32()
        Pk = T.int32()
        X = T.match_buffer(x_h, (P, Mp, Kv), "int8")
        CORR = T.match_buffer(c_h, (Mp, G, 16), "int32")
        W = T.match_buffer(w_h, (N, Pk), wdt)
        SW = T.match_buffer(s_h, (N, G), "float32")
        SX = T.match_buffer(sx_h, (Mp,), "float32")
        Y = T.match_buffer(y_h, (Mp, N), "float32")
        nvec = Kv // VV
        full = T.min(nvec, (Pk - (CB - BV)) // BV)  # vectors whose 64-byte load is in the row
        # rows of x in chunks of `mrows` (a multiple of MB) that stay in L2 while every
        # weight row passes: x is read once per chunk, not once per weight row
        for mc in range((Mp + mrows - 1) // mrows):
            for nn in T.parallel((N + NR - 1) // NR):
                tail = T.alloc_buffer((NR, CB), "uint8", scope="local")
                iacc = T.alloc_buffer((NR, P, MB, 16), "int32", scope="local")
                facc = T.alloc_buffer((NR, MB, 16), "float32", scope="local")
                red = T.alloc_buffer((1,), "float32", scope="local")
                for mb in range(mc * mrows // MB, T.min(mc * mrows + mrows, Mp) // MB):
                    for r in T.unroll(NR):
                        for mi in T.unroll(MB):
                            facc[r, mi, T.ramp(0, 1, 16)] = T.broadcast(T.float32(0), 16)
                    for g in range(G):
                        for r in T.unroll(NR):
                            for p in T.unroll(P):
                                for mi in T.unroll(MB):
                                    iacc[r, p, mi, T.ramp(0, 1, 16)] = i32(0)
                        if whole(g, full):
                            # a whole group inside the row: its vectors unrolled
                            for vv in T.unroll(max(gvec, 1)):
                                _step(W, X, iacc, nn, mb, vlo(g) + vv, N)
                        else:
                            for v in range(vlo(g), vhi(g, nvec)):
                                if v < full:
                                    _step(W, X, iacc, nn, mb, v, N)
                                else:  # the last bytes of the row, zero padded
                                    for r in T.unroll(NR):
                                        for i in range(CB):
                                            tail[r, i] = T.if_then_else(
                                                v * BV + i < Pk,
                                                T.reinterpret("uint8", W[
                                                    T.min(nn * NR + r, N - 1),
                                                    T.min(v * BV + i, Pk - 1)]),
                                                T.uint8(0))
                                        for p in T.unroll(P):
                                            for mi in T.unroll(MB):
                                                iacc[r, p, mi, T.ramp(0, 1, 16)] = _chain(
                                                    dp, iacc[r, p, mi, T.ramp(0, 1, 16)],
                                                    wvecs(tail[r, T.ramp(0, 1, CB)]),
                                                    [xvec(X, p, mb * MB + mi, v, j)
                                                 for j in range(nf)])
                        for r in T.unroll(NR):
                            for mi in T.unroll(MB):
                                facc[r, mi, T.ramp(0, 1, 16)] = facc[r, mi, T.ramp(0, 1, 16)] + (
                                    T.broadcast(SW[T.min(nn * NR + r, N - 1), g], 16) * T.Cast(
                                        "float32x16", _combine(
                                            [iacc[r, p, mi, T.ramp(0, 1, 16)] for p in range(P)])
                                        - CORR[mb * MB + mi, g, T.ramp(0, 1, 16)]))
                    for r in T.unroll(NR):
                        if nn * NR + r < N:
                            for mi in T.unroll(MB):
                                red[0] = T.float32(0)
                                for ll in T.unroll(16):
                                    red[0] = red[0] + facc[r, mi, ll]
                                Y[mb * MB + mi, nn * NR + r] = SX[mb * MB + mi] * red[0]

    return qgemv


def biased(T: Any, v: Any, wb: int, lanes: int = 64) -> list[Any]:
    """The biased unsigned factors (uint8 x ``lanes`` each) of a loaded vector ``v`` of packed
    ``wb``-bit weights: int8 ``w + 128``; int4 its low nibbles (even k) then its high nibbles
    (odd k), ``w + 8`` each; int6 (64 lanes, the first 48 bytes count) the fields of
    `int6_fields`, ``w + 32``."""
    def u8(c: int) -> Any:
        return T.broadcast(T.uint8(c), lanes)

    if wb == 8:
        return [v ^ u8(0x80)]
    if wb == 4:
        return [(v & u8(15)) ^ u8(8), T.shift_right(v, u8(4)) ^ u8(8)]
    return [int6_fields(T, v) ^ u8(0x20)]


def int6_fields(T: Any, v: Any) -> Any:
    """uint8x64 ``v`` holding 16 int6 units (its first 48 bytes) -> uint8x64 whose byte
    4u + j is field j of unit u (0..63, two's complement code): one byte permute puts each
    unit in a 32-bit lane (``vpermb``), one multishift takes bits 6j..6j+7 of the lane into its
    byte j (``vpmultishiftqb``: AVX-512 VBMI), a mask keeps 6 bits."""
    idx = [b for u in range(16) for b in (3 * u, 3 * u + 1, 3 * u + 2, 3 * u + 2)]
    lane = T.ramp(T.uint8(0), T.uint8(1), 64)  # offset of byte b: 6·(b % 4) (+32: 2nd unit)
    ctl = ((lane & T.broadcast(T.uint8(3), 64)) * T.broadcast(T.uint8(6), 64)
           + (T.shift_right(lane, T.broadcast(T.uint8(2), 64)) & T.broadcast(T.uint8(1), 64))
           * T.broadcast(T.uint8(32), 64))
    f = T.call_llvm_pure_intrin("uint8x64", "llvm.x86.avx512.pmultishift.qb.512", ctl,
                                T.Shuffle([v], idx))
    return f & T.broadcast(T.uint8(0x3F), 64)


def _chain(dp: Callable, acc: Any, us: list[Any], xs: list[Any]) -> Any:
    for u, x in zip(us, xs):
        acc = dp(acc, u, x)
    return acc


def _combine(planes: list[Any]) -> Any:
    """int32 lanes of the planes of x combined exactly: w6a12's 16·hi + lo."""
    v = planes[0]
    for p in planes[1:]:
        v = v * 16 + p
    return v


def _build_fp(T: Any, MB: int, NR: int) -> Any:
    """w8a16: fp32 FMA GEMV; NR weight rows share each x vector, 2 chains of 16 lanes each."""

    @T.prim_func
    def qgemv(x_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle, K: T.int32,
              mrows: T.int32):
        T.func_attr({"global_symbol": "qgemv", "tirx.noalias": True})
        Mp = T.int32()
        Kv = T.int32()
        N = T.int32()
        X = T.match_buffer(x_h, (Mp, Kv), "float32")
        W = T.match_buffer(w_h, (N, K), "int8")
        SW = T.match_buffer(s_h, (N,), "float32")
        Y = T.match_buffer(y_h, (Mp, N), "float32")
        # rows of x in chunks of `mrows` (a multiple of MB) that stay in L2 while every
        # weight row passes: x is read once per chunk, not once per weight row
        for mc in range((Mp + mrows - 1) // mrows):
            for nn in T.parallel((N + NR - 1) // NR):
                facc = T.alloc_buffer((NR, MB, 2, 16), "float32", scope="local")
                red = T.alloc_buffer((1,), "float32", scope="local")
                for mb in range(mc * mrows // MB, T.min(mc * mrows + mrows, Mp) // MB):
                    for r in T.unroll(NR):
                        for mi in T.unroll(MB):
                            for j in T.unroll(2):
                                facc[r, mi, j, T.ramp(0, 1, 16)] = T.broadcast(T.float32(0), 16)
                    for c in range(K // 32):
                        for j in T.unroll(2):
                            for r in T.unroll(NR):
                                for mi in T.unroll(MB):
                                    facc[r, mi, j, T.ramp(0, 1, 16)] = facc[
                                        r, mi, j, T.ramp(0, 1, 16)] + X[
                                            mb * MB + mi, T.ramp(c * 32 + 16 * j, 1, 16)] * T.Cast(
                                        "float32x16", W[T.min(nn * NR + r, N - 1),
                                                        T.ramp(c * 32 + 16 * j, 1, 16)])
                    for r in T.unroll(NR):
                        if nn * NR + r < N:
                            for mi in T.unroll(MB):
                                red[0] = T.float32(0)
                                for k in range(K // 32 * 32, K):
                                    red[0] = red[0] + X[mb * MB + mi, k] * T.Cast(
                                        "float32", W[nn * NR + r, k])
                                for j in T.unroll(2):
                                    for ll in T.unroll(16):
                                        red[0] = red[0] + facc[r, mi, j, ll]
                                Y[mb * MB + mi, nn * NR + r] = SW[nn * NR + r] * red[0]

    return qgemv


def build_prep(scheme: str, dt: str) -> Any:
    """``prep(x[M, K], xq[P, Mp, Kv] int8, corr[Mp, G, 16] int32, sx[Mp], M, K)``: the
    reference's per-token codes (as `quant_amx.build_prep`), laid out for `build`'s kernel
    (zero padded), and the bias corrections of each lane."""
    from tvm.script import tirx as T

    sc = SCHEMES[scheme]
    wb = sc.weight_bits
    P = 2 if sc.act_bits == 12 else 1
    VV = _vals_per_vec(wb)
    qmax = float(sc.act_qmax)
    bias = BIAS[wb]
    gv = GROUP if sc.grouped else 0  # codes per scale group (0: one group)
    sdt = storage(dt)

    def pos(k: Any) -> Any:
        """Position of code k in the x layout (int4: even codes of 128 first)."""
        if wb != 4:
            return k
        return (k // 128) * 128 + T.if_then_else(k % 2 == 0, (k % 128) // 2,
                                                  64 + (k % 128) // 2)

    def grp(k: Any) -> Any:
        return k // gv if gv else 0

    @T.prim_func
    def prep(x_h: T.handle, xq_h: T.handle, c_h: T.handle, sx_h: T.handle, M: T.int32,
             K: T.int32):
        T.func_attr({"global_symbol": "prep", "tirx.noalias": True})
        Mp = T.int32()
        Kv = T.int32()
        G = T.int32()
        X = T.match_buffer(x_h, (M, K), sdt)
        XQ = T.match_buffer(xq_h, (P, Mp, Kv), "int8")
        CORR = T.match_buffer(c_h, (Mp, G, 16), "int32")
        SX = T.match_buffer(sx_h, (Mp,), "float32")
        for m in range(Mp):  # few rows: not worth waking the thread pool
            av = T.alloc_buffer((16,), "float32", scope="local")
            st = T.alloc_buffer((1,), "float32", scope="local")
            q = T.alloc_buffer((1,), "int32", scope="local")
            for p, k in T.grid(P, Kv):
                XQ[p, m, k] = T.int8(0)
            for g, ll in T.grid(G, 16):
                CORR[m, g, ll] = 0
            SX[m] = T.float32(1)
            if m < M:
                for ll in T.vectorized(16):
                    av[ll] = T.float32(0)
                for c in range(K // 16):
                    for ll in T.vectorized(16):
                        av[ll] = T.max(av[ll], T.abs(widen(T, X[m, c * 16 + ll], dt)))
                for k in range(K // 16 * 16, K):
                    av[0] = T.max(av[0], T.abs(widen(T, X[m, k], dt)))
                st[0] = T.float32(0)
                for ll in T.unroll(16):
                    st[0] = T.max(st[0], av[ll])
                st[0] = T.Select(st[0] > T.float32(0), st[0] / T.float32(qmax), T.float32(1))
                SX[m] = st[0]
                for k in range(K):
                    q[0] = T.Cast("int32", T.max(T.min(T.nearbyint(
                        widen(T, X[m, k], dt) / st[0]), T.float32(qmax)), T.float32(-qmax)))
                    if P == 1:
                        XQ[0, m, pos(k)] = T.Cast("int8", q[0])
                    else:
                        XQ[0, m, k] = T.Cast("int8", T.shift_right(q[0], 4))
                        XQ[1, m, k] = T.Cast("int8", q[0] & 15)
                    # lane of code k: bytes 4·lane..4·lane+3 of its 64-byte x vector
                    CORR[m, grp(k), (pos(k) % 64) // 4] = CORR[
                        m, grp(k), (pos(k) % 64) // 4] + bias * q[0]

    return prep


def first_operand_form(kernel: Callable[[str], Callable],
                       forms: tuple[str, ...] = BYTE_OPERANDS) -> Callable:
    """``kernel(form)`` built with the first of ``forms`` (default `BYTE_OPERANDS`, vpdpbusd's
    byte operands) that LLVM's verifier accepts for the intrinsic's operands."""
    for i, bdt in enumerate(forms):
        try:
            return kernel(bdt)
        except Exception as e:  # LLVM's verifier: the intrinsic's operand types differ
            if i + 1 == len(forms) or "does not match" not in str(e):
                raise
    raise AssertionError("unreachable")


def _fn(context: Callable[[], Any], scheme: str, mb: int) -> Callable:
    ctx = context()

    def get() -> Callable:
        if SCHEMES[scheme].act_bits is None:  # w8a16: no vpdpbusd
            return _kernel(ctx, scheme, mb, BYTE_OPERANDS[0])
        return first_operand_form(lambda bdt: _kernel(ctx, scheme, mb, bdt))

    return cached(ctx, ("quant_linear_vnni", scheme, mb), get)


def _kernel(ctx: Any, scheme: str, mb: int, bdt: str) -> Callable:
    key = {"scheme": scheme, "mb": mb, "bytes": bdt, "rev": REV}
    return ctx.kernel("quant_linear_vnni", key, lambda: build(scheme, mb, bdt), "qgemv",
                      mattr=("+avx512vnni", "+avx512bw", "+avx512vbmi"))


def _prep_fn(context: Callable[[], Any], scheme: str, dt: str) -> Callable:
    ctx = context()
    key = {"scheme": scheme, "dtype": dt, "rev": REV}
    return cached(ctx, ("quant_linear_vnni_prep", scheme, dt), lambda: ctx.kernel(
        "quant_linear_vnni_prep", key, lambda: build_prep(scheme, dt), "prep"))


XCHUNK = 2**19  # bytes of x kept in L2 while the weight streams past (`mrows`)


def _mrows(Mp: int, row_bytes: int, mb: int) -> int:
    """Rows of x per chunk: a multiple of mb, at most XCHUNK bytes (at least mb rows)."""
    return min(Mp, max(mb, XCHUNK // max(row_bytes, 1) // mb * mb))


def gemv_vnni(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
              w_scale: torch.Tensor, scheme: str, mb: int) -> torch.Tensor:
    """The VNNI GEMV path: fp32 ``[M, N]`` without bias (M, N, K > 0), ``mb`` rows of x per
    pass over a weight row (1 or 4)."""
    sc = SCHEMES[scheme]
    M, K = x.shape
    N = w_packed.shape[0]
    Mp = -(-M // mb) * mb
    y = tirlib.fresh((Mp, N), torch.float32)
    if sc.act_bits is None:
        xf = tirlib.scratch("xf", (Mp, K), torch.float32)
        xf[:M] = x
        xf[M:] = 0
        _fn(context, scheme, mb)(xf, w_packed.contiguous(), w_scale.to(torch.float32).contiguous(),
                                 y, K,
                                 _mrows(Mp, 4 * K, mb))
        return y[:M]
    VV = _vals_per_vec(sc.weight_bits)
    Kv = -(-K // VV) * VV
    P = 2 if sc.act_bits == 12 else 1
    G = w_scale.shape[1] if sc.grouped else 1
    xq = tirlib.scratch("xq", (P, Mp, Kv), torch.int8)
    corr = tirlib.scratch("corr", (Mp, G, 16), torch.int32)
    sx = tirlib.scratch("sx", (Mp,), torch.float32)
    dt = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    _prep_fn(context, scheme, dt)(bits(x.contiguous()), xq, corr, sx, M, K)
    sw = w_scale.to(torch.float32).reshape(N, G).contiguous()
    _fn(context, scheme, mb)(xq, corr, w_packed.contiguous(), sw, sx, y, K,
                             _mrows(Mp, P * Kv, mb))
    return y[:M]
