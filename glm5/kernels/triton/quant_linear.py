"""Triton quant_linear for the canonical schemes w8a16, w8a8, w4a8 and w6a12 (docs/ops.md).

Two regimes, one compiled variant of each kernel per scheme and regime: M <= GEMV_M (decode
batches) runs the split-K GEMV, larger M the tiled GEMM. Output in x's dtype, shape [M, N].

The activation schemes quantize x per token first (``quantize_rows_kernel``: codes and an fp32
scale per row, bit for bit ``quantize_per_token_ref``; the scale needs the whole row, so this
stays a kernel of its own).

GEMM (prefill): a tiled kernel that unpacks the weight codes in the kernel and sums each K-group
of 128 exactly in int32 (tensor-core dots) before applying ``s_w[n, g]`` and ``s_x[m]`` in fp32;
w8a16 is one fp32-accumulated GEMM on the int8 codes with the per-channel scale applied after
the sum.

GEMV (``quant_gemv_kernel``, decode): memory bound, so it reads every packed weight byte once
and uses no tensor core. The grid (cdiv(N, GEMV_BLOCK_N), SPLIT) gives each program
GEMV_BLOCK_N output columns and one K range (whole GEMV_BLOCK_K steps, so whole 128-groups);
SPLIT makes about GEMV_TARGET_PROGRAMS programs (the token_logprobs rule). Each step loads the
packed tile with wide contiguous loads (int4 and int6 rows as 32-bit words where aligned), turns
the codes into exact fp32 values and multiplies them with the row's fp32 activation codes
(w8a16: x) on CUDA cores; every group sum is an integer below 2^24, so exact in fp32 (see
``_quant_kernels``). SPLIT == 1 writes y directly; otherwise the programs write fp32 (w8a8:
exact int32) partials [SPLIT, M, N] and ``quant_gemv_reduce_kernel`` sums them in split order
(deterministic) before the same epilogue (scales, bias, cast). docs/performance.md,
"quant_linear GEMV (decode)".
The @triton.jit kernels live in ``_quant_kernels`` and are imported on first call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.ir.quant_formats import ACT_DTYPE, ACT_QMAX, GROUP, get_scheme, n_groups
from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, interpreted, launch,
                                        launch_opts, next_pow2, split_for_target)

DEFAULTS: dict[str, dict[str, Any]] = {
    "quant_linear": {
        "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
        # Decode: M <= GEMV_M rows run the split-K GEMV (M is a runtime loop there: one
        # compilation for every decode batch), larger M the GEMM above.
        "GEMV_M": 16,
        # Output columns per program and K codes per step (a multiple of the 128-group): 16 x
        # 256 is 32 codes per thread at 4 warps, about 64 registers, 8 programs per SM.
        "GEMV_BLOCK_N": 16, "GEMV_BLOCK_K": 256,
        # Split K until about this many programs run: 8 per SM of a 132-SM H200 (one wave at
        # the occupancy above), so that enough loads are in flight to stream HBM.
        "GEMV_TARGET_PROGRAMS": 1056,
        # Columns per program of the kernel summing the split partials.
        "GEMV_REDUCE_BLOCK_N": 256,
        # One stage: the GEMV prefetches its next packed tile itself (no tl.dot to pipeline).
        "gemv_num_warps": 4, "gemv_num_stages": 1, "gemv_reduce_num_warps": 4,
        # Activation quantization: the widest row held at once.
        "QUANT_BLOCK_K": 8192, "quant_num_warps": 8,
    },
}


def _kernels():
    # lazy: optional dependency: _quant_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _quant_kernels

    return _quant_kernels


def quantize_per_token(x: torch.Tensor, bits: int, p: dict[str, Any] | None = None,
                       codes_dtype: torch.dtype | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token quantization of x[M, K]: (codes [M, K], scale fp32 [M]). The codes are
    int8/int16 (``ACT_DTYPE[bits]``), or ``codes_dtype`` (float32: the same integer values,
    exact, as the GEMV multiplies them)."""
    p = DEFAULTS["quant_linear"] if p is None else p
    check_device("quant_linear", x=x)
    M, K = x.shape
    q = torch.empty(M, K, dtype=codes_dtype or ACT_DTYPE[bits], device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    if K == 0:
        s.fill_(1.0)
        return q, s
    block = max(16, min(next_pow2(K), next_pow2(int(p.get("QUANT_BLOCK_K", 8192)))))
    opts = launch_opts(p, prefix="quant_", num_warps=8)  # its own warps: a row-wise kernel
    launch(
        _kernels().quantize_rows_kernel, (M,), p, "quant_linear",
        x, q, s, K, x.stride(0), x.stride(1), q.stride(0),
        QMAX=ACT_QMAX[bits], BLOCK_K=block, ONE_PASS=K <= block, **opts)
    return q, s


def make_quant_linear(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def quant_linear(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                     scheme: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        sc = get_scheme(scheme, "quant_linear")
        check_device("quant_linear", x=x, w_packed=w_packed, w_scale=w_scale, bias=bias)
        M, K = x.shape
        N = w_packed.shape[0]
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        if M == 0 or N == 0:
            return y
        if K == 0:
            y.zero_()
            if bias is not None:
                y += bias.to(y.dtype)
            return y
        wp = w_packed if w_packed.stride(-1) == 1 else w_packed.contiguous()
        ws = w_scale.to(torch.float32)
        ws = ws if ws.stride(-1) == 1 else ws.contiguous()
        b = bias.contiguous() if bias is not None else ws  # dummy pointer when no bias
        if M <= int(p.get("GEMV_M", 16)):
            _gemv(x, wp, ws, bias, b, y, sc, p)
            return y
        # BLOCK_M never follows M (a tile clipped to next_pow2(M) compiled once per length
        # bucket): the GEMM is the one variant for every M > GEMV_M.
        bm, bn = int(p.get("BLOCK_M", 64)), int(p.get("BLOCK_N", 64))
        bm = max(16, next_pow2(bm))
        bn = max(16, min(next_pow2(bn), next_pow2(N)))
        bk = max(32, min(next_pow2(int(p.get("BLOCK_K", 128))), GROUP))
        grid = (cdiv(M, bm), cdiv(N, bn))
        opts = launch_opts(p)
        k = _kernels()
        if sc.act_bits is None:
            dot_f32 = interpreted() or x.dtype == torch.float32
            bk16 = max(16, min(next_pow2(int(p.get("BLOCK_K", 128))), next_pow2(K)))
            launch(
                k.quant_linear_w8a16_kernel, grid, p, "quant_linear",
                x, wp, ws, b, y, M, N, K, x.stride(0), x.stride(1), wp.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, DOT_F32=dot_f32,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk16, **opts)
            return y
        xq, sx = quantize_per_token(x, sc.act_bits, p)
        launch(
            k.quant_linear_int_kernel, grid, p, "quant_linear",
            xq, sx, wp, ws, b, y, M, N, K, n_groups(K), xq.stride(0), wp.stride(0),
            ws.stride(0), y.stride(0),
            WBITS=sc.weight_bits, ABITS=sc.act_bits, GROUPED=sc.grouped,
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **opts)
        return y

    return quant_linear


def gemv_split(N: int, K: int, p: dict[str, Any]) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT, KPS) of the GEMV for N outputs and K inputs under tuning p:
    SPLIT K ranges of KPS codes (whole BLOCK_K steps, BLOCK_K a multiple of the 128-group), so
    that about GEMV_TARGET_PROGRAMS programs run; no split is left empty."""
    bn = max(1, next_pow2(int(p.get("GEMV_BLOCK_N", 16))))
    bk = max(GROUP, next_pow2(int(p.get("GEMV_BLOCK_K", 256))))
    split, per = split_for_target(cdiv(N, bn), cdiv(K, bk), int(p.get("GEMV_TARGET_PROGRAMS", 0)))
    return bn, bk, split, per * bk


def _gemv_layout(wp: torch.Tensor, sc: Any, K: int) -> tuple[int, int, int]:
    """(LAYOUT, units per row, codes per unit) the GEMV reads the packed rows in: 0 int8 codes
    (a byte each); int4 as 32-bit words of 8 codes (4) where rows are whole words on 4-byte
    boundaries, else bytes of 2 codes (1); int6 as 3 words per 16 codes (3) where rows are
    whole such units on 4-byte boundaries, else 3-byte quads of 4 codes (2)."""
    P = wp.shape[1]
    if sc.weight_bits == 8:
        return 0, K, 1
    words = wp.stride(0) % 4 == 0 and wp.data_ptr() % 4 == 0
    if sc.weight_bits == 4:
        return (4, P // 4, 8) if words and P % 4 == 0 else (1, P, 2)
    return (3, P // 12, 16) if words and P % 12 == 0 else (2, P // 3, 4)


def _gemv(x: torch.Tensor, wp: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
          b: torch.Tensor, y: torch.Tensor, sc: Any, p: dict[str, Any]) -> None:
    """y[M, N] (M <= GEMV_M, K > 0) by the split-K GEMV; b is bias or a dummy pointer."""
    M, K = x.shape
    N = wp.shape[0]
    bn, bk, split, kps = gemv_split(N, K, p)
    act = sc.act_bits is not None
    int_acc = act and not sc.grouped
    if act:
        xa, sx = quantize_per_token(x, sc.act_bits, p, codes_dtype=torch.float32)
    else:
        xa, sx = x, ws  # sx: a dummy pointer (w8a16 has no activation scale)
    # the workspace (split > 1 only): fp32 partial sums, or w8a8's exact int32 sums
    part = torch.empty((split, M, N) if split > 1 else (1,),
                       dtype=torch.int32 if int_acc else torch.float32, device=x.device)
    flags = dict(ACT=act, GROUPED=sc.grouped, INT_ACC=int_acc, HAS_BIAS=bias is not None)
    layout, units, per_unit = _gemv_layout(wp, sc, K)
    k = _kernels()
    launch(
        k.quant_gemv_kernel, (cdiv(N, bn), split), p, "quant_linear",
        xa, wp, ws, sx, b, y, part, M, N, K, n_groups(K), units, kps // per_unit, split,
        xa.stride(0), xa.stride(1), wp.stride(0), ws.stride(0), y.stride(0),
        LAYOUT=layout, BLOCK_N=bn, BLOCK_K=bk, **flags,
        **launch_opts(p, prefix="gemv_", num_warps=4))
    if split > 1:
        rb = max(16, next_pow2(int(p.get("GEMV_REDUCE_BLOCK_N", 256))))
        launch(
            k.quant_gemv_reduce_kernel, (M, cdiv(N, rb)), p, "quant_linear",
            part, ws, sx, b, y, M, N, split, y.stride(0), BLOCK_N=rb, **flags,
            **launch_opts(p, prefix="gemv_reduce_", num_warps=4))


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("quant_linear", make_quant_linear(tuning("quant_linear")), FLOATS, None)]
