"""Triton routed-expert MoE (`moe_experts`): sort by expert, two grouped GEMMs, ordered combine.

  torch:  the T*k routed (token, slot) pairs are sorted by expert id (stable argsort; id -1 sorts
          last and is never scheduled); per-expert counts give a tile schedule of BLOCK_M rows,
          each tile inside one expert (an upper bound of tiles is launched, the padding tiles
          exit) -- all on the device, no host sync.
  Triton: grouped GEMM over (tile, N-block): h = silu(x w1^T) * (x w3^T) from w13, the gather of
          the token rows fused into the loads                              (moe_gemm13_kernel)
  Triton: grouped GEMM over (tile, N-block): y_sorted = h w2^T, fp32        (moe_gemm2_kernel)
  Triton: combine per (token, D-block): out[t] = sum_j weights[t,j] y_sorted[pos(t,j)] in slot
          order -- deterministic, no atomics, fp32 accumulation            (moe_combine_kernel)
An expert with no token gets no tile. h is held in x's dtype (fp32 for fp32 inputs).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, launch,
                                        launch_opts, next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    "moe_experts": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_D": 256,
                    "num_warps": 4, "num_stages": 2},
}


def _k():
    from glm5.kernels.triton import _moe_kernels

    return _moe_kernels


def schedule(ids: torch.Tensor, E: int, block_m: int):
    """(order, inv, tok, tile_e, tile_lo, tile_hi): order[r] = flat (t*k + j) pair at sorted
    row r; inv its inverse; tok[r] the token of row r; tile_* the BLOCK_M-row tiles, one expert
    each (tile_e = -1 for padding tiles)."""
    T, k = ids.shape
    N = T * k
    dev = ids.device
    flat = ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, E))
    order = torch.argsort(key, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(N, device=dev)
    tok = torch.div(order, k, rounding_mode="floor").to(torch.int32)
    # scatter_add, not bincount: bincount's output length depends on max(key), a host read
    # (and so a failed CUDA-graph capture) on a GPU
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))[:E]
    offs = torch.zeros(E + 1, dtype=torch.long, device=dev)
    offs[1:] = torch.cumsum(counts, 0)
    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_end = torch.cumsum(tiles, 0)  # inclusive
    max_tiles = max(1, min(N, cdiv(N, block_m) + E))
    i = torch.arange(max_tiles, device=dev)
    te = torch.searchsorted(tile_end, i, right=True)  # the expert of tile i (E = padding)
    real = te < E
    tec = te.clamp(max=E - 1)
    first = tile_end[tec] - tiles[tec]
    lo = offs[tec] + (i - first) * block_m
    hi = offs[tec + 1]
    tile_e = torch.where(real, tec, torch.full_like(tec, -1)).to(torch.int32)
    return order, inv, tok, tile_e, lo.to(torch.int32), hi.to(torch.int32)


def make_moe_experts(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def moe_experts(x, ids, weights, w13, w2):
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
        bm = max(16, next_pow2(int(p.get("BLOCK_M", 16))))
        bn = max(16, next_pow2(int(p.get("BLOCK_N", 64))))
        bk = max(16, next_pow2(int(p.get("BLOCK_K", 64))))
        bdc = max(16, next_pow2(int(p.get("BLOCK_D", 256))))
        fp32 = dot_fp32(x.dtype, w13.dtype, w2.dtype)
        opts = launch_opts(p)
        k = _k()
        _, inv, tok, tile_e, lo, hi = schedule(ids, E, bm)
        N = T * kt
        nt = tile_e.shape[0]
        h = torch.empty((N, max(I, 1)), dtype=x.dtype, device=x.device)
        y = torch.empty((N, D), dtype=torch.float32, device=x.device)
        if I > 0:
            bn1 = max(16, min(bn, next_pow2(I)))
            launch(
                k.moe_gemm13_kernel, (nt, cdiv(I, bn1)), p, "moe_experts",
                x, w13, h, tok, tile_e, lo, hi, D, I,
                x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
                h.stride(0), h.stride(1),
                BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=max(16, min(bk, next_pow2(D))),
                DOT_FP32=fp32, **opts)
        else:
            h.zero_()
        bn2 = max(16, min(bn, next_pow2(D)))
        launch(
            k.moe_gemm2_kernel, (nt, cdiv(D, bn2)), p, "moe_experts",
            h, w2, y, tile_e, lo, hi, D, I,
            h.stride(0), h.stride(1), w2.stride(0), w2.stride(1), w2.stride(2),
            y.stride(0), y.stride(1),
            BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=max(16, min(bk, next_pow2(max(I, 1)))),
            DOT_FP32=fp32, **opts)
        bd = max(16, min(bdc, next_pow2(D)))
        launch(
            k.moe_combine_kernel, (T, cdiv(D, bd)), p, "moe_experts",
            y, inv, ids, weights, out, D, kt,
            y.stride(0), y.stride(1), ids.stride(0), ids.stride(1),
            weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
            BLOCK_D=bd, **opts)
        return out

    return moe_experts


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("moe_experts", make_moe_experts(tuning("moe_experts")), FLOATS, None)]
