"""@triton.jit kernel behind glm5.kernels.triton.sparse_attention (its split-KV partials are
merged by glm5.kernels.triton._splitkv_kernels).

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel

LN2 = tl.constexpr(0.6931471805599453)


@entry_kernel("K", "KPS", "sit", "sos", "sls")
def sparse_attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
                            G, Dqk, Dv, K, KPS, N_HB, N_DV, qk_scale,
                            sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                            sos, sot, soh, sod, sls, slt, slh,
                            N_TILES, NUM_PROGRAMS, GRID_1, GRID_2,
                            BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                            RESIDENT: tl.constexpr, BLOCK_DA: tl.constexpr,
                            BLOCK_DB: tl.constexpr, V_FROM_K: tl.constexpr,
                            DOT_FP32: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (T, Hk * N_HB, N_DV * SPLIT), see _sparse_tile; PERSISTENT: program p walks the
    tiles p, p + NUM_PROGRAMS, ... of that grid folded row-major."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _sparse_tile(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
                         G, Dqk, Dv, K, KPS, N_HB, N_DV, qk_scale,
                         sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                         sos, sot, soh, sod, sls, slt, slh,
                         (tile // GRID_2) // GRID_1, (tile // GRID_2) % GRID_1, tile % GRID_2,
                         BLOCK_H, BLOCK_K, BLOCK_D, BLOCK_DV, RESIDENT, BLOCK_DA, BLOCK_DB,
                         V_FROM_K, DOT_FP32)
    else:
        _sparse_tile(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
                     G, Dqk, Dv, K, KPS, N_HB, N_DV, qk_scale,
                     sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                     sos, sot, soh, sod, sls, slt, slh,
                     tl.program_id(0), tl.program_id(1), tl.program_id(2),
                     BLOCK_H, BLOCK_K, BLOCK_D, BLOCK_DV, RESIDENT, BLOCK_DA, BLOCK_DB,
                     V_FROM_K, DOT_FP32)


@triton.jit
def _sparse_tile(q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, lse_ptr,
                 G, Dqk, Dv, K, KPS, N_HB, N_DV, qk_scale,
                 sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                 sos, sot, soh, sod, sls, slt, slh, pid_t, pid_h, pid_2,
                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, RESIDENT: tl.constexpr, BLOCK_DA: tl.constexpr,
                 BLOCK_DB: tl.constexpr, V_FROM_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program per (query t, KV head j, block of BLOCK_H of its G query heads, block of Dv,
    split s of the selected keys: idx[t, s * KPS : (s + 1) * KPS]).

    Each gathered key row is loaded once for all the program's heads: [BLOCK_H, Dqk] x
    [Dqk, BLOCK_K] scores, online softmax in base 2 (qk_scale = scale * log2 e), P in v's dtype
    times V [BLOCK_K, BLOCK_DV]. RESIDENT: Q is loaded once and stays on chip, split in a
    power-of-two head [BLOCK_H, BLOCK_DA] and a tail [BLOCK_H, BLOCK_DB] (576 = 512 + 64), and
    each gathered tile is [BLOCK_K, BLOCK_DA] (+ the tail) rows; V_FROM_K (v is k's first Dv
    columns, one Dv block of BLOCK_DA): the PV dot reuses that tile as V instead of gathering
    the same rows again (its columns past Dv only reach accumulator columns that are not
    stored). Otherwise Dqk is reduced in BLOCK_D chunks with Q re-read per key tile (fp32
    inputs on a device: a resident fp32 Q would not fit beside the accumulator). Writes the
    normalized out of its keys and their lse (natural log) at split s (stride sos / sls: 0 when
    there is one split, then these are the op's outputs). Rows with no valid key give out 0
    and lse -inf."""
    t = tl.cast(pid_t, tl.int64)  # a Python int under the interpreter's persistent loop
    j = tl.cast(pid_h // N_HB, tl.int64)
    hb = pid_h % N_HB
    pid_v = pid_2 % N_DV
    split32 = pid_2 // N_DV
    split = tl.cast(split32, tl.int64)
    hg = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hg < G
    heads = (j * G + hg).to(tl.int64)
    dv = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = dv < Dv
    kb = tl.arange(0, BLOCK_K)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    lo = split32 * KPS
    hi = tl.minimum(lo + KPS, K)
    q_row = q_ptr + t * sqt + heads[:, None] * sqh
    k_head = k_ptr + j * skh
    v_head = v_ptr + j * svh
    da = tl.arange(0, BLOCK_DA)
    if RESIDENT:
        q_a = tl.load(q_row + da[None, :] * sqd, mask=h_mask[:, None] & (da[None, :] < Dqk),
                      other=0.0)
        if BLOCK_DB > 0:
            db = BLOCK_DA + tl.arange(0, BLOCK_DB)
            q_b = tl.load(q_row + db[None, :] * sqd,
                          mask=h_mask[:, None] & (db[None, :] < Dqk), other=0.0)
    for k0 in range(lo, hi, BLOCK_K):
        kk = k0 + kb
        rows = tl.load(idx_ptr + t * sit + kk * sik, mask=kk < hi, other=-1).to(tl.int64)
        valid = rows >= 0
        rows = tl.where(valid, rows, 0)
        k_rows = k_head + rows[:, None] * sks
        s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        if RESIDENT:
            k_a = tl.load(k_rows + da[None, :] * skd, mask=valid[:, None] & (da[None, :] < Dqk),
                          other=0.0)
            s = _dot(q_a, tl.trans(k_a), s, DOT_FP32)
            if BLOCK_DB > 0:
                k_b = tl.load(k_rows + db[None, :] * skd,
                              mask=valid[:, None] & (db[None, :] < Dqk), other=0.0)
                s = _dot(q_b, tl.trans(k_b), s, DOT_FP32)
        else:
            for d0 in range(0, Dqk, BLOCK_D):
                d = d0 + tl.arange(0, BLOCK_D)
                dm = d < Dqk
                qv = tl.load(q_row + d[None, :] * sqd, mask=h_mask[:, None] & dm[None, :],
                             other=0.0)
                kv = tl.load(k_head + rows[None, :] * sks + d[:, None] * skd,
                             mask=valid[None, :] & dm[:, None], other=0.0)
                s = _dot(qv, kv, s, DOT_FP32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_FROM_K:
            vv = k_a
        else:
            vv = tl.load(v_head + rows[:, None] * svs + dv[None, :] * svd,
                         mask=valid[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(vv.dtype), vv, acc, DOT_FP32)
        m_i = m_new
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    tl.store(out_ptr + split * sos + t * sot + heads[:, None] * soh + dv[None, :] * sod,
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    first = (hg * 0 + pid_v) == 0  # only the first Dv block writes lse
    tl.store(lse_ptr + split * sls + t * slt + heads * slh, lse, mask=h_mask & first)
