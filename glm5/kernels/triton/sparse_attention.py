"""Triton sparse attention (DSA stage 2). Dense ranged `attention` is the flash kernel of
glm5.kernels.triton.attention (the SPARSE=False path of this kernel is no longer launched).

One program per (query t, KV head, block of its query heads, block of Dv): the program's query
heads share each key row, so in the absorbed-MLA (MQA, Hk = 1) case every selected latent row is
gathered once for up to BLOCK_H_MAX heads (all 64 of GLM-5 by default). sparse_attention
gathers rows by idx inside the kernel (-1 anywhere = skipped); attention walks
k_start <= s < k_end. Online softmax over BLOCK_K keys at a time, scores in fp32 (Dqk reduced
in BLOCK_D chunks), P cast to v's dtype for the PV dot with fp32 accumulation, out in q's dtype,
lse fp32 natural log; a query with no valid key gives out 0 and lse -inf. v may be a view of
k's first Dv columns (strides are passed as they are).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, launch,
                                        launch_opts, next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    # BLOCK_H_MAX: query heads per program (a power of two >= 16; fewer heads are masked);
    # BLOCK_DV: the widest slice of Dv one program accumulates (more -> more programs, each
    # recomputing the scores). 64 heads x 512 fp32 accumulators want num_warps = 8.
    "sparse_attention": {"BLOCK_H_MAX": 64, "BLOCK_K": 32, "BLOCK_D": 64, "BLOCK_DV": 512,
                         "num_warps": 8, "num_stages": 2},
}

LOG2E = 1.4426950408889634


def _k():
    from glm5.kernels.triton import _attention_kernels

    return _attention_kernels


def _launch(p: dict[str, Any], q, k, v, idx, k_start, k_end, scale, sparse: bool):
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    Dv = v.shape[-1]
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
    if sparse:
        K = idx.shape[1]
        sit, sik = idx.stride(0), idx.stride(1)
        ks = ke = idx  # unused
    else:
        K = S
        sit = sik = 0
        idx = k_start  # unused
        ks, ke = k_start.contiguous(), k_end.contiguous()
    grid = (T, Hk * n_hb, cdiv(Dv_launch, bdv))
    launch(
        _k().attention_kernel, grid, p, "sparse_attention" if sparse else "attention",
        q, k, v, idx, ks, ke, out, lse, G, Dqk, Dv, K, n_hb, float(scale) * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), sit, sik,
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        SPARSE=sparse, BLOCK_H=bh, BLOCK_K=bk, BLOCK_D=bd, BLOCK_DV=bdv,
        DOT_FP32=dot_fp32(q.dtype, k.dtype, v.dtype), **launch_opts(p))
    return out, lse


def make_sparse_attention(p: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def sparse_attention(q, k, v, idx, scale):
        check_device("sparse_attention", q=q, k=k, v=v, idx=idx)
        return _launch(p, q, k, v, idx, None, None, scale, True)

    return sparse_attention


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [
        ("sparse_attention", make_sparse_attention(tuning("sparse_attention")), FLOATS, None),
    ]


