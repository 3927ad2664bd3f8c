"""@triton.jit kernel merging split-KV partials (glm5.kernels.triton.splitkv): the attention
kernels that split a query's keys across programs (sparse_attention, attention) write each
range's normalized out and lse; this kernel merges them by their lse.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import entry_kernel


@entry_kernel("T", "SPLIT")
def splitkv_combine_kernel(po_ptr, pl_ptr, out_ptr, lse_ptr, T, H, Dv, SPLIT,
                            sot, soh, sod, slt, slh, N_TILES, NUM_PROGRAMS, GRID_1,
                            BLOCK_DV: tl.constexpr, PERSISTENT: tl.constexpr):
    """Merge the SPLIT partials of each (query t, head h), one tile each: partial outs
    po [SPLIT, T, H, Dv] fp32 (each normalized over its keys) and lses pl [SPLIT, T, H] fp32,
    both contiguous. out = sum_s e^(lse_s - M) out_s / sum_s e^(lse_s - M), lse = M + ln sum,
    M = max_s lse_s; every lse_s -inf (no valid key): out 0, lse -inf."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _combine(po_ptr, pl_ptr, out_ptr, lse_ptr, T, H, Dv, SPLIT,
                     sot, soh, sod, slt, slh, tile // GRID_1, tile % GRID_1, BLOCK_DV)
    else:
        _combine(po_ptr, pl_ptr, out_ptr, lse_ptr, T, H, Dv, SPLIT,
                 sot, soh, sod, slt, slh, tl.program_id(0), tl.program_id(1), BLOCK_DV)


@triton.jit
def _combine(po_ptr, pl_ptr, out_ptr, lse_ptr, T, H, Dv, SPLIT,
             sot, soh, sod, slt, slh, pid_t, pid_h, BLOCK_DV: tl.constexpr):
    t = tl.cast(pid_t, tl.int64)
    h = tl.cast(pid_h, tl.int64)
    row = t * H + h  # (t, h) in a contiguous [T, H] plane
    plane = tl.cast(T, tl.int64) * H
    m = tl.load(pl_ptr + row)  # SPLIT >= 2: split 0 seeds both loops
    for s in range(1, SPLIT):
        m = tl.maximum(m, tl.load(pl_ptr + s * plane + row))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wsum = tl.exp(tl.load(pl_ptr + row) - m_safe)
    for s in range(1, SPLIT):
        wsum += tl.exp(tl.load(pl_ptr + s * plane + row) - m_safe)
    has = wsum > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, wsum, 1.0), 0.0)
    for d0 in range(0, Dv, BLOCK_DV):
        d = d0 + tl.arange(0, BLOCK_DV)
        dm = d < Dv
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s in range(0, SPLIT):
            w = tl.exp(tl.load(pl_ptr + s * plane + row) - m_safe)
            acc += w * tl.load(po_ptr + (s * plane + row) * Dv + d, mask=dm, other=0.0)
        tl.store(out_ptr + t * sot + h * soh + d * sod, (acc * inv).to(out_ptr.dtype.element_ty),
                 mask=dm)
    tl.store(lse_ptr + t * slt + h * slh,
             tl.where(has, m_safe + tl.log(tl.where(has, wsum, 1.0)), float("-inf")))
