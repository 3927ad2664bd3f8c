"""Normalisation, position and activation ops: rms_norm, layer_norm, rope, silu_mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.opdef import OpDef, require
from glm5.ir.signature import FLOAT_DTYPES, OutArg, TensorArg, scalar


def acc_of(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for the float64 oracle, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _bytes(*ts: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor)))


# --------------------------------------------------------------------------- rms_norm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    acc = acc_of(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return y.to(x.dtype)


RMS_NORM = OpDef(
    name="rms_norm",
    summary="x * rsqrt(mean(x^2, -1) + eps) * weight, fp32 math",
    params=(
        TensorArg("x", ("...", "D")),
        TensorArg("weight", ("D",)),
        scalar("eps", float, minimum=0.0),
    ),
    outputs=(OutArg("y", "like:x", "like:x"),),
    reference=rms_norm_ref,
    cost=lambda a, s: (4.0 * a["x"].numel(), 2 * _bytes(a["x"]) + _bytes(a["weight"])),
    tolerance="norm",
    reduce_len=lambda a, s: s["D"],
    category="norm",
)


# --------------------------------------------------------------------------- layer_norm
def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    acc = acc_of(x)
    y = F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), bias.to(acc), eps)
    return y.to(x.dtype)


LAYER_NORM = OpDef(
    name="layer_norm",
    summary="standard LayerNorm over the last dim, fp32 math",
    params=(
        TensorArg("x", ("...", "D")),
        TensorArg("weight", ("D",)),
        TensorArg("bias", ("D",)),
        scalar("eps", float, minimum=0.0),
    ),
    outputs=(OutArg("y", "like:x", "like:x"),),
    reference=layer_norm_ref,
    cost=lambda a, s: (
        7.0 * a["x"].numel(),
        2 * _bytes(a["x"]) + _bytes(a["weight"], a["bias"]),
    ),
    tolerance="norm",
    reduce_len=lambda a, s: s["D"],
    category="norm",
)


# --------------------------------------------------------------------------- rope
def rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    acc = acc_of(x)
    T, R = x.shape[0], x.shape[-1]
    mid = x.dim() - 2
    c = cos.to(acc).reshape((T,) + (1,) * mid + (R // 2,))
    s = sin.to(acc).reshape((T,) + (1,) * mid + (R // 2,))
    xf = x.to(acc)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = xf[..., : R // 2], xf[..., R // 2 :]
    ra, rb = a * c - b * s, b * c + a * s
    if interleaved:
        y = torch.stack((ra, rb), dim=-1).flatten(-2)
    else:
        y = torch.cat((ra, rb), dim=-1)
    return y.to(x.dtype)


def _rope_check(a, s) -> None:
    require(a["x"].dim() >= 2, "rope", "x", "at least 2 dims [T, ..., R]", list(a["x"].shape))
    require(s["R"] % 2 == 0, "rope", "x", "an even last dim R", s["R"])


ROPE = OpDef(
    name="rope",
    summary="rotary embedding; interleaved pairs (x[2i], x[2i+1]) or NeoX half-split",
    params=(
        TensorArg("x", ("T", "...", "R")),
        TensorArg("cos", ("T", "R/2")),
        TensorArg("sin", ("T", "R/2")),
        scalar("interleaved", bool),
    ),
    outputs=(OutArg("y", "like:x", "like:x"),),
    reference=rope_ref,
    cost=lambda a, s: (3.0 * a["x"].numel(), 2 * _bytes(a["x"]) + _bytes(a["cos"], a["sin"])),
    tolerance="elementwise",
    check=_rope_check,
    category="norm",
)


# --------------------------------------------------------------------------- silu_mul
def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    acc = acc_of(x)
    i = x.shape[-1] // 2
    xf = x.to(acc)
    return (F.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


SILU_MUL = OpDef(
    name="silu_mul",
    summary="silu(x[..., :I]) * x[..., I:]",
    params=(TensorArg("x", ("...", "2*I")),),
    outputs=(OutArg("y", lambda s, a: tuple(a["x"].shape[:-1]) + (s["I"],), "like:x"),),
    reference=silu_mul_ref,
    cost=lambda a, s: (5.0 * a["x"].numel() / 2, 1.5 * _bytes(a["x"])),
    tolerance="elementwise",
    category="norm",
)

OPS = (RMS_NORM, LAYER_NORM, ROPE, SILU_MUL)
__all__ = ["OPS", "acc_of", "FLOAT_DTYPES"]
