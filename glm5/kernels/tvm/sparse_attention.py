"""TVM (llvm, host CPU) kernels for `sparse_attention` and `attention` (docs/ops.md, DSA section).

One hand-scheduled TensorIR generator serves both ops (loop-level TIR: ``T.parallel``,
``T.vectorized``, ``T.unroll`` and register-scoped ``local`` tiles are written into the loops
directly instead of being applied with ``s_tir.Schedule`` afterwards). The ops differ only in
where a query's key rows come from:

* sparse_attention: the rows are ``idx[t, :]``. A first parallel pass groups each query's
  valid rows (the −1 holes dropped) by key block into a row list with per-block offsets. The
  selected k / v rows are gathered *inside* the kernel (read straight from k's and v's buffers
  by row number): nothing of size T×K×D is materialised; work and memory are ∝ T·H·K·D.
* attention: the rows are ``k_start[t] + j`` for ``j < k_end[t] − k_start[t]``: each query loops
  over its own range only, never over S (and nothing of size T×S×H exists).

Key-block passes (sparse; ``block_rows``): once the used rows of k outgrow a cache-sized
BLOCK_BYTES, the kernel makes one pass per block of rows, and in pass b every query consumes
only its rows of block b. All threads then gather from one cache-resident slice of k instead of
the whole cache, and each row is fetched from DRAM about once per pass rather than once per use.
The online-softmax state of every query (running max, running sum, fp32 accumulator) lives in
caller-provided scratch and carries over from pass to pass; the output is normalised after the
last pass. With one pass (short contexts, decode) this is the plain flash-style loop.

Work item = one query t with all its H heads, queries visited in zig-zag order 0, T−1, 1, T−2,
... so that each thread's contiguous chunk of items balances causal work; when there are fewer
queries than threads (decode) a runtime argument splits each query's heads into chunks of head
tiles, one work item each. A query's keys are consumed in steps of up to KB keys with an online
softmax held in fp32; the g = H/Hk query heads that share a KV head are processed together
(absorbed MLA: the 64 heads read each 576-wide latent row once per step):

1. scores P[h, j] = scale · q[t, h] · k[row j, hk] by a register-tiled micro-kernel: an
   HB-heads × JB-keys tile of VL-lane fp32 accumulators (≤ 12 of the 16 AVX2 registers), the
   head dim streamed VL lanes at a time with contiguous vector loads of q and of the gathered k
   row, fully unrolled so LLVM keeps the tile in registers; one horizontal sum per score. A
   short last step computes only ceil(n / JB) tiles (no work on padding);
2. per head: step max, P = exp(S − m) with a vectorised polynomial exp (Cephes expf, ~2 ulp,
   exp(−inf) = 0 exactly), l = α·l + ΣP with α = exp(m_old − m_new);
3. acc[h, :] = α·acc + P · v[rows] by an HB2-heads × DVB-vectors register tile streaming over
   the step's keys (broadcast p, contiguous vector loads of the gathered v row); the α rescale
   rides on the tile load, so acc is touched once per step.

Random row gathers defeat the hardware prefetcher, so the kernel issues software prefetches
(into L2) one step ahead: the rows of the next step, or during a query's last step the first
rows of the next query the thread takes; with several passes also that query's q and
accumulator rows.

out = acc / l in q's dtype, lse = m + log(l) (natural log); a query with no valid key gives 0
and −inf. Inputs are read in their own dtype and widened to fp32 in registers: bfloat16 is
bound as its uint16 bits (a free view of the same memory) and widened with a shift; the output
is rounded to nearest even in-kernel; q of a 16-bit dtype is widened once per work item into an
fp32 scratch block. All accumulation is fp32.

T, S and K are symbolic (a new length never recompiles); the variant key is (H, Hk, Dqk, Dv,
dtype). q / k / v are bound with symbolic outer strides and a unit inner stride, so a view such
as ``v = k[..., :Dv]`` (absorbed MLA) is read in place from k's buffer: no copy of k at all.
Only a tensor whose last dim is not unit-stride is made contiguous (k once, v then stays a view
of that copy).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

from glm5.kernels.tvm.build import runtime_function
from glm5.kernels.tvm.tirlib import bits, fexp, narrow, storage, widen

# Bump when the generated code changes: it is part of the build-cache key.
REV = 6

_TVM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The dtypes the backend claims. The generator also handles float16 (it passes the parity kit
# too), but fp16 is left to other backends: it would add a third set of builds per variant to
# the compile budget for a dtype CPUs have no arithmetic for.
DTYPES = (torch.float32, torch.bfloat16)


def _lanes(d: int) -> int:
    for v in (8, 4, 2):
        if d % v == 0:
            return v
    return 1


def _largest_divisor(n: int, options: tuple[int, ...]) -> int:
    for o in options:
        if n % o == 0:
            return o
    return 1


def plan(H: int, Hk: int, Dqk: int, Dv: int, **over: Any) -> dict[str, Any]:
    """Tile sizes for one variant, sized for AVX2's 16 256-bit registers (≤ 12 accumulators
    per tile, 8 fp32 lanes; LLVM splits the vectors on narrower ISAs). ``over`` overrides."""
    g = H // Hk
    hb = _largest_divisor(g, (4, 2, 1))
    jb = {4: 3, 2: 6, 1: 8}[hb]
    unit = math.lcm(jb, 8)
    vlv = _lanes(Dv)
    p = {"g": g, "vl": _lanes(Dqk), "hb": hb, "jb": jb,
         "kb": unit * max(1, round(64 / unit)),  # ~64 keys per softmax block, a multiple of 8
         "vlv": vlv, "dvb": min(Dv // vlv, 12 // hb)}
    p.update(over)
    return p


def build(mode: str, H: int, Hk: int, Dqk: int, Dv: int, dtype: str, name: str,
          **over: Any) -> Any:
    """The PrimFunc ``name`` for ``mode`` in ("sparse", "dense")."""
    from tvm import tirx
    from tvm.script import tirx as T

    p = plan(H, Hk, Dqk, Dv, **over)
    g, VL, HB, JB, KB = p["g"], p["vl"], p["hb"], p["jb"], p["kb"]
    VLV, DVB = p["vlv"], p["dvb"]
    NHT = H // HB  # head tiles (HB | g: a tile never straddles two KV heads)
    NQ = Dqk // VL  # vector steps over the qk head dim
    NVT = (Dv // VLV) // DVB  # full PV tiles along Dv
    REM = (Dv // VLV) % DVB  # vectors in the last, narrower PV tile
    NEG_INF = float("-inf")
    SPARSE = mode == "sparse"
    sdt = storage(dtype)  # bf16 is bound as its uint16 bits (see f32 / to_out)

    def i64(x: int) -> Any:
        return tirx.IntImm("int64", x)

    def f32(x):
        return widen(T, x, dtype)

    def to_out(x):
        return narrow(T, x, dtype)

    # Software prefetch of gathered k rows one step (KB keys of work) ahead: random rows defeat
    # the hardware prefetcher, and a step ahead hides a DRAM miss without thrashing L1. Every
    # cache line of the row (+1: a row need not start on a line). ``prefetch=False`` in
    # ``over`` builds without it (for measurements).
    ESZ = 4 if dtype == "float32" else 2
    PF_STEP = 64 // ESZ
    PF_LINES = (Dqk * ESZ + 63) // 64 + 1 if SPARSE and over.get("prefetch", True) else 0
    QLINES = (Dqk * ESZ + 63) // 64 + 1
    ALINES = (Dv * 4 + 63) // 64 + 1
    WIDEN_Q = dtype != "float32"  # widen q once per work item into an fp32 scratch block

    def q_at(Q, Qf, t, h, d):
        return Qf[h, d] if WIDEN_Q else Q[t, h, d]

    def row_at(ROWS, t, j):
        """The k / v row of slot j: ROWS[t, j] (sparse) or j itself (dense: a range of rows)."""
        return ROWS[t, j] if SPARSE else j

    def ceil8(x):
        return (x + 7) // 8 * 8

    @T.macro
    def pv_tile(ACC, P, V, ROWS, alpha, t, lo, hi, start, sb, nsub, v0, W):
        """acc[h, v0:v0+W vectors] = alpha acc + P . v[rows] for the step's nsub keys, in
        register tiles of HB heads x W vectors."""
        for gt in range(lo, hi):
            r = T.alloc_buffer((HB, W, VLV), "float32", scope="local")
            for hh in T.unroll(HB):
                for dd in T.unroll(W):
                    for ll in T.vectorized(VLV):
                        r[hh, dd, ll] = ACC[t, gt * HB + hh, (v0 + dd) * VLV + ll] * alpha[
                            gt * HB + hh]
            for j in range(nsub):
                for hh in T.unroll(HB):
                    for dd in T.unroll(W):
                        for ll in T.vectorized(VLV):
                            r[hh, dd, ll] = r[hh, dd, ll] + P[gt * HB + hh, j] * f32(V[
                                row_at(ROWS, t, start + sb * KB + j), (gt * HB) // g,
                                (v0 + dd) * VLV + ll])
            for hh in T.unroll(HB):
                for dd in T.unroll(W):
                    for ll in T.vectorized(VLV):
                        ACC[t, gt * HB + hh, (v0 + dd) * VLV + ll] = r[hh, dd, ll]

    # One PrimFunc per mode; the PV tile is a T.macro, used twice (full tiles, the narrower last
    # one). ARG is idx [T, K] (sparse) or the ranges [T, 2] = (k_start, k_end) (dense).
    @T.prim_func
    def kernel(q_h: T.handle, k_h: T.handle, v_h: T.handle, a_h: T.handle, scale: T.float32,
               o_h: T.handle, lse_h: T.handle, nc: T.int32, nth: T.int32, bs: T.int32,
               nb: T.int32,
               st_h: T.handle, acc_h: T.handle, rows_h: T.handle, offs_h: T.handle):
        # noalias: k and v may be the same memory (absorbed MLA) but are only read; the buffers
        # written (out, lse and the scratch) are fresh.
        T.func_attr({"tirx.noalias": True})
        Tn = T.int64()
        S = T.int64()
        Kn = T.int64()
        sq0 = T.int64()
        sq1 = T.int64()
        sk0 = T.int64()
        sk1 = T.int64()
        sv0 = T.int64()
        sv1 = T.int64()
        Q = T.match_buffer(q_h, (Tn, i64(H), i64(Dqk)), sdt, strides=(sq0, sq1, i64(1)))
        Kt = T.match_buffer(k_h, (S, i64(Hk), i64(Dqk)), sdt, strides=(sk0, sk1, i64(1)))
        V = T.match_buffer(v_h, (S, i64(Hk), i64(Dv)), sdt, strides=(sv0, sv1, i64(1)))
        ARG = T.match_buffer(a_h, (Tn, Kn), "int32")
        OUT = T.match_buffer(o_h, (Tn, i64(H), i64(Dv)), sdt)
        LSE = T.match_buffer(lse_h, (Tn, i64(H)), "float32")
        # Scratch from the caller (TIR-allocated buffers would be compacted per iteration by
        # the lowering, but this state lives across the key-block passes): per-query online
        # softmax state ST[t, 0, h] = running max, ST[t, 1, h] = running sum, ACC = the
        # unnormalised output; sparse: each query's valid rows grouped by key block (block c =
        # rows [c*bs, (c+1)*bs)) in ROWS[t, OFFS[t, c] : OFFS[t, c + 1]], idx order kept
        # inside a block.
        NR = T.int64()
        NO = T.int64()
        ST = T.match_buffer(st_h, (Tn, i64(2), i64(H)), "float32")
        ACC = T.match_buffer(acc_h, (Tn, i64(H), i64(Dv)), "float32")
        ROWS = T.match_buffer(rows_h, (Tn, NR), "int32")
        OFFS = T.match_buffer(offs_h, (Tn, NO), "int32")
        if SPARSE:
            for tp in T.parallel(Tn):
                cur = T.alloc_buffer((T.Cast("int64", nb) + 1,), "int32")
                for c in range(nb + 1):
                    cur[c] = 0
                for j in range(Kn):
                    if ARG[tp, j] >= 0:
                        cur[ARG[tp, j] // bs + 1] = cur[ARG[tp, j] // bs + 1] + 1
                for c in range(nb):
                    cur[c + 1] = cur[c + 1] + cur[c]
                for c in range(nb + 1):
                    OFFS[tp, c] = cur[c]
                for j in range(Kn):
                    if ARG[tp, j] >= 0:
                        ROWS[tp, cur[ARG[tp, j] // bs]] = ARG[tp, j]
                        cur[ARG[tp, j] // bs] = cur[ARG[tp, j] // bs] + 1
        # Key-block passes (nb = 1 unless the keys outgrow the cache, see block_rows): in pass
        # b every query consumes its rows of block b, so all threads gather from one
        # cache-sized slice of k / v at a time.
        for b in range(nb):
            # one work chunk per thread (TVM would split the parallel loop the same way):
            # the scratch below is allocated once per chunk, not once per work item
            for th in T.parallel(nth):
                P = T.alloc_buffer((H, KB + 8), "float32")
                alpha = T.alloc_buffer((H,), "float32")
                Qf = T.alloc_buffer((H if WIDEN_Q else 1, Dqk), "float32")
                for p_ in range(T.Cast("int64", th) * (Tn * T.Cast("int64", nc))
                                // T.Cast("int64", nth),
                                (T.Cast("int64", th) + 1) * (Tn * T.Cast("int64", nc))
                                // T.Cast("int64", nth)):
                    # work item = (query, chunk of head tiles [lo, hi)); nc = 1 unless T is below
                    # the thread count. Queries in zig-zag order (0, T-1, 1, T-2, ...): each
                    # thread's contiguous share of the parallel loop mixes early and late queries,
                    # so causal work stays balanced.
                    tq = p_ // T.Cast("int64", nc)
                    cc = T.Cast("int32", p_ % T.Cast("int64", nc))
                    t = T.Select(tq % 2 == 0, tq // 2, Tn - 1 - tq // 2)
                    lo = cc * NHT // nc
                    hi = (cc + 1) * NHT // nc
                    # this query's keys in this pass: j < n, at row_at(start + min(j, n - 1))
                    start = OFFS[t, b] if SPARSE else ARG[t, 0]
                    n = (OFFS[t, b + 1] - OFFS[t, b]) if SPARSE else (ARG[t, 1] - ARG[t, 0])
                    if b == 0:
                        for h in range(lo * HB, hi * HB):
                            ST[t, 0, h] = T.float32(NEG_INF)
                            ST[t, 1, h] = T.float32(0.0)
                            for d in T.vectorized(Dv):
                                ACC[t, h, d] = T.float32(0.0)
                    # the next query this thread takes (sparse, one work item per query): its
                    # first step's rows are prefetched during this query's last step
                    tq_n = T.min(tq + 1, Tn - 1) if SPARSE else tq
                    tn0 = T.Select(tq_n % 2 == 0, tq_n // 2, Tn - 1 - tq_n // 2)
                    start_n0 = OFFS[tn0, b] if SPARSE else start
                    n_n0 = (OFFS[tn0, b + 1] - OFFS[tn0, b]) if SPARSE else n
                    # no next query (nc > 1, the last item) or it has no rows here: fall back to
                    # this query's last row
                    own = nc > 1 or n_n0 == 0
                    tn = T.Select(own, t, tn0)
                    start_n = T.Select(own, start, start_n0)
                    n_n = T.Select(own, n, n_n0)
                    nsteps = T.ceildiv(n, KB)
                    if PF_LINES > 0 and nb > 1:
                        # the next item's q and accumulator rows: with several key-block passes
                        # each item is short, and its state would otherwise arrive line by line
                        for h in range(lo * HB, hi * HB):
                            for ln in range(QLINES):
                                T.evaluate(T.call_llvm_intrin(
                                    "void", "llvm.prefetch.p0",
                                    T.address_of(Q[tn0, h, T.min(ln * PF_STEP, Dqk - 1)]),
                                    T.int32(0), T.int32(2), T.int32(1)))
                            for ln in range(ALINES):
                                T.evaluate(T.call_llvm_intrin(
                                    "void", "llvm.prefetch.p0",
                                    T.address_of(ACC[tn0, h, T.min(ln * 16, Dv - 1)]),
                                    T.int32(0), T.int32(2), T.int32(1)))
                    if n > 0:
                        if WIDEN_Q:
                            for h in range(lo * HB, hi * HB):
                                for d in T.vectorized(Dqk):
                                    Qf[h, d] = f32(Q[t, h, d])
                        for sb in range(nsteps):
                            # nsub keys in this step; score tiles cover ceil(nsub / JB) * JB slots,
                            # the softmax ceil8(nsub): the slots past nsub hold -inf.
                            nsub = T.min(n - sb * KB, KB)
                            for h in range(lo * HB, hi * HB):
                                for ll in T.vectorized(8):
                                    P[h, ceil8(nsub) - 8 + ll] = T.float32(NEG_INF)
                            # ---- P[h, j] = scale * q[t, h] . k[row j, hk]: register tiles of HB
                            # heads x JB keys x VL lanes, one horizontal sum per score
                            for jt in range(T.ceildiv(nsub, JB)):
                                if PF_LINES > 0:
                                    # prefetch the rows the next step's tile jt reads, into L2
                                    for jj in T.unroll(JB):
                                        for ln in T.unroll(PF_LINES):
                                            T.evaluate(T.call_llvm_intrin(
                                                "void", "llvm.prefetch.p0", T.address_of(Kt[
                                                    T.Select(
                                                        sb + 1 < nsteps,
                                                        ROWS[t, start + T.min(
                                                            (sb + 1) * KB + jt * JB + jj, n - 1)],
                                                        ROWS[tn, start_n + T.min(
                                                            jt * JB + jj, n_n - 1)]),
                                                    (lo * HB) // g,
                                                    T.min(ln * PF_STEP, Dqk - 1)]),
                                                T.int32(0), T.int32(2), T.int32(1)))
                                for gt in range(lo, hi):
                                    c = T.alloc_buffer((HB, JB, VL), "float32", scope="local")
                                    for hh in T.unroll(HB):
                                        for jj in T.unroll(JB):
                                            for ll in T.vectorized(VL):
                                                c[hh, jj, ll] = T.float32(0.0)
                                    for dq in range(NQ):
                                        for hh in T.unroll(HB):
                                            for jj in T.unroll(JB):
                                                for ll in T.vectorized(VL):
                                                    c[hh, jj, ll] = c[hh, jj, ll] + q_at(
                                                        Q, Qf, t, gt * HB + hh, dq * VL + ll
                                                    ) * f32(Kt[row_at(ROWS, t, start + T.min(
                                                        sb * KB + jt * JB + jj, n - 1)),
                                                        (gt * HB) // g, dq * VL + ll])
                                    for hh in T.unroll(HB):
                                        for jj in T.unroll(JB):
                                            s = T.alloc_buffer((1,), "float32", scope="local")
                                            s[0] = T.float32(0.0)
                                            for ll in T.unroll(VL):
                                                s[0] = s[0] + c[hh, jj, ll]
                                            P[gt * HB + hh, jt * JB + jj] = T.Select(
                                                jt * JB + jj < nsub, s[0] * scale,
                                                T.float32(NEG_INF))
                            # ---- online softmax: running max m, P = exp(S - m), l = alpha l + sum P
                            for h in range(lo * HB, hi * HB):
                                mv = T.alloc_buffer((8,), "float32", scope="local")
                                for ll in T.vectorized(8):
                                    mv[ll] = ST[t, 0, h]
                                for jo in range(T.ceildiv(nsub, 8)):
                                    for ll in T.vectorized(8):
                                        mv[ll] = T.max(mv[ll], P[h, jo * 8 + ll])
                                mx = T.alloc_buffer((1,), "float32", scope="local")
                                mx[0] = ST[t, 0, h]
                                for ll in T.unroll(8):
                                    mx[0] = T.max(mx[0], mv[ll])
                                for ll in T.vectorized(8):
                                    mv[ll] = T.float32(0.0)
                                for jo in range(T.ceildiv(nsub, 8)):
                                    for ll in T.vectorized(8):
                                        P[h, jo * 8 + ll] = fexp(T, P[h, jo * 8 + ll] - mx[0])
                                        mv[ll] = mv[ll] + P[h, jo * 8 + ll]
                                alpha[h] = fexp(T, ST[t, 0, h] - mx[0])
                                ss = T.alloc_buffer((1,), "float32", scope="local")
                                ss[0] = T.float32(0.0)
                                for ll in T.unroll(8):
                                    ss[0] = ss[0] + mv[ll]
                                ST[t, 1, h] = ST[t, 1, h] * alpha[h] + ss[0]
                                ST[t, 0, h] = mx[0]
                            # ---- acc = alpha acc + P . v[rows]: register tiles of HB heads x DVB
                            # vectors (the rescale rides on the tile load), then one narrower tile
                            # of REM vectors
                            for dt in range(NVT):
                                pv_tile(ACC, P, V, ROWS, alpha, t, lo, hi, start, sb, nsub,
                                        dt * DVB, DVB)
                            if REM > 0:
                                pv_tile(ACC, P, V, ROWS, alpha, t, lo, hi, start, sb, nsub,
                                        NVT * DVB, REM)
                    # ---- after the last pass: out = acc / l, lse = m + log l; no valid key: 0, -inf
                    if b == nb - 1:
                        total = (OFFS[t, nb] - OFFS[t, 0]) if SPARSE else n
                        for h in range(lo * HB, hi * HB):
                            if total > 0:
                                inv = T.float32(1.0) / ST[t, 1, h]
                                for d in T.vectorized(Dv):
                                    OUT[t, h, d] = to_out(ACC[t, h, d] * inv)
                                LSE[t, h] = ST[t, 0, h] + T.log(ST[t, 1, h])
                            else:
                                for d in T.vectorized(Dv):
                                    OUT[t, h, d] = to_out(T.float32(0.0))
                                LSE[t, h] = T.float32(NEG_INF)

    return kernel.with_attr("global_symbol", name)


# --------------------------------------------------------------------------- torch-facing side
def _unit_inner(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is unit-stride (any outer strides are bound symbolically),
    else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the kernel reads them. v a prefix view of k (absorbed MLA) stays a view of
    the k the kernel reads, so k's rows are never copied twice (usually not at all)."""
    prefix_view = (
        v.data_ptr() == k.data_ptr() and v.shape[:2] == k.shape[:2]
        and v.stride() == k.stride() and v.shape[2] <= k.shape[2]
    )
    kk = _unit_inner(k)
    if prefix_view:
        return kk, kk[..., : v.shape[2]]
    return kk, _unit_inner(v)


def _scratch(T: int, H: int, Dv: int, rows: int, blocks: int) -> tuple[torch.Tensor, ...]:
    """The kernel's working buffers: online-softmax state [T, 2, H] and accumulator [T, H, Dv]
    (fp32), and for sparse mode the block-grouped row lists [T, rows] and their offsets
    [T, blocks + 1] (int32; a dummy [T, 1] each for dense mode)."""
    return (torch.empty(T, 2, H), torch.empty(T, H, Dv),
            torch.empty(T, max(rows, 1), dtype=torch.int32),
            torch.empty(T, blocks + 1, dtype=torch.int32))


def _empty_result(q: torch.Tensor, Dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, H = q.shape[0], q.shape[1]
    return (torch.zeros(T, H, Dv, dtype=q.dtype),
            torch.full((T, H), float("-inf"), dtype=torch.float32))


def _variant(context: Callable[[], Any], op: str, mode: str, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> Callable[..., Any]:
    H, Dqk, Hk, Dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    dt = _TVM_DTYPES[q.dtype]
    key = {"H": H, "Hk": Hk, "Dqk": Dqk, "Dv": Dv, "dtype": dt, "rev": REV}
    sym = f"glm5_{mode}_attention"
    return context().kernel(op, key, lambda: build(mode, H, Hk, Dqk, Dv, dt, sym), sym)


_num_threads: Callable[[], int] | None = None


def threads() -> int:
    """Worker threads of TVM's pool. TVM sizes it from TVM_NUM_THREADS, else from
    hardware_concurrency / 2 on x86 (it assumes SMT): 1 thread on a 2-vCPU VM."""
    global _num_threads
    if _num_threads is None:
        _num_threads = runtime_function("runtime.NumThreads")
    return int(_num_threads())


def head_chunks(T: int, H: int, Hk: int, Dqk: int, Dv: int) -> int:
    """Work items per query: 1, or (fewer queries than threads: decode) enough chunks of
    head tiles to give every thread work."""
    n = threads()
    if T >= n:
        return 1
    return max(1, min(H // plan(H, Hk, Dqk, Dv)["hb"], -(-n // T)))


# Bytes of k / v rows one key-block pass gathers from (see block_rows): a slice that stays in a
# shared last-level cache; 4-6 MiB blocks beat 2 and 12 MiB (docs/performance.md).
# GLM5_TVM_SPARSE_BLOCK_BYTES overrides.
BLOCK_BYTES = int(os.environ.get("GLM5_TVM_SPARSE_BLOCK_BYTES", 6 << 20))
# A pass pays off only when each of its rows is gathered this many times on average ...
MIN_REUSE = 2
# ... and when what a query gathers in one pass is this many times the query state the pass
# reloads (its q, and its fp32 accumulator read and written): each extra pass costs that state
# again, so passes are kept to >= ~3x the state (the forced-pass costs: docs/performance.md).
MIN_GATHER_PER_STATE = 3


def block_rows(idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[int, int]:
    """(rows per key-block pass, number of passes) for sparse_attention of q [T, H, Dqk] over
    ``idx`` [T, K] into k [S, Hk, Dqk] / v [S, Hk, Dv].

    One pass over all used rows (0 … max(idx)) unless they outgrow BLOCK_BYTES, the T·K
    gathers reuse each row at least MIN_REUSE times, and each pass still gathers
    MIN_GATHER_PER_STATE times the per-query state it reloads; then equal blocks of at most
    BLOCK_BYTES. In pass b every query consumes its rows of block b, so the rows being
    gathered stay in the last-level cache while all queries take their share; the online
    softmax carries each query's state across passes."""
    T, K = idx.shape
    S = int(idx.max()) + 1 if idx.numel() else 0
    if S <= 0:
        return 1, 1
    row = k.stride(0) * k.element_size()
    if v.data_ptr() != k.data_ptr():
        row += v.stride(0) * v.element_size()
    H, Dqk, Dv = q.shape[1], q.shape[2], v.shape[2]
    state = H * Dqk * q.element_size() + 2 * H * Dv * 4
    nb = min(-(-S * row // max(BLOCK_BYTES, 1)),
             max(1, K * row // max(1, MIN_GATHER_PER_STATE * state)))
    if nb <= 1 or T * K < MIN_REUSE * S:
        return S, 1
    bs = -(-S // nb)
    return bs, -(-S // bs)


def _chunks(T: int, nc: int) -> int:
    """Parallel chunks of the T·nc work items: one per TVM worker thread."""
    return max(1, min(threads(), T * nc))


def _supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Any) -> bool:
    """CPU tensors of a dtype the kernels read, with non-empty head dims."""
    ts = [q, k, v] + [a for a in rest if isinstance(a, torch.Tensor)]
    return (all(t.device.type == "cpu" for t in ts) and q.dtype in _TVM_DTYPES
            and q.dim() == 3 and k.dim() == 3 and v.dim() == 3
            and min(q.shape[1], q.shape[2], k.shape[1], v.shape[2]) > 0)


def make_sparse_attention(context: Callable[[], Any]) -> Callable[..., Any]:
    def sparse_attention(q, k, v, idx, scale):
        T, H, _ = q.shape
        Dv = v.shape[2]
        if T == 0 or k.shape[0] == 0 or idx.shape[1] == 0:
            return _empty_result(q, Dv)
        fn = _variant(context, "sparse_attention", "sparse", q, k, v)
        kk, vv = _kv(k, v)
        out = torch.empty(T, H, Dv, dtype=q.dtype)
        lse = torch.empty(T, H, dtype=torch.float32)
        nc = head_chunks(T, H, k.shape[1], q.shape[2], Dv)
        idx = idx.to(torch.int32).contiguous()
        bs, nb = block_rows(idx, q, kk, vv)
        fn(bits(_unit_inner(q)), bits(kk), bits(vv), idx,
           float(scale), bits(out), lse, nc, _chunks(T, nc), bs, nb,
           *_scratch(T, H, Dv, rows=idx.shape[1], blocks=nb))
        return out, lse

    return sparse_attention


def make_attention(context: Callable[[], Any]) -> Callable[..., Any]:
    def attention(q, k, v, k_start, k_end, scale):
        T, H, _ = q.shape
        Dv = v.shape[2]
        if T == 0 or k.shape[0] == 0:
            return _empty_result(q, Dv)
        fn = _variant(context, "attention", "dense", q, k, v)
        kk, vv = _kv(k, v)
        out = torch.empty(T, H, Dv, dtype=q.dtype)
        lse = torch.empty(T, H, dtype=torch.float32)
        ranges = torch.stack((k_start, k_end), dim=1).to(torch.int32)
        nc = head_chunks(T, H, k.shape[1], q.shape[2], Dv)
        fn(bits(_unit_inner(q)), bits(kk), bits(vv), ranges, float(scale), bits(out), lse, nc,
           _chunks(T, nc), max(1, kk.shape[0]), 1, *_scratch(T, H, Dv, rows=0, blocks=0))
        return out, lse

    return attention


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    """Rows for the cpu backend: (op, fn, dtypes, supports)."""
    return [
        ("sparse_attention", make_sparse_attention(context), DTYPES, _supports),
        ("attention", make_attention(context), DTYPES, _supports),
    ]
