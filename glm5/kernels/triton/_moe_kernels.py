"""@triton.jit kernels behind glm5.kernels.triton.moe: grouped expert GEMMs and the combine.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel


@entry_kernel()
def moe_gemm13_kernel(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                      D, I, sxt, sxd, swe, swn, swd, shr, shi, N_TILES, NUM_PROGRAMS, GRID_1,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_FP32: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (row tile, n-block), see _gemm13_tile; PERSISTENT: program p walks the tiles
    p, p + NUM_PROGRAMS, ... of that grid folded row-major."""
    if PERSISTENT:
        for t in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                         D, I, sxt, sxd, swe, swn, swd, shr, shi, t // GRID_1, t % GRID_1,
                         BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
    else:
        _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                     D, I, sxt, sxd, swe, swn, swd, shr, shi, tl.program_id(0), tl.program_id(1),
                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)


@triton.jit
def _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                 D, I, sxt, sxd, swe, swn, swd, shr, shi, tile, pn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    """Tile (tile, n-block): rows lo..hi-1 of the expert-sorted routed tokens, all of expert e:
    h[r, n] = silu(x[tok[r]] . w13[e, n]) * (x[tok[r]] . w13[e, I + n]). Padding tiles (e < 0)
    do nothing."""
    e = tl.load(tile_e_ptr + tile).to(tl.int64)
    if e >= 0:
        lo = tl.load(tile_lo_ptr + tile)
        hi = tl.load(tile_hi_ptr + tile)
        r = lo + tl.arange(0, BLOCK_M)
        rm = r < hi
        tok = tl.load(tok_ptr + r, mask=rm, other=0).to(tl.int64)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        n64 = n.to(tl.int64)
        kb = tl.arange(0, BLOCK_K)
        w_e = w13_ptr + e * swe
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + kb
            km = kk < D
            a = tl.load(x_ptr + tok[:, None] * sxt + kk[None, :] * sxd,
                        mask=rm[:, None] & km[None, :], other=0.0)
            wg = tl.load(w_e + n64[None, :] * swn + kk[:, None] * swd,
                         mask=nm[None, :] & km[:, None], other=0.0)
            wu = tl.load(w_e + (n64 + I)[None, :] * swn + kk[:, None] * swd,
                         mask=nm[None, :] & km[:, None], other=0.0)
            gate = _dot(a, wg, gate, DOT_FP32)
            up = _dot(a, wu, up, DOT_FP32)
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + r.to(tl.int64)[:, None] * shr + n64[None, :] * shi,
                 h.to(h_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


@entry_kernel()
def moe_gemm2_kernel(h_ptr, w2_ptr, y_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                     D, I, shr, shi, swe, swn, swi, syr, syd, N_TILES, NUM_PROGRAMS, GRID_1,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_FP32: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (row tile, n-block), see _gemm2_tile; PERSISTENT as in moe_gemm13_kernel."""
    if PERSISTENT:
        for t in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _gemm2_tile(h_ptr, w2_ptr, y_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                        D, I, shr, shi, swe, swn, swi, syr, syd, t // GRID_1, t % GRID_1,
                        BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
    else:
        _gemm2_tile(h_ptr, w2_ptr, y_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                    D, I, shr, shi, swe, swn, swi, syr, syd, tl.program_id(0), tl.program_id(1),
                    BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)


@triton.jit
def _gemm2_tile(h_ptr, w2_ptr, y_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                D, I, shr, shi, swe, swn, swi, syr, syd, tile, pn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """Tile (tile, n-block): y[r, n] = h[r] . w2[e, n] (fp32, unweighted) for the tile's rows."""
    e = tl.load(tile_e_ptr + tile).to(tl.int64)
    if e >= 0:
        lo = tl.load(tile_lo_ptr + tile)
        hi = tl.load(tile_hi_ptr + tile)
        r = lo + tl.arange(0, BLOCK_M)
        rm = r < hi
        r64 = r.to(tl.int64)
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < D
        n64 = n.to(tl.int64)
        kb = tl.arange(0, BLOCK_K)
        w_e = w2_ptr + e * swe
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            kk = k0 + kb
            km = kk < I
            a = tl.load(h_ptr + r64[:, None] * shr + kk[None, :] * shi,
                        mask=rm[:, None] & km[None, :], other=0.0)
            b = tl.load(w_e + n64[None, :] * swn + kk[:, None] * swi,
                        mask=nm[None, :] & km[:, None], other=0.0)
            acc = _dot(a, b, acc, DOT_FP32)
        tl.store(y_ptr + r64[:, None] * syr + n64[None, :] * syd, acc,
                 mask=rm[:, None] & nm[None, :])


@entry_kernel()
def moe_combine_kernel(y_ptr, inv_ptr, ids_ptr, w_ptr, out_ptr, D, KTOP,
                       syr, syd, sit, sik, swt, swk, sot, sod, N_TILES, NUM_PROGRAMS, GRID_1,
                       BLOCK_D: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (token, D-block), see _combine_tile; PERSISTENT as in moe_gemm13_kernel."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _combine_tile(y_ptr, inv_ptr, ids_ptr, w_ptr, out_ptr, D, KTOP,
                          syr, syd, sit, sik, swt, swk, sot, sod, tile // GRID_1, tile % GRID_1,
                          BLOCK_D)
    else:
        _combine_tile(y_ptr, inv_ptr, ids_ptr, w_ptr, out_ptr, D, KTOP,
                      syr, syd, sit, sik, swt, swk, sot, sod, tl.program_id(0), tl.program_id(1),
                      BLOCK_D)


@triton.jit
def _combine_tile(y_ptr, inv_ptr, ids_ptr, w_ptr, out_ptr, D, KTOP,
                  syr, syd, sit, sik, swt, swk, sot, sod, pid_t, pd, BLOCK_D: tl.constexpr):
    """out[t] = sum_j weights[t, j] * y[inv[t*KTOP + j]] over j with ids[t, j] >= 0, in j order
    (deterministic, no atomics), fp32 accumulation."""
    t = tl.cast(pid_t, tl.int64)  # a Python int under the interpreter's persistent loop
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, KTOP):
        e = tl.load(ids_ptr + t * sit + j * sik)
        ok = (d * 0 + e) >= 0  # [BLOCK_D]: a scalar mask trips the interpreter
        r = tl.load(inv_ptr + t * KTOP + j).to(tl.int64)
        wt = tl.load(w_ptr + t * swt + j * swk).to(tl.float32)
        yv = tl.load(y_ptr + r * syr + d * syd, mask=dm & ok, other=0.0)
        acc += tl.where(ok, wt * yv, 0.0)
    tl.store(out_ptr + t * sot + d * sod, acc.to(out_ptr.dtype.element_ty), mask=dm)
