"""`quant_linear` for many rows on AVX-512 VNNI CPUs without AMX (Zen 4 / Zen 5, Ice Lake):
a register-blocked ``vpdpbusd`` GEMM for the activation schemes (w8a8, w4a8, w6a12) and a
``vdpbf16ps`` one for w8a16 (where the CPU has AVX-512 BF16: Zen 4 / Zen 5).

The VNNI GEMV (`quant_vnni`) reads each weight byte once but holds only one to four rows of x
against a weight vector; with hundreds of rows it reloads x for every weight row and runs at
a fraction of the dot-product units. This kernel computes ``Yᵀ = W · Xᵀ`` in register tiles of
``NR`` weight rows x ``16·MV`` rows of x (`_tile`):

* x is the AMX path's tile layout in its *unsigned* form (`quant_amx.activations`: the
  reference quantizer's codes, bit for bit, plane 0 + 128; w6a12 as two int8 planes
  ``q = 16·(q >> 4) + (q & 15)``, the low one unsigned already): one 64-byte vector holds 4
  consecutive codes of 16 rows, ``vpdpbusd``'s unsigned operand;
* the weight rows of a task are unpacked once per call into a per-thread scratch (up to
  ``SCRATCH`` bytes, L2-resident) as signed int8 codes (int4 as each 64-code chunk's even
  then odd codes, like x), group-major (one group of all the task's rows is one contiguous
  run); the step broadcasts 4 codes of a weight row to all 16 lanes, so one instruction does
  64 products of one weight row against 16 rows of x and no weight is transposed;
* x's bias comes back out exactly: plane 0's accumulators start at ``-128 · Σ w`` over the
  group (summed per weight row at unpacking), so every int32 lane is the op's exact integer
  group sum; then ``acc += s_w[n, g] · float(isum)`` and ``y = s_x[m] · acc``. w8a8 (one scale
  per channel) adds its sums in int32 over all of K and converts once, as the reference does
  (the lanes wrap modulo 2^32 like the op's exact sum, which fits: no overflow is possible);
* loops run group-major: one group of a 16·MV-row block of x stays in L1 while the weight
  rows of the task pass (QB register tiles at a time), the running sums in a per-thread
  buffer; outputs leave 16 x 16 at a time, transposed in registers (`tirlib.butterfly`),
  as contiguous runs of y's rows.

w8a16 on bf16 x (``op="bf16"``) runs the same loops on bf16 operands: x is `activations`'
bf16 plane (2 values of 16 rows per int32; rows scaled by a power of two first, undone in
``s_x``), the weight codes are unpacked as bf16 (an int8 is exact in bf16), and ``vdpbf16ps``
adds two exact products per lane to fp32 accumulators: fp32 accumulation of exact products,
the scale applied to the sum. TVM 0.27 cannot emit ``vdpbf16ps`` itself (`tirlib.dpbf16`: the
kernel is written with a stand-in that its LLVM IR is rewritten from). w8a16 on fp32 x
(``op="f32"``, any AVX-512 CPU): x's values themselves in the tile layout (`f32_tiles`: one
value of 16 rows per lane group), the codes unpacked as fp32, one fused multiply-add per
weight and 16 rows (``llvm.fma``), fp32 sums over passes of 128 K values, the scale applied
to the sum, as the GEMV does. (The AMX path's exact three-plane split of fp32 x into bf16 ran
slower than the GEMV on a VNNI host; these FMAs do 16 products per instruction against
``vdpbf16ps``'s 32, but the three planes needed 3 instructions per 32.)

Each parallel work item is one TVM worker with its own scratch slot, running its contiguous
share of tasks (``nsub`` blocks of NR weight rows x a share of the row blocks of x). M, N and
K are runtime values: one build per (weight width, planes, grouped, tile, op).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.host_cpu import missing
from glm5.ir.quant_formats import GROUP, SCHEMES
from glm5.kernels.tvm import tirlib
from glm5.kernels.tvm.quant_amx import CHUNK, activations, op_planes, tvm_threads
from glm5.kernels.tvm.quant_vnni import BIAS, BYTE_OPERANDS, biased, first_operand_form
from glm5.kernels.tvm.tirlib import (
    BF16_OPERANDS,
    UNITS,
    WORD_OPERANDS,
    butterfly,
    cached,
    dpbf16,
    dpbf16_ir,
    unpack_code,
)

REV = 1
# w8a16 on fp32 x: NR weight rows x MV vectors of 16 rows of x (12 fp32 accumulators; four
# other shapes measured within noise or slower: docs/performance.md)
TILE_F32 = (3, 4)
SCRATCH = 1310720  # bytes of unpacked weight rows per parallel task (L2-resident)
QB = 16  # NR-row blocks whose running sums (QB·NR·MV vectors) stay in L1 across the groups
# w8a8's chunks per pass over x (its int32 sums need no groups: vpdpbusd wraps, so the lanes
# are exact modulo 2^32, hence exact, as the op's |Σ x·w| <= K·127² < 2^31 (supports check))
INT_CHUNKS = 8
BF_CHUNKS = 4  # w8a16's chunks (32 K values each) per pass over x
F32_CHUNKS = 8  # w8a16 on fp32 x: chunks (16 K values each) per pass over x
MATTR = ("+avx512vnni", "+avx512bw", "+avx512vbmi")
F32_MATTR = ("+avx512f",)
BF_MATTR = ("+avx512bf16", "+avx512bw")


def _gch(grouped: bool, op: str = "i8") -> int:
    """Chunks per group: a scale group (128 codes), or w8a8's / w8a16's pass over x."""
    if op == "bf16":
        return BF_CHUNKS
    if op == "f32":
        return F32_CHUNKS
    return GROUP // CHUNK if grouped else INT_CHUNKS


def _tile(P: int, op: str = "i8") -> tuple[int, int]:
    """(NR weight rows, MV vectors of 16 rows of x) per register tile: NR·MV·P int32
    accumulators (bf16: NR·MV·min(P, 2) fp32), and the x vectors LLVM loads a few steps ahead,
    within the 32 zmm registers; the accumulator buffer must stay under TVM's 1 KiB stack
    allocation (a larger one goes to the heap, out of registers). Measured against 6-9 other
    shapes each on Zen 5 (docs/performance.md): the best, or within noise of it."""
    if op == "bf16":
        return (3, 4)
    if op == "f32":
        return TILE_F32
    return (4, 3) if P == 1 else (2, 3)


def bf16_available() -> tuple[bool, str]:
    """(True, why) where the CPU has AVX-512 BF16 (``vdpbf16ps``: w8a16 on this GEMM)."""
    why = missing("avx512f", "avx512bw", "avx512_bf16")
    return (False, why) if why else (True, "AVX-512 BF16")


def build(bits: int, P: int, grouped: bool, bdt: str = BYTE_OPERANDS[0], op: str = "i8"
          ) -> Any:
    """``qgemm(xw[P, Mt, NC, 16, 16] int32, w[N, Pk], sw[N, G], sx[Mt·16], y[M, N],
    scr[nth, NG, NR·nsub, gch·16] int32, ws[nth, NR·nsub, NG] int32,
    acc[nth, NRP, MV, 16] fp32, M, K, nsub, msplit)``: xw = `activations`' tile layout, NG the
    groups of gch = `_gch` chunks of K, NRP the task's weight rows rounded up to 16; scr, ws,
    acc: per-thread scratch. ``op`` "i8": the activation schemes, x's unsigned form (4 codes of
    16 rows per int32), ``vpdpbusd``; "bf16": w8a16 on bf16 x, its bf16 plane (2 values of 16
    rows per int32), the codes as bf16 (exact), ``vdpbf16ps``; "f32": w8a16 on fp32 x
    (`f32_tiles`: 1 value of 16 rows per int32's bits), the codes as fp32, FMAs. bf16 / f32:
    P = 1, ws unused."""
    from tvm.script import tirx as T

    BF, F32 = op == "bf16", op == "f32"
    FL = BF or F32  # fp32 accumulators (w8a16)
    NR, MV = _tile(P, op)
    if FL and P != 1:
        raise ValueError(f"glm5 quant_vgemm: op {op!r} takes one plane of x, got P={P}")
    PC = P  # accumulator planes
    adt = "float32" if FL else "int32"
    gch = _gch(grouped, op)
    # K values per chunk (one 64-byte vector of a row)
    CK = CHUNK // 4 if F32 else CHUNK // 2 if BF else CHUNK
    wdt = "int8" if bits == 8 else "uint8"
    bias = BIAS[bits]
    unit_b, unit_v = UNITS[bits]
    cbytes = CK * unit_b // unit_v  # packed bytes of one chunk
    lbytes = CK if bits == 6 else cbytes  # bytes its vector load reads

    def dp(acc: Any, u: Any, x: Any) -> Any:
        if F32:  # one fp32 value of 16 rows of x times one weight, fused into the sums
            return T.call_llvm_pure_intrin("float32x16", "llvm.fma.v16f32",
                                           T.reinterpret("float32x16", u),
                                           T.reinterpret("float32x16", x), acc)
        if BF:
            return dpbf16(T, acc, u, x, bdt)
        return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc,
                                       T.reinterpret(bdt, u), T.reinterpret(bdt, x))

    def bf16_pairs(v: Any) -> Any:
        """int8 x 32 -> their bf16 bits, pairs as int32 x 16 (an int8 is exact in bf16)."""
        return T.reinterpret("int32x16", T.Cast("uint16x32", T.shift_right(T.reinterpret(
            "uint32x32", T.Cast("float32x32", v)), T.broadcast(T.uint32(16), 32))))

    def v16(buf: Any, *idx: Any) -> Any:
        return buf[(*idx, T.ramp(0, 1, 16))]

    def signed(v: Any, lanes: int) -> list[Any]:
        """Signed codes (as uint8 lanes: two's complement) of a loaded vector of packed weights."""
        return [f - T.broadcast(T.uint8(bias), lanes) for f in biased(T, v, bits, lanes)]

    def u8x64(v: Any) -> Any:
        return T.reinterpret("uint8x64", v) if bits == 8 else v

    def perm_k(c: Any, i: Any) -> Any:
        """The K index held at position i of chunk c (`quant_amx.kpermutation`)."""
        if bits != 4:
            return c * CHUNK + i
        return c * CHUNK + T.if_then_else(i < 32, 2 * i, 2 * (i - 32) + 1)

    def combine(vs: list[Any]) -> Any:
        """The pass's sums from the accumulator planes: w6a12's exactly (16·hi + lo)."""
        v = vs[0]
        for p in vs[1:]:
            v = v * 16 + p
        return v

    @T.macro
    def _steps(X: Any, SCR: Any, iacc: Any, th: Any, g: Any, q: Any, mb: Any, Mt: Any,
               c: Any) -> None:
        """Chunk c of register tile q against row block mb of x: 16 steps of NR·P·MV dps
        (f32: a loop, not unrolled: LLVM regrouped the unrolled FMAs into one dependent chain
        per accumulator and spilled)."""
        for r16 in T.serial(16) if F32 else T.unroll(16):
            for i in T.unroll(NR):
                for p in T.unroll(P):
                    for mv in T.unroll(MV):
                        iacc[i, T.min(p, PC - 1), mv, T.ramp(0, 1, 16)] = dp(
                            v16(iacc, i, T.min(p, PC - 1), mv),
                            v16(X, p, T.min(mb * MV + mv, Mt - 1), c, r16),
                            T.broadcast(SCR[th, g, q * NR + i, (c - g * gch) * 16 + r16], 16))

    @T.macro
    def _group_sum(ACC: Any, th: Any, r: Any, mv: Any, g: Any, isum: Any, sw: Any) -> None:
        """ACC[th, r, mv] (+)= the exact group sums ``isum``: scaled in fp32 (grouped), or
        added in int32 (w8a8: over all of K, its bits kept in the fp32 buffer); w8a16: the
        pass's fp32 sums added."""
        if FL:
            if g == 0:
                ACC[th, r, mv, T.ramp(0, 1, 16)] = isum
            else:
                ACC[th, r, mv, T.ramp(0, 1, 16)] = v16(ACC, th, r, mv) + isum
        elif grouped:
            if g == 0:
                ACC[th, r, mv, T.ramp(0, 1, 16)] = sw * T.Cast("float32x16", isum)
            else:
                ACC[th, r, mv, T.ramp(0, 1, 16)] = v16(ACC, th, r, mv) + sw * T.Cast(
                    "float32x16", isum)
        elif g == 0:
            ACC[th, r, mv, T.ramp(0, 1, 16)] = T.reinterpret("float32x16", isum)
        else:
            ACC[th, r, mv, T.ramp(0, 1, 16)] = T.reinterpret("float32x16", T.reinterpret(
                "int32x16", v16(ACC, th, r, mv)) + isum)

    @T.prim_func
    def qgemm(x_h: T.handle, w_h: T.handle, s_h: T.handle, sx_h: T.handle, y_h: T.handle,
              scr_h: T.handle, ws_h: T.handle, acc_h: T.handle, M: T.int32, K: T.int32,
              nsub: T.int32, msplit: T.int32):
        T.func_attr({"global_symbol": "qgemm", "tirx.noalias": True})
        Mt = T.int32()
        NC = T.int32()
        N = T.int32()
        Pk = T.int32()
        G = T.int32()
        nth = T.int32()
        NG = T.int32()
        X = T.match_buffer(x_h, (P, Mt, NC, 16, 16), "int32")
        W = T.match_buffer(w_h, (N, Pk), wdt)
        SW = T.match_buffer(s_h, (N, G), "float32")
        SX = T.match_buffer(sx_h, (Mt * 16,), "float32")
        Y = T.match_buffer(y_h, (M, N), "float32")
        # the task's weight rows, group-major: one group of every row is one contiguous run
        SCR = T.match_buffer(scr_h, (nth, NG, NR * nsub, gch * 16), "int32")
        # per task row and group: 128 · Σ w, the bias of x's plane 0 taken back out
        WS = T.match_buffer(ws_h, (nth, NR * nsub, NG), "int32")
        # per task row: the sums over the groups so far (w8a8: exact int32 bits)
        NRP = T.int32()
        ACC = T.match_buffer(acc_h, (nth, NRP, MV, 16), "float32")
        nsb = (N + NR * nsub - 1) // (NR * nsub)
        mblk = (Mt + MV - 1) // MV
        ntask = nsb * msplit
        ngroups = (NC + gch - 1) // gch
        for th in T.parallel(nth):
            t_lo = th * ntask // nth
            t_hi = (th + 1) * ntask // nth
            for task in range(t_lo, t_hi):
                sb = task % nsb
                ms = task // nsb
                tail = T.alloc_buffer((CK,), "float32" if F32 else "uint16" if BF else "uint8",
                                      scope="local")
                iacc = T.alloc_buffer((NR, PC, MV, 16), adt, scope="local")
                tb = T.alloc_buffer((2, 16, 16), "float32", scope="local")
                red = T.alloc_buffer((16,), "int32", scope="local")
                # the task's weight rows as signed codes (rows past N: zeros)
                for r in range(NR * nsub):
                    n = sb * NR * nsub + r
                    full = T.min(T.max((Pk - (lbytes - cbytes)) // cbytes, 0), NC)
                    for c in range(NC):
                        if T.And(n < N, c < full):
                            if F32:
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", T.Cast("float32x16", W[n, T.ramp(c * CK, 1, CK)]))
                            elif BF:
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = bf16_pairs(
                                    W[n, T.ramp(c * CK, 1, CK)])
                            elif bits == 4:
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", T.Shuffle(signed(W[n, T.ramp(c * 32, 1, 32)],
                                                                 32), list(range(64))))
                            else:
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", signed(u8x64(
                                        W[n, T.ramp(c * cbytes, 1, lbytes)]), 64)[0])
                        elif n < N:  # the last chunk: K ends inside it (zeros past K)
                            if F32:
                                for i in range(CK):
                                    tail[i] = T.Cast("float32", T.if_then_else(
                                        c * CK + i < K, W[n, T.min(c * CK + i, K - 1)],
                                        T.int8(0)))
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", tail[T.ramp(0, 1, CK)])
                            elif BF:
                                for i in range(CK):
                                    tail[i] = T.Cast("uint16", T.shift_right(T.reinterpret(
                                        "uint32", T.Cast("float32", T.if_then_else(
                                            c * CK + i < K, W[n, T.min(c * CK + i, K - 1)],
                                            T.int8(0)))), T.uint32(16)))
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", tail[T.ramp(0, 1, CK)])
                            else:
                                for i in range(CHUNK):
                                    tail[i] = T.Cast("uint8", T.if_then_else(
                                        perm_k(c, i) < K, unpack_code(
                                            T, lambda b: W[n, T.min(b, Pk - 1)],
                                            T.floordiv(perm_k(c, i), unit_v),
                                            T.floormod(perm_k(c, i), unit_v), bits), 0))
                                SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.reinterpret(
                                    "int32x16", tail[T.ramp(0, 1, CHUNK)])
                        else:
                            SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)] = T.broadcast(
                                T.int32(0), 16)
                    if not FL:  # 128 · Σ w per group (w8a16's x has no bias)
                        for g in range(ngroups):
                            red[T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                            for c in range(g * gch, T.min(g * gch + gch, NC)):
                                red[T.ramp(0, 1, 16)] = dp(
                                    red[T.ramp(0, 1, 16)], T.broadcast(T.int32(0x01010101), 16),
                                    SCR[th, c // gch, r, T.ramp(c % gch * 16, 1, 16)])
                            # lanes folded in halves, 16 -> 2
                            red[T.ramp(0, 1, 8)] = red[T.ramp(0, 1, 8)] + red[T.ramp(8, 1, 8)]
                            red[T.ramp(0, 1, 4)] = red[T.ramp(0, 1, 4)] + red[T.ramp(4, 1, 4)]
                            red[T.ramp(0, 1, 2)] = red[T.ramp(0, 1, 2)] + red[T.ramp(2, 1, 2)]
                            WS[th, r, g] = (red[0] + red[1]) * 128
                m_lo = ms * mblk // msplit
                m_hi = (ms + 1) * mblk // msplit
                for mb in range(m_lo, m_hi):
                    # group-major: one group of this row block of x (L1-resident) meets every
                    # weight row of the task; the sums so far wait in ACC
                    for qo in range((nsub + QB - 1) // QB):
                        for g in range(ngroups):
                            for q in range(qo * QB, T.min(qo * QB + QB, nsub)):
                                # plane 0 starts at -128 · Σ w: the bias of x taken out exactly
                                for i in T.unroll(NR):
                                    for p in T.unroll(PC):
                                        for mv in T.unroll(MV):
                                            if FL:
                                                iacc[i, p, mv, T.ramp(0, 1, 16)] = T.broadcast(
                                                    T.float32(0), 16)
                                            else:
                                                iacc[i, p, mv, T.ramp(0, 1, 16)] = T.broadcast(
                                                    T.Select(p == 0, -WS[th, q * NR + i, g], 0),
                                                    16)
                                for c in range(g * gch, T.min(g * gch + gch, NC)):
                                    _steps(X, SCR, iacc, th, g, q, mb, Mt, c)
                                for i in T.unroll(NR):
                                    for mv in T.unroll(MV):
                                        _group_sum(ACC, th, q * NR + i, mv, g, combine(
                                            [v16(iacc, i, p, mv) for p in range(PC)]),
                                            T.broadcast(SW[T.min((sb * nsub + q) * NR + i,
                                                                 N - 1), g], 16))
                    # 16 task rows x 16 rows of x at a time: scaled, transposed in registers,
                    # stored as 16 contiguous outputs of each row of y
                    for rb in range((NR * nsub + 15) // 16):
                        n0 = sb * nsub * NR + rb * 16
                        for mv in T.unroll(MV):
                            m0 = (mb * MV + mv) * 16
                            for a in T.unroll(16):
                                if grouped:
                                    tb[0, a, T.ramp(0, 1, 16)] = v16(ACC, th, rb * 16 + a, mv)
                                elif FL:
                                    tb[0, a, T.ramp(0, 1, 16)] = T.broadcast(
                                        SW[T.min(n0 + a, N - 1), 0], 16) * v16(
                                            ACC, th, rb * 16 + a, mv)
                                else:
                                    tb[0, a, T.ramp(0, 1, 16)] = T.broadcast(
                                        SW[T.min(n0 + a, N - 1), 0], 16) * T.Cast(
                                            "float32x16", T.reinterpret(
                                                "int32x16", v16(ACC, th, rb * 16 + a, mv)))
                                tb[0, a, T.ramp(0, 1, 16)] = v16(tb, 0, a) * SX[
                                    T.ramp(T.min(mb * MV + mv, Mt - 1) * 16, 1, 16)]
                            for a in T.unroll(16):
                                tb[1, a, T.ramp(0, 1, 16)] = butterfly(T, tb, 0, a, 8)
                            for a in T.unroll(16):
                                tb[0, a, T.ramp(0, 1, 16)] = butterfly(T, tb, 1, a, 4)
                            for a in T.unroll(16):
                                tb[1, a, T.ramp(0, 1, 16)] = butterfly(T, tb, 0, a, 2)
                            for a in T.unroll(16):
                                tb[0, a, T.ramp(0, 1, 16)] = butterfly(T, tb, 1, a, 1)
                            # row a of tb: row m0 + a of y, outputs n0 .. n0 + 15
                            if T.And(rb * 16 + 16 <= NR * nsub, n0 + 16 <= N):
                                for a in T.unroll(16):
                                    if m0 + a < M:
                                        Y[m0 + a, T.ramp(n0, 1, 16)] = v16(tb, 0, a)
                            else:
                                for a in range(16):
                                    if m0 + a < M:
                                        for j in range(16):
                                            if T.And(rb * 16 + j < NR * nsub, n0 + j < N):
                                                Y[m0 + a, n0 + j] = tb[0, a, j]

    return qgemm


def _fn(context: Callable[[], Any], bits: int, P: int, grouped: bool, op: str = "i8"
        ) -> Callable:
    ctx = context()

    def kernel(bdt: str) -> Callable:
        key = {"bits": bits, "planes": P, "grouped": grouped, "bytes": bdt, "tile": _tile(P),
               "rev": REV}
        return ctx.kernel("quant_linear_vgemm", key, lambda: build(bits, P, grouped, bdt),
                          "qgemm", mattr=MATTR)

    def bf16_kernel(wdt: str) -> Callable:
        for i, operand in enumerate(BF16_OPERANDS):
            key = {"op": op, "planes": P, "tile": _tile(P, op), "chunks": BF_CHUNKS,
                   "words": wdt, "operand": operand, "rev": REV}
            try:
                return ctx.kernel("quant_linear_vgemm", key,
                                  lambda: build(8, P, False, wdt, op="bf16"), "qgemm",
                                  mattr=BF_MATTR, ir_rewrite=lambda ll: dpbf16_ir(ll, operand))
            except Exception as e:  # LLVM's parser: the intrinsic's operand types differ
                if i + 1 == len(BF16_OPERANDS) or "intrinsic" not in str(e).lower():
                    raise
        raise AssertionError("unreachable")

    def f32_kernel() -> Callable:
        key = {"op": op, "tile": _tile(P, op), "chunks": F32_CHUNKS, "rev": REV}
        return ctx.kernel("quant_linear_vgemm", key, lambda: build(8, 1, False, op="f32"),
                          "qgemm", mattr=F32_MATTR)

    if op == "f32":
        return cached(ctx, ("quant_linear_vgemm", op, _tile(P, op)), f32_kernel)
    return cached(ctx, ("quant_linear_vgemm", op, bits, P, grouped, _tile(P, op)),
                  lambda: first_operand_form(bf16_kernel if op == "bf16" else kernel,
                                             WORD_OPERANDS if op == "bf16" else BYTE_OPERANDS))


def _tasks(nblk: int, threads: int, most: int) -> int:
    """Register tiles of weight rows per task: at most ``most`` (the scratch slot), at least
    two tasks per thread where there are enough tiles, and the task count a multiple of the
    thread count (each thread runs a contiguous share: 13 tasks on 2 threads would leave one
    thread idle for a task's time)."""
    per = max(1, min(most, nblk // (2 * threads)))
    rounds = -(-nblk // (per * threads))  # tasks per thread
    return max(1, -(-nblk // (rounds * threads)))


def f32_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x [M, K] -> (its bits in the GEMM's tile layout [1, Mt, NC, 16, 16] int32: entry
    (mt, c, j, i) = x[16·mt + i, 16·c + j], zeros past M and K; sx = ones [Mt·16]): one
    strided copy (two where M or K is not a multiple of 16)."""
    M, K = x.shape
    Mt, NC = -(-M // 16), -(-K // 16)
    if M % 16 or K % 16:
        x = torch.nn.functional.pad(x, (0, NC * 16 - K, 0, Mt * 16 - M))
    xt = tirlib.scratch("vgemm_xf32", (1, Mt, NC, 16, 16), torch.float32)
    xt.view(Mt, NC, 16, 16).permute(0, 3, 1, 2).copy_(x.view(Mt, 16, NC, 16))
    sx = tirlib.scratch("vgemm_sx1", (Mt * 16,), torch.float32)
    sx.fill_(1.0)
    return xt.view(torch.int32), sx


def gemm_vnni(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
              w_scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The VNNI GEMM path: x [M, K] fp32 / bf16, canonical packed weight [N, P] with its
    scales -> fp32 ``[M, N]`` without bias (M, N, K > 0). w8a16 needs AVX-512 BF16
    (`bf16_available`)."""
    sc = SCHEMES[scheme]
    op, P = ("f32", 1) if sc.act_bits is None and x.dtype == torch.float32 else op_planes(
        scheme, x.dtype)
    if op == "bf16" and not bf16_available()[0]:
        raise RuntimeError(f"glm5 quant_linear: the VNNI GEMM computes w8a16 on bf16 x with "
                           f"vdpbf16ps: {bf16_available()[1]}")
    M, K = x.shape
    N = w_packed.shape[0]
    xb, sx = f32_tiles(x) if op == "f32" else activations(context, x, scheme,
                                                           unsigned=op == "i8")
    _, Mt, NC, _, _ = xb.shape
    NR, MV = _tile(P, op)
    nblk = -(-N // NR)
    mblk = -(-Mt // MV)
    threads = tvm_threads()
    gch = _gch(sc.grouped, op)
    NG = -(-NC // gch)
    nsub = _tasks(nblk, threads, SCRATCH // (NR * NG * gch * CHUNK))
    nsb = -(-nblk // nsub)
    msplit = max(1, min(mblk, -(-threads // nsb)))
    G = w_scale.numel() // N
    sw = w_scale.to(torch.float32).reshape(N, G).contiguous()
    scr = tirlib.scratch("vgemm_w", (threads, NG, NR * nsub, gch * 16), torch.int32)
    ws = tirlib.scratch("vgemm_wsum", (threads, NR * nsub, NG), torch.int32)
    acc = tirlib.scratch("vgemm_acc", (threads, -(-NR * nsub // 16) * 16, MV, 16),
                         torch.float32)
    y = tirlib.fresh((M, N), torch.float32)
    _fn(context, sc.weight_bits, P, sc.grouped, op)(
        xb.view(torch.int32), w_packed.contiguous(), sw, sx, y, scr, ws, acc, M, K, nsub,
        msplit)
    return y
