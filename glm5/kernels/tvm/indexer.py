"""TVM (llvm, host CPU) kernels for the DSA lightning indexer and the fused `indexer_topk`.

One TensorIR kernel computes a tile of indexer scores for a block of queries:

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])   for k_start[t] <= s < k_end[t]

It is a register-blocked micro-kernel: the keys are packed once per call into chunks of
``NS`` keys laid out ``[chunk, Di, NS]`` (fp32), and for one (query, chunk) the kernel keeps an
``HB x NS`` block of fp32 dot products in vector registers (``q[t, h, d]`` broadcast, one
vector load of the chunk per ``d``: the vectors run along the keys, so no horizontal reduction
over ``Di`` is needed), so a chunk of keys is loaded once and reused across all the heads of
the query; ReLU and the ``w``-weighted head sum are applied to the registers before the next
block of heads — a ``[T, Hi, S]`` tensor never exists. Chunks outside a query's range are not
computed (only written as −inf / "invalid"). The parallel loop runs over (query, chunk) pairs.
HB is 8 on AVX-512 hosts (8 zmm accumulators hide the FMA latency) and 4 elsewhere
(`heads_per_block`, from the CPU's flags at run time).

Keys in place (decode). Packing costs a transposed fp32 copy of every key per call; a prefill
call reuses each packed chunk for many queries, a decode call reads each key once or a few
times, and there the copy was most of the call. So a call whose queries read each key at most
DIRECT_MAX_USES times on average (`keys_direct`) runs the kernel's *direct* variant: each work
item transposes its NS rows of ``k`` (in k's own dtype, bf16 widened by a shift; 16 x 16
blocks in registers; through the paged rows for ``paged_indexer_topk``) into an fp32
``[Di, NS]`` scratch, then the same
micro-kernel. The measured break-even is ~24 reads per key (docs/performance.md).

Sequence lengths are symbolic (``T``, ``S``, the tile bounds), so a new length never
recompiles. The kernel computes in fp32: bf16/fp16 ``k`` is converted (exactly) when it is
packed, and ``q`` one query block at a time on the host — converting inside the kernel costs
four instructions per broadcast and halved its speed. So the variant key is (Hi, Di, HB), plus
k's dtype for the direct variant, compute dtype fp32; one module per variant (built once,
cached on disk by `TVMContext`) serves both ops.

The kernel has two output modes:

* ``scores``: fp32 scores with −inf outside the range (``lightning_indexer``).
* ``keys``: int64 selection keys (``indexer_topk``): the score's bits mapped to an
  order-preserving integer (−0.0 folded onto +0.0) in the high 32 bits and ``2**32 − 1 − s`` in
  the low 32 bits, so every key is distinct and the integer order *is* the op's order (score
  descending, ties to the smaller index). Invalid entries (out of range, non-finite score) are
  INT64_MIN. Selecting the largest keys is exact, with no tie ambiguity.

``indexer_topk`` streams: for each block of ``TILE_T`` queries it walks the union of their key
ranges in tiles of ``TILE_S`` keys, has the kernel write the tile's keys next to the running
top-k (``[TILE_T, kb + TILE_S]`` int64, ``kb = min(topk, union range)``), keeps the top ``kb`` of
the two with the radix-select kernel of ``select.py`` (sorted at the last tile; faster than
``torch.topk`` on these rows), and a second small kernel decodes them
into the int32 output rows (−1 for invalid; the tail past ``kb`` stays −1). Memory holds that
scratch, a packed fp32 copy of ``k`` (not for decode calls), one fp32 query block (bf16/fp16
``q``) and the ``[T, topk]`` output — never ``[T, S]`` scores.

``paged_indexer_topk`` (keys in a pool of pages, read through a block table) runs the same
streaming selection: the keys each sequence's queries see are gathered through the table
straight into the packed buffer (the copy ``indexer_topk`` makes of ``k`` anyway), one sequence
after another in logical order, a batch of sequences of up to PAGED_BATCH_KEYS keys at a time
(packed, then run while still in cache); queries are grouped by sequence and a query block never
mixes sequences, so a decode batch of many sequences selects each query over its own sequence's
keys only (a shared block would select over all of them). Compact indices map back to pool rows.
A decode batch reads its keys in place through the same rows instead of gathering them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from glm5.host_cpu import missing
from glm5.ir.paging import pool_rows
from glm5.kernels.tvm import select
from glm5.kernels.tvm.fp8_rows import dequantized_rows, e4m3_rows
from glm5.kernels.tvm.tirlib import bits, butterfly, storage, widen

NS = 16  # keys per chunk (two AVX2 fp32 vectors)
HB_MAX = 4  # heads per register block where the CPU is not known (heads_per_block)
TILE_T = 64  # queries per block: the block's [TILE_T, kb + TILE_S] int64 keys (4 MiB) stay in
# cache for the selection passes (256 made them 16 MiB, out of cache, and the call slower)
TILE_S = 8192  # keys per streamed tile (indexer_topk); a multiple of NS
REV = 10  # bump when the kernel source changes (part of the on-disk cache key)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # q/k dtypes served
INT64_MIN = -(2**63)


# --------------------------------------------------------------------------- the TensorIR kernel
def heads_per_block() -> int:
    """HB: heads whose ``HB x NS`` fp32 dot products stay in vector registers. 8 with AVX-512
    (8 zmm accumulators hide the FMA latency; docs/performance.md has the timing); 4 elsewhere
    (on AVX2 a 16-lane vector is two ymm registers, so 4 heads already take 8 of the 16)."""
    return 8 if missing("avx512f") is None else HB_MAX


def _widen16(T: Any, v: Any, dtype: str) -> Any:
    """NS stored elements (a vector of ``dtype``'s storage) as fp32 lanes."""
    if dtype == "bfloat16":
        return T.reinterpret(f"float32x{NS}", T.shift_left(T.Cast(f"uint32x{NS}", v),
                                                           T.broadcast(T.uint32(16), NS)))
    return v if dtype == "float32" else T.Cast(f"float32x{NS}", v)


def _kval(kp: Any, kc: Any, sb: Any, d: Any, j: Any, direct: bool) -> Any:
    """Key element (dim ``d``, lane ``j``) of the chunk starting at key ``sb``: from the packed
    keys, or (direct) from the work item's chunk transposed out of ``k``'s rows."""
    return kc[d, j] if direct else kp[sb // NS, d, j]


@functools.lru_cache(maxsize=None)
def _generic_score_tile(mode: str, HB: int = HB_MAX, direct: str | None = None) -> Any:
    """The kernel with Hi and Di as trailing scalar parameters, parsed once per (mode, HB,
    direct); `build_score_tile` specialises them to constants (cheaper than parsing per
    variant). ``direct``: None reads the packed keys ``[NC, Di, NS]`` fp32; a dtype name reads
    ``k`` [S, Di] itself (bf16 as its uint16 bits), each work item transposing its chunk of NS
    keys into registers-sized scratch (decode: no packed copy of the cache per call)."""
    from tvm.script import tirx as T

    assert mode in ("scores", "keys")
    out_dtype = "float32" if mode == "scores" else "int64"
    keys = mode == "keys"
    NEG = float("-inf")
    kst = storage(direct) if direct else "float32"
    dk = direct is not None  # parse-time switch

    @T.prim_func
    def score_tile(q_h: T.handle, kp_h: T.handle, rows_h: T.handle, w_h: T.handle,
                   ks_h: T.handle, ke_h: T.handle, out_h: T.handle, t0: T.int32, s0: T.int32,
                   ncols: T.int32, coff: T.int32, clear: T.int32, Hi: T.int32, Di: T.int32):
        T.func_attr({"global_symbol": "score_tile", "tirx.noalias": True})
        Tn = T.int32()
        NC = T.int32()
        Tb = T.int32()
        W = T.int32()
        C = T.int32()
        q = T.match_buffer(q_h, (Tb, Hi, Di), "float32")  # the block's queries
        # packed: [NC chunks, Di, NS]; direct: k's NC rows, key s being row rows[s]
        kp = T.match_buffer(kp_h, (NC, Di) if dk else (NC, Di, NS), kst)
        rows = T.match_buffer(rows_h, (C,), "int64")  # direct only (packed: empty)
        w = T.match_buffer(w_h, (Tn, Hi), "float32")
        ks = T.match_buffer(ks_h, (Tn,), "int32")
        ke = T.match_buffer(ke_h, (Tn,), "int32")
        out = T.match_buffer(out_h, (Tb, W), out_dtype)
        for p in T.parallel(Tb * ((ncols + NS - 1) // NS)):
            acc = T.alloc_buffer((HB, NS), "float32", scope="global")
            sc = T.alloc_buffer((NS,), "float32", scope="global")
            kc = T.alloc_buffer((Di if dk else 1, NS), "float32", scope="global")
            tb = T.alloc_buffer((2 if dk else 1, NS, NS), "float32", scope="local")
            tt = T.bind(p // ((ncols + NS - 1) // NS))
            c = T.bind(p % ((ncols + NS - 1) // NS))
            t = T.bind(t0 + tt)
            lo = T.bind(ks[t])
            hi = T.bind(ke[t])
            sb = T.bind(s0 + c * NS)
            if keys:
                if clear != 0 and c == 0:
                    for j in range(coff):
                        out[tt, j] = T.min_value("int64")
            if sb < hi and sb + NS > lo:
                if dk:
                    # keys past the last are read clamped (their scores are masked). Blocks of
                    # NS dims: NS rows loaded as vectors, transposed in registers by four
                    # butterfly stages (stage d swaps bit d of the row and column index); the
                    # Di % NS last dims one by one.
                    for db in range(Di // NS):
                        for i in T.unroll(NS):
                            tb[0, i, T.ramp(0, 1, NS)] = _widen16(T, kp[
                                rows[T.min(sb + i, C - 1)], T.ramp(db * NS, 1, NS)], direct)
                        for i in T.unroll(NS):
                            tb[1, i, T.ramp(0, 1, NS)] = butterfly(T, tb, 0, i, 8)
                        for i in T.unroll(NS):
                            tb[0, i, T.ramp(0, 1, NS)] = butterfly(T, tb, 1, i, 4)
                        for i in T.unroll(NS):
                            tb[1, i, T.ramp(0, 1, NS)] = butterfly(T, tb, 0, i, 2)
                        for i in T.unroll(NS):
                            kc[db * NS + i, T.ramp(0, 1, NS)] = butterfly(T, tb, 1, i, 1)
                    for j in range(NS):
                        for d in range(Di // NS * NS, Di):
                            kc[d, j] = widen(T, kp[rows[T.min(sb + j, C - 1)], d], direct)
                for j in T.vectorized(NS):
                    sc[j] = T.float32(0)
                # Full blocks of HB heads, then one block of the Hi % HB remaining heads: an
                # HB x NS (or smaller) block of dot products lives in vector registers.
                for hb in range(Hi // HB):
                    for i in T.unroll(HB):
                        for j in T.vectorized(NS):
                            acc[i, j] = T.float32(0)
                    for d in range(Di):
                        for i in T.unroll(HB):
                            for j in T.vectorized(NS):
                                acc[i, j] = acc[i, j] + q[tt, hb * HB + i, d] * _kval(
                                    kp, kc, sb, d, j, dk)
                    for i in T.unroll(HB):
                        for j in T.vectorized(NS):
                            # relu as a select that keeps NaN (like torch.relu)
                            sc[j] = sc[j] + w[t, hb * HB + i] * T.if_then_else(
                                acc[i, j] < T.float32(0), T.float32(0), acc[i, j])
                if Hi % HB > 0:
                    for i in T.unroll(Hi % HB):
                        for j in T.vectorized(NS):
                            acc[i, j] = T.float32(0)
                    for d in range(Di):
                        for i in T.unroll(Hi % HB):
                            for j in T.vectorized(NS):
                                acc[i, j] = acc[i, j] + q[tt, Hi // HB * HB + i, d] * _kval(
                                    kp, kc, sb, d, j, dk)
                    for i in T.unroll(Hi % HB):
                        for j in T.vectorized(NS):
                            sc[j] = sc[j] + w[t, Hi // HB * HB + i] * T.if_then_else(
                                acc[i, j] < T.float32(0), T.float32(0), acc[i, j])
                for j in range(NS):
                    if c * NS + j < ncols:
                        if keys:
                            out[tt, coff + c * NS + j] = T.if_then_else(
                                sb + j >= lo and sb + j < hi
                                and (T.reinterpret("int32", sc[j]) & 0x7F800000) != 0x7F800000,
                                T.Cast("int64", T.if_then_else(
                                    sc[j] == T.float32(0), 0,
                                    T.if_then_else(T.reinterpret("int32", sc[j]) < 0,
                                                   T.reinterpret("int32", sc[j]) ^ 0x7FFFFFFF,
                                                   T.reinterpret("int32", sc[j]))))
                                * T.int64(4294967296) + T.int64(4294967295)
                                - T.Cast("int64", sb + j),
                                T.min_value("int64"))
                        else:
                            out[tt, coff + c * NS + j] = T.if_then_else(
                                sb + j >= lo and sb + j < hi, sc[j], T.float32(NEG))
            else:
                for j in range(NS):
                    if c * NS + j < ncols:
                        if keys:
                            out[tt, coff + c * NS + j] = T.min_value("int64")
                        else:
                            out[tt, coff + c * NS + j] = T.float32(NEG)

    return score_tile


def build_score_tile(Hi: int, Di: int, mode: str, HB: int = HB_MAX,
                     direct: str | None = None) -> Any:
    """The PrimFunc ``score_tile(q, kp, rows, w, ks, ke, out, t0, s0, ncols, coff, clear)`` for
    static Hi and Di.

    ``q`` [Tb, Hi, Di] fp32 holds the block's queries, rows ``t0 .. t0 + Tb`` of
    ``w``/``ks``/``ke``; ``out`` has Tb rows; keys ``s0 .. s0 + ncols``
    (``s0`` a multiple of NS); the tile is written to ``out[:, coff : coff + ncols]``, and
    ``out[:, :coff]`` is set to INT64_MIN when ``clear`` (keys mode: an empty running top-k).
    ``kp`` is the packed key tensor ``[S_pad / NS, Di, NS]`` fp32 (``rows`` empty); with
    ``direct`` (a dtype name) it is a key pool [R, Di] of that dtype and key ``s`` is its row
    ``rows[s]`` (int64 [S]).
    """
    f = _generic_score_tile(mode, HB, direct)
    hi_var, di_var = f.params[-2], f.params[-1]
    return f.specialize({hi_var: Hi, di_var: Di})


def build_decode() -> Any:
    """``decode(keys, idx, t0, n)``: ``idx[t0 + i, j]`` = the key index of ``keys[i, j]`` as
    int32, −1 for INT64_MIN, for ``j < min(keys.shape[1], n)`` (``idx`` may be wider)."""
    from tvm.script import tirx as T

    @T.prim_func
    def decode(keys_h: T.handle, idx_h: T.handle, t0: T.int32, n: T.int32):
        T.func_attr({"global_symbol": "decode", "tirx.noalias": True})
        Tb = T.int32()
        K = T.int32()
        Tn = T.int32()
        Kout = T.int32()
        keys = T.match_buffer(keys_h, (Tb, K), "int64")
        idx = T.match_buffer(idx_h, (Tn, Kout), "int32")
        for tt in T.parallel(Tb):
            for j in range(T.min(K, n)):
                idx[t0 + tt, j] = T.if_then_else(
                    keys[tt, j] == T.min_value("int64"), -1,
                    # the low 32 bits hold 2**32 - 1 - s, i.e. -1 - s as an int32
                    T.int32(-1) - T.Cast("int32", keys[tt, j]))

    return decode


def build_module(Hi: int, Di: int, HB: int = HB_MAX, direct: str | None = None) -> Any:
    """One module per variant, serving both ops: ``score_tile`` (fp32 scores), ``key_tile``
    (selection keys) and ``decode``; ``direct``: the variant reading keys of that dtype in
    place (`build_score_tile`)."""
    import tvm

    return tvm.IRModule({
        "score_tile": build_score_tile(Hi, Di, "scores", HB, direct),
        "key_tile": build_score_tile(Hi, Di, "keys", HB, direct).with_attr("global_symbol",
                                                                           "key_tile"),
        "decode": build_decode(),
    })


def _kernels(context: Callable[[], Any], Hi: int, Di: int, *symbols: str,
             direct: str | None = None) -> list[Callable[..., Any]]:
    hb = heads_per_block()
    key = {"Hi": Hi, "Di": Di, "dtype": "float32", "ns": NS, "hb": hb, "rev": REV}
    if direct is not None:
        key["direct"] = direct
    ctx = context()
    return [ctx.kernel("indexer", key, lambda: build_module(Hi, Di, hb, direct), sym)
            for sym in symbols]


# --------------------------------------------------------------------------- host-side helpers
PACK_KEYS = 4096  # keys per step of pack_keys: the gathered block stays in cache (1-2 MiB)
PAGED_BATCH_KEYS = 8192  # paged_indexer_topk packs and runs sequences in batches of up to
# this many keys (4 MiB packed at Di = 128): still in cache when the kernel reads them


def pack_keys(k: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """k [S, Di] (or its rows ``rows`` [n] int64, gathered in that order) -> [ceil(n / NS), Di,
    NS] fp32 (zero padded): one chunk is contiguous. Written block by block, each block's keys
    (gathered and) transposed and converted in one cache-resident copy: one pass over memory
    (zero-fill, copy and transpose of the whole buffer took three, and the pack was most of a
    long decode call)."""
    n, Di = (k.shape[0] if rows is None else rows.numel()), k.shape[1]
    nc = max(1, -(-n // NS))
    kp = torch.empty(nc, Di, NS, dtype=torch.float32)
    full = n // NS
    step = max(1, PACK_KEYS // NS)
    for c0 in range(0, full, step):
        c1 = min(full, c0 + step)
        src = k[c0 * NS: c1 * NS] if rows is None else k.index_select(0, rows[c0 * NS: c1 * NS])
        kp[c0:c1].copy_(src.view(c1 - c0, NS, Di).transpose(1, 2))
    if full < nc:  # the last, partial chunk: zero padded
        tail = k[full * NS: n] if rows is None else k.index_select(0, rows[full * NS: n])
        kp[full].zero_()
        kp[full, :, : n - full * NS].copy_(tail.transpose(0, 1))
    return kp


DIRECT_MAX_USES = 16  # a call whose queries read each key at most this often on average
# (decode) scores k in place; more (prefill) packs it once and reuses the packed chunks
_NO_ROWS = torch.empty(0, dtype=torch.int64)


def keys_direct(uses: int, keys: int) -> bool:
    """Whether a call reading ``keys`` keys ``uses`` times in all (the sum of its queries'
    range lengths) scores them in place: packing costs a transposed fp32 copy of every key
    (most of a decode call), reading in place a transpose per (query, chunk)."""
    return uses <= DIRECT_MAX_USES * max(1, keys)


def _key_source(k: torch.Tensor, rows: torch.Tensor | None, direct: bool
                ) -> tuple[torch.Tensor, torch.Tensor, str | None]:
    """(kp, rows, direct dtype) for the kernels: k itself (as stored; bf16 as uint16 bits) with
    the rows its keys are (all of k in order, or ``rows``), or the packed keys."""
    if direct:
        n = k.shape[0] if rows is None else rows.numel()
        r = torch.arange(n, dtype=torch.int64) if rows is None else rows.to(torch.int64)
        return bits(k.contiguous()), r, str(k.dtype).split(".")[1]
    return pack_keys(k, rows), _NO_ROWS, None


def _prep(k, w, k_start, k_end):
    ks = k_start.to(torch.int32).contiguous()
    ke = k_end.to(torch.int32).contiguous()
    direct = keys_direct(int((ke.long() - ks.long()).clamp(min=0).sum()), k.shape[0])
    return (*_key_source(k, None, direct), w.to(torch.float32).contiguous(), ks, ke)


def _q_block(q: torch.Tensor, t0: int, tb: int) -> torch.Tensor:
    """The block's queries, fp32 contiguous (a view for contiguous fp32 q; bf16/fp16 are
    converted exactly, one block at a time)."""
    return q[t0: t0 + tb].to(torch.float32).contiguous()


def _supports(q, k, w, k_start, k_end, *rest) -> bool:
    return (
        q.dtype in DTYPES and k.dtype == q.dtype and w.dtype in (torch.float32, q.dtype)
        and all(x.device.type == "cpu" for x in (q, k, w, k_start, k_end))
        and q.dim() == 3 and q.shape[1] > 0 and q.shape[2] > 0
        and k.shape[0] < 2**31 - NS
    )


# --------------------------------------------------------------------------- the ops
def lightning_indexer(context: Callable[[], Any], q, k, w, k_start, k_end) -> torch.Tensor:
    T_, Hi, Di = q.shape
    S = k.shape[0]
    out = torch.empty(T_, S, dtype=torch.float32)
    if T_ == 0 or S == 0:
        return out
    kp, kr, direct, wc, ks, ke = _prep(k, w, k_start, k_end)
    (fn,) = _kernels(context, Hi, Di, "score_tile", direct=direct)
    for t0 in range(0, T_, TILE_T):
        rows = out[t0: t0 + TILE_T]  # contiguous row block
        fn(_q_block(q, t0, rows.shape[0]), kp, kr, wc, ks, ke, rows, t0, 0, S, 0, 0)
    return out


def _block_ranges(ks: torch.Tensor, ke: torch.Tensor, tile_t: int) -> list[tuple[int, int]]:
    """Per query block: the union [lo, hi) of its non-empty ranges ((0, 0) when none)."""
    T_ = ks.shape[0]
    nb = -(-T_ // tile_t)
    pad = nb * tile_t - T_
    ks64, ke64 = ks.long(), ke.long()
    nonempty = ke64 > ks64
    lo = torch.where(nonempty, ks64, torch.iinfo(torch.int64).max)
    hi = torch.where(nonempty, ke64, 0)
    if pad:
        lo = torch.cat((lo, lo.new_full((pad,), torch.iinfo(torch.int64).max)))
        hi = torch.cat((hi, hi.new_zeros(pad)))
    lo_b = lo.view(nb, tile_t).min(dim=1).values
    hi_b = hi.view(nb, tile_t).max(dim=1).values
    return [(int(a), int(b)) if b > 0 else (0, 0) for a, b in zip(lo_b.tolist(), hi_b.tolist())]


def indexer_topk(context: Callable[[], Any], q, k, w, k_start, k_end, topk: int) -> torch.Tensor:
    T_, Hi, Di = q.shape
    S = k.shape[0]
    idx = torch.full((T_, topk), -1, dtype=torch.int32)
    if T_ == 0 or S == 0:
        return idx
    kp, kr, direct, wc, ks, ke = _prep(k, w, k_start, k_end)
    tile_t = min(TILE_T, T_)
    blocks = [(b * tile_t, min(tile_t, T_ - b * tile_t), lo, hi)
              for b, (lo, hi) in enumerate(_block_ranges(ks, ke, tile_t))]
    _stream_topk(context, q, kp, kr, direct, wc, ks, ke, topk, min(topk, S), blocks, idx)
    return idx


def _stream_topk(context: Callable[[], Any], q: torch.Tensor, kp: torch.Tensor,
                 kr: torch.Tensor, direct: str | None, wc: torch.Tensor,
                 ks: torch.Tensor, ke: torch.Tensor, topk: int, kmax: int,
                 blocks: list[tuple[int, int, int, int]], idx: torch.Tensor) -> None:
    """The streaming selection of ``indexer_topk`` over query blocks ``(t0, tb, lo, hi)``:
    queries t0 .. t0 + tb (at most TILE_T) whose key ranges lie in [lo, hi) of the keys
    (`_key_source`: packed ``kp``, or ``kp``'s rows ``kr`` read in place when ``direct``);
    writes their rows of ``idx`` (key indices, -1 tail). ``kmax``: no row has more valid keys
    (bounds the scratch)."""
    Hi, Di = q.shape[1], q.shape[2]
    fn, decode = _kernels(context, Hi, Di, "key_tile", "decode", direct=direct)
    tile_t = max((tb for _, tb, _, _ in blocks), default=1)
    tile_s = max(NS, TILE_S - TILE_S % NS)
    if kmax > select.MAX_KP:
        raise ValueError(f"glm5 cpu indexer_topk: topk expected at most {select.MAX_KP} for "
                         f"the TVM selection kernel, got {topk}")
    pick = select.select_kernel(context)
    # Flat scratch, viewed per block as [tb, kb + tile_s] (running top-k | tile), the
    # selection's scratch and its [tb, KP] output (KP = kb rounded up to a power of two).
    cand = torch.empty(tile_t * (kmax + tile_s), dtype=torch.int64)
    scratch = torch.empty(tile_t * (kmax + tile_s), dtype=torch.int64)
    sel = torch.empty(tile_t * select.pow2_at_least(kmax), dtype=torch.int64)
    for t0, tb, lo, hi in blocks:
        if hi <= lo:
            continue  # no query of the block has a key: all −1
        kb = min(kmax, hi - lo)  # no row of the block has more valid keys than its union range
        buf = cand[: tb * (kb + tile_s)].view(tb, kb + tile_s)
        kpad = select.pow2_at_least(kb)
        best = sel[: tb * kpad].view(tb, kpad)
        qb = _q_block(q, t0, tb)
        start = lo - lo % NS
        tiles = list(range(start, hi, tile_s))
        for i, s0 in enumerate(tiles):
            ncols = min(tile_s, hi - s0)
            last = i == len(tiles) - 1
            alone = i == 0 and ncols >= kb  # nothing selected yet: the tile alone
            fn(qb, kp, kr, wc, ks, ke, buf, t0, s0, ncols, kb, int(i == 0 and not alone))
            region = buf[:, kb: kb + ncols] if alone else buf[:, : kb + ncols]
            w_ = region.shape[1]
            pick(region, scratch[: tb * w_].view(tb, w_), best, kb, int(last))
            if last:
                decode(best, idx, t0, kb)
            else:
                buf[:, :kb] = best[:, :kb]


def paged_indexer_topk(context: Callable[[], Any], q, k, w, block_table, seq, k_len,
                       page_size: int, topk: int, k_scale: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """``indexer_topk`` through a paged key pool (docs/ops.md#paged_indexer_topk). Queries are
    grouped by sequence; the keys each group sees are gathered through ``block_table``
    straight into a packed buffer in logical order, and the group's queries stream over them
    (query blocks never mix sequences, so a decode batch does not select over every sequence's
    keys). Consecutive groups are packed and run together up to PAGED_BATCH_KEYS keys, so the
    packed keys are still in cache when the kernel reads them (one packed buffer for a whole
    decode batch made a decode call slower: it had left the cache when read). The
    selected compact indices map back to pool rows.

    With ``k_scale`` (`paged_indexer_topk_fp8`: ``k`` e4m3 codes, q already the e4m3 values,
    see `paged_indexer_topk_fp8`) each batch's key rows are dequantized into a bf16 buffer
    first (`fp8_rows`: exact), which the same streaming selection reads."""
    T_ = q.shape[0]
    idx = torch.full((T_, topk), -1, dtype=torch.int32)
    if T_ == 0 or k.shape[0] == 0:
        return idx
    seq64, kl = seq.long(), k_len.long()
    order = None
    if T_ > 1 and bool((seq64[1:] < seq64[:-1]).any()):
        order = torch.argsort(seq64, stable=True)  # grouped by sequence, in query order within
        seq64, kl = seq64[order], kl[order]
    uniq, counts = torch.unique_consecutive(seq64, return_counts=True)
    gid = torch.repeat_interleave(torch.arange(uniq.numel()), counts)
    need = torch.zeros(uniq.numel(), dtype=torch.int64).scatter_reduce(0, gid, kl, "amax")
    ends = need.cumsum(0)
    first = ends - need
    C = int(ends[-1])
    if C == 0:
        return idx
    if int(need.max()) >= 2**31 - NS:
        raise ValueError(f"glm5 cpu paged_indexer_topk: k_len expected below {2**31 - NS}, "
                         f"got {int(need.max())}")
    # compact key c -> pool row: sequence g's logical keys 0 .. need[g] - 1, one after another
    c = torch.arange(C)
    g = torch.searchsorted(ends, c, right=True)
    j = c - first[g]
    rows = pool_rows(block_table, uniq[g], j, page_size)
    ks64 = first[gid]
    qs = q if order is None else q[order]
    wc = (w if order is None else w[order]).to(torch.float32).contiguous()
    kmax = min(topk, int(need.max()))
    out = torch.full((T_, topk), -1, dtype=torch.int32)
    firsts, needs, ns = first.tolist(), need.tolist(), counts.tolist()
    kls = torch.split(kl, ns)
    g0 = t0 = 0
    while g0 < len(ns):
        g1, keys = g0 + 1, needs[g0]  # groups g0 .. g1 - 1 packed together
        while g1 < len(ns) and keys + needs[g1] <= PAGED_BATCH_KEYS:
            keys += needs[g1]
            g1 += 1
        base = firsts[g0]
        blocks, t = [], t0
        for gi in range(g0, g1):
            for i in range(0, ns[gi], TILE_T):
                tb = min(TILE_T, ns[gi] - i)
                lo = firsts[gi] - base
                blocks.append((t + i, tb, lo, lo + int(kls[gi][i: i + tb].max())))
            t += ns[gi]
        part = rows[base: base + keys]
        ks = (ks64 - base).to(torch.int32)
        direct = keys_direct(int(kl[t0:t].sum()), keys)
        src = (_key_source(k, part, direct) if k_scale is None else _key_source(
            dequantized_rows(context, k, k_scale, part), None, direct))
        _stream_topk(context, qs, *src, wc, ks, ks + kl.to(torch.int32), topk, kmax, blocks,
                     out)
        sel = out[t0:t]
        out[t0:t] = torch.where(sel >= 0, part[sel.long().clamp(min=0)], -1).to(torch.int32)
        g0, t0 = g1, t
    if order is None:
        return out
    idx[order] = out
    return idx


def _paged_supports(q, k, w, block_table, seq, k_len, *rest) -> bool:
    return (
        q.dtype in DTYPES and k.dtype == q.dtype and w.dtype in (torch.float32, q.dtype)
        and all(x.device.type == "cpu" for x in (q, k, w, block_table, seq, k_len))
        and q.dim() == 3 and q.shape[1] > 0 and q.shape[2] > 0
    )


def paged_indexer_topk_fp8(context: Callable[[], Any], q, k, k_scale, w, block_table, seq,
                           k_len, page_size: int, topk: int) -> torch.Tensor:
    """`paged_indexer_topk_fp8` (docs/ops.md): q quantized per row as the op defines it
    (`fp8_rows.e4m3_rows`, exact), the pool's rows dequantized batch by batch as the selection
    reads them: the scores are those of the op's definition, in fp32."""
    q, w = _quantizable(q), _quantizable(w)
    return paged_indexer_topk(context, e4m3_rows(context, q), k, w, block_table, seq, k_len,
                              page_size, topk, k_scale=k_scale)


def indexer_topk_fp8(context: Callable[[], Any], q, k, w, k_start, k_end, topk: int
                     ) -> torch.Tensor:
    """`indexer_topk_fp8` (docs/ops.md): q and k quantized per row as the op defines it
    (`fp8_rows.e4m3_rows`: one TVM pass each, exact in bf16), then `indexer_topk` on them."""
    q, k, w = _quantizable(q), _quantizable(k), _quantizable(w)
    return indexer_topk(context, e4m3_rows(context, q), e4m3_rows(context, k), w, k_start,
                        k_end, topk)


def _quantizable(x: torch.Tensor) -> torch.Tensor:
    """fp16 widened to fp32 (exact) for `fp8_rows.e4m3_rows`, which reads fp32 and bf16: the
    op's quantizer widens to fp32 first too, so the codes are the same."""
    return x.float() if x.dtype == torch.float16 else x


FP8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fp8_supports(q, k, w, k_start, k_end, *rest) -> bool:
    return q.dtype in FP8_DTYPES and _supports(q, k, w, k_start, k_end)


def _paged_fp8_supports(q, k, k_scale, w, block_table, seq, k_len, *rest) -> bool:
    return (
        q.dtype in FP8_DTYPES and k.dtype == torch.float8_e4m3fn
        and k_scale.dtype == torch.float32
        and w.dtype in (torch.float32, q.dtype)
        and all(x.device.type == "cpu" for x in (q, k, k_scale, w, block_table, seq, k_len))
        and q.dim() == 3 and q.shape[1] > 0 and q.shape[2] > 0
    )


# --------------------------------------------------------------------------- registration
def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    def _lightning_indexer(q, k, w, k_start, k_end):
        return lightning_indexer(context, q, k, w, k_start, k_end)

    def _indexer_topk(q, k, w, k_start, k_end, topk):
        return indexer_topk(context, q, k, w, k_start, k_end, topk)

    def _paged_indexer_topk(q, k, w, block_table, seq, k_len, page_size, topk):
        return paged_indexer_topk(context, q, k, w, block_table, seq, k_len, page_size, topk)

    def _indexer_topk_fp8(q, k, w, k_start, k_end, topk):
        return indexer_topk_fp8(context, q, k, w, k_start, k_end, topk)

    def _paged_indexer_topk_fp8(q, k, k_scale, w, block_table, seq, k_len, page_size, topk):
        return paged_indexer_topk_fp8(context, q, k, k_scale, w, block_table, seq, k_len,
                                      page_size, topk)

    return [
        ("lightning_indexer", _lightning_indexer, DTYPES, _supports),
        ("indexer_topk", _indexer_topk, DTYPES, _supports),
        ("paged_indexer_topk", _paged_indexer_topk, DTYPES, _paged_supports),
        ("indexer_topk_fp8", _indexer_topk_fp8, FP8_DTYPES, _fp8_supports),
        ("paged_indexer_topk_fp8", _paged_indexer_topk_fp8, FP8_DTYPES, _paged_fp8_supports),
    ]
