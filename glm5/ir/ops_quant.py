"""Quantization ops: quantize_per_token, quant_linear, moe_experts_quant (composite).

Formats (packing, scales, rounding) live in :mod:`glm5.ir.quant_formats`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.opdef import OpDef, check_index_range, require
from glm5.ir.ops_norm import _bytes, acc_of
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
        _bytes(a["x"]) + a["x"].numel() * (1 if a["bits"] == 8 else 2) + 4.0 * s["M"],
    ),
    tolerance="quant",
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
    return 2.0 * M * N * K, _bytes(a["x"]) * (1 + N / max(K, 1)) + wbytes


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
    tolerance="quant",
    reduce_len=lambda a, s: s["K"],
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
    return T * k * (6.0 * D * I + 4.0 * I), _bytes(a["x"]) * 2 + wbytes + 8.0 * T * k


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
    tolerance="quant",
    reduce_len=lambda a, s: max(s["D"], a["w13_packed"].shape[1] // 2),
    check=_meq_check,
    decompose=moe_experts_quant_decompose,
    category="quant",
)

OPS = (QUANTIZE_PER_TOKEN, QUANT_LINEAR, MOE_EXPERTS_QUANT)
__all__ = ["OPS", "dequantize_weight", "GROUP", "n_groups"]
