"""@triton.jit kernels behind glm5.kernels.triton.mla_prolog: the fused norm / RoPE / cache-write
tail of the MLA prolog.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import entry_kernel


@triton.jit
def _rms_row(ptr, g_ptr, n, sx, sg, eps, BLOCK: tl.constexpr):
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(ptr + c * sx, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / n
    g = tl.load(g_ptr + c * sg, mask=m, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(ms + eps)) * g, c, m


@entry_kernel()
def prolog_token_kernel(cq_raw_ptr, g_qa_ptr, cq_ptr, kv_ptr, g_kva_ptr, cos_ptr, sin_ptr,
                        slots_ptr, cache_ptr, Rq, Rkv, R2, eps,
                        s_cqr_t, s_cqr_c, s_gqa, s_cq_t, s_cq_c, s_kv_t, s_kv_c, s_gkva,
                        s_cos_t, s_cos_i, s_sin_t, s_sin_i, s_cache_n, s_cache_c,
                        N_TILES, NUM_PROGRAMS,
                        BLOCK_RQ: tl.constexpr, BLOCK_RKV: tl.constexpr,
                        BLOCK_R2: tl.constexpr, PERSISTENT: tl.constexpr):
    """One tile per token t: c_q = rms_norm(c_q_raw[t], g_qa); ckv = rms_norm(kv[t, :Rkv],
    g_kva); k_pe = interleaved rope(kv[t, Rkv:]); [ckv | k_pe] -> kv_cache[slots[t]] unless the
    slot is -1. PERSISTENT: program p handles tokens p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _prolog_token(cq_raw_ptr, g_qa_ptr, cq_ptr, kv_ptr, g_kva_ptr, cos_ptr, sin_ptr,
                          slots_ptr, cache_ptr, Rq, Rkv, R2, eps,
                          s_cqr_t, s_cqr_c, s_gqa, s_cq_t, s_cq_c, s_kv_t, s_kv_c, s_gkva,
                          s_cos_t, s_cos_i, s_sin_t, s_sin_i, s_cache_n, s_cache_c, tile,
                          BLOCK_RQ, BLOCK_RKV, BLOCK_R2)
    else:
        _prolog_token(cq_raw_ptr, g_qa_ptr, cq_ptr, kv_ptr, g_kva_ptr, cos_ptr, sin_ptr,
                      slots_ptr, cache_ptr, Rq, Rkv, R2, eps,
                      s_cqr_t, s_cqr_c, s_gqa, s_cq_t, s_cq_c, s_kv_t, s_kv_c, s_gkva,
                      s_cos_t, s_cos_i, s_sin_t, s_sin_i, s_cache_n, s_cache_c,
                      tl.program_id(0), BLOCK_RQ, BLOCK_RKV, BLOCK_R2)


@triton.jit
def _prolog_token(cq_raw_ptr, g_qa_ptr, cq_ptr, kv_ptr, g_kva_ptr, cos_ptr, sin_ptr,
                  slots_ptr, cache_ptr, Rq, Rkv, R2, eps,
                  s_cqr_t, s_cqr_c, s_gqa, s_cq_t, s_cq_c, s_kv_t, s_kv_c, s_gkva,
                  s_cos_t, s_cos_i, s_sin_t, s_sin_i, s_cache_n, s_cache_c, pid,
                  BLOCK_RQ: tl.constexpr, BLOCK_RKV: tl.constexpr, BLOCK_R2: tl.constexpr):
    t = tl.cast(pid, tl.int64)  # a Python int under the interpreter's persistent loop
    cq, c, m = _rms_row(cq_raw_ptr + t * s_cqr_t, g_qa_ptr, Rq, s_cqr_c, s_gqa, eps, BLOCK_RQ)
    tl.store(cq_ptr + t * s_cq_t + c * s_cq_c, cq.to(cq_ptr.dtype.element_ty), mask=m)

    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        row = kv_ptr + t * s_kv_t
        ckv, c2, m2 = _rms_row(row, g_kva_ptr, Rkv, s_kv_c, s_gkva, eps, BLOCK_RKV)
        i = tl.arange(0, BLOCK_R2)
        mi = i < R2
        e = tl.load(row + (Rkv + 2 * i) * s_kv_c, mask=mi, other=0.0).to(tl.float32)
        o = tl.load(row + (Rkv + 2 * i + 1) * s_kv_c, mask=mi, other=0.0).to(tl.float32)
        cs = tl.load(cos_ptr + t * s_cos_t + i * s_cos_i, mask=mi, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + t * s_sin_t + i * s_sin_i, mask=mi, other=0.0).to(tl.float32)
        dst = cache_ptr + slot * s_cache_n
        ty = cache_ptr.dtype.element_ty
        tl.store(dst + c2 * s_cache_c, ckv.to(ty), mask=m2)
        tl.store(dst + (Rkv + 2 * i) * s_cache_c, (e * cs - o * sn).to(ty), mask=mi)
        tl.store(dst + (Rkv + 2 * i + 1) * s_cache_c, (o * cs + e * sn).to(ty), mask=mi)


@entry_kernel()
def prolog_q_kernel(q_ptr, cos_ptr, sin_ptr, qn_ptr, qpe_ptr, Dn, R2, DH,
                    s_q_t, s_q_c, s_cos_t, s_cos_i, s_sin_t, s_sin_i,
                    s_qn_t, s_qn_h, s_qn_d, s_qpe_t, s_qpe_h, s_qpe_d,
                    N_TILES, NUM_PROGRAMS, GRID_1,
                    WRITE_NOPE: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr,
                    PERSISTENT: tl.constexpr):
    """One tile per (token t, head h) of q = c_q w_qb^T viewed [T, H, Dn + Dr]: q_pe =
    interleaved rope(q[t, h, Dn:]); q_nope copied out (in the output dtype) when WRITE_NOPE.
    PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ... of the (T, H) grid."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _prolog_q(q_ptr, cos_ptr, sin_ptr, qn_ptr, qpe_ptr, Dn, R2, DH,
                      s_q_t, s_q_c, s_cos_t, s_cos_i, s_sin_t, s_sin_i,
                      s_qn_t, s_qn_h, s_qn_d, s_qpe_t, s_qpe_h, s_qpe_d,
                      tile // GRID_1, tile % GRID_1, WRITE_NOPE, BLOCK_DN, BLOCK_R2)
    else:
        _prolog_q(q_ptr, cos_ptr, sin_ptr, qn_ptr, qpe_ptr, Dn, R2, DH,
                  s_q_t, s_q_c, s_cos_t, s_cos_i, s_sin_t, s_sin_i,
                  s_qn_t, s_qn_h, s_qn_d, s_qpe_t, s_qpe_h, s_qpe_d,
                  tl.program_id(0), tl.program_id(1), WRITE_NOPE, BLOCK_DN, BLOCK_R2)


@triton.jit
def _prolog_q(q_ptr, cos_ptr, sin_ptr, qn_ptr, qpe_ptr, Dn, R2, DH,
              s_q_t, s_q_c, s_cos_t, s_cos_i, s_sin_t, s_sin_i,
              s_qn_t, s_qn_h, s_qn_d, s_qpe_t, s_qpe_h, s_qpe_d, pid_t, pid_h,
              WRITE_NOPE: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R2: tl.constexpr):
    t = tl.cast(pid_t, tl.int64)  # a Python int under the interpreter's persistent loop
    h = tl.cast(pid_h, tl.int64)
    row = q_ptr + t * s_q_t + h * DH * s_q_c
    if WRITE_NOPE:
        d = tl.arange(0, BLOCK_DN)
        md = d < Dn
        x = tl.load(row + d * s_q_c, mask=md, other=0.0)
        tl.store(qn_ptr + t * s_qn_t + h * s_qn_h + d * s_qn_d,
                 x.to(qn_ptr.dtype.element_ty), mask=md)
    i = tl.arange(0, BLOCK_R2)
    mi = i < R2
    e = tl.load(row + (Dn + 2 * i) * s_q_c, mask=mi, other=0.0).to(tl.float32)
    o = tl.load(row + (Dn + 2 * i + 1) * s_q_c, mask=mi, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * s_cos_t + i * s_cos_i, mask=mi, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * s_sin_t + i * s_sin_i, mask=mi, other=0.0).to(tl.float32)
    dst = qpe_ptr + t * s_qpe_t + h * s_qpe_h
    ty = qpe_ptr.dtype.element_ty
    tl.store(dst + (2 * i) * s_qpe_d, (e * cs - o * sn).to(ty), mask=mi)
    tl.store(dst + (2 * i + 1) * s_qpe_d, (o * cs + e * sn).to(ty), mask=mi)
