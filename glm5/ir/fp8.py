"""FP8 e4m3 row quantization of the DSA indexer's inputs (DeepSeek-V3.2's fp8 indexer, as vLLM
and SGLang deploy it: per-token-group scales in UE8M0, i.e. powers of two).

One scale per row of the last dimension (a (token, head) row of q, a key row of k: Di = 128 in
GLM-5 and DeepSeek-V3.2, their quantization block): ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``,
``codes = e4m3(x / s)`` rounded to nearest even (|x / s| <= 448, e4m3's largest finite value, by
the choice of s). All arithmetic is fp32 on the input cast to fp32, so the float64 oracle (its
inputs hold the same values) and a kernel get the same codes and scales bit for bit. A power-of-
two scale makes ``codes · s`` exact in fp32 and bf16 (4 significant bits), and ReLU commutes
with it: ``relu((q8·sq)·(k8·sk)) = sq·sk·relu(q8·k8)``, so an fp8 kernel may fold sq into the
head weights and multiply its per-key sums by sk without rounding anything. This module is the
one definition used by the reference, the decomposition and every kernel's launcher.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value
AMAX_FLOOR = 1e-4  # DeepSeek-V3.2's act_quant: rows below it share this scale (zero rows too)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (codes [..., D] float8_e4m3fn, scale [...] fp32, a power
    of two). Non-finite inputs have no defined codes (their row's scale is NaN / inf)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1).clamp(min=AMAX_FLOOR) if x.shape[-1] else torch.full(
        x.shape[:-1], AMAX_FLOOR, dtype=torch.float32, device=x.device)
    mant, exp = torch.frexp(amax / E4M3_MAX)  # v = mant · 2^exp, mant in [0.5, 1)
    # ceil(log2 v) = exp, or exp - 1 when v is a power of two (mant == 0.5)
    scale = torch.ldexp(torch.ones_like(amax), exp - (mant == 0.5).to(exp.dtype))
    codes = (xf / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_rows_e4m3(codes: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes · scale in ``dtype`` (exact in fp32 / fp64: a 4-bit significand times a power of
    two)."""
    return codes.to(dtype) * scale.to(dtype).unsqueeze(-1)


def e4m3_rows(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x as the fp8 indexer sees it: quantized per row, dequantized exactly into ``dtype``."""
    return dequantize_rows_e4m3(*quantize_rows_e4m3(x), dtype)
