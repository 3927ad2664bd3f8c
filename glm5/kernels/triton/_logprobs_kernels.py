"""@triton.jit kernel behind glm5.kernels.triton.logprobs: token_logprobs.

Each program owns a block of BLOCK_T tokens and one contiguous range of the vocabulary (the
whole vocabulary, or one of SPLIT ranges when the launcher splits V across programs). It walks
its range in chunks of BLOCK_V rows: logits z = h_tile . w_tileᵀ (tl.dot over D in BLOCK_D
steps, fp32 accumulation) scaled by 1/temperature, and keeps per token the running max m,
sum exp(z - m), sum exp(z - m)·z and the target's logit. Only a [BLOCK_T, BLOCK_V] tile of logits
ever exists. The four running values go to [SPLIT, T] fp32 partials that the launcher combines.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import entry_kernel


@entry_kernel("T", "v_per_split")
def token_logprobs_partial_kernel(
    h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, zs_ptr, zt_ptr,
    T, V, D, inv_temp, v_per_split,
    stride_ht, stride_hd, stride_wv, stride_wd, stride_tgt, N_TILES, NUM_PROGRAMS, GRID_1,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """Tiles (token block, split); PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _partial_tile(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, zs_ptr, zt_ptr,
                          T, V, D, inv_temp, v_per_split,
                          stride_ht, stride_hd, stride_wv, stride_wd, stride_tgt,
                          tile // GRID_1, tile % GRID_1, BLOCK_T, BLOCK_V, BLOCK_D, DOT_F32)
    else:
        _partial_tile(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, zs_ptr, zt_ptr,
                      T, V, D, inv_temp, v_per_split,
                      stride_ht, stride_hd, stride_wv, stride_wd, stride_tgt,
                      tl.program_id(0), tl.program_id(1), BLOCK_T, BLOCK_V, BLOCK_D, DOT_F32)


@triton.jit
def _partial_tile(
    h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, zs_ptr, zt_ptr,
    T, V, D, inv_temp, v_per_split,
    stride_ht, stride_hd, stride_wv, stride_wd, stride_tgt, pid_t, split,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    tgt = tl.load(tgt_ptr + rows64 * stride_tgt, mask=rmask, other=-1).to(tl.int64)
    cols_v = tl.arange(0, BLOCK_V)
    cols_d = tl.arange(0, BLOCK_D)

    neg_inf = float("-inf")
    m = tl.full([BLOCK_T], neg_inf, dtype=tl.float32)
    ssum = tl.zeros([BLOCK_T], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_T], dtype=tl.float32)
    zt = tl.zeros([BLOCK_T], dtype=tl.float32)

    v_begin = split * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        vrows = v0 + cols_v
        vmask = vrows < v_end
        vrows64 = vrows.to(tl.int64)
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + cols_d
            dmask = dd < D
            h = tl.load(h_ptr + rows64[:, None] * stride_ht + dd[None, :] * stride_hd,
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
            w = tl.load(w_ptr + vrows64[None, :] * stride_wv + dd[:, None] * stride_wd,
                        mask=vmask[None, :] & dmask[:, None], other=0.0)  # [BLOCK_D, BLOCK_V]
            if DOT_F32:
                acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(h, w, acc)
        zf = acc * inv_temp  # finite everywhere (masked vocabulary rows load as 0)
        z = tl.where(vmask[None, :], zf, neg_inf)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])
        ssum = ssum * alpha + tl.sum(e, axis=1)
        zsum = zsum * alpha + tl.sum(e * zf, axis=1)  # e is 0 on masked rows
        m = m_new
        hit = vrows64[None, :] == tgt[:, None]
        zt += tl.sum(tl.where(hit, zf, 0.0), axis=1)

    out = tl.cast(split, tl.int64) * T + rows64
    tl.store(m_ptr + out, m, mask=rmask)
    tl.store(s_ptr + out, ssum, mask=rmask)
    tl.store(zs_ptr + out, zsum, mask=rmask)
    tl.store(zt_ptr + out, zt, mask=rmask)


@entry_kernel("T", "SPLIT")
def token_logprobs_combine_kernel(m_ptr, s_ptr, zs_ptr, zt_ptr, logp_ptr, ent_ptr, T, SPLIT,
                                  N_TILES, NUM_PROGRAMS,
                                  BLOCK_T: tl.constexpr, PERSISTENT: tl.constexpr):
    """Merge the SPLIT partial (max, sum exp, sum exp·z, target logit) rows of each token, one
    tile per BLOCK_T tokens (PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ...)."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _combine_rows(m_ptr, s_ptr, zs_ptr, zt_ptr, logp_ptr, ent_ptr, T, SPLIT, tile,
                          BLOCK_T)
    else:
        _combine_rows(m_ptr, s_ptr, zs_ptr, zt_ptr, logp_ptr, ent_ptr, T, SPLIT,
                      tl.program_id(0), BLOCK_T)


@triton.jit
def _combine_rows(m_ptr, s_ptr, zs_ptr, zt_ptr, logp_ptr, ent_ptr, T, SPLIT, pid,
                  BLOCK_T: tl.constexpr):
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    for i in range(0, SPLIT):
        mi = tl.load(m_ptr + i * T + rows64, mask=rmask, other=0.0)
        m = tl.maximum(m, mi)
    ssum = tl.zeros([BLOCK_T], dtype=tl.float32)
    zsum = tl.zeros([BLOCK_T], dtype=tl.float32)
    zt = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in range(0, SPLIT):
        off = i * T + rows64
        mi = tl.load(m_ptr + off, mask=rmask, other=0.0)
        a = tl.exp(mi - m)
        ssum += tl.load(s_ptr + off, mask=rmask, other=1.0) * a
        zsum += tl.load(zs_ptr + off, mask=rmask, other=0.0) * a
        zt += tl.load(zt_ptr + off, mask=rmask, other=0.0)
    lse = m + tl.log(ssum)
    tl.store(logp_ptr + rows64, zt - lse, mask=rmask)
    tl.store(ent_ptr + rows64, lse - zsum / ssum, mask=rmask)
