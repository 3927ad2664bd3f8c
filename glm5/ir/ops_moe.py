"""MoE ops: moe_route (sigmoid + correction bias + optional groups) and moe_experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm5.ir.numerics import (
    ErrorTerms,
    Selection,
    SelectionRows,
    bound,
    linear_error,
    near_ties,
    silu_mul_error,
    no_error,
)
from glm5.ir.opdef import OpDef, check_index_range, require
from glm5.ir.cost import tensor_bytes
from glm5.ir.ops_norm import acc_of
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


def _route_terms(logits: torch.Tensor, bias: torch.Tensor) -> ErrorTerms:
    """sigmoid in fp32 (exp, add, divide: 3 roundings) plus the bias add: acc on the selection
    score s + bias."""
    sg = torch.sigmoid(logits)
    return ErrorTerms(acc=3.0 * sg + (sg + bias).abs())


def _moe_route_rows(o, got, work) -> SelectionRows:
    """Sigmoid scores are computed by the kernel: experts (and groups) whose scores lie within
    the fp32 bound of each other may be ordered either way unless their inputs are identical
    (equal (logit, bias) pairs score equally in any kernel, and then the smaller id wins). A
    row without such near ties must equal the reference exactly. Otherwise: every selected
    expert's group must score within the bound of the topk_group-th group, and the experts must
    be the top-k (within the bound) over the groups the kernel evidently kept plus the groups
    every correct kernel keeps."""
    logits, bias = o["logits"], o["bias"]
    T, E = logits.shape
    ng, tg, k = o["n_group"], o["topk_group"], o["top_k"]
    s = torch.sigmoid(logits)
    sel = s + bias
    terms = _route_terms(logits, bias)
    b = bound(sel, terms, torch.float32, torch.float32)
    keys = torch.stack((logits, bias.expand(T, E)), dim=-1)
    exact = ~near_ties(sel, b, keys)
    ids = got["ids"].long()
    problems: list[tuple[int, str]] = []
    scores = sel.clone()
    if ng > 1:
        per = E // ng
        gs = sel.reshape(T, ng, per)
        top2, arg2 = torch.sort(gs, dim=-1, descending=True)
        gscore = top2[..., :2].sum(-1)
        gb = torch.gather(b.reshape(T, ng, per), 2, arg2[..., :2]).sum(-1)
        gkeys = torch.gather(keys.reshape(T, ng, per, 2), 2,
                             arg2[..., :2, None].expand(T, ng, 2, 2)).flatten(2)
        exact &= ~near_ties(gscore, gb, gkeys)
        kth, kpos = torch.sort(gscore, dim=-1, descending=True)
        for t in range(T):
            cut = float(kth[t, tg - 1])
            cut_b = float(gb[t, kpos[t, tg - 1]])
            chosen = torch.unique(ids[t][ids[t] >= 0] // per)
            if chosen.numel() > tg:
                problems.append((t, f"experts from {chosen.numel()} groups, topk_group={tg}"))
                continue
            weak = [int(g) for g in chosen if float(gscore[t, g]) < cut - (cut_b + float(gb[t, g]))]
            if weak:
                problems.append((t, f"expert of group {weak[0]} whose group score is below the "
                                    f"topk_group-th group's beyond the bound"))
            sure = gscore[t] > cut + gb[t] + cut_b  # kept by every correct kernel
            kept = sure.clone()
            kept[chosen[(chosen >= 0) & (chosen < ng)]] = True
            scores[t] = sel[t].reshape(ng, per).masked_fill(~kept[:, None], float("-inf")).reshape(E)
    w = route_weights(s, ids.clamp(min=0), o["norm_topk_prob"], o["routed_scaling"])
    return SelectionRows(scores, terms, k, exact, tuple(problems), {"weights": w})


def moe_route_error(o, r, work):
    """weights (fp32): the kernel's scores s[ids] (sigmoid: 3 fp32 roundings), their sum over
    top_k and the division when normalised, the scaling product: acc (top_k + 8) |w|."""
    return {"weights": ErrorTerms(acc=(o["top_k"] + 8.0) * r[0].abs())}


MOE_ROUTE_SELECTION = Selection(
    "ids", _moe_route_rows,
    "exact where no two distinct (logit, bias) pairs - or groups' top-2 pairs - score within "
    "the fp32 sigmoid bound of each other (ties to the smaller id); else by score within the "
    "bound, over the groups the kernel kept. weights are checked for the kernel's own ids")


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
        tensor_bytes(a["logits"], a["bias"]) + 8.0 * s["T"] * a["top_k"],
    ),
    error=moe_route_error,
    check=_route_check,
    selection=MOE_ROUTE_SELECTION,
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


def expert_chain_error(x, ids, weights, up, down):
    """The error chain of y = sum_j weights w2 silu_mul(w13 x) shared by moe_experts and
    moe_experts_quant: ``up(x_rows, e) -> (h, ErrorTerms)`` and ``down(g_rows, eg, e) -> (out,
    ErrorTerms)`` give each projection's value and error; silu_mul as in silu_mul (its result
    rounded to the working dtype); the expert outputs weighted and summed in fp32 over top_k
    (acc sqrt(k) sum_j |w o|); the input error of each stage carried through |W|."""
    T, D = x.shape
    k = ids.shape[1]
    mid = torch.zeros(T, D, dtype=torch.float64)
    acc, step = mid.clone(), mid.clone()
    mag = mid.clone()
    for e in torch.unique(ids[ids >= 0]).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        h, eh = up(x[t], e)
        i = h.shape[-1] // 2
        a, b = h[:, :i], h[:, i:]
        ea = eh.map(lambda z: torch.broadcast_to(z, h.shape)[:, :i])
        eb = eh.map(lambda z: torch.broadcast_to(z, h.shape)[:, i:])
        g = F.silu(a) * b
        eg = silu_mul_error(a, b, ea, eb)
        out, eo = down(g, eg, e)
        wt = weights[t, j].abs()[:, None]
        for dst, src in ((mid, eo.mid), (acc, eo.acc), (step, eo.step)):
            dst.index_add_(0, t, wt * torch.broadcast_to(
                torch.as_tensor(src, dtype=torch.float64), out.shape))
        mag.index_add_(0, t, wt * out.abs())
    return ErrorTerms(mid=mid, acc=acc + (k ** 0.5 + 1.0) * mag, step=step)


def moe_experts_error(o, r, work):
    """y: see expert_chain_error; each projection an fp32 sum over D (w13) or I (w2) whose
    result may be rounded to the working dtype."""
    x, w13, w2 = o["x"], o["w13"], o["w2"]

    def up(xr, e):
        h = F.linear(xr, w13[e])
        return h, linear_error(xr, no_error(), w13[e], h)

    def down(g, eg, e):
        out = F.linear(g, w2[e])
        return out, linear_error(g, eg, w2[e], out)

    return {"y": expert_chain_error(x, o["ids"], o["weights"], up, down)}


def _experts_check(a, s) -> None:
    require(a["w13"].dtype == a["x"].dtype and a["w2"].dtype == a["x"].dtype, "moe_experts",
            "w13", f"weights of the dtype of x ({a['x'].dtype})", f"{a['w13'].dtype}/{a['w2'].dtype}")
    check_index_range("moe_experts", "ids", a["ids"], 0, s["E"], "(experts; -1 = skip)")


def _experts_cost(a, s, wbytes: float):
    T, k, D, I = s["T"], s["k"], s["D"], s["I"]
    routed = T * k
    return (
        routed * (2.0 * D * 2 * I + 2.0 * I * D + 4.0 * I),
        tensor_bytes(a["x"]) * 2 + wbytes + 8.0 * routed,
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
    error=moe_experts_error,
    check=_experts_check,
    category="moe",
)

OPS = (MOE_ROUTE, MOE_EXPERTS)
