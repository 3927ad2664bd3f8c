"""@triton.jit kernel behind glm5.kernels.triton.sparse_attention: sparse_attention, attention.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel


@entry_kernel("K")
def attention_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                     G, Dqk, Dv, K, N_HB, qk_scale,
                     sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                     sot, soh, sod, slt, slh, N_TILES, NUM_PROGRAMS, GRID_1, GRID_2,
                     SPARSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr,
                     PERSISTENT: tl.constexpr):
    """Tiles (T, Hk * N_HB, cdiv(Dv, BLOCK_DV)), see _attention_tile; PERSISTENT: program p
    walks the tiles p, p + NUM_PROGRAMS, ... of that grid folded row-major."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _attention_tile(q_ptr, k_ptr, v_ptr, idx_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                            G, Dqk, Dv, K, N_HB, qk_scale,
                            sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                            sot, soh, sod, slt, slh,
                            (tile // GRID_2) // GRID_1, (tile // GRID_2) % GRID_1, tile % GRID_2,
                            SPARSE, BLOCK_H, BLOCK_K, BLOCK_D, BLOCK_DV, DOT_FP32)
    else:
        _attention_tile(q_ptr, k_ptr, v_ptr, idx_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                        G, Dqk, Dv, K, N_HB, qk_scale,
                        sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                        sot, soh, sod, slt, slh,
                        tl.program_id(0), tl.program_id(1), tl.program_id(2),
                        SPARSE, BLOCK_H, BLOCK_K, BLOCK_D, BLOCK_DV, DOT_FP32)


@triton.jit
def _attention_tile(q_ptr, k_ptr, v_ptr, idx_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                    G, Dqk, Dv, K, N_HB, qk_scale,
                    sqt, sqh, sqd, sks, skh, skd, svs, svh, svd, sit, sik,
                    sot, soh, sod, slt, slh, pid_t, pid_h, pid_v,
                    SPARSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program per (query t, KV head j, block of BLOCK_H of its G query heads, block of Dv).

    Each key row (gathered by idx when SPARSE, else k_start <= s < k_end) is loaded once for all
    the program's heads: [BLOCK_H, Dqk] x [Dqk, BLOCK_K] scores (Dqk in BLOCK_D chunks), online
    softmax in base 2 (qk_scale = scale * log2 e), P in v's dtype times V [BLOCK_K, BLOCK_DV].
    Rows with no valid key give out 0 and lse -inf."""
    t = tl.cast(pid_t, tl.int64)  # a Python int under the interpreter's persistent loop
    j = tl.cast(pid_h // N_HB, tl.int64)
    hb = pid_h % N_HB
    hg = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hg < G
    heads = (j * G + hg).to(tl.int64)
    dv = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = dv < Dv
    d_base = tl.arange(0, BLOCK_D)
    kb = tl.arange(0, BLOCK_K)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    if SPARSE:
        lo = 0
        hi = K
    else:
        lo = tl.load(ks_ptr + t).to(tl.int32)
        hi = tl.load(ke_ptr + t).to(tl.int32)
    q_row = q_ptr + t * sqt + heads[:, None] * sqh
    k_head = k_ptr + j * skh
    v_head = v_ptr + j * svh
    for k0 in range(lo, hi, BLOCK_K):
        kk = k0 + kb
        in_blk = kk < hi
        if SPARSE:
            rows = tl.load(idx_ptr + t * sit + kk * sik, mask=in_blk, other=-1).to(tl.int64)
            valid = rows >= 0
            rows = tl.where(valid, rows, 0)
        else:
            valid = in_blk
            rows = kk.to(tl.int64)
        s = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
        for d0 in range(0, Dqk, BLOCK_D):
            d = d0 + d_base
            dm = d < Dqk
            qv = tl.load(q_row + d[None, :] * sqd, mask=h_mask[:, None] & dm[None, :], other=0.0)
            kv = tl.load(k_head + rows[None, :] * sks + d[:, None] * skd,
                         mask=valid[None, :] & dm[:, None], other=0.0)
            s = _dot(qv, kv, s, DOT_FP32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vv = tl.load(v_head + rows[:, None] * svs + dv[None, :] * svd,
                     mask=valid[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(vv.dtype), vv, acc, DOT_FP32)
        m_i = m_new
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    tl.store(out_ptr + t * sot + heads[:, None] * soh + dv[None, :] * sod,
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    first = (hg * 0 + pid_v) == 0  # only the first Dv block writes lse
    tl.store(lse_ptr + t * slt + heads * slh, lse, mask=h_mask & first)
