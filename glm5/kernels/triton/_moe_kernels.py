"""@triton.jit kernels behind glm5.kernels.triton.moe: grouped expert GEMMs and the combine.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).

Both GEMMs run over a 1-D logical grid of MAX_TILES row tiles x the N-blocks, ordered by the
GROUP_M swizzle of Triton's matmul tutorial: GROUP_M consecutive row tiles (the same expert's,
as rows are sorted by expert) sweep the N-blocks together, so a weight tile is read from HBM
once and served to the other row tiles of its expert from L2, and the gathered activation rows
stay in L2 across N-blocks. MAX_TILES is an upper bound computed from shapes on the host; the
tiles past the real count have tile_e = -1 and exit.

Only the K dimension is masked in the inner loops: padding rows of a tile gather a valid row
(token 0 / the tile's last row) and columns past the end are clamped to the last column; their
results are never stored. That keeps the loads maskless on the M and N axes, as in the
tutorial, so the pipeliner streams them into shared memory for wgmma.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel


@triton.jit
def _swizzle(t, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile t over a num_m x num_n grid, GROUP_M row tiles at a time
    (Triton tutorial 03's grouped ordering)."""
    t = tl.cast(t, tl.int32)  # a Python int under the interpreter's persistent loop
    in_group = GROUP_M * num_n
    first_m = (t // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % in_group) % size_m
    pid_n = (t % in_group) // size_m
    return pid_m, pid_n


@entry_kernel("MAX_TILES")
def moe_gemm13_kernel(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                      D, I, sxt, sxd, swe, swn, swd, shr, shi, MAX_TILES, N_TILES, NUM_PROGRAMS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                      PERSISTENT: tl.constexpr):
    """Tiles (row tile, n-block) of h = silu(x w1^T) * (x w3^T), see _gemm13_tile; PERSISTENT:
    program p walks the linear tiles p, p + NUM_PROGRAMS, ..."""
    num_n = tl.cdiv(I, BLOCK_N)
    if PERSISTENT:
        for t in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            pm, pn = _swizzle(t, MAX_TILES, num_n, GROUP_M)
            _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                         D, I, sxt, sxd, swe, swn, swd, shr, shi, pm, pn,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_FP32)
    else:
        pm, pn = _swizzle(tl.program_id(0), MAX_TILES, num_n, GROUP_M)
        _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                     D, I, sxt, sxd, swe, swn, swd, shr, shi, pm, pn,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_FP32)


@triton.jit
def _gemm13_tile(x_ptr, w13_ptr, h_ptr, tok_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                 D, I, sxt, sxd, swe, swn, swd, shr, shi, tile, pn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Tile (tile, n-block): sorted rows lo..hi-1, all routed to expert e:
    h[r, n] = silu(x[tok[r]] . w13[e, n]) * (x[tok[r]] . w13[e, I + n]), the gather of the token
    rows fused into the A loads and silu_mul into the epilogue (the [rows, 2I] product never
    reaches memory). Padding tiles (e < 0) do nothing."""
    e = tl.load(tile_e_ptr + tile).to(tl.int64)
    if e >= 0:
        lo = tl.load(tile_lo_ptr + tile).to(tl.int32)  # rows < T k: int32 index math
        hi = tl.load(tile_hi_ptr + tile).to(tl.int32)
        r = lo + tl.arange(0, BLOCK_M)
        rm = r < hi
        tok = tl.load(tok_ptr + r, mask=rm, other=0).to(tl.int64)  # padding rows: token 0
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < I
        nc = tl.minimum(n, I - 1).to(tl.int64)  # columns past I: a valid row, not stored
        kb = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * sxt + kb[None, :] * sxd
        g_ptrs = w13_ptr + e * swe + nc[None, :] * swn + kb[:, None] * swd
        u_ptrs = g_ptrs + I * swn
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                wg = tl.load(g_ptrs)
                wu = tl.load(u_ptrs)
            else:
                km = kb < D - k0
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=km[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=km[:, None], other=0.0)
            gate = _dot(a, wg, gate, DOT_FP32)
            up = _dot(a, wu, up, DOT_FP32)
            a_ptrs += BLOCK_K * sxd
            g_ptrs += BLOCK_K * swd
            u_ptrs += BLOCK_K * swd
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + r.to(tl.int64)[:, None] * shr + n[None, :] * shi,
                 h.to(h_ptr.dtype.element_ty), mask=rm[:, None] & nm[None, :])


@entry_kernel("MAX_TILES")
def moe_gemm2_kernel(h_ptr, w2_ptr, y_ptr, pair_ptr, wt_ptr, tile_e_ptr, tile_lo_ptr,
                     tile_hi_ptr, D, I, KTOP, shr, shi, swe, swn, swi, swt, swk, syr, syd,
                     MAX_TILES, N_TILES, NUM_PROGRAMS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
                     PERSISTENT: tl.constexpr):
    """Tiles (row tile, n-block) of y = weight * (h w2^T), see _gemm2_tile; PERSISTENT as in
    moe_gemm13_kernel."""
    num_n = tl.cdiv(D, BLOCK_N)
    if PERSISTENT:
        for t in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            pm, pn = _swizzle(t, MAX_TILES, num_n, GROUP_M)
            _gemm2_tile(h_ptr, w2_ptr, y_ptr, pair_ptr, wt_ptr, tile_e_ptr, tile_lo_ptr,
                        tile_hi_ptr, D, I, KTOP, shr, shi, swe, swn, swi, swt, swk, syr, syd,
                        pm, pn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_FP32)
    else:
        pm, pn = _swizzle(tl.program_id(0), MAX_TILES, num_n, GROUP_M)
        _gemm2_tile(h_ptr, w2_ptr, y_ptr, pair_ptr, wt_ptr, tile_e_ptr, tile_lo_ptr,
                    tile_hi_ptr, D, I, KTOP, shr, shi, swe, swn, swi, swt, swk, syr, syd,
                    pm, pn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_FP32)


@triton.jit
def _gemm2_tile(h_ptr, w2_ptr, y_ptr, pair_ptr, wt_ptr, tile_e_ptr, tile_lo_ptr, tile_hi_ptr,
                D, I, KTOP, shr, shi, swe, swn, swi, swt, swk, syr, syd, tile, pn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Tile (tile, n-block): for sorted row r of routed pair p = pair[r] = t * KTOP + j,
    y[p, n] = weights[t, j] * (h[r] . w2[e, n]) in fp32 (weighted once, in fp32, as the op
    contract sums). y is indexed by the pair, so the combine reads a token's slots
    contiguously."""
    e = tl.load(tile_e_ptr + tile).to(tl.int64)
    if e >= 0:
        lo = tl.load(tile_lo_ptr + tile).to(tl.int32)  # rows < T k: int32 index math
        hi = tl.load(tile_hi_ptr + tile).to(tl.int32)
        r = lo + tl.arange(0, BLOCK_M)
        rm = r < hi
        rc = tl.minimum(r, hi - 1).to(tl.int64)  # padding rows re-read the tile's last row
        n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < D
        nc = tl.minimum(n, D - 1).to(tl.int64)
        kb = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rc[:, None] * shr + kb[None, :] * shi
        b_ptrs = w2_ptr + e * swe + nc[None, :] * swn + kb[:, None] * swi
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                km = kb < I - k0
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=km[:, None], other=0.0)
            acc = _dot(a, b, acc, DOT_FP32)
            a_ptrs += BLOCK_K * shi
            b_ptrs += BLOCK_K * swi
        p = tl.load(pair_ptr + r, mask=rm, other=0).to(tl.int64)
        wt = tl.load(wt_ptr + (p // KTOP) * swt + (p % KTOP) * swk, mask=rm, other=0.0)
        acc = acc * wt.to(tl.float32)[:, None]
        tl.store(y_ptr + p[:, None] * syr + n[None, :] * syd, acc,
                 mask=rm[:, None] & nm[None, :])


@entry_kernel()
def moe_combine_kernel(y_ptr, ids_ptr, out_ptr, D, E, KTOP,
                       syr, syd, sit, sik, sot, sod, N_TILES, NUM_PROGRAMS, GRID_1,
                       BLOCK_D: tl.constexpr, PERSISTENT: tl.constexpr):
    """Tiles (token, D-block), see _combine_tile; PERSISTENT as in moe_gemm13_kernel, over the
    grid folded row-major."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _combine_tile(y_ptr, ids_ptr, out_ptr, D, E, KTOP, syr, syd, sit, sik, sot, sod,
                          tile // GRID_1, tile % GRID_1, BLOCK_D)
    else:
        _combine_tile(y_ptr, ids_ptr, out_ptr, D, E, KTOP, syr, syd, sit, sik, sot, sod,
                      tl.program_id(0), tl.program_id(1), BLOCK_D)


@triton.jit
def _combine_tile(y_ptr, ids_ptr, out_ptr, D, E, KTOP, syr, syd, sit, sik, sot, sod, pid_t, pd,
                  BLOCK_D: tl.constexpr):
    """out[t] = sum_j y[t * KTOP + j] (already weighted) over the slots j with an expert id in
    [0, E), in j order (deterministic, no atomics), fp32 accumulation, one rounding."""
    t = tl.cast(pid_t, tl.int64)  # a Python int under the interpreter's persistent loop
    d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, KTOP):
        e = tl.load(ids_ptr + t * sit + j * sik)
        ev = d * 0 + e  # [BLOCK_D]: a scalar mask trips the interpreter
        ok = (ev >= 0) & (ev < E)
        yv = tl.load(y_ptr + (t * KTOP + j) * syr + d * syd, mask=dm & ok, other=0.0)
        acc += yv
    tl.store(out_ptr + t * sot + d * sod, acc.to(out_ptr.dtype.element_ty), mask=dm)
