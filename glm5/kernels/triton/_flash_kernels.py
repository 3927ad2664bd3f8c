"""@triton.jit flash kernel behind glm5.kernels.triton.attention (dense ranged attention).

Imported on the first kernel call only (Triton reads TRITON_INTERPRET when a @triton.jit function
is defined).
"""

from __future__ import annotations

import triton
import triton.language as tl

from glm5.kernels.triton._common import dot as _dot, entry_kernel

_BIG = tl.constexpr(2147483647)  # above any key index: the neutral element of a min


@entry_kernel("T", "N_TB", "SPLIT", "sos", "sls")
def flash_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                           T, N_TB, G, N_GB, N_DV, SPLIT, qk_scale,
                           sqt, sqh, sqd, sks, skh, skd, svs, svh, svd,
                           sos, sot, soh, sod, sls, slt, slh,
                           N_TILES, NUM_PROGRAMS, GRID_1, GRID_2,
                           Dqk: tl.constexpr, Dv: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr,
                           BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
                           SPLIT_KV: tl.constexpr, DOT_FP32: tl.constexpr,
                           PERSISTENT: tl.constexpr):
    """Tiles (N_TB = cdiv(T, BLOCK_T), Hk * N_GB, N_DV * SPLIT), see _flash_tile;
    PERSISTENT: program p walks the tiles p, p + NUM_PROGRAMS, ... of that grid folded
    row-major."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), N_TILES, NUM_PROGRAMS):
            _flash_tile(q_ptr, k_ptr, v_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                        T, G, N_GB, N_DV, SPLIT, qk_scale,
                        sqt, sqh, sqd, sks, skh, skd, svs, svh, svd,
                        sos, sot, soh, sod, sls, slt, slh,
                        (tile // GRID_2) // GRID_1, (tile // GRID_2) % GRID_1, tile % GRID_2,
                        Dqk, Dv, BLOCK_T, BLOCK_G, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV,
                        EVEN_DV, SPLIT_KV, DOT_FP32)
    else:
        # Query blocks in reverse: under causal ranges the last blocks see the most keys, and
        # starting them first shortens the tail of the launch.
        _flash_tile(q_ptr, k_ptr, v_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                    T, G, N_GB, N_DV, SPLIT, qk_scale,
                    sqt, sqh, sqd, sks, skh, skd, svs, svh, svd,
                    sos, sot, soh, sod, sls, slt, slh,
                    N_TB - 1 - tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    Dqk, Dv, BLOCK_T, BLOCK_G, BLOCK_N, BLOCK_DA, BLOCK_DB, BLOCK_DV,
                    EVEN_DV, SPLIT_KV, DOT_FP32)


@triton.jit
def _flash_tile(q_ptr, k_ptr, v_ptr, ks_ptr, ke_ptr, out_ptr, lse_ptr,
                T, G, N_GB, N_DV, SPLIT, qk_scale,
                sqt, sqh, sqd, sks, skh, skd, svs, svh, svd,
                sos, sot, soh, sod, sls, slt, slh, pid_t, pid_h, pid_2,
                Dqk: tl.constexpr, Dv: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr,
                BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
                SPLIT_KV: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program: BLOCK_M = BLOCK_T x BLOCK_G rows, the (query, head) pairs of BLOCK_T
    consecutive queries and BLOCK_G heads of KV head j's group, times one BLOCK_DV slice of Dv
    (and, SPLIT_KV, one of SPLIT equal BLOCK_N-aligned windows of the union of the rows' ranges:
    each row's range is clipped to the window, and the program writes the window's normalized
    out and lse at split stride sos / sls for glm5.kernels.triton.splitkv to merge).

    Each K/V tile of BLOCK_N keys is loaded once for all BLOCK_M rows. Keys are walked on
    BLOCK_N-aligned tiles: first the interior [b, c), the whole tiles every row sees (max k_start
    <= s < min k_end), without masks; then the rest of the union of the rows' ranges, masked per
    row, as runs of tiles that some row sees: a packed batch's query block that straddles two
    sequences jumps over the keys between them instead of walking masked tiles. Every loop is
    a plain range loop (software-pipelined on GPUs). Q stays on chip for the whole walk, split
    in a power-of-two head [.., BLOCK_DA] and a tail [.., BLOCK_DB] (Dqk = 576 = 512 + 64,
    256 = 256 + 0). Online softmax in base 2 (qk_scale = scale * log2 e), fp32 accumulators, P
    in v's dtype for the PV dot. A row with no key gives out 0 and lse -inf."""
    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_G
    pid_v = pid_2 % N_DV
    split = tl.cast(pid_2 // N_DV, tl.int64)
    j = tl.cast(pid_h // N_GB, tl.int64)  # a Python int under the interpreter's persistent loop
    gb = pid_h % N_GB
    r = tl.arange(0, BLOCK_M)
    t = pid_t * BLOCK_T + r // BLOCK_G
    g = gb * BLOCK_G + r % BLOCK_G
    row_ok = (t < T) & (g < G)
    t64 = t.to(tl.int64)
    heads = j * G + g.to(tl.int64)

    ks = tl.load(ks_ptr + t64, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + t64, mask=row_ok, other=0)
    if SPLIT_KV:
        # this program's window: split `split` of SPLIT equal tile-aligned pieces of the union
        # of the rows' ranges (the same union for every split of the block)
        live0 = ks < ke
        any0 = tl.max(live0.to(tl.int32), axis=0) > 0
        base = tl.where(any0, tl.min(tl.where(live0, ks, _BIG), axis=0), 0)
        base = (base // BLOCK_N) * BLOCK_N
        top = tl.max(tl.where(live0, ke, 0), axis=0)
        per = (((top - base + SPLIT - 1) // SPLIT + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        w_lo = base + split.to(tl.int32) * per
        ks = tl.maximum(ks, w_lo)
        ke = tl.minimum(ke, w_lo + per)
    live = ks < ke
    any_live = tl.max(live.to(tl.int32), axis=0) > 0
    lo = tl.where(any_live, tl.min(tl.where(live, ks, _BIG), axis=0), 0)
    hi = tl.max(tl.where(live, ke, 0), axis=0)
    in_lo = tl.max(tl.where(live, ks, 0), axis=0)
    in_hi = tl.where(any_live, tl.min(tl.where(live, ke, _BIG), axis=0), 0)
    b = ((in_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    c = (in_hi // BLOCK_N) * BLOCK_N
    full = b < c  # at least one tile every row sees whole
    b = tl.where(full, b, hi)
    c = tl.where(full, c, hi)

    da = tl.arange(0, BLOCK_DA)
    q_rows = q_ptr + t64[:, None] * sqt + heads[:, None] * sqh
    if Dqk < BLOCK_DA:
        q_a = tl.load(q_rows + da[None, :] * sqd, mask=row_ok[:, None] & (da[None, :] < Dqk),
                      other=0.0)
    else:
        q_a = tl.load(q_rows + da[None, :] * sqd, mask=row_ok[:, None], other=0.0)
    if BLOCK_DB > 0:
        db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        q_b = tl.load(q_rows + db[None, :] * sqd, mask=row_ok[:, None] & (db[None, :] < Dqk),
                      other=0.0)
    else:
        q_b = q_a  # unused

    dv = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    kn = tl.arange(0, BLOCK_N)
    k_head = k_ptr + j * skh
    v_head = v_ptr + j * svh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for k0 in range(b, c, BLOCK_N):
        acc, m_i, l_i = _flash_keys(acc, m_i, l_i, q_a, q_b, k_head, v_head, k0 + kn, da, dv,
                                    ks, ke, hi, qk_scale, sks, skd, svs, svd, Dqk, Dv,
                                    BLOCK_DA, BLOCK_DB, EVEN_DV, DOT_FP32, False)
    # The masked rest, run by run. k0 stays tile-aligned; each pass moves it forward by at
    # least one tile, so the walk ends.
    k0 = (lo // BLOCK_N) * BLOCK_N
    while k0 < hi:
        # first key >= k0 that a row sees (the interior is done: jump over it)
        nxt = tl.min(tl.where(live & (ke > k0), tl.maximum(ks, k0), _BIG), axis=0)
        nxt = tl.minimum(tl.where((nxt >= b) & (nxt < c), c, nxt), hi)  # none left: hi
        start = (nxt // BLOCK_N) * BLOCK_N
        # one row's range covers every tile from there to the furthest end of a row that
        # starts in that tile
        run = tl.max(tl.where(live & (ks < start + BLOCK_N), ke, 0), axis=0)
        end = ((run + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        end = tl.where(start < b, tl.minimum(end, b), end)
        start = tl.where(nxt < hi, start, hi)
        end = tl.where(nxt < hi, end, hi)
        for k1 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _flash_keys(acc, m_i, l_i, q_a, q_b, k_head, v_head, k1 + kn, da,
                                        dv, ks, ke, hi, qk_scale, sks, skd, svs, svd, Dqk, Dv,
                                        BLOCK_DA, BLOCK_DB, EVEN_DV, DOT_FP32, True)
        k0 = end

    # Rows outside every range (and the padding rows) ran through the unmasked tiles with
    # finite scores: `live` decides, not l_i.
    has = live & (l_i > 0.0)
    l_safe = tl.where(has, l_i, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    o_ptrs = (out_ptr + split * sos) + t64[:, None] * sot + heads[:, None] * soh + \
        dv[None, :] * sod
    if EVEN_DV:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < Dv))
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    first = (r * 0 + pid_v) == 0  # only the first Dv block writes lse
    tl.store(lse_ptr + split * sls + t64 * slt + heads * slh, lse, mask=row_ok & first)


@triton.jit
def _flash_keys(acc, m_i, l_i, q_a, q_b, k_head, v_head, kk, da, dv, ks, ke, hi, qk_scale,
                sks, skd, svs, svd, Dqk: tl.constexpr, Dv: tl.constexpr,
                BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, EVEN_DV: tl.constexpr,
                DOT_FP32: tl.constexpr, MASKED: tl.constexpr):
    """Keys kk (one tile) for every row: MASKED applies the rows' ranges, else every key is
    inside every row's range (and exists)."""
    # The tile's base in 64 bits (S x Hk x Dqk passes 2^31 elements at long context) plus
    # 32-bit offsets inside it. k0 is taken from kk rather than passed beside it: one value
    # per tile for the pipeliner to carry (sm_90 static check, MHA 256: 242 registers against
    # 254 with k0 passed, 255 and spills with 64-bit offsets per element at BLOCK_N = 64).
    k0 = tl.min(kk, axis=0)
    kn = kk - k0
    k_rows = (k_head + tl.cast(k0, tl.int64) * sks) + kn[:, None] * sks
    v_rows = (v_head + tl.cast(k0, tl.int64) * svs) + kn[:, None] * svs
    if MASKED:
        in_k = kk[:, None] < hi
    else:
        in_k = kk[:, None] >= 0  # every key of the tile exists (folded away)
    if Dqk < BLOCK_DA:
        k_a = tl.load(k_rows + da[None, :] * skd, mask=in_k & (da[None, :] < Dqk), other=0.0)
    elif MASKED:
        k_a = tl.load(k_rows + da[None, :] * skd, mask=in_k, other=0.0)
    else:
        k_a = tl.load(k_rows + da[None, :] * skd)
    s = tl.zeros([q_a.shape[0], kk.shape[0]], dtype=tl.float32)
    s = _dot(q_a, tl.trans(k_a), s, DOT_FP32)
    if BLOCK_DB > 0:
        db = BLOCK_DA + tl.arange(0, BLOCK_DB)
        k_b = tl.load(k_rows + db[None, :] * skd, mask=in_k & (db[None, :] < Dqk), other=0.0)
        s = _dot(q_b, tl.trans(k_b), s, DOT_FP32)
    if MASKED:
        valid = (kk[None, :] >= ks[:, None]) & (kk[None, :] < ke[:, None])
        s = tl.where(valid, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    else:
        m_safe = m_new  # every row has a finite score in this tile
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if EVEN_DV:
        if MASKED:
            vv = tl.load(v_rows + dv[None, :] * svd, mask=in_k, other=0.0)
        else:
            vv = tl.load(v_rows + dv[None, :] * svd)
    else:
        vv = tl.load(v_rows + dv[None, :] * svd, mask=in_k & (dv[None, :] < Dv), other=0.0)
    acc = acc * alpha[:, None]
    acc = _dot(p.to(vv.dtype), vv, acc, DOT_FP32)
    return acc, m_new, l_i
