"""@triton.jit kernels behind glm5.kernels.triton.indexer: lightning_indexer, indexer_topk
(and its fp8 form), paged_indexer_topk (and its fp8 form).

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).

Scores (all three kernels, ``_score_tile``): the rows of one tensor-core dot are (query, head)
pairs, as DeepGEMM's mqa_logits lays them out: row r = t * HP + h of a block of BLOCK_T queries
with the Hi heads padded to HP = next_pow2(Hi) (padded rows are masked: q = 0, w = 0). One
[BLOCK_T*HP, Di] x [Di, BLOCK_S] dot per key tile (M = 256 for GLM-5's Hi = 32 at BLOCK_T = 8:
warpgroup-sized wgmma, where a [BLOCK_T, Di] dot per head was 16 rows of mma.sync), then ReLU,
times w[t, h] per row, and the [BLOCK_T, HP, BLOCK_S] view summed over heads (at 8 warps a
query's 32 accumulator rows lie in two warps, 16 each: register adds, lane shuffles and one
two-warp exchange). The query tile is loaded once per program when Di fits one BLOCK_D (ONE_D)
and reused for every key tile.

Order keys: a score s (fp32) at key index j becomes one int64 whose signed order is (s desc,
j asc): the high 32 bits are the float's bits made order-preserving as a signed int32 (-0.0 is
folded onto +0.0 first, so the two tie), the low 32 bits are 0xFFFFFFFF - j. Keys are distinct,
so an unstable bitonic sort yields exactly "descending score, ties to the smaller index". An
empty slot holds SENT, the key of -inf at index 2^32-1 (below every key of a real index).

Selection (indexer_topk, paged_indexer_topk): threshold-filtered running top-k. Each query owns a
workspace row of W = 2*CH order keys (CH = next_pow2(topk) >= BLOCK_S) and keeps, in registers,
``cnt`` (filled slots) and ``thr`` (its current TOPK-th best key; SENT until a merge has seen
TOPK keys). A key tile's keys strictly above the row's ``thr`` are appended at slots cnt, cnt+1,
... (positions from a cumsum over the tile). A row is merged only when a full tile could
overflow it (cnt > W - BLOCK_S): its cnt keys sorted descending, the best TOPK kept at slots
0..TOPK-1, ``thr`` raised to the TOPK-th (after it cnt = TOPK <= W - BLOCK_S). The stream runs
in rounds: merge the rows that need it, then m = min over rows of (W - cnt) // BLOCK_S key tiles
(>= 1) that cannot overflow any row, in a loop without a merge (so Triton pipelines its loads).
The round after the last tile merges each row with keys appended since its last merge, and the
first TOPK slots decode to indices (-1 past cnt or for a -inf key). Keys stream in increasing
index, so a new key equal in score to the threshold key has the larger index and is correctly
below it; comparing order keys (not scores) keeps the contract's order in every case. A key at
or below the TOPK-th best of the keys already seen can never be selected, so the output is
exactly the full sort's. Merges: one per round in which a row fills up; on random scores a merge
having seen n keys lets a new key in with probability TOPK/n, so the W - TOPK free slots last
until the stream has grown by a factor W/TOPK: about log(S/W)/log(W/TOPK) + 2 merges for S keys
(log2(S/4096) + 2 at topk 2048), at most about S/CH (every key above the threshold, e.g.
increasing scores), where the former design sorted after every chunk of CH keys (S/CH sorts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel

# order key of -inf: bits 0xFF800000 as int32 = -8388608, ^ 0x7FFFFFFF -> -2139095041
HI_NINF = -2139095041
SENT = HI_NINF * (1 << 32)  # -9187343243497619456: the key of an empty slot


@triton.jit
def _row_setup(q_ptr, w_ptr, pid, T, Hi, sqt, sqh, swt, swh,
               BLOCK_T: tl.constexpr, HP: tl.constexpr):
    """Per dot row r = t * HP + h of query block ``pid``: (q row offset int64, row mask,
    w[t, h] fp32, 0 on masked rows)."""
    r = tl.arange(0, BLOCK_T * HP)
    tr = pid * BLOCK_T + r // HP
    hr = r % HP
    r_mask = (tr < T) & (hr < Hi)
    trr = tr.to(tl.int64)
    qoff = trr * sqt + hr.to(tl.int64) * sqh
    wr = tl.load(w_ptr + trr * swt + hr.to(tl.int64) * swh, mask=r_mask, other=0.0)
    return qoff, r_mask, wr.to(tl.float32)


@triton.jit
def _load_q(q_ptr, qoff, r_mask, d0, Di, sqd, BLOCK_D: tl.constexpr):
    """[BLOCK_T*HP, BLOCK_D] query tile of dims d0 .. d0 + BLOCK_D (0 where masked)."""
    d = d0 + tl.arange(0, BLOCK_D)
    return tl.load(q_ptr + qoff[:, None] + d[None, :].to(tl.int64) * sqd,
                   mask=r_mask[:, None] & (d < Di)[None, :], other=0.0)


@triton.jit
def _score_tile(q_ptr, qv, qoff, r_mask, wr, k_ptr, koff, s_mask, Di, sqd, skd,
                BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """[BLOCK_T, BLOCK_S] fp32: sum_h w[t,h] * relu(q[t,h] . k[s]) of one key tile (0 where
    masked). ``koff`` [BLOCK_S] int64 are the key rows' offsets (k_ptr + koff is row s); with
    ONE_D, ``qv`` is the program's query tile (Di <= BLOCK_D), else q is read per Di chunk."""
    acc = tl.zeros([BLOCK_T * HP, BLOCK_S], dtype=tl.float32)
    if ONE_D:
        d = tl.arange(0, BLOCK_D)
        kv = tl.load(k_ptr + koff[None, :] + d[:, None].to(tl.int64) * skd,
                     mask=s_mask[None, :] & (d < Di)[:, None], other=0.0)
        acc = _dot(qv, kv, acc, DOT_FP32)
    else:
        for d0 in range(0, Di, BLOCK_D):
            qd = _load_q(q_ptr, qoff, r_mask, d0, Di, sqd, BLOCK_D)
            d = d0 + tl.arange(0, BLOCK_D)
            kv = tl.load(k_ptr + koff[None, :] + d[:, None].to(tl.int64) * skd,
                         mask=s_mask[None, :] & (d < Di)[:, None], other=0.0)
            acc = _dot(qd, kv, acc, DOT_FP32)
    acc = tl.maximum(acc, 0.0) * wr[:, None]
    return tl.sum(tl.reshape(acc, [BLOCK_T, HP, BLOCK_S]), axis=1)


@triton.jit
def _order_key(score, s_idx):
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 tie
    b = score.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (4294967295 - s_idx.to(tl.int64))


# --------------------------------------------------------------------------- lightning_indexer
@entry_kernel("T", "S", "sot", "SPAN")
def lightning_indexer_kernel(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                             sqt, sqh, sqd, sks, skd, swt, swh, sot, sos, SPAN,
                             N_TILES, NUM_PROGRAMS, GRID_1,
                             BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_D: tl.constexpr, ONE_D: tl.constexpr,
                             DOT_FP32: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (cdiv(T, BLOCK_T), cdiv(S, SPAN)): a block of BLOCK_T queries times SPAN keys (a
    multiple of BLOCK_S), the query tile loaded once; PERSISTENT: program p walks tiles p,
    p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _indexer_span(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                          sqt, sqh, sqd, sks, skd, swt, swh, sot, sos, SPAN,
                          tile // GRID_1, tile % GRID_1, BLOCK_T, HP, BLOCK_S, BLOCK_D, ONE_D,
                          DOT_FP32)
    else:
        _indexer_span(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                      sqt, sqh, sqd, sks, skd, swt, swh, sot, sos, SPAN,
                      tl.program_id(0), tl.program_id(1), BLOCK_T, HP, BLOCK_S, BLOCK_D, ONE_D,
                      DOT_FP32)


@triton.jit
def _store_ninf(out_ptr, t64, t_mask, a, b, S, sot, sos, BLOCK_T: tl.constexpr,
                BLOCK_S: tl.constexpr):
    sb = tl.arange(0, BLOCK_S)
    for s0 in range(a, b, BLOCK_S):
        s = s0 + sb
        tl.store(out_ptr + t64[:, None] * sot + s.to(tl.int64)[None, :] * sos,
                 tl.full([BLOCK_T, BLOCK_S], float("-inf"), tl.float32),
                 mask=t_mask[:, None] & (s < b)[None, :])


@triton.jit
def _indexer_span(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                  sqt, sqh, sqd, sks, skd, swt, swh, sot, sos, SPAN, pid_t, pid_s,
                  BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, DOT_FP32: tl.constexpr):
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    ks = tl.load(ks_ptr + t, mask=t_mask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + t, mask=t_mask, other=0).to(tl.int32)
    nonempty = (ks < ke) & t_mask
    lo = tl.min(tl.where(nonempty, ks, S), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    s_lo = pid_s * SPAN
    s_hi = tl.minimum(s_lo + SPAN, S)
    # the span splits into [s_lo, a) -inf | [a, b) computed tiles | [b, s_hi) -inf, with a on
    # the span's tile grid: key tiles outside every query's range cost no dot.
    a = s_lo + (tl.maximum(tl.minimum(lo, s_hi) - s_lo, 0) // BLOCK_S) * BLOCK_S
    b = tl.maximum(tl.minimum(hi, s_hi), a)
    _store_ninf(out_ptr, t64, t_mask, s_lo, a, S, sot, sos, BLOCK_T, BLOCK_S)
    if a < b:
        qoff, r_mask, wr = _row_setup(q_ptr, w_ptr, pid_t, T, Hi, sqt, sqh, swt, swh,
                                      BLOCK_T, HP)
        qv = tl.zeros([BLOCK_T * HP, BLOCK_D], dtype=q_ptr.dtype.element_ty)
        if ONE_D:
            qv = _load_q(q_ptr, qoff, r_mask, 0, Di, sqd, BLOCK_D)
        sb = tl.arange(0, BLOCK_S)
        for s0 in range(a, b, BLOCK_S):
            s = s0 + sb
            s_mask = s < b
            score = _score_tile(q_ptr, qv, qoff, r_mask, wr, k_ptr, s.to(tl.int64) * sks,
                                s_mask, Di, sqd, skd, BLOCK_T, HP, BLOCK_S, BLOCK_D, ONE_D,
                                DOT_FP32)
            valid = (s[None, :] >= ks[:, None]) & (s[None, :] < ke[:, None])
            score = tl.where(valid, score, float("-inf"))
            tl.store(out_ptr + t64[:, None] * sot + s.to(tl.int64)[None, :] * sos, score,
                     mask=t_mask[:, None] & s_mask[None, :])
    _store_ninf(out_ptr, t64, t_mask, b, s_hi, S, sot, sos, BLOCK_T, BLOCK_S)


# --------------------------------------------------------------------------- selection
@triton.jit
def _bitonic_desc(x, N: tl.constexpr, LOG_N: tl.constexpr):
    """A bitonic sequence x [N] (N = 2^LOG_N) sorted descending: LOG_N half-cleaner stages on
    its [2]*LOG_N hypercube (as tl.sort is built, so the compiler lays it out the same way):
    stage i pairs elements N >> (i+1) apart, the partner read by an xor over that axis, the
    larger kept at the lower position."""
    h = tl.reshape(x, [2] * LOG_N)
    for i in tl.static_range(LOG_N):
        partner = h ^ tl.xor_sum(h, axis=i, keep_dims=True)
        upper = tl.reshape(tl.arange(0, 2), [1] * i + [2] + [1] * (LOG_N - i - 1)) == 1
        h = tl.where((h > partner) != upper, h, partner)
    return tl.reshape(h, [N])


@triton.jit
def _merge(ws_ptr, rows, pid, T, TOPK, cnt, thr, merges, need, t_mask,
           BLOCK_T: tl.constexpr, CH: tl.constexpr, LOG_CH: tl.constexpr,
           RANK_MERGE: tl.constexpr):
    """Merge the rows ``need`` of the block: their best min(cnt, CH) keys, descending, at
    slots 0 .. CH-1 (the running set A; slots CH .. 2CH-1 are the buffer B), ``thr`` the
    TOPK-th key (unchanged while fewer). Returns the new (cnt, thr)."""
    W: tl.constexpr = 2 * CH
    wcols = tl.arange(0, W)
    tl.debug_barrier()  # the appends of every thread are visible
    if RANK_MERGE:
        # all rows at once, by rank: position of key i = #(greater keys) + #(equal keys
        # before i). Fewer, larger ops (fast under the interpreter); O(W^2) per row.
        kv = tl.load(rows[:, None] + wcols[None, :],
                     mask=t_mask[:, None] & (wcols[None, :] < cnt[:, None]),
                     other=-9187343243497619456)
        ka = kv[:, :, None]
        kb = kv[:, None, :]
        before = wcols[None, :] < wcols[:, None]  # [i, j]: j < i
        rank = tl.sum(((kb > ka) | ((kb == ka) & before[None, :, :])).to(tl.int32), axis=2)
        tl.debug_barrier()
        tl.store(rows[:, None] + rank, kv, mask=(need & t_mask)[:, None] & (rank < CH))
    else:
        # per row that needs it: A is sorted once (on the row's first merge: until then the
        # appends fill A, then B); when B holds keys, B sorted ascending against A descending
        # gives, elementwise, the best CH of both as a bitonic sequence (bitonic top-k), which
        # log2(CH) half-cleaners sort: about half the work of sorting all 2*CH keys.
        cols = tl.arange(0, CH)
        rid = tl.arange(0, BLOCK_T)
        for i in range(0, BLOCK_T):
            sel = rid == i
            if tl.sum(tl.where(sel & need, 1, 0), axis=0) > 0:
                c = tl.sum(tl.where(sel, cnt, 0), axis=0)
                rp = ws_ptr + (pid * BLOCK_T + i).to(tl.int64) * W
                va = tl.load(rp + cols, mask=cols < c, other=-9187343243497619456)
                if tl.sum(tl.where(sel, merges, 0), axis=0) == 0:
                    va = tl.sort(va, descending=True)
                if c > CH:
                    vb = tl.load(rp + CH + cols, mask=CH + cols < c,
                                 other=-9187343243497619456)
                    va = _bitonic_desc(tl.maximum(va, tl.sort(vb, descending=False)), CH,
                                       LOG_CH)
                tl.store(rp + cols, va)
    tl.debug_barrier()  # the merged rows are visible before the next appends or the decode
    full = need & t_mask & (cnt >= TOPK)
    last = tl.load(rows + (TOPK - 1), mask=full, other=-9187343243497619456)
    thr = tl.where(full, last, thr)
    cnt = tl.where(need, tl.minimum(cnt, CH), cnt)
    return cnt, thr


@triton.jit
def _make_room(ws_ptr, rows, pid, T, TOPK, done, cnt, thr, merges, dirty, t_mask,
               BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, CH: tl.constexpr,
               LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr):
    """Start of a run of key tiles: merge the rows a full tile of keys could overflow (cnt >
    W - BLOCK_S); ``done`` ([BLOCK_T] mask, all set once the stream has ended): merge instead
    the rows with keys appended since their last merge (the final merge: one merge site, one
    inlined copy of the sorts). Returns (cnt, thr, merges, dirty, m): m = the number of tiles
    every row has room for, so the run of m tiles needs no merge (and its loop pipelines)."""
    W: tl.constexpr = 2 * CH
    need = t_mask & ((done & dirty) | (~done & (cnt > W - BLOCK_S)))
    if tl.max(need.to(tl.int32), axis=0) > 0:
        cnt, thr = _merge(ws_ptr, rows, pid, T, TOPK, cnt, thr, merges, need, t_mask,
                          BLOCK_T, CH, LOG_CH, RANK_MERGE)
        merges += need.to(tl.int32)
        dirty = dirty & ~need
    m = tl.min(tl.where(t_mask, (W - cnt) // BLOCK_S, W // BLOCK_S), axis=0)
    return cnt, thr, merges, dirty, m


@triton.jit
def _append(rows, key, cnt, thr, dirty, t_mask):
    """Append each row's keys of a [BLOCK_T, BLOCK_S] tile (SENT where invalid) that lie above
    its threshold at slots cnt, cnt+1, ... (the caller guarantees the room). Returns the new
    (cnt, dirty)."""
    take = (key > thr[:, None]) & t_mask[:, None]
    n = tl.sum(take.to(tl.int32), axis=1)
    pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
    tl.store(rows[:, None] + pos, key, mask=take)
    return cnt + n, dirty | (n > 0)


@triton.jit
def _decoded_keys(rows, cnt, TOPK, merges, t_mask, mc_ptr, t, CH: tl.constexpr,
                  COUNT_MERGES: tl.constexpr):
    """The first CH slots' keys of each (merged) row, [BLOCK_T, CH], SENT past min(cnt, TOPK);
    stores the merge counts when COUNT_MERGES."""
    if COUNT_MERGES:
        tl.store(mc_ptr + t, merges, mask=t_mask)
    cols = tl.arange(0, CH)
    return tl.load(rows[:, None] + cols[None, :],
                   mask=t_mask[:, None] & (cols[None, :] < tl.minimum(cnt, TOPK)[:, None]),
                   other=-9187343243497619456)


# --------------------------------------------------------------------------- indexer_topk
@entry_kernel("T", "S", "SPLIT", "sws", "spk")
def indexer_topk_kernel(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, mc_ptr, pk_ptr,
                        sk_ptr, T, S, Hi, Di, TOPK, SPLIT, sws, spk,
                        sqt, sqh, sqd, sks, skd, swt, swh, sot, sok,
                        N_TILES, NUM_PROGRAMS, GRID_1,
                        BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, CH: tl.constexpr,
                        LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                        COUNT_MERGES: tl.constexpr, SPLIT_OUT: tl.constexpr,
                        DOT_FP32: tl.constexpr, KSCALE: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (block of BLOCK_T queries, split): each streams over (its window of) the union of
    its queries' key ranges in BLOCK_S key tiles; each tile's scores go straight into the
    threshold-filtered running selection (module docstring), only a [BLOCK_T, BLOCK_S] score
    tile is ever live. With COUNT_MERGES each query's number of merges is written to mc_ptr[t].
    SPLIT_OUT (split top-k, decode): the union is cut into SPLIT tile-aligned windows, one per
    program, each keeping its own workspace (split stride sws) and writing its best TOPK order
    keys to pk_ptr [SPLIT, T, TOPK] (split stride spk) for indexer_topk_merge_kernel. Blocks are
    taken last first: in a causal prefill the last queries see the most keys, and starting the
    longest work first shortens the tail. PERSISTENT: program p walks tiles p, p +
    NUM_PROGRAMS, ... of that order. KSCALE (indexer_topk_fp8): q and k are fp8 codes, w holds
    the q scales folded in, and each key's head sum is multiplied by its scale sk_ptr[s] (a
    power of two: exact)."""
    n_tb = N_TILES // GRID_1
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, mc_ptr, pk_ptr,
                       sk_ptr, T, S, Hi, Di, TOPK, SPLIT, sws, spk,
                       sqt, sqh, sqd, sks, skd, swt, swh, sot, sok,
                       n_tb - 1 - tile // GRID_1, tile % GRID_1, BLOCK_T, HP, BLOCK_S,
                       BLOCK_D, ONE_D, CH, LOG_CH, RANK_MERGE, COUNT_MERGES, SPLIT_OUT,
                       DOT_FP32, KSCALE)
    else:
        _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, mc_ptr, pk_ptr,
                   sk_ptr, T, S, Hi, Di, TOPK, SPLIT, sws, spk,
                   sqt, sqh, sqd, sks, skd, swt, swh, sot, sok,
                   n_tb - 1 - tl.program_id(0), tl.program_id(1), BLOCK_T, HP, BLOCK_S,
                   BLOCK_D, ONE_D, CH, LOG_CH, RANK_MERGE, COUNT_MERGES, SPLIT_OUT, DOT_FP32,
                   KSCALE)


@triton.jit
def _window(lo, hi, split, SPLIT, BLOCK_S: tl.constexpr):
    """[lo, hi) cut to window ``split`` of SPLIT equal BLOCK_S-aligned pieces of it."""
    base = (lo // BLOCK_S) * BLOCK_S
    per = (((hi - base + SPLIT - 1) // SPLIT + BLOCK_S - 1) // BLOCK_S) * BLOCK_S
    w_lo = base + split * per
    return tl.maximum(lo, w_lo), tl.minimum(hi, w_lo + per)


@triton.jit
def _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, mc_ptr, pk_ptr, sk_ptr,
               T, S, Hi, Di, TOPK, SPLIT, sws, spk,
               sqt, sqh, sqd, sks, skd, swt, swh, sot, sok, pid, split,
               BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, CH: tl.constexpr,
               LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr, COUNT_MERGES: tl.constexpr,
               SPLIT_OUT: tl.constexpr, DOT_FP32: tl.constexpr, KSCALE: tl.constexpr):
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    ks = tl.load(ks_ptr + t, mask=t_mask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + t, mask=t_mask, other=0).to(tl.int32)
    nonempty = ks < ke
    lo = tl.min(tl.where(nonempty & t_mask, ks, S), axis=0)
    hi = tl.max(tl.where(nonempty & t_mask, ke, 0), axis=0)
    if SPLIT_OUT:
        lo, hi = _window(lo, hi, split, SPLIT, BLOCK_S)
        ws_ptr += tl.cast(split, tl.int64) * sws  # this split's own workspace rows
    rows = ws_ptr + t64 * (2 * CH)
    qoff, r_mask, wr = _row_setup(q_ptr, w_ptr, pid, T, Hi, sqt, sqh, swt, swh, BLOCK_T, HP)
    qv = tl.zeros([BLOCK_T * HP, BLOCK_D], dtype=q_ptr.dtype.element_ty)
    if ONE_D:
        qv = _load_q(q_ptr, qoff, r_mask, 0, Di, sqd, BLOCK_D)
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    thr = tl.full([BLOCK_T], -9187343243497619456, tl.int64)
    merges = tl.zeros([BLOCK_T], dtype=tl.int32)
    dirty = cnt > 0  # keys appended since the row's last merge: none yet
    sb = tl.arange(0, BLOCK_S)
    # runs of key tiles between merges; the round after the last tile makes the final merge
    s0 = lo
    go = lo < hi
    while go:
        # [BLOCK_T] comparison: the interpreter turns vector & 0-d bool into int32
        done = (tl.zeros_like(cnt) + s0) >= hi
        cnt, thr, merges, dirty, m = _make_room(ws_ptr, rows, pid, T, TOPK, done, cnt, thr,
                                                merges, dirty, t_mask, BLOCK_T, BLOCK_S, CH,
                                                LOG_CH, RANK_MERGE)
        s1 = tl.minimum(hi, s0 + m * BLOCK_S)
        for j0 in range(s0, s1, BLOCK_S):
            s = j0 + sb
            s_mask = s < hi
            score = _score_tile(q_ptr, qv, qoff, r_mask, wr, k_ptr, s.to(tl.int64) * sks,
                                s_mask, Di, sqd, skd, BLOCK_T, HP, BLOCK_S, BLOCK_D, ONE_D,
                                DOT_FP32)
            if KSCALE:
                score = score * tl.load(sk_ptr + s, mask=s_mask, other=1.0)[None, :]
            # s < hi too: a split's window may end inside a row's range and inside the tile
            valid = (s[None, :] >= ks[:, None]) & (s[None, :] < ke[:, None]) & s_mask[None, :]
            key = tl.where(valid, _order_key(score, s), -9187343243497619456)
            cnt, dirty = _append(rows, key, cnt, thr, dirty, t_mask)
        go = (s1 < hi) | (tl.max(dirty.to(tl.int32), axis=0) > 0)
        s0 = s1
    key = _decoded_keys(rows, cnt, TOPK, merges, t_mask, mc_ptr, t, CH, COUNT_MERGES)
    if SPLIT_OUT:
        _store_keys(key, pk_ptr, split, spk, t64, t_mask, TOPK, CH)
    else:
        _store_indices(key, out_ptr, t64, t_mask, sot, sok, TOPK, CH)


@triton.jit
def _store_keys(key, pk_ptr, split, spk, t64, t_mask, TOPK, CH: tl.constexpr):
    """A split's best TOPK order keys per query into pk [SPLIT, T, TOPK] (SENT past its
    count)."""
    cols = tl.arange(0, CH)
    tl.store(pk_ptr + tl.cast(split, tl.int64) * spk + t64[:, None] * TOPK + cols[None, :], key,
             mask=t_mask[:, None] & (cols[None, :] < TOPK))


@triton.jit
def _store_indices(key, out_ptr, t64, t_mask, sot, sok, TOPK, CH: tl.constexpr):
    """The first TOPK keys decoded: the index, or -1 for an empty slot / a -inf score."""
    cols = tl.arange(0, CH)
    ok = (key >> 32) > -2139095041
    idx = tl.where(ok, 4294967295 - (key & 4294967295), -1).to(tl.int32)
    tl.store(out_ptr + t64[:, None] * sot + cols[None, :] * sok, idx,
             mask=t_mask[:, None] & (cols[None, :] < TOPK))


@triton.jit
def _store_pool_rows(key, out_ptr, bt_ptr, sq, t64, t_mask, PS, sbb, sbp, sot, sok, TOPK,
                     CH: tl.constexpr):
    """The first TOPK keys (logical positions of sequence sq[t]) decoded to pool rows through
    the block table, or -1 for an empty slot."""
    cols = tl.arange(0, CH)
    ok = (key >> 32) > -2139095041
    j = tl.where(ok, 4294967295 - (key & 4294967295), 0)
    page = tl.load(bt_ptr + sq.to(tl.int64)[:, None] * sbb + (j // PS) * sbp,
                   mask=ok & t_mask[:, None], other=0)
    idx = tl.where(ok, page.to(tl.int64) * PS + j % PS, -1).to(tl.int32)
    tl.store(out_ptr + t64[:, None] * sot + cols[None, :] * sok, idx,
             mask=t_mask[:, None] & (cols[None, :] < TOPK))


# --------------------------------------------------------------------------- paged_indexer_topk
@entry_kernel("T", "sbb", "SPLIT", "sws", "spk")
def paged_indexer_topk_kernel(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                              mc_ptr, pk_ptr, sk_ptr, T, PS, Hi, Di, TOPK, SPLIT, sws, spk,
                              sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok,
                              N_TILES, NUM_PROGRAMS, GRID_1,
                              BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, CH: tl.constexpr,
                              LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                              COUNT_MERGES: tl.constexpr, SPLIT_OUT: tl.constexpr,
                              DOT_FP32: tl.constexpr, KSCALE: tl.constexpr,
                              PERSISTENT: tl.constexpr):
    """indexer_topk_kernel through a block table: query t sees logical keys 0 .. kl[t] - 1 of
    sequence seq[t], key j at pool row bt[seq[t], j // PS] * PS + j % PS. Tiles (block of
    BLOCK_T queries, split), last block first (a prefill chunk's last queries see the most
    keys); SPLIT_OUT as in indexer_topk_kernel (each pass over a sequence's keys cut into
    SPLIT windows); PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ... of that
    order. KSCALE (paged_indexer_topk_fp8): q and the pool hold e4m3 codes, w the q scales
    folded in, and each key's head sum is multiplied by its pool row's scale sk_ptr[row]."""
    n_tb = N_TILES // GRID_1
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                             mc_ptr, pk_ptr, sk_ptr, T, PS, Hi, Di, TOPK, SPLIT, sws, spk,
                             sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok,
                             n_tb - 1 - tile // GRID_1, tile % GRID_1, BLOCK_T, HP, BLOCK_S,
                             BLOCK_D, ONE_D, CH, LOG_CH, RANK_MERGE, COUNT_MERGES, SPLIT_OUT,
                             DOT_FP32, KSCALE)
    else:
        _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                         mc_ptr, pk_ptr, sk_ptr, T, PS, Hi, Di, TOPK, SPLIT, sws, spk,
                         sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok,
                         n_tb - 1 - tl.program_id(0), tl.program_id(1), BLOCK_T, HP, BLOCK_S,
                         BLOCK_D, ONE_D, CH, LOG_CH, RANK_MERGE, COUNT_MERGES, SPLIT_OUT,
                         DOT_FP32, KSCALE)


@triton.jit
def _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr, mc_ptr,
                     pk_ptr, sk_ptr, T, PS, Hi, Di, TOPK, SPLIT, sws, spk,
                     sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok, pid, split,
                     BLOCK_T: tl.constexpr, HP: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_D: tl.constexpr, ONE_D: tl.constexpr, CH: tl.constexpr,
                     LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                     COUNT_MERGES: tl.constexpr, SPLIT_OUT: tl.constexpr,
                     DOT_FP32: tl.constexpr, KSCALE: tl.constexpr):
    """The block's queries may belong to several sequences (a decode batch: one each). A
    [BLOCK_S] tile of keys is one sequence's, so the block makes one pass per distinct sequence
    among its queries (smallest id first), streaming that sequence's keys through its table row
    for the queries of that sequence only (the others' keys are SENT, offered to no one). Order
    keys carry the LOGICAL index (ties to the smaller logical position); the decode maps each
    to its pool row."""
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    sq = tl.load(seq_ptr + t, mask=t_mask, other=0).to(tl.int32)
    kl = tl.load(kl_ptr + t, mask=t_mask, other=0).to(tl.int32)
    if SPLIT_OUT:
        ws_ptr += tl.cast(split, tl.int64) * sws  # this split's own workspace rows
    rows = ws_ptr + t64 * (2 * CH)
    qoff, r_mask, wr = _row_setup(q_ptr, w_ptr, pid, T, Hi, sqt, sqh, swt, swh, BLOCK_T, HP)
    qv = tl.zeros([BLOCK_T * HP, BLOCK_D], dtype=q_ptr.dtype.element_ty)
    if ONE_D:
        qv = _load_q(q_ptr, qoff, r_mask, 0, Di, sqd, BLOCK_D)
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    thr = tl.full([BLOCK_T], -9187343243497619456, tl.int64)
    merges = tl.zeros([BLOCK_T], dtype=tl.int32)
    dirty = cnt > 0  # keys appended since the row's last merge: none yet
    sb = tl.arange(0, BLOCK_S)
    todo = t_mask & (kl > 0)
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        b = tl.min(tl.where(todo, sq, 2147483647), axis=0)
        act = todo & (sq == b)
        hi = tl.max(tl.where(act, kl, 0), axis=0)
        brow = bt_ptr + b.to(tl.int64) * sbb
        # runs of key tiles between merges, then the final merge of the pass's queries
        s0 = hi * 0
        if SPLIT_OUT:
            s0, hi = _window(s0, hi, split, SPLIT, BLOCK_S)
        go = s0 < hi
        while go:
            done = (tl.zeros_like(cnt) + s0) >= hi
            cnt, thr, merges, dirty, m = _make_room(ws_ptr, rows, pid, T, TOPK, done, cnt,
                                                    thr, merges, dirty, t_mask, BLOCK_T,
                                                    BLOCK_S, CH, LOG_CH, RANK_MERGE)
            s1 = tl.minimum(hi, s0 + m * BLOCK_S)
            for j0 in range(s0, s1, BLOCK_S):
                s = j0 + sb
                s_mask = s < hi
                page = tl.load(brow + (s // PS).to(tl.int64) * sbp, mask=s_mask, other=0)
                prow = page.to(tl.int64) * PS + (s % PS).to(tl.int64)
                score = _score_tile(q_ptr, qv, qoff, r_mask, wr, k_ptr, prow * sks, s_mask,
                                    Di, sqd, skd, BLOCK_T, HP, BLOCK_S, BLOCK_D, ONE_D,
                                    DOT_FP32)
                if KSCALE:
                    score = score * tl.load(sk_ptr + prow, mask=s_mask, other=1.0)[None, :]
                valid = act[:, None] & (s[None, :] < kl[:, None]) & s_mask[None, :]
                key = tl.where(valid, _order_key(score, s), -9187343243497619456)
                cnt, dirty = _append(rows, key, cnt, thr, dirty, t_mask)
            go = (s1 < hi) | (tl.max(dirty.to(tl.int32), axis=0) > 0)
            s0 = s1
        todo = todo & ~act
        left = tl.sum(todo.to(tl.int32), axis=0)
    key = _decoded_keys(rows, cnt, TOPK, merges, t_mask, mc_ptr, t, CH, COUNT_MERGES)
    if SPLIT_OUT:
        _store_keys(key, pk_ptr, split, spk, t64, t_mask, TOPK, CH)
    else:
        _store_pool_rows(key, out_ptr, bt_ptr, sq, t64, t_mask, PS, sbb, sbp, sot, sok, TOPK,
                         CH)


# --------------------------------------------------------------------------- split top-k merge
@entry_kernel("T", "SPLIT", "spk", "sbb")
def indexer_topk_merge_kernel(pk_ptr, ws_ptr, out_ptr, mc_ptr, bt_ptr, seq_ptr, T, TOPK, SPLIT,
                              spk, PS, sbb, sbp, sot, sok, N_TILES, NUM_PROGRAMS,
                              BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, CH: tl.constexpr,
                              LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                              COUNT_MERGES: tl.constexpr, PAGED: tl.constexpr,
                              PERSISTENT: tl.constexpr):
    """The split top-k's merge, one tile per block of BLOCK_T queries: each query's SPLIT x TOPK
    candidate order keys (pk [SPLIT, T, TOPK], SENT for empty slots; the windows are disjoint,
    so the keys are distinct) stream through the same threshold-filtered selection as the key
    tiles did, and the best TOPK decode to indices (PAGED: logical positions of sequence
    seq[t] to pool rows through the block table)."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _merge_tile(pk_ptr, ws_ptr, out_ptr, mc_ptr, bt_ptr, seq_ptr, T, TOPK, SPLIT, spk,
                        PS, sbb, sbp, sot, sok, tile, BLOCK_T, BLOCK_S, CH, LOG_CH,
                        RANK_MERGE, COUNT_MERGES, PAGED)
    else:
        _merge_tile(pk_ptr, ws_ptr, out_ptr, mc_ptr, bt_ptr, seq_ptr, T, TOPK, SPLIT, spk,
                    PS, sbb, sbp, sot, sok, tl.program_id(0), BLOCK_T, BLOCK_S, CH, LOG_CH,
                    RANK_MERGE, COUNT_MERGES, PAGED)


@triton.jit
def _merge_tile(pk_ptr, ws_ptr, out_ptr, mc_ptr, bt_ptr, seq_ptr, T, TOPK, SPLIT, spk,
                PS, sbb, sbp, sot, sok, pid, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                CH: tl.constexpr, LOG_CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                COUNT_MERGES: tl.constexpr, PAGED: tl.constexpr):
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    rows = ws_ptr + t64 * (2 * CH)
    cnt = tl.zeros([BLOCK_T], dtype=tl.int32)
    thr = tl.full([BLOCK_T], -9187343243497619456, tl.int64)
    merges = tl.zeros([BLOCK_T], dtype=tl.int32)
    dirty = cnt > 0
    sb = tl.arange(0, BLOCK_S)
    total = SPLIT * TOPK  # candidates per query: split j // TOPK, slot j % TOPK
    s0 = T * 0
    go = s0 < total
    while go:
        done = (tl.zeros_like(cnt) + s0) >= total
        cnt, thr, merges, dirty, m = _make_room(ws_ptr, rows, pid, T, TOPK, done, cnt, thr,
                                                merges, dirty, t_mask, BLOCK_T, BLOCK_S, CH,
                                                LOG_CH, RANK_MERGE)
        s1 = tl.minimum(total, s0 + m * BLOCK_S)
        for j0 in range(s0, s1, BLOCK_S):
            j = j0 + sb
            off = (j // TOPK).to(tl.int64) * spk + (j % TOPK)
            key = tl.load(pk_ptr + off[None, :] + t64[:, None] * TOPK,
                          mask=t_mask[:, None] & (j < s1)[None, :],
                          other=-9187343243497619456)
            cnt, dirty = _append(rows, key, cnt, thr, dirty, t_mask)
        go = (s1 < total) | (tl.max(dirty.to(tl.int32), axis=0) > 0)
        s0 = s1
    key = _decoded_keys(rows, cnt, TOPK, merges, t_mask, mc_ptr, t, CH, COUNT_MERGES)
    if PAGED:
        sq = tl.load(seq_ptr + t, mask=t_mask, other=0).to(tl.int32)
        _store_pool_rows(key, out_ptr, bt_ptr, sq, t64, t_mask, PS, sbb, sbp, sot, sok, TOPK,
                         CH)
    else:
        _store_indices(key, out_ptr, t64, t_mask, sot, sok, TOPK, CH)
