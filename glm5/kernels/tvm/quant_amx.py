"""`quant_linear` on AMX tiles (Intel AMX-INT8 / AMX-BF16, detected at run time).

One TensorIR kernel per (weight width, tile op, activation planes) computes
``Yᵀ = W · Xᵀ`` in 16 x 16 output tiles (``tdpbssd`` int8 x int8 -> int32 for the activation
schemes, ``tdpbf16ps`` bf16 x bf16 -> fp32 for w8a16):

* the **A** operand is 16 weight rows x one 64-byte chunk of K, unpacked from the canonical
  packed layout into the task's slot of a per-thread scratch (up to ``SCRATCH`` bytes of rows,
  once per call, then used by every row block of x): int8 codes, or bf16 for w8a16 (an int8
  code is exact in bf16). int4 is unpacked as each chunk's low nibbles then its high nibbles
  (even k, then odd k); int6 in natural order by one byte permute and one multishift per 64
  codes (`quant_vnni.int6_fields`). x is permuted the same way, so no weight is ever
  transposed. w8a8 tiles of whole rows and chunks are loaded from the packed weight itself;
* the **B** operand is x in AMX's quad / pair interleaved layout, ``xb[P, Mt, NC, 16, 64
  bytes]`` (16 rows of x per tile), made by one TVM pass (`build_prep`): the activation
  schemes' per-token codes are the reference quantizer's, bit for bit;
* activation schemes accumulate one scale group (128 codes, two chunks; w8a8: all of K) in
  int32 tiles — exact: the op's integer group sums — then ``acc += s_w[n, g] · float(isum)``
  in fp32 (software pipelined: while the tile unit multiplies group g, the vector units scale
  group g-1) and ``y = s_x[m] · acc``. w6a12's 12-bit codes go in as two int8 planes,
  ``q = 16·(q >> 4) + (q & 15)``, combined exactly in int32 before the scale;
* w8a16 multiplies exact bf16 products into fp32 tiles: a bf16 x is one plane; an fp32 x is
  split into three bf16 planes ``x = hi + mid + lo`` (exact), hi accumulated in its own tile
  and added last — an fp32 GEMM's rounding, not bf16's (three times the tile work of a bf16
  GEMM). Rows of x are scaled by a power of two first (undone in ``s_x``: exact) so that the
  tile unit's flush of bf16 denormals only touches values 2^-100 below their row's largest.

Each thread runs its contiguous share of the tasks (``nsub`` n-blocks of 32 rows x a share of
the row blocks of x) in its own scratch slot; the 16 x 16 accumulator tiles leave through an
in-register transpose. M, N, K are runtime values: one build per (weight width, op, planes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.host_cpu import missing
from glm5.ir.quant_formats import GROUP, SCHEMES
from glm5.kernels.tvm import sparse_attention, tirlib
from glm5.kernels.tvm.quant_vnni import int6_fields
from glm5.kernels.tvm.tirlib import (
    UNITS,
    bits,
    cached,
    narrow,
    storage,
    unpack_code,
    widen,
)

REV = 1
CHUNK = 64  # bytes of K per tile row
SCRATCH = 1310720  # bytes of unpacked weight rows per parallel task (L2-resident)
MATTR = ("+amx-tile", "+amx-int8", "+amx-bf16")


_amx: list[tuple[bool, str]] = []


def amx_available() -> tuple[bool, str]:
    """(True, why) where this CPU has AMX-INT8 and AMX-BF16 tiles and the OS lets this process
    use them (Linux grants the tile state on request: torch's ``_init_amx``). Once."""
    if not _amx:
        _amx.append(_amx_check())
    return _amx[0]


def _amx_check() -> tuple[bool, str]:
    why = missing("amx_tile", "amx_int8", "amx_bf16")
    if why:
        return False, why
    try:
        if not torch._C._cpu._init_amx():
            return False, "the OS refused the AMX tile state"
    except (AttributeError, RuntimeError) as e:
        return False, f"torch cannot request the AMX tile state ({e})"
    return True, "AMX-INT8 and AMX-BF16 tiles"


def op_planes(scheme: str, dtype: torch.dtype) -> tuple[str, int]:
    """(tile op, activation planes) of a scheme for activations of ``dtype``."""
    sc = SCHEMES[scheme]
    if sc.act_bits is None:
        return "bf16", 1 if dtype == torch.bfloat16 else 3
    return "i8", 2 if sc.act_bits == 12 else 1


def kpermutation(bits: int, Kp: int) -> torch.Tensor:
    """For unpacked position k' (chunks of 64) the K index it holds: int4 even k then odd k,
    else the identity."""
    k = torch.arange(Kp)
    c, i = k // CHUNK, k % CHUNK
    if bits != 4:
        return k
    return c * CHUNK + torch.where(i < 32, 2 * i, 2 * (i - 32) + 1)


def _layout(op: str, P: int) -> tuple[int, int, int]:
    """(n tiles, m tiles, accumulator planes) per step. int8 planes stay apart (w6a12's are
    combined with weights 16 and 1); bf16's mid and lo planes share one accumulator (their
    roundings are 2^-8 below hi's). Tiles: NT·MT·PC accumulators + NT A + the rest B (>= 2)."""
    PC = P if op == "i8" else min(P, 2)
    NT, MT = (2, 2) if P == 1 else (2, 1)
    assert NT * MT * PC + NT + 2 <= 8
    return NT, MT, PC


def build(bits: int, op: str, P: int, grouped: bool) -> Any:
    """``qgemm_amx(xb, w[N, Pk], swt[G, NP], sx[Mt·16], y[M, N], M, K, gch, nsub, msplit)``:
    gch = chunks per scale group (grouped: 2; else all); one parallel task unpacks ``nsub``
    n-blocks of 16·NT weight rows into its scratch and runs them against its share (one of
    ``msplit``) of the row blocks of x."""
    from tvm.script import tirx as T

    NT, MT, PC = _layout(op, P)
    NB = 16 * NT
    nC = NT * MT * PC
    A0, B0 = nC, nC + NT
    NBR = 8 - B0  # B registers, used in turn
    I8 = op == "i8"
    sdt = "int8" if I8 else "uint16"  # scratch / x element (bf16 as its bits)
    CK = CHUNK if I8 else CHUNK // 2  # K per chunk
    cdt = "int32" if I8 else "float32"
    wdt = "int8" if bits == 8 else "uint8"
    tdp = "tdpbssd" if I8 else "tdpbf16ps"
    unit_b, unit_v = UNITS[bits]
    # bytes of one chunk (int8 CK, int4 CK/2, int6 CK/4 units of 3) and of its vector load
    cbytes = CK * unit_b // unit_v
    lbytes = CHUNK if bits == 6 else cbytes
    # one chunk more than K per scratch row: rows 4 KiB apart would share L1 sets
    pad = CK

    def u8(v: int) -> Any:
        return T.broadcast(T.uint8(v), 64)

    def amx(name: str, *args: Any) -> Any:
        return T.evaluate(T.call_llvm_intrin("void", f"llvm.x86.{name}", *args))

    def code(v: Any) -> Any:
        """An int32 code as the scratch element: int8, or bf16 bits (exact below 2^8)."""
        if I8:
            return T.Cast("int8", v)
        return T.Cast("uint16", T.shift_right(T.reinterpret("uint32", T.Cast("float32", v)),
                                              T.uint32(16)))

    def perm_k(c: Any, i: Any) -> Any:
        """The K index held at position i of chunk c (`kpermutation`)."""
        if bits != 4 or not I8:
            return c * CK + i
        return c * CK + T.if_then_else(i < 32, 2 * i, 2 * (i - 32) + 1)

    def cplane(p: Any) -> Any:
        """The accumulator plane of x plane p (an unrolled loop variable)."""
        return T.min(p, PC - 1)

    def breg(p: Any, mi: Any) -> Any:
        return B0 + (p * MT + mi) % NBR

    # 16 x 16 transpose in 4 rounds of two-vector shuffles: round h swaps the off-diagonal
    # h x h blocks of rows (lo, lo + h)
    lo_idx = {h: [v if v & h == 0 else 16 + v - h for v in range(16)] for h in (8, 4, 2, 1)}
    hi_idx = {h: [v + h if v & h == 0 else 16 + v for v in range(16)] for h in (8, 4, 2, 1)}

    def row(i: Any, h: int) -> Any:
        return (i // h) * 2 * h + i % h

    @T.macro
    def post(acc: Any, cb: Any, SWT: Any, g: Any, n0: Any) -> None:
        """acc += s_w[n, g] · (the accumulator tiles of group g, planes combined)."""
        for t in T.unroll(NT):
            for mi in T.unroll(MT):
                for a in T.unroll(16):
                    for ll in T.vectorized(16):
                        acc[t, mi, a, ll] = acc[t, mi, a, ll] + SWT[g, n0 + t * 16 + a] * (
                            _planes(T, cb, (t * MT + mi) * PC, a, ll, PC, I8))

    @T.prim_func
    def qgemm_amx(x_h: T.handle, w_h: T.handle, s_h: T.handle, sx_h: T.handle, y_h: T.handle,
                  scr_h: T.handle, M: T.int32, K: T.int32, gch: T.int32, nsub: T.int32,
                  msplit: T.int32):
        T.func_attr({"global_symbol": "qgemm_amx", "tirx.noalias": True})
        Mt = T.int32()
        NC = T.int32()
        N = T.int32()
        Pk = T.int32()
        G = T.int32()
        NP = T.int32()
        X = T.match_buffer(x_h, (P, Mt, NC, 16, CK), sdt)
        W = T.match_buffer(w_h, (N, Pk), wdt)
        SWT = T.match_buffer(s_h, (G, NP), "float32")  # scales [G, N] padded to whole tasks
        SX = T.match_buffer(sx_h, (Mt * 16,), "float32")
        Y = T.match_buffer(y_h, (M, N), "float32")
        nth = T.int32()
        SCR = T.match_buffer(scr_h, (nth, NB * nsub, NC * CK + pad), sdt)
        nsb = (N + NB * nsub - 1) // (NB * nsub)
        mblk = (Mt + MT - 1) // MT
        ngroups = (NC + gch - 1) // gch
        ntask = nsb * msplit
        # one work item per scratch slot (= TVM worker): its contiguous share of the tasks
        for th in T.parallel(nth):
            t_lo = th * ntask // nth
            t_hi = (th + 1) * ntask // nth
            for task in range(t_lo, t_hi):
                # row-range major: the tasks of one thread share one share of x
                sb = task % nsb
                ms = task // nsb
                cfg = T.alloc_buffer((64,), "uint8", scope="local")
                cb = T.alloc_buffer((nC, 16, 16), cdt, scope="local")
                acc = T.alloc_buffer((NT, MT, 16, 16), "float32", scope="local")
                tr = T.alloc_buffer((2, 16, 16), "float32", scope="local")
                # w8a8 tiles of whole rows and chunks load from the weight itself; else the task's
                # weight rows are unpacked first (rows past N: zeros)
                direct = T.And(bits == 8 and I8, T.And(K % CK == 0, (sb + 1) * NB * nsub <= N))
                for r in range(T.Select(direct, 0, NB * nsub)):
                    n = sb * NB * nsub + r
                    if n < N:
                        full = T.max((Pk - (lbytes - cbytes)) // cbytes, 0)
                        for c in range(T.min(full, NC)):
                            if bits == 8:
                                for i in T.vectorized(CK):
                                    SCR[th, r, c * CK + i] = code(T.Cast("int32", W[n, c * CK + i]))
                            elif bits == 4:
                                for i in T.vectorized(32):
                                    SCR[th, r, c * CK + i] = T.Cast("int8", (T.Cast(
                                        "int32", W[n, c * 32 + i] & T.uint8(15)) ^ 8) - 8)
                                    SCR[th, r, c * CK + 32 + i] = T.Cast("int8", (T.Cast(
                                        "int32", T.shift_right(W[n, c * 32 + i], T.uint8(4)))
                                        ^ 8) - 8)
                            else:  # 64-byte loads while they stay in the row
                                SCR[th, r, T.ramp(c * CK, 1, CK)] = T.reinterpret("int8x64", (
                                    int6_fields(T, W[n, T.ramp(c * 48, 1, 64)]) ^ u8(32)) - u8(32))
                        for c in range(T.min(full, NC), NC):  # the last chunk: K ends inside it
                            for i in range(CK):
                                SCR[th, r, c * CK + i] = code(T.if_then_else(
                                    perm_k(c, i) < K, unpack_code(
                                        T, lambda b: W[n, T.min(b, Pk - 1)],
                                        T.floordiv(perm_k(c, i), unit_v),
                                        T.floormod(perm_k(c, i), unit_v), bits), 0))
                    else:
                        for c in range(NC):
                            for i in T.vectorized(CK):
                                SCR[th, r, c * CK + i] = code(0)
                for i in range(64):
                    cfg[i] = T.uint8(0)
                cfg[0] = T.uint8(1)  # palette 1: every tile 16 rows x 64 bytes
                for t in T.unroll(8):
                    cfg[16 + 2 * t] = T.uint8(64)
                    cfg[48 + t] = T.uint8(16)
                amx("ldtilecfg", T.address_of(cfg[0]))
                # loop bounds bound once: a division in the chunk loop costs as much as a tile op
                m_lo = ms * mblk // msplit
                m_hi = (ms + 1) * mblk // msplit
                for mb in range(m_lo, m_hi):
                    for q in range(nsub):
                        for t, mi, a, b in T.grid(NT, MT, 16, 16):
                            acc[t, mi, a, b] = T.float32(0)
                        # software pipelined: the scale products of group g-1 run on the
                        # vector units while the tile unit multiplies group g
                        for g in range(ngroups):
                            for ci in T.unroll(nC):
                                amx("tilezero", T.int8(ci))
                            for c in range(g * gch, T.min(g * gch + gch, NC)):
                                for t in T.unroll(NT):
                                    if direct:  # int8 codes straight from the packed weight
                                        amx("tileloadd64", T.int8(A0 + t), T.address_of(
                                            W[(sb * nsub + q) * NB + t * 16, c * CK]), T.int64(Pk))
                                    else:
                                        amx("tileloadd64", T.int8(A0 + t),
                                            T.address_of(SCR[th, q * NB + t * 16, c * CK]),
                                            T.int64((NC * CK + pad) * (1 if I8 else 2)))
                                for p in T.unroll(P):
                                    for mi in T.unroll(MT):
                                        amx("tileloadd64", T.int8(breg(p, mi)), T.address_of(
                                            X[p, T.min(mb * MT + mi, Mt - 1), c, 0, 0]),
                                            T.int64(CHUNK))
                                        for t in T.unroll(NT):
                                            amx(tdp, T.int8((t * MT + mi) * PC + cplane(p)),
                                                T.int8(A0 + t), T.int8(breg(p, mi)))
                            if g > 0:
                                post(acc, cb, SWT, g - 1, (sb * nsub + q) * NB)
                            for ci in T.unroll(nC):
                                amx("tilestored64", T.int8(ci), T.address_of(cb[ci, 0, 0]),
                                    T.int64(64))
                        post(acc, cb, SWT, ngroups - 1, (sb * nsub + q) * NB)
                        for t in T.unroll(NT):
                            for mi in T.unroll(MT):
                                if T.And((mb * MT + mi) * 16 + 16 <= M,
                                         (sb * nsub + q) * NB + t * 16 + 16 <= N):
                                    # a whole tile: transposed in registers, rows of y stored
                                    for i in T.unroll(8):
                                        tr[0, row(i, 8), T.ramp(0, 1, 16)] = T.Shuffle(
                                            [acc[t, mi, row(i, 8), T.ramp(0, 1, 16)],
                                             acc[t, mi, row(i, 8) + 8, T.ramp(0, 1, 16)]],
                                            lo_idx[8])
                                        tr[0, row(i, 8) + 8, T.ramp(0, 1, 16)] = T.Shuffle(
                                            [acc[t, mi, row(i, 8), T.ramp(0, 1, 16)],
                                             acc[t, mi, row(i, 8) + 8, T.ramp(0, 1, 16)]],
                                            hi_idx[8])
                                    for i in T.unroll(8):
                                        tr[1, row(i, 4), T.ramp(0, 1, 16)] = T.Shuffle(
                                            [tr[0, row(i, 4), T.ramp(0, 1, 16)],
                                             tr[0, row(i, 4) + 4, T.ramp(0, 1, 16)]], lo_idx[4])
                                        tr[1, row(i, 4) + 4, T.ramp(0, 1, 16)] = T.Shuffle(
                                            [tr[0, row(i, 4), T.ramp(0, 1, 16)],
                                             tr[0, row(i, 4) + 4, T.ramp(0, 1, 16)]], hi_idx[4])
                                    for i in T.unroll(8):
                                        tr[0, row(i, 2), T.ramp(0, 1, 16)] = T.Shuffle(
                                            [tr[1, row(i, 2), T.ramp(0, 1, 16)],
                                             tr[1, row(i, 2) + 2, T.ramp(0, 1, 16)]], lo_idx[2])
                                        tr[0, row(i, 2) + 2, T.ramp(0, 1, 16)] = T.Shuffle(
                                            [tr[1, row(i, 2), T.ramp(0, 1, 16)],
                                             tr[1, row(i, 2) + 2, T.ramp(0, 1, 16)]], hi_idx[2])
                                    for i in T.unroll(8):
                                        Y[(mb * MT + mi) * 16 + row(i, 1), T.ramp(
                                            (sb * nsub + q) * NB + t * 16, 1, 16)] = T.Shuffle(
                                            [tr[0, row(i, 1), T.ramp(0, 1, 16)],
                                             tr[0, row(i, 1) + 1, T.ramp(0, 1, 16)]], lo_idx[1]
                                        ) * T.broadcast(SX[(mb * MT + mi) * 16 + row(i, 1)], 16)
                                        Y[(mb * MT + mi) * 16 + row(i, 1) + 1, T.ramp(
                                            (sb * nsub + q) * NB + t * 16, 1, 16)] = T.Shuffle(
                                            [tr[0, row(i, 1), T.ramp(0, 1, 16)],
                                             tr[0, row(i, 1) + 1, T.ramp(0, 1, 16)]], hi_idx[1]
                                        ) * T.broadcast(SX[(mb * MT + mi) * 16 + row(i, 1) + 1], 16)
                                else:
                                    for ll in range(16):
                                        if (mb * MT + mi) * 16 + ll < M:
                                            for a in range(16):
                                                if (sb * nsub + q) * NB + t * 16 + a < N:
                                                    Y[(mb * MT + mi) * 16 + ll,
                                                      (sb * nsub + q) * NB + t * 16 + a] = (
                                                        SX[(mb * MT + mi) * 16 + ll]
                                                        * acc[t, mi, a, ll])
                amx("tilerelease")

    return qgemm_amx


def _planes(T: Any, cb: Any, c0: Any, a: Any, ll: Any, PC: int, I8: bool) -> Any:
    """One lane of the accumulator tiles of one (n tile, m tile), planes combined: int8 planes
    exactly in int32 (w6a12: 16·hi + lo) then as fp32; bf16 planes (fp32 sums) added smallest
    first."""
    if I8:
        v = cb[c0, a, ll]
        for p in range(1, PC):
            v = v * 16 + cb[c0 + p, a, ll]
        return T.Cast("float32", v)
    v = cb[c0 + PC - 1, a, ll]
    for p in range(PC - 2, -1, -1):
        v = v + cb[c0 + p, a, ll]
    return v


def _fn(context: Callable[[], Any], bits: int, op: str, P: int, grouped: bool) -> Callable:
    ok, why = amx_available()  # also asks the OS for the tile state: without it, SIGILL
    if not ok:
        raise RuntimeError(f"glm5 quant_linear: the AMX path cannot run here: {why}")
    ctx = context()
    key = {"bits": bits, "op": op, "planes": P, "grouped": grouped, "rev": REV}
    return cached(ctx, ("quant_linear_amx", bits, op, P, grouped), lambda: ctx.kernel(
        "quant_linear_amx", key, lambda: build(bits, op, P, grouped), "qgemm_amx",
        mattr=MATTR))


def build_prep(scheme: str, P: int, dt: str, unsigned: bool = False) -> Any:
    """``prep(x[M, K], xb[P, Mt, NC, 16, 16] int32, sx[Mt·16], M, K)``: x in the tile layout
    (each int32 one (row, tile row) quad / pair of a chunk), zero padded (rows to Mt·16, K to
    NC chunks); `activations` says what the planes and sx hold. ``unsigned``: int8 plane 0
    biased by 128 (its bytes XOR 0x80, padding included), for unsigned-by-signed products."""
    from tvm.script import tirx as T

    sc = SCHEMES[scheme]
    I8 = sc.act_bits is not None
    CK = CHUNK if I8 else CHUNK // 2
    sdt = storage(dt)
    qmax = float(sc.act_qmax) if I8 else 0.0
    perm = kpermutation(sc.weight_bits if I8 else 8, CK).tolist()

    def xf(X: Any, m: Any, k: Any) -> Any:
        return widen(T, X[m, k], dt)

    def quant(v: Any, s: Any) -> Any:
        """The reference's code: round half to even of v / s (fp32), clamped (int32)."""
        return T.Cast("int32", T.max(T.min(T.nearbyint(v / s), T.float32(qmax)),
                                     T.float32(-qmax)))

    def plane_i8(q: Any, p: Any) -> Any:
        """Plane p (a loop variable) of a code: the code, or w6a12's q >> 4 and q & 15
        (``unsigned``: plane 0 + 128)."""
        if P == 1:
            v = T.Cast("int8", q)
        else:
            v = T.Cast("int8", T.Select(p == 0, T.shift_right(q, 4), q & 15))
        return T.Select(p == 0, v ^ T.int8(-128), v) if unsigned else v

    pad0 = T.int32(-0x7F7F7F80 if unsigned else 0)  # four padding bytes of plane 0

    def bf(v: Any) -> Any:
        return widen(T, narrow(T, v, "bfloat16"), "bfloat16")

    def plane_bf(v: Any, fin: Any, p: Any) -> Any:
        """bf16 bits of plane p (a loop variable) of v: hi, mid, lo with v = hi + mid + lo
        exactly; a non-finite row keeps v in hi."""
        if P == 1:
            return narrow(T, v, "bfloat16")
        mid = v - bf(v)
        return T.Select(p == 0, narrow(T, v, "bfloat16"), T.Select(fin, narrow(
            T, T.Select(p == 1, mid, mid - bf(mid)), "bfloat16"), T.uint16(0)))

    @T.prim_func
    def prep(x_h: T.handle, xb_h: T.handle, sx_h: T.handle, M: T.int32, K: T.int32):
        T.func_attr({"global_symbol": "prep", "tirx.noalias": True})
        Mt = T.int32()
        NC = T.int32()
        X = T.match_buffer(x_h, (M, K), sdt)
        XB = T.match_buffer(xb_h, (P, Mt, NC, 16, 16), "int32")
        SX = T.match_buffer(sx_h, (Mt * 16,), "float32")
        for m in T.parallel(Mt * 16):
            av = T.alloc_buffer((16,), "float32", scope="local")
            st = T.alloc_buffer((2,), "float32", scope="local")
            qb = T.alloc_buffer((P, CK), "int8" if I8 else "uint16", scope="local")
            if m < M:
                for ll in T.vectorized(16):
                    av[ll] = T.float32(0)
                for c in range(K // 16):
                    for ll in T.vectorized(16):
                        av[ll] = T.max(av[ll], T.abs(xf(X, m, c * 16 + ll)))
                for k in range(K // 16 * 16, K):
                    av[0] = T.max(av[0], T.abs(xf(X, m, k)))
                st[0] = T.float32(0)
                for ll in T.unroll(16):
                    st[0] = T.max(st[0], av[ll])
                if I8:  # the scale of quantize_per_token_ref
                    st[0] = T.Select(st[0] > T.float32(0), st[0] / T.float32(qmax),
                                     T.float32(1))
                    SX[m] = st[0]
                else:  # 2^e with max |x|·2^e in [1, 2) (exponent field clamped to 1..253)
                    st[1] = T.Cast("float32", T.shift_right(
                        T.reinterpret("uint32", st[0]), T.uint32(23)) < T.uint32(255))
                    st[0] = T.reinterpret("float32", T.shift_left(T.uint32(254) - T.max(
                        T.min(T.shift_right(T.reinterpret("uint32", st[0]), T.uint32(23)),
                              T.uint32(253)), T.uint32(1)), T.uint32(23)))
                    st[0] = T.Select(st[1] > T.float32(0), st[0], T.float32(1))
                    SX[m] = T.float32(1) / st[0]  # a power of two: exact
                for c in range(NC):
                    if c * CK + CK <= K:
                        for i in T.vectorized(CK):
                            for p in T.unroll(P):
                                if I8:
                                    qb[p, i] = plane_i8(quant(xf(X, m, c * CK + i), st[0]), p)
                                else:
                                    qb[p, i] = plane_bf(xf(X, m, c * CK + i) * st[0],
                                                        st[1] > T.float32(0), p)
                    else:
                        for i in range(CK):
                            for p in T.unroll(P):
                                if I8:
                                    qb[p, i] = T.if_then_else(
                                        c * CK + i < K, plane_i8(quant(xf(
                                            X, m, T.min(c * CK + i, K - 1)), st[0]), p),
                                        plane_i8(T.int32(0), p))
                                else:
                                    qb[p, i] = T.if_then_else(
                                        c * CK + i < K, plane_bf(xf(
                                            X, m, T.min(c * CK + i, K - 1)) * st[0],
                                            st[1] > T.float32(0), p), T.uint16(0))
                    for p in T.unroll(P):
                        for r in T.unroll(16):
                            XB[p, m // 16, c, r, m % 16] = T.Shuffle([T.reinterpret(
                                "int32x16", T.Shuffle([qb[p, T.ramp(0, 1, CK)]],
                                                      perm if I8 else list(range(CK))))], [r])
            else:
                SX[m] = T.float32(1)
                for p, c, r in T.grid(P, NC, 16):
                    XB[p, m // 16, c, r, m % 16] = T.Select(p == 0, pad0, T.int32(0))

    return prep


def _prep_fn(context: Callable[[], Any], scheme: str, P: int, dt: str,
             unsigned: bool = False) -> Callable:
    ctx = context()
    key = {"scheme": scheme, "planes": P, "dtype": dt, "rev": REV}
    if unsigned:
        key["unsigned"] = True
    return cached(ctx, ("quant_linear_amx_prep", scheme, P, dt, unsigned), lambda: ctx.kernel(
        "quant_linear_amx_prep", key, lambda: build_prep(scheme, P, dt, unsigned), "prep"))


def activations(context: Callable[[], Any], x: torch.Tensor, scheme: str,
                unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp32 / bf16) -> (xb [P, Mt, NC, 16, 64 bytes] in the tile layout, sx [Mt·16]
    fp32), one TVM pass.

    Activation schemes: the reference's per-token codes (`quantize_per_token_ref`: the same
    fp32 quotient, rounded half to even), permuted like the unpacked weight, w6a12 as two int8
    planes (q >> 4, q & 15); sx = their scales; ``unsigned``: plane 0 + 128 (`build_prep`).
    w8a16: each row scaled by 2^e (max |x|·2^e in [1, 2)), then bf16 planes (1 for bf16 x;
    hi, mid, lo for fp32 x: exact); sx = 2^-e."""
    op, P = op_planes(scheme, x.dtype)
    M, K = x.shape
    Mt = -(-M // 16)
    CK = CHUNK if op == "i8" else CHUNK // 2
    NC = -(-K // CK)
    xb = tirlib.scratch("xb", (P, Mt, NC, 16, 16), torch.int32)
    sx = tirlib.scratch("sx", (Mt * 16,), torch.float32)
    dt = "bfloat16" if x.dtype == torch.bfloat16 else "float32"
    _prep_fn(context, scheme, P, dt, unsigned)(bits(x.contiguous()), xb, sx, M, K)
    return xb.view(torch.int8 if op == "i8" else torch.uint16).view(P, Mt, NC, 16, CK), sx


def gemm_amx(context: Callable[[], Any], x: torch.Tensor, w_packed: torch.Tensor,
             w_scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The AMX path: x [M, K] fp32 / bf16, canonical packed weight [N, P] with its scales ->
    fp32 ``[M, N]`` without bias (M, N, K > 0; raises where the CPU has no usable AMX)."""
    sc = SCHEMES[scheme]
    op, P = op_planes(scheme, x.dtype)
    M, K = x.shape
    N = w_packed.shape[0]
    xb, sx = activations(context, x, scheme)
    NC = xb.shape[2]
    gch = GROUP // CHUNK if sc.grouped else NC
    NT, MT, _ = _layout(op, P)
    nblk = -(-N // (16 * NT))
    mblk = -(-xb.shape[1] // MT)
    threads = tvm_threads()
    # n-blocks per task: a scratch of at most SCRATCH bytes, and work for every thread
    row_bytes = xb.shape[2] * CHUNK + CHUNK
    nsub = max(1, min(SCRATCH // (16 * NT * row_bytes), nblk // (2 * threads)))
    nsb = -(-nblk // nsub)
    msplit = max(1, min(mblk, -(-threads // nsb)))
    # scales as [G, N], zero padded to whole tasks: one contiguous row per group
    G = w_scale.numel() // N
    swt = tirlib.scratch("swt", (G, nsb * nsub * 16 * NT), torch.float32)
    swt[:, N:] = 0
    swt[:, :N] = w_scale.reshape(N, G).T
    scr = tirlib.scratch("unpacked", (threads, 16 * NT * nsub,
                                       row_bytes // xb.element_size()), xb.dtype)
    y = tirlib.fresh((M, N), torch.float32)
    _fn(context, sc.weight_bits, op, P, sc.grouped)(
        xb, w_packed.contiguous(), swt, sx, y, scr, M, K, gch, nsub, msplit)
    return y


def tvm_threads() -> int:
    """Worker threads of TVM's pool (one scratch slot each)."""
    return sparse_attention.threads()
