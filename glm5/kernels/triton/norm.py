"""Triton rms_norm, rope (interleaved and NeoX) and silu_mul.

One tile per row (or per block of rows for rope), fp32 math, output in the input's dtype; the
tuning entry's grid policy maps tiles to programs (glm5.kernels.triton._grid).
Launchers take the op's arguments as docs/ops.md lists them and return what the reference returns.
The @triton.jit kernels live in ``_norm_kernels`` and are imported on first call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.kernels.triton.launch import FLOATS, cdiv, check_device, launch, launch_opts, next_pow2

DEFAULTS: dict[str, dict[str, Any]] = {
    # BLOCK_D: the widest row held at once (longer rows take two passes over D).
    "rms_norm": {"BLOCK_D": 8192, "num_warps": 8},
    # BLOCK_M rows of x[T, M, R] per program; the R/2 pairs are one tile.
    "rope": {"BLOCK_M": 16, "num_warps": 4},
    "silu_mul": {"BLOCK_I": 1024, "num_warps": 4},
}


def _kernels():
    # lazy: optional dependency: _norm_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _norm_kernels

    return _norm_kernels


# --------------------------------------------------------------------------- rms_norm
def make_rms_norm(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        check_device("rms_norm", x=x, weight=weight)
        D = x.shape[-1]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return y
        x2 = x.reshape(-1, D)
        y2 = y.view(-1, D)
        cap = next_pow2(int(p.get("BLOCK_D", 8192)))
        block = max(16, min(next_pow2(D), cap))
        launch(_kernels().rms_norm_kernel, (x2.shape[0],), p, "rms_norm",
               x2, weight, y2, D, x2.stride(0), x2.stride(1), weight.stride(0), y2.stride(0),
               float(eps), BLOCK_D=block, ONE_PASS=D <= block, **launch_opts(p))
        return y

    return rms_norm


# --------------------------------------------------------------------------- rope
def make_rope(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
        check_device("rope", x=x, cos=cos, sin=sin)
        T, R = x.shape[0], x.shape[-1]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return y
        x3 = x.reshape(T, -1, R)
        y3 = y.view(T, -1, R)
        M, half = x3.shape[1], R // 2
        c2 = cos.reshape(T, half)
        s2 = sin.reshape(T, half)
        bm = max(1, min(next_pow2(M), next_pow2(int(p.get("BLOCK_M", 16)))))
        bh = max(16, next_pow2(half))
        launch(_kernels().rope_kernel, (T, cdiv(M, bm)), p, "rope",
               x3, c2, s2, y3, M, half,
               x3.stride(0), x3.stride(1), x3.stride(2), c2.stride(0), c2.stride(1),
               s2.stride(0), s2.stride(1), y3.stride(0), y3.stride(1),
               INTERLEAVED=bool(interleaved), BLOCK_M=bm, BLOCK_H=bh, **launch_opts(p))
        return y

    return rope


# --------------------------------------------------------------------------- silu_mul
def make_silu_mul(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        check_device("silu_mul", x=x)
        I = x.shape[-1] // 2
        y = torch.empty(tuple(x.shape[:-1]) + (I,), dtype=x.dtype, device=x.device)
        if y.numel() == 0:
            return y
        x2 = x.reshape(-1, 2 * I)
        y2 = y.view(-1, I)
        block = max(16, min(next_pow2(I), next_pow2(int(p.get("BLOCK_I", 1024)))))
        launch(_kernels().silu_mul_kernel, (x2.shape[0], cdiv(I, block)), p,
               "silu_mul", x2, y2, I, x2.stride(0), x2.stride(1), y2.stride(0), BLOCK_I=block,
               **launch_opts(p))
        return y

    return silu_mul


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    return [
        ("rms_norm", make_rms_norm(tuning("rms_norm")), FLOATS, None),
        ("rope", make_rope(tuning("rope")), FLOATS, None),
        ("silu_mul", make_silu_mul(tuning("silu_mul")), FLOATS, None),
    ]
