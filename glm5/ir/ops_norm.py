"""Normalisation, position and activation ops: rms_norm, layer_norm, rope, silu_mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.cost import tensor_bytes
from glm5.ir.numerics import (
    ErrorTerms,
    rms_norm_error,
    rope_error,
    silu_mul_error,
    sqrt_n,
    no_error,
)
from glm5.ir.opdef import OpDef, require
from glm5.ir.signature import FLOAT_DTYPES, OutArg, TensorArg, scalar


def acc_of(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for the float64 oracle, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- rms_norm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    acc = acc_of(x)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return y.to(x.dtype)


def rms_norm_error_model(o, r, work):
    """y: the fp32 mean over D (sqrt(D) growth), rsqrt and two products (acc); x * rsqrt may
    be rounded to the working dtype before the weight, as transformers does (mid)."""
    x = o["x"]
    return {"y": rms_norm_error(x, no_error(), o["weight"], o["eps"], r[0])}


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
    cost=lambda a, s: (4.0 * a["x"].numel(), 2 * tensor_bytes(a["x"]) + tensor_bytes(a["weight"])),
    error=rms_norm_error_model,
    category="norm",
)


# --------------------------------------------------------------------------- layer_norm
def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    acc = acc_of(x)
    y = F.layer_norm(x.to(acc), (x.shape[-1],), weight.to(acc), bias.to(acc), eps)
    return y.to(x.dtype)


def layer_norm_error_model(o, r, work):
    """y: the fp32 mean (an error of sqrt(D) u mean|x| in x - mean), the variance over D and
    rsqrt (sqrt(D) growth), products and the bias add (acc); the normalised value and its
    product with the weight may each be rounded to the working dtype (mid)."""
    x, w, eps = o["x"], o["weight"], o["eps"]
    D = x.shape[-1]
    mu = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    c = ((x - mu) * rstd * w).abs()
    acc = ((sqrt_n(D) + 4.0) * (c + w.abs() * rstd * x.abs().mean(-1, keepdim=True))
           + r[0].abs())
    return {"y": ErrorTerms(mid=2.0 * c, acc=acc, tiny=torch.broadcast_to(w.abs() + 1.0, x.shape))}


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
        2 * tensor_bytes(a["x"]) + tensor_bytes(a["weight"], a["bias"]),
    ),
    error=layer_norm_error_model,
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


def rope_error_model(o, r, work):
    """y: per output, M = |x1 cos| + |x2 sin|; the two products may be rounded to the working
    dtype (mid = M) and are summed in fp32 (acc = 2M). cos and sin are inputs: exact."""
    x = o["x"]
    return {"y": rope_error(x, no_error(), o["cos"], o["sin"], o["interleaved"], rope_ref)}


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
    cost=lambda a, s: (3.0 * a["x"].numel(),
                       2 * tensor_bytes(a["x"]) + tensor_bytes(a["cos"], a["sin"])),
    error=rope_error_model,
    check=_rope_check,
    category="norm",
)


# --------------------------------------------------------------------------- silu_mul
def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    acc = acc_of(x)
    i = x.shape[-1] // 2
    xf = x.to(acc)
    return (F.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def silu_mul_error_model(o, r, work):
    """y = silu(a) b: exp, add, divide, multiply in fp32 (acc = 4|y|); silu(a) may be rounded
    to the working dtype before the product (mid = |y|)."""
    x = o["x"]
    i = x.shape[-1] // 2
    a, b = x[..., :i], x[..., i:]
    return {"y": silu_mul_error(a, b, no_error(), no_error())}


SILU_MUL = OpDef(
    name="silu_mul",
    summary="silu(x[..., :I]) * x[..., I:]",
    params=(TensorArg("x", ("...", "2*I")),),
    outputs=(OutArg("y", lambda s, a: tuple(a["x"].shape[:-1]) + (s["I"],), "like:x"),),
    reference=silu_mul_ref,
    cost=lambda a, s: (5.0 * a["x"].numel() / 2, 1.5 * tensor_bytes(a["x"])),
    error=silu_mul_error_model,
    category="norm",
)

OPS = (RMS_NORM, LAYER_NORM, ROPE, SILU_MUL)
__all__ = ["OPS", "acc_of", "FLOAT_DTYPES"]
