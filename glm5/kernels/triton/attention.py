"""Triton dense ranged attention (`attention`) as a flash kernel.

A program owns BLOCK_M = BLOCK_T x BLOCK_G rows -- the (query, head) pairs of BLOCK_T
consecutive queries and BLOCK_G query heads of one KV head -- and one BLOCK_DV slice of Dv.
Each K/V tile of BLOCK_N keys is loaded once for all its rows, so the QK^T and PV dots are
[BLOCK_M x BLOCK_N] tiles (Hopper wgmma from 64 rows per warpgroup). The key loop runs over the
union of the rows' ranges k_start[t] <= s < k_end[t] (masked per row at its edges, unmasked in
the keys every row sees); online softmax in base 2, fp32 accumulators, P in v's dtype for PV,
out in q's dtype, lse fp32 natural log; a query with no key gives out 0 and lse -inf.

Tiles come from the tuning entry per launch, by regime (one table, ``DEFAULTS["attention"]``):

=========  =================================  =======  =======  ========  =====  ======
regime     when (G = H / Hk)                  BLOCK_M  BLOCK_N  BLOCK_DV  warps  stages
=========  =================================  =======  =======  ========  =====  ======
MHA        G < MQA_MIN_G, T > DECODE_MAX_T    128      32       256       8      3
DECODE     G < MQA_MIN_G, T <= DECODE_MAX_T   16       32       256       4      2
MQA        G >= MQA_MIN_G (absorbed MLA)      128      16       256       8      2
FP32       float32 inputs, any G and T        16       16       128       4      2
=========  =================================  =======  =======  ========  =====  ======

BLOCK_G = min(next_pow2(G), BLOCK_M) heads and BLOCK_T = BLOCK_M / BLOCK_G queries per
program: MHA 128 queries x 1 head; MQA (G = 64) 2 queries x 64 heads, all the heads of a
query in one program as decode wants. Keys: ``<REGIME>_<name>`` sets a parameter for one regime; an
unprefixed ``<name>`` in a backend's entry pins it for every regime (e.g. ascend's
``BLOCK_DV: 128``, cambricon's ``num_warps: 1``). The regime depends on T only through the
DECODE threshold: two compiled variants per head layout, never one per length.

Split-KV (glm5.kernels.triton.splitkv): when the grid is short of about TARGET_PROGRAMS programs
(decode), each program block's union of key ranges is cut into SPLIT equal tile-aligned windows,
every row's range is clipped to its window, and the windows' fp32 partials are merged by their
lse. The partial-writing kernel is one more compiled variant per regime.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton import splitkv
from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, launch,
                                        launch_opts, next_pow2, split_head_dim)

TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_DV")

DEFAULTS: dict[str, dict[str, Any]] = {
    "attention": {
        "MQA_MIN_G": 16, "DECODE_MAX_T": 16,
        # [128, 256] fp32 accumulators over 8 warps: 128 registers a thread, and the scores
        # and probabilities of a 64-key tile take the rest (255 and spills at BLOCK_N = 64,
        # 242 at 32); Q [128, 256] bf16 (64 KiB) stays in shared memory beside three stages
        # of K and V tiles (3 x 32 KiB)
        "MHA_BLOCK_M": 128, "MHA_BLOCK_N": 32, "MHA_BLOCK_DV": 256,
        "MHA_num_warps": 8, "MHA_num_stages": 3,
        # few queries: memory bound, K/V read once per KV head, no 128-row dots
        "DECODE_BLOCK_M": 16, "DECODE_BLOCK_N": 32, "DECODE_BLOCK_DV": 256,
        "DECODE_num_warps": 4, "DECODE_num_stages": 2,
        # absorbed MLA (G = 64, Dqk 576, Dv 512): 2 queries x 64 heads, Dv in two halves.
        # 64 rows with all of Dv (FlashMLA's split of Dv across two warpgroups) spills here,
        # and 128 rows with a 32-key tile need 248 KiB of shared memory (Q alone is 144 KiB)
        "MQA_BLOCK_M": 128, "MQA_BLOCK_N": 16, "MQA_BLOCK_DV": 256,
        "MQA_num_warps": 8, "MQA_num_stages": 2,
        # fp32 inputs: IEEE fp32 dots run on CUDA cores with the operands in registers, and
        # fp32 tiles take twice the shared memory (the MHA tiles would need 272 KiB, 10 KB of
        # spills); correctness and the parity suite, not speed
        "FP32_BLOCK_M": 16, "FP32_BLOCK_N": 16, "FP32_BLOCK_DV": 128,
        "FP32_num_warps": 4, "FP32_num_stages": 2,
        # split-KV for grids short of TARGET_PROGRAMS programs (decode; glm5.kernels.triton.
        # splitkv): at most S / SPLIT_MIN_KEYS ranges
        **splitkv.DEFAULTS,
    },
}

LOG2E = 1.4426950408889634


def _k():
    # lazy: optional dependency: _flash_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _flash_kernels

    return _flash_kernels


def regime(p: dict[str, Any], T: int, G: int, fp32: bool = False) -> str:
    """The tile regime of a launch with T queries, G query heads per KV head, fp32 inputs."""
    if fp32:
        return "FP32"
    if G >= int(p.get("MQA_MIN_G", 16)):
        return "MQA"
    return "DECODE" if T <= int(p.get("DECODE_MAX_T", 16)) else "MHA"


def _param(p: dict[str, Any], reg: str, name: str) -> int:
    """An unprefixed key pins the parameter for every regime; else the regime's own key."""
    key = name if name in p else f"{reg}_{name}"
    if key not in p:
        raise ValueError(f"glm5 triton attention: tuning entry has neither {name!r} nor "
                         f"{reg + '_' + name!r}")
    v = p[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"glm5 triton attention: tuning {key!r} expected a power of two >= 16, "
                         f"got {v!r}")
    return v


def tiles(p: dict[str, Any], T: int, G: int, Dqk: int, Dv: int,
          fp32: bool = False) -> dict[str, Any]:
    """The constexpr tiles and launch options of one launch (see the module's table)."""
    reg = regime(p, T, G, fp32)
    bm, bn, bdv = (_param(p, reg, n) for n in TILE_KEYS)
    bg = min(next_pow2(G), bm)
    da, db = split_head_dim(Dqk)
    bdv = min(bdv, max(16, next_pow2(Dv)))
    opts = launch_opts(p, **launch_opts(p, prefix=reg + "_"))  # unprefixed pins win
    return {"BLOCK_T": bm // bg, "BLOCK_G": bg, "BLOCK_N": bn, "BLOCK_DA": da, "BLOCK_DB": db,
            "BLOCK_DV": bdv, "EVEN_DV": Dv > 0 and Dv % bdv == 0, **opts}


def make_attention(p: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_start: torch.Tensor,
                  k_end: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, Dqk], k [S, Hk, Dqk], v [S, Hk, Dv] (one float dtype), k_start / k_end
        int32 [T] -> out [T, H, Dv] in q's dtype, lse [T, H] fp32 (natural log)."""
        check_device("attention", q=q, k=k, v=v, k_start=k_start, k_end=k_end)
        T, H, Dqk = q.shape
        Hk = k.shape[1]
        Dv = v.shape[-1]
        out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
        if T == 0 or H == 0:
            return out, lse
        G = H // Hk
        c = tiles(p, T, G, Dqk, Dv, torch.float32 in (q.dtype, k.dtype, v.dtype))
        n_tb = cdiv(T, c["BLOCK_T"])
        n_gb = cdiv(G, c["BLOCK_G"])
        n_dv = cdiv(max(Dv, 1), c["BLOCK_DV"])  # Dv = 0: lse still needed
        # few query blocks (decode): the keys (at most S per row) split across programs
        split, _ = splitkv.split_keys(p, n_tb * Hk * n_gb * n_dv, k.shape[0], c["BLOCK_N"])
        po, pl, sos, sls = splitkv.partials(split, out, lse)
        launch(
            _k().flash_attention_kernel, (n_tb, Hk * n_gb, n_dv * split), p, "attention",
            q, k, v, k_start.contiguous(), k_end.contiguous(), po, pl,
            T, n_tb, G, n_gb, n_dv, split, float(scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            sos, po.stride(-3), po.stride(-2), po.stride(-1), sls, pl.stride(-2),
            pl.stride(-1), Dqk=Dqk, Dv=Dv, SPLIT_KV=split > 1,
            DOT_FP32=dot_fp32(q.dtype, k.dtype, v.dtype), **c)
        splitkv.merge(p, "attention", po, pl, out, lse)
        return out, lse

    return attention


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("attention", make_attention(tuning("attention")), FLOATS, None)]
