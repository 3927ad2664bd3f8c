"""Triton sparse attention (DSA stage 2). Dense ranged `attention` is the flash kernel of
glm5.kernels.triton.attention.

One program per (query t, KV head, block of its query heads, block of Dv, split of the selected
keys): the program's query heads share each key row, so in the absorbed-MLA (MQA, Hk = 1) case
every selected latent row is gathered once for up to BLOCK_H_MAX heads (all 64 of GLM-5 by
default). Rows are gathered by idx inside the kernel (-1 anywhere = skipped). Online softmax over
BLOCK_K keys at a time, scores in fp32 (Dqk reduced in BLOCK_D chunks), P cast to v's dtype for
the PV dot with fp32 accumulation, out in q's dtype, lse fp32 natural log; a query with no valid
key gives out 0 and lse -inf. v may be a view of k's first Dv columns (strides are passed as
they are).

Split-KV (decode): a prefill has thousands of query rows, enough programs for every SM, but a
decode step has one per sequence (one program for the whole GPU at batch 1). When the grid is
short of about TARGET_PROGRAMS programs the selected keys are cut into SPLIT ranges of whole
BLOCK_K blocks, each program writes its range's normalized out and lse in fp32, and the
partials are merged by their lse (glm5.kernels.triton.splitkv; docs/performance.md,
"Split-KV decode").
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton import splitkv
from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, interpreted,
                                        launch, launch_opts, next_pow2, split_head_dim)

DEFAULTS: dict[str, dict[str, Any]] = {
    # BLOCK_H_MAX: query heads per program (a power of two >= 16; fewer heads are masked);
    # BLOCK_DV: the widest slice of Dv one program accumulates (more -> more programs, each
    # recomputing the scores). 64 heads x 512 fp32 accumulators want num_warps = 8.
    "sparse_attention": {"BLOCK_H_MAX": 64, "BLOCK_K": 32, "BLOCK_D": 64, "BLOCK_DV": 512,
                         "num_warps": 8, "num_stages": 2,
                         # RESIDENT_Q: Q held on chip for the whole key walk (never for fp32
                         # inputs on a device), V_FROM_K: with it, the gathered K tile reused as
                         # V when v = k[..., :Dv]. Off by default: at these tiles Triton keeps
                         # the resident Q in registers and spills (sm_90 static check: 255
                         # registers, 96 B; 217 and none at BLOCK_DV 256, which recomputes the
                         # scores per Dv half); bench/gpu_tune.py tries both on a GPU.
                         "RESIDENT_Q": False, "V_FROM_K": True,
                         **splitkv.DEFAULTS},
}

LOG2E = 1.4426950408889634


def _k():
    # lazy: optional dependency: _attention_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _attention_kernels

    return _attention_kernels


def _launch(p: dict[str, Any], q, k, v, idx, scale):
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    Dv = v.shape[-1]
    K = idx.shape[1]
    out = torch.empty((T, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    Dv_launch = max(Dv, 1)  # Dv = 0: out is empty, lse still needs the scores
    G = H // Hk
    bh = max(16, min(next_pow2(G), next_pow2(int(p.get("BLOCK_H_MAX", 64)))))
    bk = max(16, next_pow2(int(p.get("BLOCK_K", 32))))
    bd = max(16, min(next_pow2(Dqk), next_pow2(int(p.get("BLOCK_D", 64)))))
    bdv = max(16, min(next_pow2(Dv_launch), next_pow2(int(p.get("BLOCK_DV", 512)))))
    n_hb = cdiv(G, bh)
    # an fp32 Q on a device would not fit beside the accumulator
    resident = bool(p.get("RESIDENT_Q", False)) and (interpreted() or q.dtype != torch.float32)
    da, db = split_head_dim(Dqk)
    # v = k[..., :Dv] (absorbed MLA): the PV dot reuses the gathered K tile when one Dv block
    # of BLOCK_DA columns covers Dv
    v_from_k = (resident and bool(p.get("V_FROM_K", True)) and Dv <= da and bdv >= da
                and v.dtype == k.dtype and v.data_ptr() == k.data_ptr()
                and v.shape[:2] == k.shape[:2] and v.stride() == k.stride())
    if v_from_k:
        bdv = da
    n_dv = cdiv(Dv_launch, bdv)
    split, kps = splitkv.split_keys(p, T * Hk * n_hb * n_dv, K, bk)
    po, pl, sos, sls = splitkv.partials(split, out, lse)
    so = (po.stride(-3), po.stride(-2), po.stride(-1))
    launch(
        _k().sparse_attention_kernel, (T, Hk * n_hb, n_dv * split), p, "sparse_attention",
        q, k, v, idx, po, pl, G, Dqk, Dv, K, kps, n_hb, n_dv, float(scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), idx.stride(0), idx.stride(1),
        sos, *so, sls, pl.stride(-2), pl.stride(-1),
        BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd, BLOCK_DV=bdv, RESIDENT=resident,
        BLOCK_DA=da, BLOCK_DB=db, V_FROM_K=v_from_k,
        DOT_FP32=dot_fp32(q.dtype, k.dtype, v.dtype), **launch_opts(p))
    splitkv.merge(p, "sparse_attention", po, pl, out, lse)
    return out, lse


def make_sparse_attention(p: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def sparse_attention(q, k, v, idx, scale):
        check_device("sparse_attention", q=q, k=k, v=v, idx=idx)
        return _launch(p, q, k, v, idx, scale)

    return sparse_attention


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [
        ("sparse_attention", make_sparse_attention(tuning("sparse_attention")), FLOATS, None),
    ]


