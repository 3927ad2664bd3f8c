"""Quantization ops: quantize_per_token, quant_linear, moe_experts_quant (composite).

Formats (packing, scales, rounding) live in :mod:`glm5.ir.quant_formats`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.numerics import (
    LAMBDA,
    QUOTIENT_ULPS,
    ErrorTerms,
    carry,
    fragile_codes,
    power_of_two,
    linear_error,
    sqrt_n,
    unit_roundoff,
    no_error,
)
from glm5.ir.opdef import OpDef, check_index_range, require
from glm5.ir.ops_moe import expert_chain_error
from glm5.ir.cost import tensor_bytes
from glm5.ir.ops_norm import acc_of
from glm5.ir.quant_formats import (
    ACT_DTYPE,
    GROUP,
    SCHEMES,
    dequantize_weight,
    get_scheme,
    group_view,
    n_groups,
    quantize_per_token_ref,
    unpack,
)
from glm5.ir.signature import FLOAT_DTYPES, INDEX_DTYPES, OutArg, TensorArg, scalar

PACKED_DTYPES = frozenset({torch.int8, torch.uint8})
SCALE_DTYPES = frozenset({torch.float32})
SCHEME_NAMES = tuple(SCHEMES)


# --------------------------------------------------------------------------- quantize_per_token
U32 = unit_roundoff(torch.float32)


def quantize_per_token_error(o, r, work):
    """q: the codes of x / s are exact (fp32 math on exact inputs, as the oracle does) except
    where the quotient lies within QUOTIENT_ULPS fp32 ulps of a half, where an approximate
    division may round either way: one step there (step = 1), none elsewhere; an exact half
    over a power-of-two scale is computed exactly by any implementation and must round to
    even. scale = amax / qmax: one fp32 division (acc |s|)."""
    x = o["x"].to(torch.float32)
    s = r[1].to(torch.float32)[:, None]
    q = (x / s).to(torch.float64)
    fr = fragile_codes(q, QUOTIENT_ULPS * U32 * q.abs(), power_of_two(s.double()))
    return {"q": ErrorTerms(step=fr.to(torch.float64)),
            "scale": ErrorTerms(acc=r[1].abs())}


QUANTIZE_PER_TOKEN = OpDef(
    name="quantize_per_token",
    summary="dynamic symmetric per-row quantization to int8 (bits=8) or int16-held 12-bit",
    params=(TensorArg("x", ("M", "K")), scalar("bits", int, choices=(8, 12))),
    outputs=(
        OutArg("q", ("M", "K"), lambda a: ACT_DTYPE[a["bits"]], differentiable=False),
        OutArg("scale", ("M",), torch.float32, differentiable=False),
    ),
    reference=quantize_per_token_ref,
    cost=lambda a, s: (
        3.0 * a["x"].numel(),
        tensor_bytes(a["x"]) + a["x"].numel() * (1 if a["bits"] == 8 else 2) + 4.0 * s["M"],
    ),
    error=quantize_per_token_error,
    differentiable=False,
    category="quant",
)


# --------------------------------------------------------------------------- quant_linear
def _integer_group_sums(xq: torch.Tensor, wq: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Exact sum_{k in g} xq[m,k] wq[n,k] -> [M, N, G] (float64 holds these sums exactly)."""
    if not grouped:
        return (xq.to(torch.float64) @ wq.to(torch.float64).T)[..., None]
    xg, _ = group_view(xq.to(torch.float64))
    wg, _ = group_view(wq.to(torch.float64))
    return torch.einsum("mgk,ngk->mng", xg, wg)


def quant_linear_ref(x, w_packed, w_scale, scheme, bias=None):
    sc = get_scheme(scheme, "quant_linear")
    acc = acc_of(x)
    K = x.shape[1]
    if sc.act_bits is None:
        w = unpack(w_packed, sc, K).to(acc) * w_scale.to(acc)[:, None]
        y = x.to(acc) @ w.T
    else:
        xq, sx = quantize_per_token_ref(x, sc.act_bits)
        wq = unpack(w_packed, sc, K)
        isum = _integer_group_sums(xq, wq, sc.grouped).to(acc)
        sw = w_scale.to(acc) if sc.grouped else w_scale.to(acc)[:, None]
        y = sx.to(acc)[:, None] * (isum * sw[None]).sum(-1)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def act_codes(x: torch.Tensor, bits: int, ex: torch.Tensor | float = 0.0):
    """(codes, scale, dequantized, error of the dequantized activation) of per-token
    quantization of ``x`` [M, K] (float64 values a kernel holds up to an absolute error ``ex``).

    A code moves where the quotient x/s, perturbed by x's error and by the scale's (amax moves
    by at most max ex), lies within that perturbation (plus QUOTIENT_ULPS fp32 ulps) of a half:
    there the dequantized value may be a whole step s off. Where no code moves, s q still moves
    with s: |q| ds."""
    xq, sx = quantize_per_token_ref(x, bits)
    qf, s = xq.to(torch.float64), sx.to(torch.float64)[:, None]
    ex = torch.broadcast_to(torch.as_tensor(ex, dtype=torch.float64), x.shape)
    amax = x.abs().amax(-1, keepdim=True)
    zero = amax == 0  # s = 1, codes 0; a kernel's row of tiny values dequantizes to itself
    ds = torch.where(zero, 0.0, s * ex.amax(-1, keepdim=True) / amax.clamp(min=1e-300))
    quot = x / s
    window = (ex + x.abs() * ds / s) / s + QUOTIENT_ULPS * U32 * quot.abs()
    moved = fragile_codes(quot, window, power_of_two(s) & (ex == 0))
    err = qf.abs() * ds + torch.where(moved, s + ex, torch.zeros_like(x))
    err = torch.where(zero, ex, err)
    return qf, s, qf * s, err


def quant_linear_error(o, r, work):
    """y, float activations (w8a16): the dequantized weight (code * scale, one fp32 product) may
    be rounded to the working dtype before the GEMM (mid |x||W|), fp32 sum over K (acc
    sqrt(K) |x||W|), y before the bias may be rounded (mid). Quantized activations (w8a8,
    w4a8, w6a12): the integer sums are exact and the codes equal the oracle's except the
    fragile ones (act_codes: a step each, through |W|); the scale products and group sums are
    fp32 (acc sqrt(K) s_x |q||W|)."""
    return {"y": _ql_terms(o["x"], 0.0, o["w_packed"], o["w_scale"], o["scheme"], r[0],
                           o["bias"] is not None, work)}


def _ql_terms(x, ex, w_packed, w_scale, scheme, y, has_bias, work) -> ErrorTerms:
    sc = get_scheme(scheme, "quant_linear")
    K = x.shape[-1]
    w = dequantize_weight(w_packed, w_scale, scheme, K).to(torch.float64)
    wa, w2 = w.abs().T, w.pow(2).T
    ex = torch.broadcast_to(torch.as_tensor(ex, dtype=torch.float64), x.shape)
    yb = y.abs() if has_bias else 0.0

    def through(e: torch.Tensor) -> torch.Tensor:  # independent errors of the K inputs
        return carry(ErrorTerms(step=e), x.shape, lambda v: v @ wa, lambda v2: v2 @ w2).step

    if sc.act_bits is None:
        mag = x.abs() @ wa
        # the dequantized weight rounded to the working dtype: K independent roundings
        wround = torch.minimum(mag, LAMBDA * torch.sqrt(x.pow(2) @ w2))
        return ErrorTerms(mid=wround + yb, acc=sqrt_n(K) * mag + y.abs(), step=through(ex))
    qf, s, deq, err = act_codes(x, sc.act_bits, ex)
    return ErrorTerms(mid=yb, acc=sqrt_n(K) * (deq.abs() @ wa) + y.abs(), step=through(err))


def check_packed_weight(op: str, prefix: str, packed, scale, scheme: str, N: int, K: int) -> None:
    """Shape/dtype rules of a canonical packed weight [.., N, P] with its scales."""
    sc = get_scheme(scheme, op)
    lead = tuple(packed.shape[:-2])
    require(packed.dtype == sc.weight_dtype(), op, f"{prefix}packed",
            f"dtype {sc.weight_dtype()} for scheme {scheme}", packed.dtype)
    want = lead + (N, sc.packed_k(K))
    require(tuple(packed.shape) == want, op, f"{prefix}packed",
            f"shape {list(want)} for scheme {scheme} with K={K}", list(packed.shape))
    want_s = lead + sc.scale_shape(N, K)
    require(tuple(scale.shape) == want_s, op, f"{prefix}scale",
            f"shape {list(want_s)} for scheme {scheme}", list(scale.shape))


def _ql_check(a, s) -> None:
    check_packed_weight("quant_linear", "w_", a["w_packed"], a["w_scale"], a["scheme"],
                        s["N"], s["K"])


def _ql_cost(a, s):
    sc = SCHEMES[a["scheme"]]
    M, N, K = s["M"], s["N"], s["K"]
    wbytes = N * sc.packed_k(K) + 4.0 * a["w_scale"].numel()
    return 2.0 * M * N * K, tensor_bytes(a["x"]) * (1 + N / max(K, 1)) + wbytes


QUANT_LINEAR = OpDef(
    name="quant_linear",
    summary="y = x W^T with W in a quantized scheme (w8a16 / w8a8 / w4a8 / w6a12)",
    params=(
        TensorArg("x", ("M", "K")),
        TensorArg("w_packed", ("N", "P"), PACKED_DTYPES),
        TensorArg("w_scale", None, SCALE_DTYPES),
        scalar("scheme", str, choices=SCHEME_NAMES),
        TensorArg("bias", ("N",), FLOAT_DTYPES, optional=True),
    ),
    outputs=(OutArg("y", ("M", "N"), "like:x"),),
    reference=quant_linear_ref,
    cost=_ql_cost,
    error=quant_linear_error,
    check=_ql_check,
    category="quant",
)


# --------------------------------------------------------------------------- moe_experts_quant
def moe_experts_quant_ref(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale, scheme):
    acc = acc_of(x)
    T, D = x.shape
    y = torch.zeros(T, D, dtype=acc, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = quant_linear_ref(x[t], w13_packed[e], w13_scale[e], scheme)
        i = h.shape[-1] // 2
        hf = h.to(acc)
        h = (F.silu(hf[:, :i]) * hf[:, i:]).to(x.dtype)
        out = quant_linear_ref(h, w2_packed[e], w2_scale[e], scheme).to(acc)
        y.index_add_(0, t, out * weights[t, j].to(acc)[:, None])
    return y.to(x.dtype)


def moe_experts_quant_decompose(ops, x, ids, weights, w13_packed, w13_scale, w2_packed,
                                w2_scale, scheme):
    T, D = x.shape
    acc = acc_of(x)
    y = torch.zeros(T, D, dtype=acc, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = ops.silu_mul(ops.quant_linear(x[t], w13_packed[e], w13_scale[e], scheme))
        out = ops.quant_linear(h, w2_packed[e], w2_scale[e], scheme).to(acc)
        y.index_add_(0, t, out * weights[t, j].to(acc)[:, None])
    return y.to(x.dtype)


def moe_experts_quant_error(o, r, work):
    """y: moe_experts' chain (expert_chain_error) with quant_linear's terms for each projection;
    the w2 projection quantizes the activation silu_mul produced, which a kernel holds only up
    to that activation's own error (its rounding to the working dtype included), so codes
    within that error of a half may move a step (act_codes)."""
    x, scheme = o["x"], o["scheme"]

    def up(xr, e):
        h = quant_linear_ref(xr, o["w13_packed"][e], o["w13_scale"][e], scheme)
        eh = _ql_terms(xr, 0.0, o["w13_packed"][e], o["w13_scale"][e], scheme, h, False, work)
        return h, eh + ErrorTerms(mid=h.abs())

    def down(g, eg, e):
        out = quant_linear_ref(g, o["w2_packed"][e], o["w2_scale"][e], scheme)
        t = _ql_terms(g, eg.absolute(work), o["w2_packed"][e], o["w2_scale"][e], scheme, out,
                      False, work)
        return out, t + ErrorTerms(mid=out.abs())

    return {"y": expert_chain_error(x, o["ids"], o["weights"], up, down)}


def _meq_check(a, s) -> None:
    op = "moe_experts_quant"
    sc = get_scheme(a["scheme"], op)
    # I from the w2 packed width is ambiguous for packed schemes; take it from w13's rows.
    E, D = s["E"], s["D"]
    require(a["w13_packed"].shape[1] % 2 == 0, op, "w13_packed", "an even row count 2*I",
            list(a["w13_packed"].shape))
    I = a["w13_packed"].shape[1] // 2
    check_packed_weight(op, "w13_", a["w13_packed"], a["w13_scale"], a["scheme"], 2 * I, D)
    check_packed_weight(op, "w2_", a["w2_packed"], a["w2_scale"], a["scheme"], D, I)
    require(a["w13_packed"].shape[0] == E and a["w2_packed"].shape[0] == E, op, "w2_packed",
            f"{E} experts like w13_packed", a["w2_packed"].shape[0])
    check_index_range(op, "ids", a["ids"], 0, E, "(experts; -1 = skip)")
    del sc


def _meq_cost(a, s):
    sc = SCHEMES[a["scheme"]]
    T, k, D = s["T"], s["k"], s["D"]
    I = a["w13_packed"].shape[1] // 2
    touched = min(s["E"], T * k)
    scales = 4.0 * (a["w13_scale"].numel() + a["w2_scale"].numel()) / max(s["E"], 1)
    wbytes = touched * (2 * I * sc.packed_k(D) + D * sc.packed_k(I) + scales)
    return T * k * (6.0 * D * I + 4.0 * I), tensor_bytes(a["x"]) * 2 + wbytes + 8.0 * T * k


MOE_EXPERTS_QUANT = OpDef(
    name="moe_experts_quant",
    summary="moe_experts with w13 and w2 in a quantized scheme (quant_linear inside)",
    params=(
        TensorArg("x", ("T", "D")),
        TensorArg("ids", ("T", "k"), INDEX_DTYPES),
        TensorArg("weights", ("T", "k"), FLOAT_DTYPES),
        TensorArg("w13_packed", ("E", "N13", "P13"), PACKED_DTYPES),
        TensorArg("w13_scale", None, SCALE_DTYPES),
        TensorArg("w2_packed", ("E", "D", "P2"), PACKED_DTYPES),
        TensorArg("w2_scale", None, SCALE_DTYPES),
        scalar("scheme", str, choices=SCHEME_NAMES),
    ),
    outputs=(OutArg("y", ("T", "D"), "like:x"),),
    reference=moe_experts_quant_ref,
    cost=_meq_cost,
    error=moe_experts_quant_error,
    check=_meq_check,
    decompose=moe_experts_quant_decompose,
    category="quant",
)

OPS = (QUANTIZE_PER_TOKEN, QUANT_LINEAR, MOE_EXPERTS_QUANT)
__all__ = ["OPS", "dequantize_weight", "GROUP", "n_groups"]
