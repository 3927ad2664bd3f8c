"""@triton.jit kernels behind glm5.kernels.triton.indexer: lightning_indexer, indexer_topk,
paged_indexer_topk.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).

Order keys: a score s (fp32) at key index j becomes one int64 whose signed order is (s desc,
j asc): the high 32 bits are the float's bits made order-preserving as a signed int32 (-0.0 is
folded onto +0.0 first, so the two tie), the low 32 bits are 0xFFFFFFFF - j. Keys are distinct,
so an unstable bitonic sort yields exactly "descending score, ties to the smaller index". An
empty slot holds SENT, the key of -inf (below every finite score).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel

# order key of -inf: bits 0xFF800000 as int32 = -8388608, ^ 0x7FFFFFFF -> -2139095041
HI_NINF = -2139095041
SENT = HI_NINF * (1 << 32)  # -9187343243497619456: the key of an empty slot


@triton.jit
def _score_tile(q_ptr, k_ptr, w_ptr, t64, t_mask, s64, s_mask, Hi, Di,
                sqt, sqh, sqd, sks, skd, swt, swh,
                BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """[BLOCK_T, BLOCK_S] fp32: sum_h w[t,h] * relu(q[t,h] . k[s]) (0 where masked)."""
    acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    d_base = tl.arange(0, BLOCK_D)
    for h in range(0, Hi):
        dots = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
        for d0 in range(0, Di, BLOCK_D):
            d = d0 + d_base
            dm = d < Di
            qv = tl.load(q_ptr + t64[:, None] * sqt + h * sqh + d[None, :] * sqd,
                         mask=t_mask[:, None] & dm[None, :], other=0.0)
            kv = tl.load(k_ptr + s64[None, :] * sks + d[:, None] * skd,
                         mask=s_mask[None, :] & dm[:, None], other=0.0)
            dots = _dot(qv, kv, dots, DOT_FP32)
        wv = tl.load(w_ptr + t64 * swt + h * swh, mask=t_mask, other=0.0).to(tl.float32)
        acc += tl.maximum(dots, 0.0) * wv[:, None]
    return acc


@triton.jit
def _order_key(score, s_idx):
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and +0.0 tie
    b = score.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (4294967295 - s_idx.to(tl.int64))


@entry_kernel("T", "S", "sot")
def lightning_indexer_kernel(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                             sqt, sqh, sqd, sks, skd, swt, swh, sot, sos,
                             N_TILES, NUM_PROGRAMS, GRID_1,
                             BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                             BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
                             PERSISTENT: tl.constexpr):
    """Tiles (cdiv(T, BLOCK_T), cdiv(S, BLOCK_S)); PERSISTENT: program p walks tiles p,
    p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _indexer_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                          sqt, sqh, sqd, sks, skd, swt, swh, sot, sos,
                          tile // GRID_1, tile % GRID_1, BLOCK_T, BLOCK_S, BLOCK_D, DOT_FP32)
    else:
        _indexer_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                      sqt, sqh, sqd, sks, skd, swt, swh, sot, sos,
                      tl.program_id(0), tl.program_id(1), BLOCK_T, BLOCK_S, BLOCK_D, DOT_FP32)


@triton.jit
def _indexer_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, T, S, Hi, Di,
                  sqt, sqh, sqd, sks, skd, swt, swh, sot, sos, pid_t, pid_s,
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = s < S
    t64 = t.to(tl.int64)
    s64 = s.to(tl.int64)
    ks = tl.load(ks_ptr + t, mask=t_mask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + t, mask=t_mask, other=0).to(tl.int32)
    valid = (s[None, :] >= ks[:, None]) & (s[None, :] < ke[:, None])
    score = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    if tl.sum(valid.to(tl.int32)) > 0:  # a tile outside every query's range costs nothing
        score = _score_tile(q_ptr, k_ptr, w_ptr, t64, t_mask, s64, s_mask, Hi, Di,
                            sqt, sqh, sqd, sks, skd, swt, swh,
                            BLOCK_T, BLOCK_S, BLOCK_D, DOT_FP32)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_ptr + t64[:, None] * sot + s64[None, :] * sos, score,
             mask=t_mask[:, None] & s_mask[None, :])


@entry_kernel("T", "S")
def indexer_topk_kernel(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr,
                        T, S, Hi, Di, TOPK,
                        sqt, sqh, sqd, sks, skd, swt, swh, sot, sok, N_TILES, NUM_PROGRAMS,
                        BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                        CH: tl.constexpr, RANK_MERGE: tl.constexpr,
                        DOT_FP32: tl.constexpr, PERSISTENT: tl.constexpr):
    """One tile per block of BLOCK_T queries, streaming over their key range in chunks of CH
    columns. Each query's workspace row holds 2*CH order keys: [running top-CH | chunk keys];
    after a chunk's score tiles are written, the row is sorted (descending) so its first CH keys
    are again the running top-CH. Only a [BLOCK_T, BLOCK_S] score tile is ever live.
    PERSISTENT: program p walks query blocks p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, T, S, Hi, Di, TOPK,
                       sqt, sqh, sqd, sks, skd, swt, swh, sot, sok, tile,
                       BLOCK_T, BLOCK_S, BLOCK_D, CH, RANK_MERGE, DOT_FP32)
    else:
        _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, T, S, Hi, Di, TOPK,
                   sqt, sqh, sqd, sks, skd, swt, swh, sot, sok, tl.program_id(0),
                   BLOCK_T, BLOCK_S, BLOCK_D, CH, RANK_MERGE, DOT_FP32)


@triton.jit
def _topk_tile(q_ptr, k_ptr, w_ptr, ks_ptr, ke_ptr, ws_ptr, out_ptr, T, S, Hi, Di, TOPK,
               sqt, sqh, sqd, sks, skd, swt, swh, sot, sok, pid,
               BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
               CH: tl.constexpr, RANK_MERGE: tl.constexpr, DOT_FP32: tl.constexpr):
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    ks = tl.load(ks_ptr + t, mask=t_mask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + t, mask=t_mask, other=0).to(tl.int32)
    nonempty = ks < ke
    lo = tl.min(tl.where(nonempty, ks, S), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    W: tl.constexpr = 2 * CH
    rows = ws_ptr + t64 * W
    cols = tl.arange(0, CH)
    tl.store(rows[:, None] + cols[None, :],
             tl.full([BLOCK_T, CH], -9187343243497619456, tl.int64), mask=t_mask[:, None])
    tl.debug_barrier()
    sb = tl.arange(0, BLOCK_S)
    wcols = tl.arange(0, W)
    for c0 in range(lo, hi, CH):
        # 1) score tiles of this chunk -> order keys in the second half of each row
        for j0 in range(0, CH, BLOCK_S):
            s = c0 + j0 + sb
            s_mask = s < hi
            valid = (s[None, :] >= ks[:, None]) & (s[None, :] < ke[:, None])
            score = _score_tile(q_ptr, k_ptr, w_ptr, t64, t_mask, s.to(tl.int64), s_mask,
                                Hi, Di, sqt, sqh, sqd, sks, skd, swt, swh,
                                BLOCK_T, BLOCK_S, BLOCK_D, DOT_FP32)
            key = tl.where(valid, _order_key(score, s), -9187343243497619456)
            tl.store(rows[:, None] + (CH + j0 + sb)[None, :], key, mask=t_mask[:, None])
        tl.debug_barrier()
        # 2) merge: keep the best CH keys of each row's 2*CH
        if RANK_MERGE:
            # all rows at once, by rank: position of key i = #(greater keys) + #(equal keys
            # before i). Fewer, larger ops (fast under the interpreter); O(W^2) per row.
            kv = tl.load(rows[:, None] + wcols[None, :], mask=t_mask[:, None],
                         other=-9187343243497619456)
            a = kv[:, :, None]
            b = kv[:, None, :]
            before = wcols[None, :] < wcols[:, None]  # [i, j]: j < i
            rank = tl.sum(((b > a) | ((b == a) & before[None, :, :])).to(tl.int32), axis=2)
            tl.debug_barrier()
            tl.store(rows[:, None] + rank, kv, mask=t_mask[:, None])
        else:
            # per query whose range meets the chunk: a bitonic sort of its 2*CH keys
            for i in range(0, BLOCK_T):
                row = pid * BLOCK_T + i
                if row < T:
                    rks = tl.load(ks_ptr + row).to(tl.int32)
                    rke = tl.load(ke_ptr + row).to(tl.int32)
                    if (rks < rke) & (rks < c0 + CH) & (rke > c0):
                        rp = ws_ptr + tl.cast(row, tl.int64) * W + wcols
                        v = tl.load(rp)
                        v = tl.sort(v, descending=True)
                        tl.store(rp, v)
        tl.debug_barrier()
    # 3) decode the first TOPK keys: index, or -1 for an empty slot
    key = tl.load(rows[:, None] + cols[None, :], mask=t_mask[:, None],
                  other=-9187343243497619456)
    ok = (key >> 32) > -2139095041
    idx = tl.where(ok, 4294967295 - (key & 4294967295), -1).to(tl.int32)
    tl.store(out_ptr + t64[:, None] * sot + cols[None, :] * sok, idx,
             mask=t_mask[:, None] & (cols[None, :] < TOPK))


@entry_kernel("T", "sbb")
def paged_indexer_topk_kernel(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                              T, PS, Hi, Di, TOPK,
                              sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok,
                              N_TILES, NUM_PROGRAMS,
                              BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_D: tl.constexpr, CH: tl.constexpr,
                              RANK_MERGE: tl.constexpr, DOT_FP32: tl.constexpr,
                              PERSISTENT: tl.constexpr):
    """indexer_topk_kernel through a block table: query t sees logical keys 0 .. kl[t] - 1 of
    sequence seq[t], key j at pool row bt[seq[t], j // PS] * PS + j % PS. One tile per block
    of BLOCK_T queries; PERSISTENT: program p walks blocks p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                             T, PS, Hi, Di, TOPK, sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp,
                             sot, sok, tile, BLOCK_T, BLOCK_S, BLOCK_D, CH, RANK_MERGE,
                             DOT_FP32)
    else:
        _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                         T, PS, Hi, Di, TOPK, sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp,
                         sot, sok, tl.program_id(0), BLOCK_T, BLOCK_S, BLOCK_D, CH, RANK_MERGE,
                         DOT_FP32)


@triton.jit
def _paged_topk_tile(q_ptr, k_ptr, w_ptr, bt_ptr, seq_ptr, kl_ptr, ws_ptr, out_ptr,
                     T, PS, Hi, Di, TOPK, sqt, sqh, sqd, sks, skd, swt, swh, sbb, sbp, sot, sok,
                     pid, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     CH: tl.constexpr, RANK_MERGE: tl.constexpr, DOT_FP32: tl.constexpr):
    """The block's queries may belong to several sequences (a decode batch: one each). A
    [BLOCK_S] tile of keys is one sequence's, so the block makes one pass per distinct sequence
    among its queries (smallest id first), streaming that sequence's keys through its table row
    for the queries of that sequence only; the other rows' chunk halves hold SENT, which the
    merge leaves behind their running top-CH. Order keys carry the LOGICAL index (ties to the
    smaller logical position); the decode maps each to its pool row."""
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t64 = t.to(tl.int64)
    sq = tl.load(seq_ptr + t, mask=t_mask, other=0).to(tl.int32)
    kl = tl.load(kl_ptr + t, mask=t_mask, other=0).to(tl.int32)
    W: tl.constexpr = 2 * CH
    rows = ws_ptr + t64 * W
    cols = tl.arange(0, CH)
    tl.store(rows[:, None] + cols[None, :],
             tl.full([BLOCK_T, CH], -9187343243497619456, tl.int64), mask=t_mask[:, None])
    tl.debug_barrier()
    sb = tl.arange(0, BLOCK_S)
    wcols = tl.arange(0, W)
    todo = t_mask & (kl > 0)
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        b = tl.min(tl.where(todo, sq, 2147483647), axis=0)
        act = todo & (sq == b)
        hi = tl.max(tl.where(act, kl, 0), axis=0)
        brow = bt_ptr + b.to(tl.int64) * sbb
        for c0 in range(0, hi, CH):
            # 1) score tiles of this chunk of sequence b's keys -> order keys
            for j0 in range(0, CH, BLOCK_S):
                s = c0 + j0 + sb
                s_mask = s < hi
                page = tl.load(brow + (s // PS).to(tl.int64) * sbp, mask=s_mask, other=0)
                prow = page.to(tl.int64) * PS + (s % PS).to(tl.int64)
                valid = act[:, None] & (s[None, :] < kl[:, None])
                score = _score_tile(q_ptr, k_ptr, w_ptr, t64, act, prow, s_mask,
                                    Hi, Di, sqt, sqh, sqd, sks, skd, swt, swh,
                                    BLOCK_T, BLOCK_S, BLOCK_D, DOT_FP32)
                key = tl.where(valid, _order_key(score, s), -9187343243497619456)
                tl.store(rows[:, None] + (CH + j0 + sb)[None, :], key, mask=t_mask[:, None])
            tl.debug_barrier()
            # 2) merge: keep the best CH keys of each row's 2*CH
            if RANK_MERGE:
                kv = tl.load(rows[:, None] + wcols[None, :], mask=t_mask[:, None],
                             other=-9187343243497619456)
                a = kv[:, :, None]
                bb = kv[:, None, :]
                before = wcols[None, :] < wcols[:, None]  # [i, j]: j < i
                rank = tl.sum(((bb > a) | ((bb == a) & before[None, :, :])).to(tl.int32),
                              axis=2)
                tl.debug_barrier()
                tl.store(rows[:, None] + rank, kv, mask=t_mask[:, None])
            else:
                for i in range(0, BLOCK_T):
                    row = pid * BLOCK_T + i
                    if row < T:
                        rsq = tl.load(seq_ptr + row).to(tl.int32)
                        rkl = tl.load(kl_ptr + row).to(tl.int32)
                        if (rsq == b) & (rkl > c0):
                            rp = ws_ptr + tl.cast(row, tl.int64) * W + wcols
                            v = tl.load(rp)
                            v = tl.sort(v, descending=True)
                            tl.store(rp, v)
            tl.debug_barrier()
        todo = todo & ~act
        left = tl.sum(todo.to(tl.int32), axis=0)
    # 3) decode the first TOPK keys: logical index -> pool row, or -1 for an empty slot
    key = tl.load(rows[:, None] + cols[None, :], mask=t_mask[:, None],
                  other=-9187343243497619456)
    ok = (key >> 32) > -2139095041
    j = tl.where(ok, 4294967295 - (key & 4294967295), 0)
    page = tl.load(bt_ptr + sq.to(tl.int64)[:, None] * sbb + (j // PS) * sbp,
                   mask=ok & t_mask[:, None], other=0)
    idx = tl.where(ok, page.to(tl.int64) * PS + j % PS, -1).to(tl.int32)
    tl.store(out_ptr + t64[:, None] * sot + cols[None, :] * sok, idx,
             mask=t_mask[:, None] & (cols[None, :] < TOPK))
