"""Triton routed-expert MoE (`moe_experts`): a sorted grouped GEMM (vLLM fused_moe's design).

  torch:  the T*k routed (token, slot) pairs are sorted by expert id (stable argsort; an id of -1
          sorts last and is never scheduled); per-expert row offsets (searchsorted) give a
          schedule of row tiles of BLOCK_M rows, each inside one expert. The tile count is an
          upper bound from shapes (cdiv(T k, BLOCK_M) + E, as vLLM's moe_align_block_size);
          tiles past the real count are marked -1 and exit. All on the device, no host sync
          (``schedule``).
  Triton: grouped GEMM over (row tile, N-block): h = silu(x w1^T) * (x w3^T) from w13, the
          gather of the token rows fused into the A loads, silu_mul in the epilogue (the
          [rows, 2I] product never reaches memory, only h [rows, I])      (moe_gemm13_kernel)
  Triton: grouped GEMM over (row tile, N-block): y[pair] = weight * (h w2^T) in fp32, the
          routing weight applied in the epilogue, rows stored by (token, slot) pair
                                                                          (moe_gemm2_kernel)
  Triton: combine per (token, D-block): out[t] = sum_j y[t k + j] in slot order --
          deterministic, no atomics, fp32 accumulation, one rounding   (moe_combine_kernel)
Both GEMMs order their tiles GROUP_M row tiles at a time (L2 reuse of each expert's weight tile).
Two tile regimes from the tuning entry: decode (few rows per expert: 16-row tiles, memory bound
on the weights) and prefill (64-row tiles, wgmma on Hopper); see ``tiles``. An expert with no
token gets no tile. h is held in x's dtype (fp32 for fp32 inputs).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, launch,
                                        launch_opts, next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    "moe_experts": {
        # Prefill: vLLM fused_moe's tuned H200 entry for ~256 rows per expert (E=128, N=1024,
        # M=4096: 64 x 128 x 64, 4 warps, 3 stages): row tiles of 64 (one warpgroup's wgmma M),
        # gemm13 gate and up blocks of 64 columns each (a 64 x 128 slice of the [rows, 2I]
        # product, vLLM's tile), gemm2 blocks of 128. sm_90: 122 / 140 registers, 72 KiB of
        # shared memory each, so 3 blocks fit an SM. BLOCK_N is per half of w13.
        "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_N2": 128, "BLOCK_K": 64, "GROUP_M": 8,
        "num_warps": 4, "num_stages": 3,
        # Decode (T * k <= DECODE_ROWS_PER_EXPERT * E: at most about one 16-row tile per expert):
        # memory bound on the weights, each read once; 16-row tiles waste the least work and
        # narrower N-blocks give more programs to stream the weights with.
        "DECODE_ROWS_PER_EXPERT": 16, "BLOCK_M_DECODE": 16, "BLOCK_N_DECODE": 64,
        "BLOCK_N2_DECODE": 64, "BLOCK_K_DECODE": 128,
        # The combine: one program per (token, D-block); launch options combine_num_warps /
        # combine_num_stages where set, else the entry's.
        "BLOCK_D": 256,
    },
}


def _k():
    # lazy: optional dependency: _moe_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _moe_kernels

    return _moe_kernels


def tiles(p: dict[str, Any], T: int, k: int, E: int, elem_bytes: int) -> dict[str, Any]:
    """The launch tiles of one call: the decode regime's (``*_DECODE`` keys, launch options
    ``decode_num_warps`` / ``decode_num_stages`` where set, else the prefill ones) when
    T * k <= DECODE_ROWS_PER_EXPERT * E, else the prefill ones. Chosen from shapes only, so the
    regime is one of two compiled variants and never a sync. 4-byte operands (fp32: IEEE dots
    on the FMA units, operands and both accumulators in registers) get half the BLOCK_K and
    N-blocks of the entry, which is sized for 16-bit tensor-core tiles: on sm_90 the fp32
    prefill GEMMs took 255 registers at full size (gemm2 spilling 32 B) and 128 at half."""
    decode = T * k <= int(p.get("DECODE_ROWS_PER_EXPERT", 16)) * E
    sfx = "_DECODE" if decode else ""
    div = 2 if elem_bytes > 2 else 1

    def tile(name: str, default: int, d: int = 1) -> int:
        return max(16, next_pow2(int(p.get(name + sfx, p.get(name, default)))) // d)

    opts = launch_opts(p)
    if decode:
        opts = launch_opts(p, "decode_", **opts)
    return {"decode": decode, "BLOCK_M": tile("BLOCK_M", 64),
            "BLOCK_N": tile("BLOCK_N", 64, div), "BLOCK_N2": tile("BLOCK_N2", 128, div),
            "BLOCK_K": tile("BLOCK_K", 64, div), "GROUP_M": max(1, int(p.get("GROUP_M", 8))),
            "opts": opts}


def schedule(ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The expert-sorted tile schedule of routed pairs, on ids' device, without a host sync.

    ids: [T, k] int expert ids (-1, or any id outside [0, E), is never scheduled). Returns
    (pair, tok, tile_e, tile_lo, tile_hi), int64 (left so: no conversion launches):
    pair[r] = t * k + j, the (token, slot) pair at sorted row r (pairs sorted by expert,
    stably: by pair within an expert); tok[r] = its token;
    and per tile i of the MAX_TILES = min(T k, cdiv(T k, block_m) + E) upper bound (a count
    from shapes only, as vLLM's moe_align_block_size allocates), the expert tile_e[i] and the
    sorted rows [tile_lo[i], tile_hi[i]) it covers: block_m rows or an expert's last rows, one
    expert each. tile_e = -1 marks the tiles past the real count; an expert without rows gets
    no tile. Only argsort, searchsorted, cumsum and elementwise ops: nothing whose output shape
    depends on values (bincount, nonzero, unique would read back to the host on a GPU)."""
    T, k = ids.shape
    N = T * k
    dev = ids.device
    flat = ids.reshape(-1)
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    # gather / index_select / diff rather than Python indexing: the same kernels, and they also
    # run on the faked CUDA tensors of the no-sync test on a CPU-only torch build.
    skey = key.gather(0, order)
    offs = torch.searchsorted(skey, torch.arange(E + 1, device=dev, dtype=skey.dtype))
    counts = offs.diff()
    per = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_end = torch.cumsum(per, 0)  # inclusive
    max_tiles = max(1, min(N, cdiv(N, block_m) + E))
    i = torch.arange(max_tiles, device=dev)
    te = torch.searchsorted(tile_end, i, right=True)  # the expert of tile i (E: past the count)
    real = te < E
    tec = te.clamp(max=E - 1)
    lo = offs.index_select(0, tec) + (i - (tile_end - per).index_select(0, tec)) * block_m
    hi = torch.minimum(offs.index_select(0, tec + 1), lo + block_m)
    tile_e = torch.where(real, tec, torch.full_like(tec, -1))
    return order, torch.div(order, k, rounding_mode="floor"), tile_e, lo, hi


def make_moe_experts(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """y [T, D] in x's dtype = sum_j weights[t, j] w2[e] silu_mul(w13[e] x[t]), e = ids[t, j]
        (docs/ops.md moe_experts): x [T, D], ids [T, k] int32, weights [T, k] any float,
        w13 [E, 2I, D], w2 [E, D, I]. No host synchronisation: every launch size comes from
        shapes."""
        check_device("moe_experts", x=x, ids=ids, weights=weights, w13=w13, w2=w2)
        T, D = x.shape
        E, I2, _ = w13.shape
        I = I2 // 2
        kt = ids.shape[1]
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
        if T == 0 or D == 0:
            return out
        if kt == 0 or E == 0:
            return out.zero_()
        N = T * kt
        fp32 = dot_fp32(x.dtype, w13.dtype, w2.dtype)
        cfg = tiles(p, T, kt, E, max(x.element_size(), w13.element_size(), w2.element_size()))
        bm, gm, opts = cfg["BLOCK_M"], cfg["GROUP_M"], cfg["opts"]
        k = _k()
        pair, tok, tile_e, lo, hi = schedule(ids, E, bm)
        nt = tile_e.shape[0]
        h = torch.empty((N, max(I, 1)), dtype=x.dtype, device=x.device)
        y = torch.empty((N, D), dtype=torch.float32, device=x.device)
        if I > 0:
            bn1 = max(16, min(cfg["BLOCK_N"], next_pow2(I)))
            bk1 = max(16, min(cfg["BLOCK_K"], next_pow2(D)))
            launch(
                k.moe_gemm13_kernel, (nt * cdiv(I, bn1),), p, "moe_experts",
                x, w13, h, tok, tile_e, lo, hi, D, I,
                x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
                h.stride(0), h.stride(1), nt,
                BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=bk1, GROUP_M=gm, EVEN_K=D % bk1 == 0,
                DOT_FP32=fp32, **opts)
        else:
            h.zero_()
        bn2 = max(16, min(cfg["BLOCK_N2"], next_pow2(D)))
        bk2 = max(16, min(cfg["BLOCK_K"], next_pow2(max(I, 1))))
        launch(
            k.moe_gemm2_kernel, (nt * cdiv(D, bn2),), p, "moe_experts",
            h, w2, y, pair, weights, tile_e, lo, hi, D, I, kt,
            h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
            weights.stride(0), weights.stride(1), y.stride(0), y.stride(1), nt,
            BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, GROUP_M=gm, EVEN_K=max(I, 1) % bk2 == 0,
            DOT_FP32=fp32, **opts)
        bd = max(16, min(next_pow2(int(p.get("BLOCK_D", 256))), next_pow2(D)))
        launch(
            k.moe_combine_kernel, (T, cdiv(D, bd)), p, "moe_experts",
            y, ids, out, D, E, kt, y.stride(0), y.stride(1), ids.stride(0), ids.stride(1),
            out.stride(0), out.stride(1), BLOCK_D=bd,
            **launch_opts(p, "combine_", **launch_opts(p)))  # the entry's, unless combine_*
        return out

    return moe_experts


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("moe_experts", make_moe_experts(tuning("moe_experts")), FLOATS, None)]
