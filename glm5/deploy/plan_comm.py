"""The planner's communication, collective by collective (`glm5 plan`; docs/planner.md): the
expert load of an EP rank, the all-to-alls of an MoE layer with data-parallel attention (uniform
or a measured routing), the activation-scale gathers of split quantized layers, one decoder
layer's collectives in the order the model (glm5.parallel.layouts) issues them
(:func:`layer_comm`; tests/test_plan_measured.py counts them while the model runs), and the
communication section of one phase of a plan (:func:`comm_section`). `glm5.deploy.plan`
re-exports every name."""

from __future__ import annotations

import math
from typing import Any

import torch

from glm5.core.config import GLM5Config
from glm5.core.quant_policy import is_quantized
from glm5.deploy.chips import Chip
from glm5.deploy.costs import plan_error
from glm5.deploy.flashcomm import (
    COMM_OPTIONS,
    PER_POINT_SUMS,
    all_to_all_link_bytes,
    collective_seconds,
    link_bytes,
    padded_tokens,
    sync_point,
    tp_collectives,
)
from glm5.ir.ops_comm import get_comm_op
from glm5.ir.quant_formats import SCHEMES, Scheme

def expert_load(E: int, k: int, tokens: int, ep: int) -> tuple[int, int]:
    """(routed token slots one expert-parallel rank serves, experts it touches), for ``tokens``
    tokens routed to k of E experts each, uniformly: slots = ceil(tokens k / ep); touched =
    ceil(E/ep * (1 - (1 - k/E)^tokens)) (the expected number of distinct experts hit), at most
    the slots."""
    slots = -(-tokens * k // ep)
    p_hit = 1.0 - (1.0 - k / E) ** tokens
    touched = min(slots, max(1, math.ceil(E / ep * p_hit - 1e-9)))
    return slots, touched


# --------------------------------------------------------------------------- per-layer comm
#: what the model's all-to-all MoE (glm5.parallel.layouts.ParallelMoE, data-parallel attention)
#: sends besides the hidden rows: first an all-to-all of one int64 pair count per rank (so every
#: rank knows what it receives), then, beside the dispatch of the rows, one of each pair's
#: int64 local expert id
A2A_COUNT_DTYPE = torch.int64
A2A_ID_DTYPE = torch.int64


def route_pairs(expert_ids: list[torch.Tensor], n_experts: int, ep: int) -> list[list[int]]:
    """The routing as the all-to-all sees it: ``M[s][r]`` = the (token, expert) pairs EP rank
    ``s`` sends rank ``r``, from ``expert_ids[s]`` (rank s's router output, [tokens, k] ints;
    -1 = an empty slot, not sent). Rank r owns experts [r E/ep, (r+1) E/ep)."""
    if ep <= 0 or n_experts % ep:
        raise plan_error("ep", f"a divisor of n_experts={n_experts}", ep)
    if len(expert_ids) != ep:
        raise plan_error("expert_ids", f"one tensor per EP rank ({ep})", len(expert_ids))
    per = n_experts // ep
    out = []
    for ids in expert_ids:
        e = torch.as_tensor(ids).reshape(-1).long()
        e = e[e >= 0]
        out.append(torch.bincount(e // per, minlength=ep).tolist())
    return out


def moe_all_to_alls(hidden: int, ep: int, tokens: int, k: int,
                    dtype: torch.dtype = torch.bfloat16, pairs: list[list[int]] | None = None,
                    rank: int = 0) -> list[tuple[str, float]]:
    """(collective, link bytes EP rank ``rank`` sends) of one MoE layer with data-parallel
    attention, in the model's order: the pair counts ([ep] int64, one to each rank), the
    dispatch of the hidden rows ([pairs, hidden] of ``dtype``), the pairs' local expert ids
    ([pairs] int64), the combine of the expert outputs (the dispatch reversed). Only rows for
    other ranks cross a link (the ``all_to_all`` op cost).

    ``pairs`` (`route_pairs`, a measured routing): the exact bytes of rank ``rank``.
    None: the planner's assumption: ``tokens`` tokens per rank, each to k experts spread
    uniformly over the ep ranks, (ep-1)/ep of the ``tokens * k`` rows off the device both ways
    (fractional in general)."""
    if ep <= 1:
        return []
    op = get_comm_op("all_to_all")
    counts = op.link_bytes((ep,), A2A_COUNT_DTYPE, ep, send_counts=[1] * ep, rank=rank)
    if pairs is None:
        rows = tokens * k
        isz, idsz = (torch.empty((), dtype=d).element_size() for d in (dtype, A2A_ID_DTYPE))
        x = all_to_all_link_bytes(rows * hidden * isz, ep)
        return [("all_to_all", counts), ("all_to_all", x),
                ("all_to_all", all_to_all_link_bytes(rows * idsz, ep)), ("all_to_all", x)]
    send = list(pairs[rank])
    recv = [pairs[s][rank] for s in range(ep)]
    return [("all_to_all", counts),
            ("all_to_all", op.link_bytes((sum(send), hidden), dtype, ep, send_counts=send,
                                         rank=rank)),
            ("all_to_all", op.link_bytes((sum(send),), A2A_ID_DTYPE, ep, send_counts=send,
                                         rank=rank)),
            ("all_to_all", op.link_bytes((sum(recv), hidden), dtype, ep, send_counts=recv,
                                         rank=rank))]


# Row-parallel linears of a layer that a split quantized model cuts by input columns (the TP
# group's o_proj and the MLP's down_proj — the dense MLP's or, in an MoE layer, the shared
# expert's; under EP with replicated tokens the shared expert's down_proj over the EP group).
ACT_SCALE_DTYPE = torch.float32  # each token's max |x|, all-gathered (glm5.parallel.layouts)
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                 "mlp.shared_experts.down_proj.weight")


def act_scale_gathers(scheme: str | Scheme | None, tp: int, ep: int, dp_attention: bool,
                      moe: bool) -> tuple[tuple[bool, ...], int]:
    """One layer's activation-scale all-gathers in a split quantized model: for each of the
    layer's reduction points (TP: after attention, after the MLP; EP with replicated tokens:
    after the MoE), whether its row-parallel linear gathers; and the group's size.

    A scheme that quantizes activations per token (w8a8, w4a8, w6a12) takes each token's scale
    from max |x| over the whole input width; a rank holding K/n of a row-parallel linear's
    columns all-gathers each token's partial max (one ``ACT_SCALE_DTYPE`` per token and rank)
    so that every part quantizes as the whole layer does (`RowParallelQuantLinear`). w8a16
    (float activations), float weights, and layers cut by rows or by expert gather nothing."""
    sc = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    if sc is None or sc.act_bits is None:
        return (), 1
    if tp > 1:  # o_proj, and the dense MLP's or the shared expert's down_proj
        names = (_ROW_PARALLEL[0], _ROW_PARALLEL[2] if moe else _ROW_PARALLEL[1])
        return tuple(is_quantized(f"model.layers.0.{n}") for n in names), tp
    if ep > 1 and moe and not dp_attention:  # the shared expert split over the EP group
        return (is_quantized(f"model.layers.0.{_ROW_PARALLEL[2]}"),), ep
    return (), 1


def layer_comm(cfg: GLM5Config, tp: int, ep: int, tokens: int, option: str = "allreduce", *,
               moe: bool, dp_attention: bool = False, last: bool = False,
               dtype: torch.dtype = torch.bfloat16, pairs: list[list[int]] | None = None,
               rank: int = 0, quant: str | Scheme | None = None) -> list[tuple[str, float]]:
    """(collective, link bytes one device sends) of one decoder layer, in the order the model
    (glm5.parallel.layouts) issues them, for ``tokens`` tokens on this device's group (the TP
    group's tokens; with data-parallel attention this rank's own):

    * tp > 1 (the routed experts split over the TP group, ep 1 or tp): the two TP reduction
      points (:func:`tp_collectives` done the ``option`` way: all-reduce, or FlashComm's
      all-gather before and reduce-scatter after each sub-layer), the MoE's partial sum
      reduced with the layer's; ``last`` adds FlashComm's gather of the residual stream (bf16
      always) at the end of a stack;
    * tp 1, ep > 1, replicated tokens: an all-reduce of the MoE layer's [tokens, hidden] output
      over the EP group (the shared expert split by columns, inside that sum);
    * tp 1, ep > 1, ``dp_attention``: :func:`moe_all_to_alls` of an MoE layer (``pairs`` /
      ``rank``: a measured routing, else the uniform assumption);
    * a dense layer under tp 1: nothing.

    ``dtype``: the activations' (the planner costs bf16; the CPU test model runs fp32).
    ``quant``: the weights' scheme; one that quantizes activations adds, before each reduction
    of a row-parallel quantized linear, the all-gather of each token's max |x|
    (:func:`act_scale_gathers`; ``tokens`` rows of one fp32 — under FlashComm the gathered,
    unpadded tokens the sub-layer runs on)."""
    if tp > 1 and ep not in (1, tp):
        raise plan_error("ep", f"1 or tp={tp} for the layouts the model runs (experts split "
                               f"over the TP group)", ep)
    if dp_attention and tp > 1:
        raise plan_error("dp_attention", "False with tp > 1", dp_attention)
    D = cfg.hidden_size
    gathers, g = act_scale_gathers(quant, tp, ep, dp_attention, moe)
    act = [("all_gather", link_bytes("all_gather", tokens, 1, g, ACT_SCALE_DTYPE))]

    def scale(point: int) -> list[tuple[str, float]]:
        return act if point < len(gathers) and gathers[point] else []

    if tp > 1:
        red = (tp_collectives(D, tp, tokens, option, dtype)[::-1] if option != "allreduce"
               else tp_collectives(D, tp, tokens, option, dtype))
        # the linear's own gather runs inside the sub-layer: after FlashComm's all-gather of
        # its input, before the reduction of its output
        out = [c for i in range(2) for c in red[:-1] + scale(i) + red[-1:]]
        if last and option != "allreduce":
            out.append(("all_gather", link_bytes("all_gather", padded_tokens(tokens, tp) // tp,
                                                 D, tp, dtype)))
        return out
    if ep <= 1 or not moe:
        return []
    if not dp_attention:
        return scale(0) + [("all_reduce", link_bytes("all_reduce", tokens, D, ep, dtype))]
    return moe_all_to_alls(D, ep, tokens, cfg.num_experts_per_tok, dtype, pairs, rank)


def comm_section(cfg: GLM5Config, chip: Chip, lay: Any, tokens: int, global_tokens: int,
                 layer_counts: dict[str, list[int]], stacks_extra: int, option: str,
                 thresholds: dict[str, int | None],
                 scheme: Scheme | None = None) -> dict[str, Any]:
    """Communication of one phase per layer kind ('dense', 'moe', 'mtp') under ``lay`` (a
    `glm5.deploy.plan.Layout`): for each TP option
    the per-layer figures of its two reduction points (:func:`sync_point`, doubled), the EP
    dispatch + combine of an MoE layer, and the phase totals for the chosen ``option``.

    EP (only where ep > tp: the EP group spans attention groups; with ep <= tp the MoE output
    is summed by the TP reduction): with data-parallel attention each device sends the hidden
    states of its share of its group's tokens (tokens / tp) to their k experts and gets them
    back, as the model does (:func:`moe_all_to_alls`: the pair counts, the dispatch, the pairs'
    expert ids, the combine; uniform routing); with replicated tokens (``lay.dp_attention``
    False, tp 1) an all-reduce of the MoE output over the EP group. FlashComm also gathers the
    residual stream once at the end of each stack (the main layers, each MTP block): one bf16
    all-gather each. A ``scheme`` that quantizes activations adds the row-parallel linears'
    activation-scale all-gathers (:func:`act_scale_gathers`) to the TP figures (or, EP with
    replicated tokens, to the EP all-reduce's).
    """
    D, tp, ep = cfg.hidden_size, lay.tp, lay.ep
    eps = cfg.rms_norm_eps
    per_opt = {}
    for o in COMM_OPTIONS:
        pt = sync_point(chip, D, eps, tp, tokens, o)
        # two reduction points per layer (after o_proj, after the MLP): the sums double
        per_opt[o] = {**pt, "collectives": pt["collectives"] * 2,
                      **{k: 2 * pt[k] for k in PER_POINT_SUMS}}
    # EP communication of an MoE layer beyond the TP reduction: only when the EP group spans
    # several attention groups (ep > tp). With ep <= tp the experts are split over the TP group,
    # whose ranks hold the same tokens: the MoE's partial output is summed by the layer's TP
    # reduction, already counted (the model issues no all-to-all there).
    a2a = ep_ar = None
    if ep > tp and lay.dp_attention:
        # each device dispatches its share of its attention group's tokens
        coll = moe_all_to_alls(D, ep, tokens / tp, cfg.num_experts_per_tok)
        a2a = {"collectives": [c for c, _ in coll], "link_bytes": sum(b for _, b in coll),
               "us": sum(collective_seconds(b, chip) for _, b in coll) * 1e6}
    elif ep > tp:  # replicated tokens (tp 1): the MoE output is all-reduced over the EP group
        b = link_bytes("all_reduce", tokens, D, ep)
        ep_ar = {"collectives": ["all_reduce"], "link_bytes": b,
                 "us": collective_seconds(b, chip) * 1e6}
    kinds = []
    tp_link = tp_s = ep_link = ep_s = ar_link = ar_s = 0.0
    act_link = act_s = 0.0
    for kind, (n, n_moe) in layer_counts.items():
        moe = n_moe > 0  # a kind's layers are all MoE or all dense (plan._kinds)
        gathers, g = act_scale_gathers(scheme, tp, ep, lay.dp_attention, moe)
        lb = link_bytes("all_gather", tokens, 1, g, ACT_SCALE_DTYPE)
        act = {"all_gathers": sum(gathers), "link_bytes": sum(gathers) * lb,
               "us": sum(gathers) * collective_seconds(lb, chip) * 1e6} if any(gathers) else None
        kinds.append({"kind": kind, "layers": n, "tp": per_opt if tp > 1 else None,
                      "ep_alltoall": a2a if n_moe else None,
                      "ep_allreduce": ep_ar if n_moe else None, "act_scale_gathers": act})
        if act is not None:
            act_link += n * act["link_bytes"]
            act_s += n * act["us"] * 1e-6
        if tp > 1:
            tp_link += n * per_opt[option]["link_bytes"]
            tp_s += n * per_opt[option]["comm_us"] * 1e-6
        if a2a is not None:
            ep_link += n_moe * a2a["link_bytes"]
            ep_s += n_moe * a2a["us"] * 1e-6
        if ep_ar is not None:
            ar_link += n_moe * ep_ar["link_bytes"]
            ar_s += n_moe * ep_ar["us"] * 1e-6
    if tp > 1:
        tp_link, tp_s = tp_link + act_link, tp_s + act_s
    else:
        ar_link, ar_s = ar_link + act_link, ar_s + act_s
    stack_end = None
    if tp > 1 and option in ("flashcomm", "flashcomm-int8"):
        lb = link_bytes("all_gather", padded_tokens(tokens, tp) // tp, D, tp)
        stack_end = {"all_gathers": 1 + stacks_extra, "link_bytes": (1 + stacks_extra) * lb,
                     "us": (1 + stacks_extra) * collective_seconds(lb, chip) * 1e6}
        tp_link += stack_end["link_bytes"]
        tp_s += stack_end["us"] * 1e-6
    return {
        "option": option,
        "tokens_per_tp_group": tokens,
        "padded_tokens": padded_tokens(tokens, tp),
        "thresholds": thresholds,
        "kinds": kinds,
        "stack_end_gather": stack_end,
        "tp_link_bytes": tp_link,
        "tp_ms": tp_s * 1e3,
        "ep_link_bytes": ep_link,
        "ep_ms": ep_s * 1e3,
        "ep_allreduce_link_bytes": ar_link,
        "ep_allreduce_ms": ar_s * 1e3,
        "act_scale_link_bytes": act_link,  # included in the tp (or ep all-reduce) figures
        "act_scale_ms": act_s * 1e3,
    }
