"""MoE ops: moe_route (sigmoid + correction bias + optional groups) and moe_experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.opdef import OpDef, check_index_range, require
from glm5.ir.ops_norm import _bytes, acc_of
from glm5.ir.signature import FLOAT_DTYPES, FP32_DTYPES, INDEX_DTYPES, OutArg, TensorArg, scalar


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, descending, ties to the smaller index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


# --------------------------------------------------------------------------- moe_route
def moe_route_scores(logits, bias, n_group, topk_group):
    """(s = sigmoid(logits), sel = s + bias with dropped groups at -inf), in the acc dtype."""
    acc = acc_of(logits)
    s = torch.sigmoid(logits.to(acc))
    sel = s + bias.to(acc)
    if n_group > 1:
        T, E = sel.shape
        grouped = sel.reshape(T, n_group, E // n_group)
        gscore = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
        keep = _stable_topk(gscore, topk_group)
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, keep, True)
        sel = grouped.masked_fill(~gmask[..., None], float("-inf")).reshape(T, E)
    return s, sel


def route_weights(s, ids, norm_topk_prob, routed_scaling):
    """weights = s[ids], normalised by (sum + 1e-20) if asked, times routed_scaling."""
    w = torch.gather(s, 1, ids.long())
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling


def moe_route_ref(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling):
    s, sel = moe_route_scores(logits, bias, n_group, topk_group)
    ids = _stable_topk(sel, top_k)
    return route_weights(s, ids, norm_topk_prob, routed_scaling), ids.to(torch.int32)


def _route_check(a, s) -> None:
    E, k, ng, tg = s["E"], a["top_k"], a["n_group"], a["topk_group"]
    require(E % ng == 0, "moe_route", "n_group", f"a divisor of E={E}", ng)
    if ng > 1:
        require(E // ng >= 2, "moe_route", "n_group", "groups of at least 2 experts", ng)
        require(tg <= ng, "moe_route", "topk_group", f"<= n_group={ng}", tg)
    cap = E if ng <= 1 else tg * (E // ng)
    require(k <= cap, "moe_route", "top_k", f"<= {cap} experts reachable", k)


MOE_ROUTE = OpDef(
    name="moe_route",
    summary="sigmoid router with correction bias, optional group limit, normalised and scaled",
    params=(
        TensorArg("logits", ("T", "E"), FP32_DTYPES),
        TensorArg("bias", ("E",), FP32_DTYPES),
        scalar("top_k", int, minimum=1),
        scalar("n_group", int, minimum=1),
        scalar("topk_group", int, minimum=1),
        scalar("norm_topk_prob", bool),
        scalar("routed_scaling", float),
    ),
    outputs=(
        OutArg("weights", lambda s, a: (s["T"], a["top_k"]), "acc"),
        OutArg("ids", lambda s, a: (s["T"], a["top_k"]), torch.int32, differentiable=False),
    ),
    reference=moe_route_ref,
    cost=lambda a, s: (
        6.0 * s["T"] * s["E"],
        _bytes(a["logits"], a["bias"]) + 8.0 * s["T"] * a["top_k"],
    ),
    tolerance="selection",
    reduce_len=lambda a, s: a["top_k"],
    check=_route_check,
    selection=True,
    category="moe",
)


# --------------------------------------------------------------------------- moe_experts
def moe_experts_ref(x, ids, weights, w13, w2):
    acc = acc_of(x)
    T, D = x.shape
    y = torch.zeros(T, D, dtype=acc, device=x.device)
    xf = x.to(acc)
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h = F.linear(xf[t], w13[e].to(acc))
        i = h.shape[-1] // 2
        h = F.silu(h[:, :i]) * h[:, i:]
        out = F.linear(h, w2[e].to(acc))
        y.index_add_(0, t, out * weights[t, j].to(acc)[:, None])
    return y.to(x.dtype)


def _experts_check(a, s) -> None:
    require(a["w13"].dtype == a["x"].dtype and a["w2"].dtype == a["x"].dtype, "moe_experts",
            "w13", f"weights of the dtype of x ({a['x'].dtype})", f"{a['w13'].dtype}/{a['w2'].dtype}")
    check_index_range("moe_experts", "ids", a["ids"], 0, s["E"], "(experts; -1 = skip)")


def _experts_cost(a, s, wbytes: float):
    T, k, D, I = s["T"], s["k"], s["D"], s["I"]
    routed = T * k
    return (
        routed * (2.0 * D * 2 * I + 2.0 * I * D + 4.0 * I),
        _bytes(a["x"]) * 2 + wbytes + 8.0 * routed,
    )


MOE_EXPERTS = OpDef(
    name="moe_experts",
    summary="y[t] = sum_j weights[t,j] w2[e] silu_mul(w13[e] x[t]), e = ids[t,j]; -1 skipped",
    params=(
        TensorArg("x", ("T", "D")),
        TensorArg("ids", ("T", "k"), INDEX_DTYPES),
        TensorArg("weights", ("T", "k"), FLOAT_DTYPES),
        TensorArg("w13", ("E", "2*I", "D")),
        TensorArg("w2", ("E", "D", "I")),
    ),
    outputs=(OutArg("y", ("T", "D"), "like:x"),),
    reference=moe_experts_ref,
    # Weight bytes: only the experts a batch can touch (min(E, T*k)) are read.
    cost=lambda a, s: _experts_cost(
        a, s, min(s["E"], s["T"] * s["k"]) * 3.0 * s["I"] * s["D"] * a["w13"].element_size()
    ),
    tolerance="matmul",
    reduce_len=lambda a, s: max(s["D"], s["I"]),
    check=_experts_check,
    category="moe",
)

OPS = (MOE_ROUTE, MOE_EXPERTS)
