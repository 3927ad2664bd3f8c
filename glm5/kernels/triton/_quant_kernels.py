"""@triton.jit kernels behind glm5.kernels.triton.quant_linear.

* ``quantize_rows_kernel``: dynamic symmetric per-token quantization, bit for bit
  glm5.ir.quant_formats.quantize_per_token_ref: fp32 amax, ``s = amax / qmax`` (1 when amax is
  0) and ``clamp(round_half_even(x / s), ±qmax)`` with IEEE (div_rn) divisions.
* ``quant_linear_int_kernel``: w8a8 / w4a8 / w6a12. Weight codes are unpacked in the kernel
  (int8, int4 nibbles, int6 fields of 3-byte little-endian words, two's complement), the integer
  dot per K-group of 128 is exact in int32 (int8 x int8 tl.dot with an int32 result; 12-bit
  activations are split as x = 32·hi + lo with hi in [-64, 63] and lo in [0, 31], both int8, so
  the 12-bit x 6-bit products stay int8 dots with exact int32 sums), then
  ``y = s_x[m] · Σ_g s_w[n, g] · isum[m, n, g]`` (+ bias) in fp32.
* ``quant_linear_w8a16_kernel``: x · (w_q · s_w)ᵀ. The per-channel scale is taken out of the
  sum (y = s_w[n] · Σ_k x[k] w_q[n, k]); int8 codes are exact in bf16/fp16, so on a GPU the dot
  runs on tensor cores in x's dtype with fp32 accumulation; fp32 x (and the interpreter) use an
  IEEE fp32 dot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import entry_kernel

GROUP: tl.constexpr = tl.constexpr(128)


@triton.jit
def _round_half_even(v):
    """torch.round semantics (ties to even) for |v| < 2^22, without libdevice."""
    f = tl.floor(v)
    d = v - f
    half = f * 0.5
    odd = (half - tl.floor(half)) != 0.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@entry_kernel()
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm,
                         N_TILES, NUM_PROGRAMS,
                         QMAX: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                         PERSISTENT: tl.constexpr):
    """One tile per row: codes q[m, :] (int8 or int16) and scale s[m] (fp32). PERSISTENT:
    program p handles rows p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for row in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm, row,
                          QMAX, BLOCK_K, ONE_PASS)
    else:
        _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm,
                      tl.program_id(0), QMAX, BLOCK_K, ONE_PASS)


@triton.jit
def _quantize_row(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_xk, stride_qm, pid,
                  QMAX: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.cast(pid, tl.int64)  # a Python int under the interpreter's persistent loop
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    cols = tl.arange(0, BLOCK_K)
    qmax = QMAX * 1.0
    if ONE_PASS:
        m = cols < K
        x = tl.load(x_row + cols * stride_xk, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        s = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
        q = _round_half_even(tl.math.div_rn(x, s))
        q = tl.minimum(tl.maximum(q, -qmax), qmax)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=m)
    else:
        run = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            x = tl.load(x_row + c * stride_xk, mask=c < K, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(x))
        amax = tl.max(run, axis=0)
        s = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            m = c < K
            x = tl.load(x_row + c * stride_xk, mask=m, other=0.0).to(tl.float32)
            q = _round_half_even(tl.math.div_rn(x, s))
            q = tl.minimum(tl.maximum(q, -qmax), qmax)
            tl.store(q_row + c, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row, s)


@triton.jit
def _weight_codes(w_ptr, offs_n, offs_k, N, K, stride_wn, WBITS: tl.constexpr):
    """Signed weight codes [BLOCK_N, BLOCK_K] as int32 (0 outside N x K) from the packed rows."""
    nmask = offs_n < N
    kmask = offs_k < K
    mask = nmask[:, None] & kmask[None, :]
    row = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    if WBITS == 8:
        w = tl.load(row + offs_k[None, :], mask=mask, other=0).to(tl.int32)
    elif WBITS == 4:
        b = tl.load(row + (offs_k // 2)[None, :], mask=mask, other=0).to(tl.int32) & 0xFF
        u = (b >> ((offs_k % 2) * 4)[None, :]) & 0xF
        w = u - ((u & 0x8) << 1)
    else:
        base = row + ((offs_k // 4) * 3)[None, :]
        b0 = tl.load(base, mask=mask, other=0).to(tl.int32) & 0xFF
        b1 = tl.load(base + 1, mask=mask, other=0).to(tl.int32) & 0xFF
        b2 = tl.load(base + 2, mask=mask, other=0).to(tl.int32) & 0xFF
        word = b0 | (b1 << 8) | (b2 << 16)
        u = (word >> ((offs_k % 4) * 6)[None, :]) & 0x3F
        w = u - ((u & 0x20) << 1)
    return w


@triton.jit
def _group_isum(xq_ptr, w_ptr, offs_m, offs_n, k0, M, N, K, stride_xm, stride_wn,
                WBITS: tl.constexpr, ABITS: tl.constexpr, BLOCK_K: tl.constexpr,
                isum):
    """isum += Σ_{k in [k0, k0 + BLOCK_K)} xq[m, k] · wq[n, k], exact in int32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    kmask = offs_k < K
    xa = tl.load(xq_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                 mask=(offs_m < M)[:, None] & kmask[None, :], other=0)
    w = _weight_codes(w_ptr, offs_n, offs_k, N, K, stride_wn, WBITS).to(tl.int8)
    wt = tl.trans(w)  # [BLOCK_K, BLOCK_N]
    if ABITS == 8:
        isum = tl.dot(xa, wt, isum, out_dtype=tl.int32)
    else:
        x32 = xa.to(tl.int32)
        hi = (x32 >> 5).to(tl.int8)  # [-64, 63]
        lo = (x32 & 31).to(tl.int8)  # [0, 31]
        zero = tl.zeros(isum.shape, dtype=tl.int32)
        isum += tl.dot(hi, wt, zero, out_dtype=tl.int32) * 32
        isum = tl.dot(lo, wt, isum, out_dtype=tl.int32)
    return isum


@entry_kernel("M")
def quant_linear_int_kernel(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
    M, N, K, G, stride_xm, stride_wn, stride_swn, stride_ym, N_TILES, NUM_PROGRAMS, GRID_1,
    WBITS: tl.constexpr, ABITS: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Tiles (M-block, N-block); PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _int_tile(xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
                      M, N, K, G, stride_xm, stride_wn, stride_swn, stride_ym,
                      tile // GRID_1, tile % GRID_1,
                      WBITS, ABITS, GROUPED, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _int_tile(xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
                  M, N, K, G, stride_xm, stride_wn, stride_swn, stride_ym,
                  tl.program_id(0), tl.program_id(1),
                  WBITS, ABITS, GROUPED, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _int_tile(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
    M, N, K, G, stride_xm, stride_wn, stride_swn, stride_ym, pid_m, pid_n,
    WBITS: tl.constexpr, ABITS: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    if GROUPED:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, G):
            isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for kk in tl.static_range(0, GROUP, BLOCK_K):
                isum = _group_isum(xq_ptr, w_ptr, offs_m, offs_n, g * GROUP + kk, M, N, K,
                                   stride_xm, stride_wn, WBITS, ABITS, BLOCK_K, isum)
            sw = tl.load(sw_ptr + offs_n.to(tl.int64) * stride_swn + g, mask=nmask, other=0.0)
            acc += isum.to(tl.float32) * sw[None, :]
    else:
        isum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            isum = _group_isum(xq_ptr, w_ptr, offs_m, offs_n, k0, M, N, K,
                               stride_xm, stride_wn, WBITS, ABITS, BLOCK_K, isum)
        sw = tl.load(sw_ptr + offs_n.to(tl.int64) * stride_swn, mask=nmask, other=0.0)
        acc = isum.to(tl.float32) * sw[None, :]
    sx = tl.load(sx_ptr + offs_m, mask=mmask, other=0.0)
    y = sx[:, None] * acc
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@entry_kernel("M")
def quant_linear_w8a16_kernel(
    x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_ym, N_TILES, NUM_PROGRAMS, GRID_1,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Tiles (M-block, N-block); PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _w8a16_tile(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
                        M, N, K, stride_xm, stride_xk, stride_wn, stride_ym,
                        tile // GRID_1, tile % GRID_1,
                        HAS_BIAS, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _w8a16_tile(x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
                    M, N, K, stride_xm, stride_xk, stride_wn, stride_ym,
                    tl.program_id(0), tl.program_id(1),
                    HAS_BIAS, DOT_F32, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _w8a16_tile(
    x_ptr, w_ptr, sw_ptr, b_ptr, y_ptr,
    M, N, K, stride_xm, stride_xk, stride_wn, stride_ym, pid_m, pid_n,
    HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
                    + offs_k[None, :] * stride_xk,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None],
                    mask=nmask[None, :] & kmask[:, None], other=0)  # [BLOCK_K, BLOCK_N] int8
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    sw = tl.load(sw_ptr + offs_n, mask=nmask, other=0.0)
    y = acc * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
