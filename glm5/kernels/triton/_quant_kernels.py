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
* ``quant_gemv_kernel`` / ``quant_gemv_reduce_kernel``: the decode GEMV of every scheme (M <=
  GEMV_M), CUDA-core FMAs on exact fp32 codes, split over K with a deterministic reduction
  (see "decode GEMV" below).
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


# --------------------------------------------------------------------------- decode GEMV
# M <= GEMV_M rows (decode batches): the weight stream is the whole cost, so the GEMV moves only
# the packed bytes, once, over (N-block, K-split) programs, and multiplies on CUDA cores: the
# codes become exact fp32 values (below) and every product and every partial sum inside a K-group
# of 128 is an integer of magnitude < 2^24 (w8a8 127 * 128 * 128, w4a8 127 * 8 * 128, w6a12
# 2047 * 32 * 128 = 8.4e6), so fp32 FMAs sum each group exactly, in any order.
#
# LAYOUT: how the packed rows are read (the launcher picks it from the scheme and alignment); a
# "unit" is what one mask element covers, CPU its codes:
#   0 int8: a byte per code (16-byte loads), CPU 1
#   1 int4: a byte per 2 codes, low nibble first, CPU 2
#   4 int4: a 32-bit word per 8 codes (rows 4-byte aligned; 16-byte loads), CPU 8
#   2 int6: a 3-byte quad per 4 codes (three byte planes), CPU 4
#   3 int6: three 32-bit words per 16 codes (rows of whole 12-byte units, 4-byte aligned), CPU 16


@triton.jit
def _exact_f32(u, HALF: tl.constexpr):
    """The two's-complement field ``u`` (int32 in [0, 2 * HALF)) as an exact fp32:
    ``(u ^ HALF) - HALF`` placed in the mantissa of 2^23 (one bit op and one add, no int-to-float
    conversion, which issues at a quarter of the rate on NVIDIA GPUs)."""
    f = (u ^ (0x4B000000 | HALF)).to(tl.float32, bitcast=True)
    return f - (8388608.0 + HALF)


@triton.jit
def _offset_f32(u, HALF: tl.constexpr):
    """The offset-binary field ``u`` (int32 in [0, 2 * HALF), value u - HALF) as an exact fp32."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + HALF)


@triton.jit
def _gemv_load(w_ptr, offs_n, u0, u_end, U, N, stride_wn,
               LAYOUT: tl.constexpr, BLOCK_U: tl.constexpr):
    """The packed weight units [u0, u0 + BLOCK_U) of rows offs_n (units of LAYOUT, above), as a
    tuple of tiles [BLOCK_N, BLOCK_U]: one tile, or for int6 three planes (byte or word d of
    each 3-element unit). A unit at or past u_end (the end of the program's K range) or U (the
    row), or in a row at or past N, is not read (0)."""
    row = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u = u0 + tl.arange(0, BLOCK_U)
    m = (offs_n < N)[:, None] & ((u < U) & (u < u_end))[None, :]
    if LAYOUT == 3 or LAYOUT == 4:  # the row as int32 words
        row = row.to(tl.pointer_type(tl.int32))
    if LAYOUT <= 1 or LAYOUT == 4:  # one byte or word per unit
        out = (tl.load(row + u[None, :], mask=m, other=0),)
    else:
        base = row + (3 * u)[None, :]
        out = (tl.load(base, mask=m, other=0), tl.load(base + 1, mask=m, other=0),
               tl.load(base + 2, mask=m, other=0))
    return out


@triton.jit
def _f6(lo, hi, S: tl.constexpr):
    """The 6-bit code at bit S of the 64-bit little-endian pair (lo, hi) of int32 words, as an
    exact fp32 (S < 32)."""
    if S <= 26:
        u = (lo >> S) & 0x3F
    else:
        u = ((lo >> S) & ((1 << (32 - S)) - 1)) | ((hi << (32 - S)) & 0x3F)
    return _exact_f32(u, 32)


@triton.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """[..., 8] with [..., c] = c-th argument (the pairing of _join16)."""
    q0, q1, q2, q3 = tl.join(c0, c4), tl.join(c1, c5), tl.join(c2, c6), tl.join(c3, c7)
    o0, o1 = tl.join(q0, q2), tl.join(q1, q3)
    j = tl.join(o0, o1)
    return tl.reshape(j, [j.shape[0], j.shape[1], 8])


@triton.jit
def _join16(c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    """[..., 16] with [..., c] = c-th argument. tl.join appends a last dim of 2, so pairing
    c_r with c_{r + 8}, then r with r + 4, r + 2, r + 1 leaves the row-major index s4 + 2 s3 +
    4 s2 + 8 s1 = c."""
    p0, p1, p2, p3 = tl.join(c0, c8), tl.join(c1, c9), tl.join(c2, c10), tl.join(c3, c11)
    p4, p5, p6, p7 = tl.join(c4, c12), tl.join(c5, c13), tl.join(c6, c14), tl.join(c7, c15)
    q0, q1, q2, q3 = tl.join(p0, p4), tl.join(p1, p5), tl.join(p2, p6), tl.join(p3, p7)
    o0, o1 = tl.join(q0, q2), tl.join(q1, q3)
    j = tl.join(o0, o1)
    return tl.reshape(j, [j.shape[0], j.shape[1], 16])


@triton.jit
def _gemv_unpack(b, LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 T: tl.constexpr):
    """Weight codes [BLOCK_N, BLOCK_K / T, T] (row-major = K order) as exact fp32 from
    _gemv_load's tiles; T codes (a unit, or 16 int8 codes) are held by one thread."""
    if LAYOUT == 0:
        w = _exact_f32(b[0].to(tl.int32) & 0xFF, 128)
    elif LAYOUT == 1:
        u = b[0].to(tl.int32)  # uint8: zero-extended
        w = tl.join(_exact_f32(u & 0xF, 8), _exact_f32(u >> 4, 8))
    elif LAYOUT == 4:
        # 8 codes per word, code i in bits 4i .. 4i + 3 (bytes little-endian, low nibble first).
        # Flipping every nibble's sign bit once per word makes each field offset binary
        # (u = code + 8): then a code is a shift, a mask and an or with the 2^23 exponent.
        v = b[0] ^ -0x77777778  # 0x88888888
        w = _join8(
            _offset_f32(v & 0xF, 8), _offset_f32((v >> 4) & 0xF, 8),
            _offset_f32((v >> 8) & 0xF, 8), _offset_f32((v >> 12) & 0xF, 8),
            _offset_f32((v >> 16) & 0xF, 8), _offset_f32((v >> 20) & 0xF, 8),
            _offset_f32((v >> 24) & 0xF, 8), _offset_f32((v >> 28) & 0xF, 8))
    elif LAYOUT == 2:
        word = b[0].to(tl.int32) | (b[1].to(tl.int32) << 8) | (b[2].to(tl.int32) << 16)
        c0 = _exact_f32(word & 0x3F, 32)
        c1 = _exact_f32((word >> 6) & 0x3F, 32)
        c2 = _exact_f32((word >> 12) & 0x3F, 32)
        c3 = _exact_f32((word >> 18) & 0x3F, 32)
        # join(join(c0, c2), join(c1, c3))[n, q, t, s] = c[2t + s]: row-major is k = 4q + 2t + s
        w = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    else:
        # 16 codes in 3 words w0 | w1 << 32 | w2 << 64 (four 24-bit quads): code c at bit 6c
        w0, w1, w2 = b[0], b[1], b[2]
        w = _join16(
            _f6(w0, w0, 0), _f6(w0, w0, 6), _f6(w0, w0, 12), _f6(w0, w0, 18),
            _f6(w0, w0, 24), _f6(w0, w1, 30), _f6(w1, w1, 4), _f6(w1, w1, 10),
            _f6(w1, w1, 16), _f6(w1, w1, 22), _f6(w1, w2, 28), _f6(w2, w2, 2),
            _f6(w2, w2, 8), _f6(w2, w2, 14), _f6(w2, w2, 20), _f6(w2, w2, 26))
    return tl.reshape(w, [BLOCK_N, BLOCK_K // T, T])


@entry_kernel("M")
def quant_gemv_kernel(
    xa_ptr, w_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, G, U, KPS_U, SPLIT, stride_xm, stride_xk, stride_wn, stride_swn, stride_ym,
    N_TILES, NUM_PROGRAMS, GRID_1,
    LAYOUT: tl.constexpr, ACT: tl.constexpr, GROUPED: tl.constexpr, INT_ACC: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    """Tiles (N-block, K-split); PERSISTENT: program p walks tiles p, p + NUM_PROGRAMS, ..."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _gemv_tile(xa_ptr, w_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, ws_ptr,
                       M, N, K, G, U, KPS_U, SPLIT, stride_xm, stride_xk, stride_wn, stride_swn,
                       stride_ym, tile // GRID_1, tile % GRID_1,
                       LAYOUT, ACT, GROUPED, INT_ACC, HAS_BIAS, BLOCK_N, BLOCK_K)
    else:
        _gemv_tile(xa_ptr, w_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, ws_ptr,
                   M, N, K, G, U, KPS_U, SPLIT, stride_xm, stride_xk, stride_wn, stride_swn,
                   stride_ym, tl.program_id(0), tl.program_id(1),
                   LAYOUT, ACT, GROUPED, INT_ACC, HAS_BIAS, BLOCK_N, BLOCK_K)


@triton.jit
def _gemv_tile(
    xa_ptr, w_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, ws_ptr,
    M, N, K, G, U, KPS_U, SPLIT, stride_xm, stride_xk, stride_wn, stride_swn, stride_ym,
    pid_n, pid_s,
    LAYOUT: tl.constexpr, ACT: tl.constexpr, GROUPED: tl.constexpr, INT_ACC: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Columns pid_n * BLOCK_N ... of every row m < M over the packed units [pid_s * KPS_U,
    + KPS_U) of the weight rows (a whole number of BLOCK_K steps, BLOCK_K a multiple of the
    128-group; U units per row). Rows one after another: at M = 1 (the decode case that counts)
    each weight is read, unpacked and multiplied once with nothing held per row; further rows
    read the program's weight slab again from L1/L2. The row's sum is fp32 Σ_g s_w[n, g] ·
    isum[n, g] (grouped), the exact int32 Σ_k (w8a8) or the fp32 Σ_k x · w_q (w8a16).
    SPLIT == 1: the epilogue writes y here; else the sums go to the [SPLIT, M, N] workspace and
    quant_gemv_reduce_kernel finishes."""
    GPI: tl.constexpr = BLOCK_K // GROUP  # K-groups per step
    # codes per packed unit (LAYOUT, above) and units per step
    CPU: tl.constexpr = (1 if LAYOUT == 0 else 2 if LAYOUT == 1 else 4 if LAYOUT == 2
                         else 16 if LAYOUT == 3 else 8)
    BLOCK_U: tl.constexpr = BLOCK_K // CPU
    # codes each thread sums in one chain before any cross-thread reduction
    T: tl.constexpr = 16 if LAYOUT == 0 else CPU
    S: tl.constexpr = BLOCK_K // T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    # the loop runs over units: its start (a multiple of KPS_U, which Triton sees divisible by
    # 16 as an argument) keeps the packed loads 16-byte aligned
    u_lo = pid_s * KPS_U
    u_end = u_lo + KPS_U
    u_hi = tl.minimum(u_end, U)
    for m in range(0, M):
        x_row = xa_ptr + tl.cast(m, tl.int64) * stride_xm
        if ACT:
            acc = tl.zeros([BLOCK_N, GPI], dtype=tl.int32 if INT_ACC else tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, S, T], dtype=tl.float32)  # reduced once, at the end
        # the packed tile of the next step is loaded before this step's arithmetic: its loads
        # are in flight while this step computes (a software pipeline of depth 1)
        b = _gemv_load(w_ptr, offs_n, u_lo, u_end, U, N, stride_wn, LAYOUT, BLOCK_U)
        for u0 in range(u_lo, u_hi, BLOCK_U):
            b_next = _gemv_load(w_ptr, offs_n, u0 + BLOCK_U, u_end, U, N, stride_wn, LAYOUT,
                                BLOCK_U)
            w = _gemv_unpack(b, LAYOUT, BLOCK_N, BLOCK_K, T)
            b = b_next
            kk = u0 * CPU + offs_k
            x = tl.load(x_row + kk * stride_xk, mask=kk < K, other=0.0).to(tl.float32)
            prod = w * tl.reshape(x, [S, T])[None, :, :]
            if ACT:
                # exact integer sums per 128-group (see above): T codes in one chain, then
                # the units of each group
                gs = tl.sum(tl.reshape(tl.sum(prod, axis=2), [BLOCK_N, GPI, S // GPI]), axis=2)
                if INT_ACC:
                    acc += gs.to(tl.int32)
                else:
                    g = u0 * CPU // GROUP + tl.arange(0, GPI)
                    sw = tl.load(sw_ptr + offs_n.to(tl.int64)[:, None] * stride_swn
                                 + g[None, :], mask=nmask[:, None] & (g < G)[None, :], other=0.0)
                    acc += gs * sw
            else:
                acc += prod
        if ACT:
            tot = tl.sum(acc, axis=1)
        else:
            tot = tl.sum(tl.sum(acc, axis=2), axis=1)
        if SPLIT == 1:
            _gemv_epilogue(tot, tl.zeros_like(offs_n) + m, offs_n, nmask, sw_ptr, sx_ptr, b_ptr,
                           y_ptr, stride_ym, ACT, GROUPED, HAS_BIAS)
        else:
            tl.store(ws_ptr + (pid_s * M + m).to(tl.int64) * N + offs_n, tot, mask=nmask)


@triton.jit
def _gemv_epilogue(tot, m, n, mask, sw_ptr, sx_ptr, b_ptr, y_ptr, stride_ym,
                   ACT: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[m, n] from the finished sums ``tot`` (m, n broadcast to tot's shape), in the order of
    the op contract: grouped ``s_x[m] · tot``; w8a8 ``s_x[m] · (tot · s_w[n])`` (tot the exact
    int32 sum); w8a16 ``tot · s_w[n]``; then + bias, cast to y's dtype."""
    if ACT:
        sx = tl.load(sx_ptr + m, mask=mask, other=0.0)
        if GROUPED:
            y = sx * tot
        else:
            y = sx * (tot.to(tl.float32) * tl.load(sw_ptr + n, mask=mask, other=0.0))
    else:
        y = tot * tl.load(sw_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, y.to(y_ptr.dtype.element_ty), mask=mask)


@entry_kernel("M")
def quant_gemv_reduce_kernel(
    ws_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym,
    N_TILES, NUM_PROGRAMS, GRID_1,
    ACT: tl.constexpr, GROUPED: tl.constexpr, INT_ACC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """y[m, n-block] = epilogue(Σ_s ws[s, m, n]) for tiles (row m, N-block), the splits summed in
    order s = 0, 1, ... (deterministic; int32 for w8a8, exact)."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _gemv_reduce_tile(ws_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym,
                              tile // GRID_1, tile % GRID_1, ACT, GROUPED, INT_ACC, HAS_BIAS,
                              BLOCK_N)
    else:
        _gemv_reduce_tile(ws_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym,
                          tl.program_id(0), tl.program_id(1), ACT, GROUPED, INT_ACC, HAS_BIAS,
                          BLOCK_N)


@triton.jit
def _gemv_reduce_tile(ws_ptr, sw_ptr, sx_ptr, b_ptr, y_ptr, M, N, SPLIT, stride_ym, pid_m, pid_n,
                      ACT: tl.constexpr, GROUPED: tl.constexpr, INT_ACC: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    src = ws_ptr + tl.cast(pid_m, tl.int64) * N + offs_n
    if INT_ACC:
        tot = tl.zeros([BLOCK_N], dtype=tl.int32)
    else:
        tot = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(0, SPLIT):
        tot += tl.load(src + tl.cast(s, tl.int64) * M * N, mask=nmask, other=0)
    m = tl.zeros([BLOCK_N], dtype=tl.int32) + pid_m
    _gemv_epilogue(tot, m, offs_n, nmask, sw_ptr, sx_ptr, b_ptr, y_ptr, stride_ym,
                   ACT, GROUPED, HAS_BIAS)
