"""Triton MLA prolog (MLAPO): torch GEMMs + a fused Triton norm / RoPE / cache-write tail.

Served whole (`mla_prolog`), in this order:
  torch:  c_q_raw = x w_qa^T, kv = x w_kva^T                                   (GEMMs)
  Triton: per token, c_q = rms_norm(c_q_raw, g_qa); ckv = rms_norm(kv[:, :Rkv], g_kva);
          k_pe = interleaved rope(kv[:, Rkv:]); [ckv | k_pe] -> kv_cache[slots[t]] in place,
          slot -1 skipped                                           (prolog_token_kernel)
  torch:  q = c_q w_qb^T                                                        (GEMM)
  Triton: per (token, head), q_pe = interleaved rope(q[..., Dn:]), and q_nope copied out in x's
          dtype when not absorbing                                      (prolog_q_kernel)
  torch:  q_main = q_nope . w_uk[h] (a batched GEMM over heads) when absorbing.
Norm/RoPE math is fp32. GEMMs run in fp32 when interpreted or for fp32 inputs, otherwise in x's
dtype (tensor cores, fp32 accumulation). Returns (q_main, q_pe, c_q) in x's dtype.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import (FLOATS, check_device, dot_fp32, launch, launch_opts,
                                        next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    "mla_prolog": {"num_warps": 4, "num_stages": 1},
}


def _k():
    # lazy: optional dependency: _prolog_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _prolog_kernels

    return _prolog_kernels


def make_mla_prolog(p: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    def mla_prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots,
                   absorb):
        check_device("mla_prolog", x=x, w_qa=w_qa, g_qa=g_qa, w_qb=w_qb, w_kva=w_kva, g_kva=g_kva,
                     w_uk=w_uk, cos=cos, sin=sin, kv_cache=kv_cache, slots=slots)
        T, D = x.shape
        H, Dn, Rkv = w_uk.shape
        Rq = w_qa.shape[0]
        Dr = w_kva.shape[0] - Rkv
        R2 = Dr // 2
        dt = x.dtype
        fp32 = dot_fp32(dt, w_qa.dtype, w_qb.dtype, w_kva.dtype, w_uk.dtype)
        cd = torch.float32 if fp32 else dt
        dev = x.device
        q_main = torch.empty((T, H, Rkv if absorb else Dn), dtype=dt, device=dev)
        q_pe = torch.empty((T, H, Dr), dtype=dt, device=dev)
        if T == 0:
            return q_main, q_pe, torch.empty((T, Rq), dtype=dt, device=dev)
        k = _k()
        opts = launch_opts(p)
        xc = x.to(cd)
        cq_raw = xc @ w_qa.to(cd).t()  # [T, Rq]
        kv = xc @ w_kva.to(cd).t()  # [T, Rkv + Dr]
        c_q = torch.empty((T, Rq), dtype=cd, device=dev)
        sl = slots.contiguous()
        launch(
            k.prolog_token_kernel, (T,), p, "mla_prolog",
            cq_raw, g_qa, c_q, kv, g_kva, cos, sin, sl, kv_cache, Rq, Rkv, R2, float(eps),
            cq_raw.stride(0), cq_raw.stride(1), g_qa.stride(0), c_q.stride(0), c_q.stride(1),
            kv.stride(0), kv.stride(1), g_kva.stride(0), cos.stride(0), cos.stride(1),
            sin.stride(0), sin.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            BLOCK_RQ=max(16, next_pow2(Rq)), BLOCK_RKV=max(16, next_pow2(Rkv)),
            BLOCK_R2=max(16, next_pow2(R2)), **opts)
        q = c_q @ w_qb.to(cd).t()  # [T, H * (Dn + Dr)]
        qn_out = q_pe if absorb else q_main  # q_pe: an unused placeholder when absorbing
        launch(
            k.prolog_q_kernel, (T, H), p, "mla_prolog",
            q, cos, sin, qn_out, q_pe, Dn, R2, Dn + Dr,
            q.stride(0), q.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            qn_out.stride(0), qn_out.stride(1), qn_out.stride(2),
            q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
            WRITE_NOPE=not absorb, BLOCK_DN=max(16, next_pow2(Dn)),
            BLOCK_R2=max(16, next_pow2(R2)), **opts)
        if absorb:
            q_nope = q.view(T, H, Dn + Dr)[..., :Dn]  # [T, H, Dn]
            # [H, T, Dn] x [H, Dn, Rkv] -> [H, T, Rkv]
            qa = torch.bmm(q_nope.transpose(0, 1), w_uk.to(cd))
            q_main.copy_(qa.transpose(0, 1))
        return q_main, q_pe, c_q if cd == dt else c_q.to(dt)

    return mla_prolog


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("mla_prolog", make_mla_prolog(tuning("mla_prolog")), FLOATS, None)]
