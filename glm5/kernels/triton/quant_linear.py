"""Triton quant_linear for the canonical schemes w8a16, w8a8, w4a8 and w6a12 (docs/ops.md).

Activation schemes run two kernels: per-token dynamic quantization (codes int8 / int16 and an
fp32 scale per row, bit for bit ``quantize_per_token_ref``), then a tiled GEMM that unpacks the
weight codes in the kernel and sums each K-group of 128 exactly in int32 before applying
``s_w[n, g]`` and ``s_x[m]`` in fp32. w8a16 is one fp32-accumulated GEMM on the int8 codes with
the per-channel scale applied after the sum. Output in x's dtype, shape [M, N].
The @triton.jit kernels live in ``_quant_kernels`` and are imported on first call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.ir.quant_formats import ACT_DTYPE, ACT_QMAX, GROUP, get_scheme, n_groups
from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, interpreted, launch,
                                        launch_opts, next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    "quant_linear": {
        "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
        # Decode (M <= SMALL_M): one 16-row tile and narrower N tiles, so that more programs
        # share the weight stream.
        "SMALL_M": 16, "BLOCK_M_SMALL_M": 16, "BLOCK_N_SMALL_M": 32,
        # Activation quantization: the widest row held at once.
        "QUANT_BLOCK_K": 8192, "quant_num_warps": 8,
    },
}


def _kernels():
    from glm5.kernels.triton import _quant_kernels

    return _quant_kernels


def quantize_per_token(x: torch.Tensor, bits: int,
                       p: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token quantization of x[M, K]: (codes int8/int16 [M, K], scale fp32 [M])."""
    p = DEFAULTS["quant_linear"] if p is None else p
    check_device("quant_linear", x=x)
    M, K = x.shape
    q = torch.empty(M, K, dtype=ACT_DTYPE[bits], device=x.device)
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
        bm, bn = int(p.get("BLOCK_M", 64)), int(p.get("BLOCK_N", 64))
        if M <= int(p.get("SMALL_M", 16)):
            bm = int(p.get("BLOCK_M_SMALL_M", bm))
            bn = int(p.get("BLOCK_N_SMALL_M", bn))
        # BLOCK_M follows M only through the two regimes above (decode / prefill tiles, one
        # compilation each): a tile clipped to next_pow2(M) compiled once per length bucket.
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


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [("quant_linear", make_quant_linear(tuning("quant_linear")), FLOATS, None)]
