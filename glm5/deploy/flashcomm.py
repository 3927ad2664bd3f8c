"""What a tensor-parallel group's reduction costs, done as a plain all-reduce or as FlashComm
(reduce-scatter, residual + norm on 1/N of the tokens, all-gather; bf16 or int8 gathers), and
the token count from which FlashComm wins (`flashcomm_threshold`): the planner prices layouts
with it and `glm5.parallel` decides, per forward, which way to reduce from it.

Link bytes are the ``glm5.ir.ops_comm`` costs; times are the chip's (`glm5.deploy.chips`)
collective latency + bytes / per-direction link bandwidth, and the roofline of the work after
the reduction (`glm5.deploy.costs`)."""

from __future__ import annotations

from typing import Any

import torch

from glm5.deploy.chips import Chip
from glm5.deploy.costs import OpCost, meta_tensor, op_cost, plan_error
from glm5.ir.ops_comm import SCALE_BYTES, get_comm_op

#: ``--comm``: how a TP group sums its partial outputs (``auto`` picks between the first two)
COMM_OPTIONS = ("allreduce", "flashcomm", "flashcomm-int8")
COMM_CHOICES = (*COMM_OPTIONS, "auto")
#: the threshold search gives up past this many tokens per TP group (FlashComm never wins)
THRESHOLD_MAX_TOKENS = 2 ** 40


def link_bytes(op: str, rows: float, width: int, n: int, dtype: torch.dtype = torch.bfloat16,
               **attrs: Any) -> float:
    """Bytes one device sends in the collective ``op`` (the ``glm5.ir.ops_comm`` cost) of its
    ``[rows, width]`` input of ``dtype`` (bf16 unless told: the model's activations) over ``n``
    devices: all_reduce 2 (n-1)/n B, reduce_scatter (n-1)/n B (B = the whole input each device
    holds), all_gather (n-1) B of its shard (``quant="int8"``: (n-1) (numel + 4 rows), whatever
    ``dtype``); 0 when n is 1."""
    return 0.0 if n <= 1 else get_comm_op(op).link_bytes((rows, width), dtype, n, **attrs)


def all_to_all_link_bytes(nbytes: float, n: int) -> float:
    """Bytes one device sends exchanging ``nbytes`` spread evenly over ``n`` devices (the
    ``all_to_all`` op's cost with equal send counts; uniform routing makes them equal on
    average, and fractional, so the counts are not passed): the 1/n kept local never crosses a
    link: (n-1)/n * nbytes."""
    return 0.0 if n <= 1 else (n - 1) / n * nbytes


def collective_seconds(sent_bytes: float, chip: Chip) -> float:
    """One collective: the chip's fixed per-collective latency + the bytes one device sends over
    the per-direction link bandwidth."""
    return chip.collective_latency_us * 1e-6 + sent_bytes / (chip.link_gbs_per_direction * 1e9)


def padded_tokens(tokens: int, n: int) -> int:
    """Tokens after padding to a multiple of ``n`` (FlashComm's reduce-scatter splits the token
    axis n ways)."""
    return -(-tokens // n) * n


def int8_rows_bytes(rows: int, width: int) -> int:
    """Bytes of ``rows`` int8 rows of ``width`` with one fp32 scale per row."""
    return rows * width + SCALE_BYTES * rows


def _check_comm(option: str, where: str) -> None:
    if option not in COMM_OPTIONS:
        raise plan_error(where, f"one of {', '.join(COMM_OPTIONS)}", option)


def tp_collectives(hidden: int, tp: int, tokens: int, option: str,
                   dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, float]]:
    """(collective, link bytes one device sends) of one place where a TP group of ``tp`` sums
    its partial ``[tokens, hidden]`` outputs (bf16 unless ``dtype`` says otherwise), done the
    ``option`` way, in the order the model issues them (glm5.parallel.layouts: FlashComm's
    reduce-scatter ends one sub-layer, its all-gather feeds the next):

    * allreduce: one all-reduce of tokens * hidden * 2 bytes;
    * flashcomm: a reduce-scatter of the padded ``[P, hidden]`` (P = tokens padded to a multiple
      of tp), then an all-gather of the normed ``[P, hidden]`` bf16 before the next
      column-parallel linear;
    * flashcomm-int8: the same reduce-scatter in bf16 (a reduction sums partial sums: int8 there
      would re-quantize at every ring step), and the all-gather of int8 codes + one fp32 scale
      per token: P * hidden + 4 P bytes.
    """
    _check_comm(option, "comm")
    if tp <= 1:
        return []
    if option == "allreduce":
        return [("all_reduce", link_bytes("all_reduce", tokens, hidden, tp, dtype))]
    P = padded_tokens(tokens, tp)
    quant = None if option == "flashcomm" else "int8"
    return [("reduce_scatter", link_bytes("reduce_scatter", P, hidden, tp, dtype)),
            ("all_gather", link_bytes("all_gather", P // tp, hidden, tp, dtype, quant=quant))]


def sync_ops(hidden: int, eps: float, tp: int, tokens: int, option: str, norm_label: str,
             count: float = 1.0) -> list[OpCost]:
    """The device work between a TP reduction and the next column-parallel linear: the residual
    add ([t, hidden] + [t, hidden] -> [t, hidden] bf16: t * hidden flops, 3 * 2 t * hidden bytes)
    and the RMSNorm (its OpDef cost), on t = ``tokens`` rows (all-reduce; also tp 1 or
    ``option`` "none") or on this device's shard t = P / tp of the padded tokens (FlashComm).
    With int8 communication also the per-token quantization of the shard (the
    ``quantize_per_token`` OpDef) and the dequantization of the gathered [P, hidden] (read
    codes + scales, write bf16: P * hidden flops)."""
    if option != "none":
        _check_comm(option, "comm")
    shard = tp > 1 and option != "allreduce" and option != "none"
    P = padded_tokens(tokens, tp) if shard else tokens
    t = P // tp if shard else tokens
    D = hidden
    f, b = op_cost("rms_norm", x=meta_tensor(t, D), weight=meta_tensor(D), eps=eps)
    ops = [OpCost("residual_add", "add", float(t * D), 6.0 * t * D, "bf16", count),
           OpCost(norm_label, "rms_norm", f, b, "bf16", count)]
    if shard and option == "flashcomm-int8":
        f, b = op_cost("quantize_per_token", x=meta_tensor(t, D), bits=8)
        ops.append(OpCost("comm_quant_int8", "quantize_per_token", f, b, "bf16", count))
        ops.append(OpCost("comm_dequant_int8", "dequant", float(P * D),
                          float(int8_rows_bytes(P, D) + 2 * P * D), "bf16", count))
    return ops


def sync_point(chip: Chip, hidden: int, eps: float, tp: int, tokens: int,
               option: str) -> dict[str, Any]:
    """One TP reduction point done the ``option`` way, as one device sees it: its collectives,
    their link bytes and time, the residual/norm work after it (:func:`sync_ops`), and the
    residual-stream bytes a device holds ([t, hidden] bf16: t = tokens, or the shard)."""
    coll = tp_collectives(hidden, tp, tokens, option)
    work = sync_ops(hidden, eps, tp, tokens, option, "norm")
    comm_s = sum(collective_seconds(lb, chip) for _, lb in coll)
    work_s = sum(o.seconds(chip) for o in work)
    shard = tp > 1 and option != "allreduce"
    rows = padded_tokens(tokens, tp) // tp if shard else tokens
    return {
        "collectives": [c for c, _ in coll],
        "link_bytes": float(sum(lb for _, lb in coll)),
        "comm_us": comm_s * 1e6,
        "work_flops": sum(o.flops for o in work),
        "work_bytes": sum(o.bytes for o in work),
        "work_us": work_s * 1e6,
        "total_us": (comm_s + work_s) * 1e6,
        "norm_tokens": rows,
        "residual_bytes": 2.0 * rows * hidden,
    }


PER_POINT_SUMS = ("link_bytes", "comm_us", "work_flops", "work_bytes", "work_us", "total_us")
_THRESHOLDS: dict[tuple[Any, ...], int | None] = {}


def flashcomm_threshold(chip: Chip, hidden: int, tp: int, option: str = "flashcomm",
                        eps: float = 1e-5) -> int | None:
    """The token count per TP group from which ``option`` (FlashComm, bf16 or int8) is never
    slower than a plain all-reduce at one reduction point (collectives + the residual/norm work
    after them, :func:`sync_point`); None when tp is 1 or it is slower up to
    THRESHOLD_MAX_TOKENS tokens.

    Why a threshold: FlashComm launches two collectives instead of one (one more latency) and
    pads the tokens to a multiple of tp, and wins back (1 - 1/tp) of the residual add + norm
    work (and, with int8, half the gathered bytes less the quantize/dequantize work), all in
    proportion to the tokens. Within a block of tp token counts sharing one padded size the
    FlashComm time is flat and the all-reduce time grows, and from block to block the
    difference falls, so the last losing token count is found by two binary searches.
    """
    if option not in ("flashcomm", "flashcomm-int8"):
        raise plan_error("option", "'flashcomm' or 'flashcomm-int8'", option)
    if tp <= 1:
        return None
    key = (chip.name, chip.hbm_gbs, chip.bf16_tflops, chip.link_gbs_per_direction,
           chip.collective_latency_us, hidden, tp, option)
    if key in _THRESHOLDS:
        return _THRESHOLDS[key]

    def loses(T: int) -> bool:  # FlashComm strictly slower than the all-reduce at T tokens
        fc = sync_point(chip, hidden, eps, tp, T, option)["total_us"]
        return fc > sync_point(chip, hidden, eps, tp, T, "allreduce")["total_us"]

    def first(k: int) -> int:  # first token count of block k (padded size k * tp)
        return (k - 1) * tp + 1

    out: int | None
    if not loses(1):
        out = 1
    else:
        lo, hi = 1, 2  # loses(first(lo)); look for a block whose first count wins
        while loses(first(hi)):
            lo, hi = hi, hi * 2
            if first(hi) > THRESHOLD_MAX_TOKENS:
                _THRESHOLDS[key] = None
                return None
        while hi - lo > 1:  # last losing block
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if loses(first(mid)) else (lo, mid)
        a, b = first(lo), lo * tp  # last losing token count inside block lo
        while a < b:
            mid = (a + b + 1) // 2
            a, b = (mid, b) if loses(mid) else (a, mid - 1)
        out = a + 1
    _THRESHOLDS[key] = out
    return out


def choose_comm(comm: str, tp: int, tokens: int, threshold: int | None) -> str:
    """The option a phase uses: "none" at tp 1; ``auto`` = FlashComm (bf16) from ``threshold``
    tokens per TP group on, else all-reduce; otherwise ``comm`` as given."""
    if comm not in COMM_CHOICES:
        raise plan_error("comm", f"one of {', '.join(COMM_CHOICES)}", comm)
    if tp <= 1:
        return "none"
    if comm == "auto":
        return "flashcomm" if threshold is not None and tokens >= threshold else "allreduce"
    return comm
