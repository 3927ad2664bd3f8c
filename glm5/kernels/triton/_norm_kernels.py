"""@triton.jit kernels behind glm5.kernels.triton.norm: rms_norm, rope, silu_mul.

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined). All math is fp32; loads upcast, stores cast to the output's dtype. Row offsets are
int64 so that large tensors never overflow 32-bit pointer arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import entry_kernel


@entry_kernel()
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_xr, stride_xd, stride_w, stride_yr, eps,
                    N_TILES, NUM_PROGRAMS,
                    BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr, PERSISTENT: tl.constexpr):
    """One tile per row: y = x * rsqrt(mean(x^2) + eps) * w (fp32 math). PERSISTENT: program p
    handles rows p, p + NUM_PROGRAMS, ... (glm5.kernels.triton._grid)."""
    if PERSISTENT:
        for row in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _rms_norm_row(x_ptr, w_ptr, y_ptr, D, stride_xr, stride_xd, stride_w, stride_yr,
                          eps, row, BLOCK_D, ONE_PASS)
    else:
        _rms_norm_row(x_ptr, w_ptr, y_ptr, D, stride_xr, stride_xd, stride_w, stride_yr, eps,
                      tl.program_id(0), BLOCK_D, ONE_PASS)


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, y_ptr, D, stride_xr, stride_xd, stride_w, stride_yr, eps, pid,
                  BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.cast(pid, tl.int64)  # a Python int under the interpreter's persistent loop
    x_row = x_ptr + row * stride_xr
    y_row = y_ptr + row * stride_yr
    cols = tl.arange(0, BLOCK_D)
    if ONE_PASS:
        m = cols < D
        x = tl.load(x_row + cols * stride_xd, mask=m, other=0.0).to(tl.float32)
        ms = tl.sum(x * x, axis=0) / D
        r = 1.0 / tl.sqrt(ms + eps)
        w = tl.load(w_ptr + cols * stride_w, mask=m, other=0.0).to(tl.float32)
        y = x * r * w
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=m)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            x = tl.load(x_row + c * stride_xd, mask=c < D, other=0.0).to(tl.float32)
            acc += x * x
        ms = tl.sum(acc, axis=0) / D
        r = 1.0 / tl.sqrt(ms + eps)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            m = c < D
            x = tl.load(x_row + c * stride_xd, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * stride_w, mask=m, other=0.0).to(tl.float32)
            y = x * r * w
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=m)


@entry_kernel()
def silu_mul_kernel(x_ptr, y_ptr, I, stride_xr, stride_xc, stride_yr, N_TILES, NUM_PROGRAMS,
                    GRID_1, BLOCK_I: tl.constexpr, PERSISTENT: tl.constexpr):
    """Grid (rows, cdiv(I, BLOCK_I)): y[r, i] = silu(x[r, i]) * x[r, I + i] (fp32 math)."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _silu_mul_tile(x_ptr, y_ptr, I, stride_xr, stride_xc, stride_yr,
                           tile // GRID_1, tile % GRID_1, BLOCK_I)
    else:
        _silu_mul_tile(x_ptr, y_ptr, I, stride_xr, stride_xc, stride_yr,
                       tl.program_id(0), tl.program_id(1), BLOCK_I)


@triton.jit
def _silu_mul_tile(x_ptr, y_ptr, I, stride_xr, stride_xc, stride_yr, pid0, pid1,
                   BLOCK_I: tl.constexpr):
    row = tl.cast(pid0, tl.int64)
    cols = pid1 * BLOCK_I + tl.arange(0, BLOCK_I)
    m = cols < I
    x_row = x_ptr + row * stride_xr
    a = tl.load(x_row + cols * stride_xc, mask=m, other=0.0).to(tl.float32)
    b = tl.load(x_row + (cols + I) * stride_xc, mask=m, other=0.0).to(tl.float32)
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(y_ptr + row * stride_yr + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@entry_kernel()
def rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, M, HALF,
                stride_xt, stride_xm, stride_xr, stride_ct, stride_cr, stride_st, stride_sr,
                stride_yt, stride_ym, N_TILES, NUM_PROGRAMS, GRID_1,
                INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                PERSISTENT: tl.constexpr):
    """Grid (T, cdiv(M, BLOCK_M)) over x viewed as [T, M, R]: rotate the R/2 pairs of each row.

    Interleaved pairs are (x[2i], x[2i+1]); NeoX pairs are (x[i], x[i + R/2]).
    (a, b) -> (a c - b s, b c + a s), written to the same positions of y.
    """
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _rope_tile(x_ptr, cos_ptr, sin_ptr, y_ptr, M, HALF, stride_xt, stride_xm, stride_xr,
                       stride_ct, stride_cr, stride_st, stride_sr, stride_yt, stride_ym,
                       tile // GRID_1, tile % GRID_1, INTERLEAVED, BLOCK_M, BLOCK_H)
    else:
        _rope_tile(x_ptr, cos_ptr, sin_ptr, y_ptr, M, HALF, stride_xt, stride_xm, stride_xr,
                   stride_ct, stride_cr, stride_st, stride_sr, stride_yt, stride_ym,
                   tl.program_id(0), tl.program_id(1), INTERLEAVED, BLOCK_M, BLOCK_H)


@triton.jit
def _rope_tile(x_ptr, cos_ptr, sin_ptr, y_ptr, M, HALF,
               stride_xt, stride_xm, stride_xr, stride_ct, stride_cr, stride_st, stride_sr,
               stride_yt, stride_ym, pid0, pid1,
               INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.cast(pid0, tl.int64)
    rows = pid1 * BLOCK_M + tl.arange(0, BLOCK_M)
    i = tl.arange(0, BLOCK_H)
    mi = i < HALF
    c = tl.load(cos_ptr + t * stride_ct + i * stride_cr, mask=mi, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + i * stride_sr, mask=mi, other=0.0).to(tl.float32)
    if INTERLEAVED:
        ia = 2 * i
        ib = 2 * i + 1
    else:
        ia = i
        ib = i + HALF
    m = (rows < M)[:, None] & mi[None, :]
    xrow = x_ptr + t * stride_xt + rows.to(tl.int64)[:, None] * stride_xm
    a = tl.load(xrow + ia[None, :] * stride_xr, mask=m, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib[None, :] * stride_xr, mask=m, other=0.0).to(tl.float32)
    ra = a * c[None, :] - b * s[None, :]
    rb = b * c[None, :] + a * s[None, :]
    yrow = y_ptr + t * stride_yt + rows.to(tl.int64)[:, None] * stride_ym
    tl.store(yrow + ia[None, :], ra.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(yrow + ib[None, :], rb.to(y_ptr.dtype.element_ty), mask=m)
