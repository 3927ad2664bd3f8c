"""DSA ops: lightning_indexer, topk_indices, indexer_topk (composite), indexer_topk_fp8
(indexer_topk on fp8-quantized q and k), paged_indexer_topk (composite: indexer_topk through a
paged key cache), paged_indexer_topk_fp8 (the same over an fp8 key cache), sparse_attention,
attention."""

from __future__ import annotations

import math

import torch

from glm5.ir.fp8 import dequantize_rows_e4m3, e4m3_rows
from glm5.ir.numerics import ErrorTerms, Selection, SelectionRows, sqrt_n
from glm5.ir.opdef import OpDef, check_index_range, has_data, require, value_checks
from glm5.ir.paging import pool_rows
from glm5.ir.cost import tensor_bytes
from glm5.ir.ops_norm import acc_of
from glm5.ir.signature import FLOAT_DTYPES, INDEX_DTYPES, OpInputError, OutArg, TensorArg, scalar


def check_ranges(op: str, k_start: torch.Tensor, k_end: torch.Tensor, S: int) -> None:
    """0 <= k_start[t] <= k_end[t] <= S (a value check: see `value_checks`)."""
    if k_start.numel() == 0 or not value_checks(k_start, k_end):
        return
    if bool((k_start < 0).any()):
        raise OpInputError(
            f"glm5.{op}: argument 'k_start' expected entries >= 0, got {int(k_start.min())}"
        )
    if bool((k_end > S).any()):
        raise OpInputError(
            f"glm5.{op}: argument 'k_end' expected entries <= S={S}, got {int(k_end.max())}"
        )
    bad = k_start > k_end
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise OpInputError(
            f"glm5.{op}: argument 'k_end' expected k_start[t] <= k_end[t], got "
            f"k_start[{t}]={int(k_start[t])} > k_end[{t}]={int(k_end[t])}"
        )


def range_mask(k_start: torch.Tensor, k_end: torch.Tensor, S: int) -> torch.Tensor:
    """[T, S] bool, True where k_start[t] <= s < k_end[t]. Reference-only helper."""
    s = torch.arange(S, device=k_start.device)
    return (s[None, :] >= k_start[:, None].long()) & (s[None, :] < k_end[:, None].long())


# --------------------------------------------------------------------------- lightning_indexer
def lightning_indexer_ref(q, k, w, k_start, k_end):
    acc = acc_of(q)
    dots = torch.einsum("thd,sd->ths", q.to(acc), k.to(acc))
    scores = torch.einsum("ths,th->ts", torch.relu(dots), w.to(acc))
    valid = range_mask(k_start, k_end, k.shape[0])
    return scores.masked_fill(~valid, float("-inf"))


def indexer_score_terms(q, k, w) -> ErrorTerms:
    """Scores (fp32 from inputs of any dtype): each dot q[t,h].k[s] is an fp32 sum over Di
    (acc sqrt(Di) sum_d |q k|), the weighted sum over heads another over Hi (acc sqrt(Hi)
    sum_h |w relu(dot)|). No rounding to the working dtype: the scores are fp32."""
    Hi, Di = q.shape[1], q.shape[2]
    dots = torch.einsum("thd,sd->ths", q, k)
    mag = torch.einsum("thd,sd,th->ts", q.abs(), k.abs(), w.abs())
    heads = torch.einsum("ths,th->ts", torch.relu(dots), w.abs())
    return ErrorTerms(acc=sqrt_n(Di) * mag + (sqrt_n(Hi) + 1.0) * heads)


def lightning_indexer_error(o, r, work):
    """scores: see indexer_score_terms."""
    return {"scores": indexer_score_terms(o["q"], o["k"], o["w"])}


def _ranges_check(op: str):
    """The op's check of k_start / k_end against S (`check_ranges`)."""
    def check(a, s) -> None:
        check_ranges(op, a["k_start"], a["k_end"], s["S"])

    return check


_INDEXER_PARAMS = (
    TensorArg("q", ("T", "Hi", "Di"), doc="indexer queries"),
    TensorArg("k", ("S", "Di"), doc="indexer keys (one head)"),
    TensorArg("w", ("T", "Hi"), doc="per-head weights, all scale factors folded in"),
    TensorArg("k_start", ("T",), INDEX_DTYPES, doc="first valid key per query"),
    TensorArg("k_end", ("T",), INDEX_DTYPES, doc="one past the last valid key per query"),
)


def _indexer_cost(a, s):
    T, S, H, D = s["T"], s["S"], s["Hi"], s["Di"]
    return (2.0 * T * S * H * D + 3.0 * T * S * H,
            tensor_bytes(a["q"], a["k"], a["w"]) + 4.0 * T * S)


LIGHTNING_INDEXER = OpDef(
    name="lightning_indexer",
    summary="scores[t,s] = sum_h w[t,h] relu(q[t,h].k[s]) on k_start<=s<k_end, else -inf",
    params=_INDEXER_PARAMS,
    outputs=(OutArg("scores", ("T", "S"), "acc"),),
    reference=lightning_indexer_ref,
    cost=_indexer_cost,
    error=lightning_indexer_error,
    check=_ranges_check("lightning_indexer"),
    category="dsa",
)


# --------------------------------------------------------------------------- topk_indices
def topk_indices_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    T, S = scores.shape
    finite = torch.isfinite(scores)
    keyed = scores.masked_fill(~finite, float("-inf"))
    # A stable descending sort puts equal scores in ascending index order: ties -> smaller index.
    vals, order = torch.sort(keyed, dim=-1, descending=True, stable=True)
    n = min(k, S)
    idx = order[:, :n].to(torch.int32)
    ok = torch.gather(finite, 1, order[:, :n])
    idx = idx.masked_fill(~ok, -1)
    if k > S:
        pad = torch.full((T, k - S), -1, dtype=torch.int32, device=scores.device)
        idx = torch.cat((idx, pad), dim=1)
    return idx


def _topk_rows(o, got, work) -> SelectionRows:
    """The scores are the input: any correct kernel compares them exactly, so every row must
    equal the reference (ties to the smaller index, -1 tail)."""
    sc = o["scores"]
    scores = sc.masked_fill(~torch.isfinite(sc), float("-inf"))
    return SelectionRows(scores, ErrorTerms(), o["k"],
                         torch.ones(sc.shape[0], dtype=torch.bool), score_dtype=sc.dtype)


TOPK_SELECTION = Selection(
    "idx", _topk_rows,
    "exact: the scores are inputs, so the order rule (descending, ties to the smaller index, "
    "-1 tail) is checked element for element")


TOPK_INDICES = OpDef(
    name="topk_indices",
    summary="k largest finite scores per row, descending, ties to the smaller index, -1 tail",
    params=(
        TensorArg("scores", ("T", "S"), FLOAT_DTYPES),
        scalar("k", int, minimum=1),
    ),
    outputs=(OutArg("idx", lambda s, a: (s["T"], a["k"]), torch.int32, differentiable=False),),
    reference=topk_indices_ref,
    cost=lambda a, s: (
        s["T"] * s["S"] * max(1.0, math.log2(max(2, a["k"]))),
        tensor_bytes(a["scores"]) + 4.0 * s["T"] * a["k"],
    ),
    selection=TOPK_SELECTION,
    differentiable=False,
    category="dsa",
)


# --------------------------------------------------------------------------- indexer_topk
def indexer_topk_ref(q, k, w, k_start, k_end, topk):
    return topk_indices_ref(lightning_indexer_ref(q, k, w, k_start, k_end), topk)


def indexer_topk_decompose(ops, q, k, w, k_start, k_end, topk):
    return ops.topk_indices(ops.lightning_indexer(q, k, w, k_start, k_end), topk)


# what indexer_topk and indexer_topk_fp8 share: arguments, output, cost
_TOPK_PARAMS = _INDEXER_PARAMS + (scalar("topk", int, minimum=1),)
_TOPK_OUT = (OutArg("idx", lambda s, a: (s["T"], a["topk"]), torch.int32, differentiable=False),)


def _topk_cost(a, s):
    return (_indexer_cost(a, s)[0] + s["T"] * s["S"],
            tensor_bytes(a["q"], a["k"], a["w"]) + 4.0 * s["T"] * a["topk"])


def _topk_rows(prep=lambda x: x):
    """The kernel computes its own scores, so fp32 rounding may reorder keys whose scores lie
    within the score bound: the selected set and order are judged by the oracle's scores of
    what was selected (each position within the two keys' bounds of the oracle's), scored on
    ``prep(q)``, ``prep(k)`` (the fp8 op: the quantized inputs)."""
    def rows(o, got, work) -> SelectionRows:
        q, k = prep(o["q"]), prep(o["k"])
        w = o["w"].to(q.dtype)
        scores = lightning_indexer_ref(q, k, w, o["k_start"], o["k_end"])
        return SelectionRows(scores, indexer_score_terms(q, k, w), o["topk"],
                             torch.zeros(scores.shape[0], dtype=torch.bool))

    return rows


INDEXER_TOPK_SELECTION = Selection(
    "idx", _topk_rows(),
    "by score: the k selected keys' oracle scores, sorted, match the oracle's top-k position "
    "by position within the two keys' score bounds (the lightning_indexer bound); valid "
    "entries first, distinct, in range, in descending order within the bound")


INDEXER_TOPK = OpDef(
    name="indexer_topk",
    summary="composite: topk_indices(lightning_indexer(q, k, w, k_start, k_end), topk)",
    params=_TOPK_PARAMS,
    outputs=_TOPK_OUT,
    reference=indexer_topk_ref,
    cost=_topk_cost,
    check=_ranges_check("indexer_topk"),
    decompose=indexer_topk_decompose,
    selection=INDEXER_TOPK_SELECTION,
    differentiable=False,
    category="dsa",
)


# --------------------------------------------------------------------------- indexer_topk_fp8
def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row as the fp8 indexer does (`glm5.ir.fp8`), exact in x's accumulation
    dtype (float64 for the oracle)."""
    return e4m3_rows(x, acc_of(x))


def indexer_topk_fp8_ref(q, k, w, k_start, k_end, topk):
    return indexer_topk_ref(_e4m3(q), _e4m3(k), w, k_start, k_end, topk)


def indexer_topk_fp8_decompose(ops, q, k, w, k_start, k_end, topk):
    """indexer_topk on the dequantized fp8 inputs (exact in fp32: power-of-two scales)."""
    return ops.indexer_topk(e4m3_rows(q), e4m3_rows(k), w.to(torch.float32), k_start, k_end,
                            topk)


INDEXER_TOPK_FP8 = OpDef(
    name="indexer_topk_fp8",
    summary="indexer_topk with q and k quantized to fp8 e4m3 per row (DeepSeek-V3.2's fp8 "
            "indexer)",
    params=_TOPK_PARAMS,
    outputs=_TOPK_OUT,
    reference=indexer_topk_fp8_ref,
    cost=_topk_cost,
    check=_ranges_check("indexer_topk_fp8"),
    decompose=indexer_topk_fp8_decompose,
    selection=Selection(
        "idx", _topk_rows(_e4m3),
        "by score as indexer_topk's, on the scores of the fp8-quantized q and k (each row's "
        "codes and power-of-two scale as `glm5.ir.fp8` makes them)"),
    differentiable=False,
    category="dsa",
)


# --------------------------------------------------------------------------- paged_indexer_topk
# The paged form of indexer_topk: keys live in a pool of pages of `page_size` rows; sequence b's
# logical key j is pool row `glm5.ir.paging.pool_rows`, and
# query t (of sequence seq[t]) sees logical keys 0 .. k_len[t] - 1.
def paged_logical_rows(block_table: torch.Tensor, page_size: int, b: int, n: int) -> torch.Tensor:
    """[n] int64: the pool rows of sequence ``b``'s logical keys 0 .. n-1 (a page id of -1, an
    unallocated page, gives negative rows: the caller masks them)."""
    return pool_rows(block_table, b, torch.arange(n, device=block_table.device), page_size)


def paged_compact_rows(block_table: torch.Tensor, seq: torch.Tensor, k_len: torch.Tensor,
                       page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compact key buffer of a paged call: every sequence the queries use, its logical keys
    0 .. (the longest k_len among its queries) - 1, one sequence after another.

    Returns ``rows`` [C] int64, the pool row of each compact key (in logical order within a
    sequence, so compact order breaks ties as logical order does), and ``start`` [T] int64, where
    query t's sequence begins in it: query t sees compact keys start[t] .. start[t] + k_len[t].
    One host sync (C)."""
    B = block_table.shape[0]
    need = torch.zeros(B, dtype=torch.int64, device=seq.device).scatter_reduce(
        0, seq.long(), k_len.long(), "amax", include_self=True)
    ends = need.cumsum(0)
    first = ends - need
    C = int(ends[-1]) if B else 0
    c = torch.arange(C, device=seq.device)
    b = torch.searchsorted(ends, c, right=True)
    j = c - first[b]
    return pool_rows(block_table, b, j, page_size), first[seq.long()]


def paged_indexer_topk_ref(q, k, w, block_table, seq, k_len, page_size, topk):
    """indexer_topk over each sequence's logically ordered keys, mapped to pool rows."""
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    L = block_table.shape[1] * page_size
    if L == 0 or k.shape[0] == 0:  # no page, or an empty pool: no query sees a key
        return out
    for b in seq.unique().tolist():
        sel = (seq == b).nonzero()[:, 0]
        rows = paged_logical_rows(block_table, page_size, b, L)
        keys = k[rows.clamp(min=0)]  # pages of -1 lie past every k_len: masked by k_end
        ks = torch.zeros_like(k_len[sel])
        logical = indexer_topk_ref(q[sel], keys, w[sel], ks, k_len[sel], topk)
        out[sel] = torch.where(logical >= 0, rows[logical.long().clamp(min=0)],
                               -1).to(torch.int32)
    return out


def _paged_via_compact(ops, q, keys, w, block_table, seq, k_len, page_size, topk):
    """ops.indexer_topk over the compact buffer of the sequences' keys (``keys(rows)``: the
    [C, Di] keys of those pool rows; one call: a fused indexer_topk kernel serves it), then
    compact -> pool rows."""
    rows, start = paged_compact_rows(block_table, seq, k_len, page_size)
    if rows.numel() == 0:  # no query sees a key
        return torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    ks = start.to(torch.int32)
    idx = ops.indexer_topk(q, keys(rows), w, ks, ks + k_len, topk)
    return torch.where(idx >= 0, rows[idx.long().clamp(min=0)], -1).to(torch.int32)


def paged_indexer_topk_decompose(ops, q, k, w, block_table, seq, k_len, page_size, topk):
    """ops.indexer_topk over the compact buffer of the sequences' keys, then pool rows."""
    return _paged_via_compact(ops, q, lambda rows: k[rows], w, block_table, seq, k_len,
                              page_size, topk)


def paged_reachable(block_table: torch.Tensor, seq: torch.Tensor, k_len: torch.Tensor,
                    page_size: int, S: int) -> torch.Tensor:
    """[T, S] bool: pool row r holds a key query t sees (r = the row of a logical j < k_len[t]).
    Reference-only helper."""
    T, P = seq.shape[0], block_table.shape[1]
    out = torch.zeros(T, S, dtype=torch.bool, device=seq.device)
    if T == 0 or P == 0:
        return out
    j = torch.arange(P * page_size, device=seq.device)
    rows = pool_rows(block_table, seq[:, None], j, page_size)
    ok = j[None, :] < k_len.long()[:, None]
    t = torch.arange(T, device=seq.device)[:, None].expand_as(rows)
    out[t[ok], rows[ok]] = True
    return out


def _paged_check(op: str):
    """The paged ops' check (`_check_paged_args`)."""
    def check(a, s) -> None:
        _check_paged_args(op, a, s)

    return check


def _check_paged_args(op: str, a, s) -> None:
    """The value checks read three values (the seq and k_len flags, the widest used row, the
    page flags): only where `value_checks` allows, as this runs on every decode step."""
    ps, S = a["page_size"], s["S"]
    require(S % ps == 0, op, "k", f"a row count S that is a multiple of page_size={ps} (the "
            f"pool holds whole pages)", f"S={S}")
    bt, seq, k_len = a["block_table"], a["seq"], a["k_len"]
    if seq.numel() == 0 or not value_checks(bt, seq, k_len):
        return
    B, P = bt.shape
    bad_seq = (seq < 0) | (seq >= B)
    bad_len = (k_len < 0) | (k_len > P * ps)
    f_seq, f_len = torch.stack((bad_seq.any(), bad_len.any())).tolist()
    if f_seq:
        t = int(bad_seq.nonzero()[0, 0])
        raise OpInputError(f"glm5.{op}: argument 'seq' expected entries in [0, {B}) (rows of "
                           f"block_table), got seq[{t}]={int(seq[t])}")
    if f_len:
        t = int(bad_len.nonzero()[0, 0])
        raise OpInputError(f"glm5.{op}: argument 'k_len' expected entries in [0, {P * ps}] "
                           f"(P={P} pages of page_size={ps}), got k_len[{t}]={int(k_len[t])}")
    # The pages a sequence's queries read: its first ceil(max k_len / page_size) entries; only
    # those columns are looked at.
    need = torch.zeros(B, dtype=torch.int32, device=seq.device).scatter_reduce(
        0, seq.long(), k_len, "amax", include_self=True)
    n_used = (need + ps - 1) // ps
    cols = int(n_used.max())
    if cols == 0:
        return
    bt_u = bt[:, :cols]
    pos = torch.arange(cols, dtype=torch.int32, device=bt.device)[None, :]
    used = pos < n_used[:, None]
    pages = S // ps
    bad = used & ((bt_u < 0) | (bt_u >= pages))
    # A page twice in one sequence would make two logical keys one pool row (unused entries
    # become distinct negative values, so only used pages can collide).
    srt = torch.where(used, bt_u, -1 - pos).sort(dim=1).values
    dup = srt[:, 1:] == srt[:, :-1]
    f_bad, f_dup = torch.stack((bad.any(), dup.any())).tolist()
    if f_bad:
        b, p = (int(x) for x in bad.nonzero()[0])
        t = int(((seq == b) & (k_len.long() > p * ps)).nonzero()[0, 0])
        raise OpInputError(
            f"glm5.{op}: argument 'block_table' expected a page id in [0, {pages}) for every "
            f"key a query sees, got block_table[{b}, {p}]={int(bt[b, p])} (logical keys "
            f"{p * ps}..{(p + 1) * ps - 1} of sequence {b}, seen by query {t} with "
            f"k_len[{t}]={int(k_len[t])})")
    if f_dup:
        b, i = (int(x) for x in dup.nonzero()[0])
        raise OpInputError(
            f"glm5.{op}: argument 'block_table' expected distinct pages within a sequence's "
            f"used entries, got page {int(srt[b, i])} twice in row {b}")


def _paged_rows(inputs=lambda o: (o["q"], o["k"])):
    """As indexer_topk's rule, through the mapping: query t's candidates are the pool rows of its
    logical keys j < k_len[t], each with the oracle score and bound of its key row; other rows
    are not selectable. ``inputs(o)`` gives the (q, k) scored (the fp8 op: the quantized q and
    the dequantized key pool)."""
    def rows(o, got, work) -> SelectionRows:
        q, k = inputs(o)
        return _paged_selection_rows(o, q, k, o["w"].to(q.dtype))

    return rows


def _paged_selection_rows(o, q, k, w) -> SelectionRows:
    T, S = q.shape[0], k.shape[0]
    full_s = torch.zeros(T, dtype=torch.int32)
    scores = lightning_indexer_ref(q, k, w, full_s, torch.full_like(full_s, S))
    reach = paged_reachable(o["block_table"], o["seq"], o["k_len"], o["page_size"], S)
    terms = indexer_score_terms(q, k, w)
    return SelectionRows(scores.masked_fill(~reach, float("-inf")), terms, o["topk"],
                         torch.zeros(T, dtype=torch.bool))


PAGED_INDEXER_TOPK_SELECTION = Selection(
    "idx", _paged_rows(),
    "by score as indexer_topk, through the page mapping: the selected pool rows' oracle scores "
    "match the oracle's top-k over the query's logical keys position by position within the "
    "two keys' score bounds; valid entries first, distinct, rows the query sees, in descending "
    "order within the bound")


def _paged_cost(a, s):
    T, Hi, Di, ps = s["T"], s["Hi"], s["Di"], a["page_size"]
    kl, seq = a["k_len"], a["seq"]
    if has_data(kl) and kl.numel():
        n = float(kl.double().mean())
        # each sequence's keys are read once, up to its longest query
        need = torch.zeros(s["B"], dtype=torch.int64).scatter_reduce(
            0, seq.long().cpu(), kl.long().cpu(), "amax", include_self=True)
        keys = float(need.sum())
    else:
        n = keys = float(s["P"] * ps)
    # bytes per key: its Di values (and its fp32 scale in an fp8 pool)
    per_key = Di * a["k"].element_size() + (4.0 if a.get("k_scale") is not None else 0.0)
    flops = T * n * (2.0 * Hi * Di + 3.0 * Hi + 1.0) + T * a["topk"]
    return flops, (tensor_bytes(a["q"], a["w"], a["seq"], a["k_len"], a["block_table"])
                   + keys * per_key + 4.0 * T * a["topk"])


# the paged ops' arguments after the key pool
_PAGED_TAIL = (
    TensorArg("w", ("T", "Hi"), doc="per-head weights, all scale factors folded in"),
    TensorArg("block_table", ("B", "P"), INDEX_DTYPES,
              doc="page ids of each sequence's logical pages; -1 = not allocated"),
    TensorArg("seq", ("T",), INDEX_DTYPES, doc="the block_table row of each query"),
    TensorArg("k_len", ("T",), INDEX_DTYPES,
              doc="query t sees logical keys 0 .. k_len[t]-1 of its sequence"),
    scalar("page_size", int, minimum=1),
    scalar("topk", int, minimum=1),
)


PAGED_INDEXER_TOPK = OpDef(
    name="paged_indexer_topk",
    summary="composite: indexer_topk over each query's sequence's keys read through a block "
            "table of pages, returned as pool rows",
    params=(
        TensorArg("q", ("T", "Hi", "Di"), doc="indexer queries"),
        TensorArg("k", ("S", "Di"), doc="the paged key pool: S = pages * page_size rows"),
    ) + _PAGED_TAIL,
    outputs=_TOPK_OUT,
    reference=paged_indexer_topk_ref,
    cost=_paged_cost,
    check=_paged_check("paged_indexer_topk"),
    decompose=paged_indexer_topk_decompose,
    selection=PAGED_INDEXER_TOPK_SELECTION,
    differentiable=False,
    category="dsa",
)


# --------------------------------------------------------------------------- paged_indexer_topk_fp8
# The paged indexer over an fp8 key cache, as DeepSeek-V3.2's serving stacks keep the indexer's
# keys: each key row stored once, when its token is written, as e4m3 codes and one fp32 scale
# (`glm5.ir.fp8.quantize_rows_e4m3`: Di + 4 bytes a row instead of 2 Di); q is quantized per
# (token, head) row by the op, as indexer_topk_fp8 does.
def _dequantized_pool(k: torch.Tensor, k_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_rows_e4m3(k, k_scale, dtype)


def paged_indexer_topk_fp8_ref(q, k, k_scale, w, block_table, seq, k_len, page_size, topk):
    """paged_indexer_topk on the quantized q and the dequantized key pool (both exact in the
    accumulation dtype)."""
    acc = acc_of(q)
    return paged_indexer_topk_ref(e4m3_rows(q, acc), _dequantized_pool(k, k_scale, acc), w,
                                  block_table, seq, k_len, page_size, topk)


def paged_indexer_topk_fp8_decompose(ops, q, k, k_scale, w, block_table, seq, k_len,
                                     page_size, topk):
    """ops.indexer_topk over the dequantized keys of the compact buffer (only the rows the
    queries see are dequantized) and the quantized q, then pool rows."""
    return _paged_via_compact(
        ops, e4m3_rows(q), lambda rows: _dequantized_pool(k[rows], k_scale[rows], torch.float32),
        w.to(torch.float32), block_table, seq, k_len, page_size, topk)


def _paged_fp8_check(a, s) -> None:
    """paged_indexer_topk's checks, and the key scales finite and >= 0 (a scale commutes with
    the ReLU only when it is not negative; rows never written hold 0)."""
    op = "paged_indexer_topk_fp8"
    _check_paged_args(op, a, s)
    sc = a["k_scale"]
    if sc.numel() == 0 or not value_checks(sc):
        return
    bad = ~(torch.isfinite(sc) & (sc >= 0))
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        raise OpInputError(f"glm5.{op}: argument 'k_scale' expected finite entries >= 0, got "
                           f"k_scale[{r}]={float(sc[r])}")


PAGED_INDEXER_TOPK_FP8 = OpDef(
    name="paged_indexer_topk_fp8",
    summary="paged_indexer_topk over an fp8 e4m3 key pool with a scale per row, q quantized "
            "per row to e4m3 (DeepSeek-V3.2's fp8 indexer cache)",
    params=(
        TensorArg("q", ("T", "Hi", "Di"), doc="indexer queries (quantized per row by the op)"),
        TensorArg("k", ("S", "Di"), frozenset({torch.float8_e4m3fn}),
                  doc="the paged key pool's e4m3 codes: S = pages * page_size rows"),
        TensorArg("k_scale", ("S",), frozenset({torch.float32}),
                  doc="each pool row's scale (key = k[s] * k_scale[s]); a power of two as "
                      "`glm5.ir.fp8` makes them keeps every product exact"),
    ) + _PAGED_TAIL,
    outputs=_TOPK_OUT,
    reference=paged_indexer_topk_fp8_ref,
    cost=_paged_cost,
    check=_paged_fp8_check,
    decompose=paged_indexer_topk_fp8_decompose,
    selection=Selection(
        "idx", _paged_rows(lambda o: (_e4m3(o["q"]),
                                      _dequantized_pool(o["k"], o["k_scale"], acc_of(o["q"])))),
        "by score as paged_indexer_topk's, on the scores of the e4m3-quantized q (each row's "
        "codes and power-of-two scale as `glm5.ir.fp8` makes them) and the dequantized key "
        "pool (k[s] * k_scale[s])"),
    differentiable=False,
    category="dsa",
)


# --------------------------------------------------------------------------- sparse_attention
def _softmax_out(scores: torch.Tensor, valid: torch.Tensor, v: torch.Tensor, eq: str):
    """Masked softmax(scores) @ v with lse; rows without a valid key give 0 and -inf."""
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    p = p.masked_fill(~valid, 0.0)
    return torch.einsum(eq, p, v), lse


def sparse_attention_ref(q, k, v, idx, scale):
    acc = acc_of(q)
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    Dv = v.shape[-1]
    g = H // Hk
    if S == 0:  # every index is -1: empty rows
        return (q.new_zeros(T, H, Dv), torch.full((T, H), float("-inf"), dtype=acc,
                                                  device=q.device))
    valid = idx >= 0  # [T, K]
    safe = idx.long().clamp(min=0)
    kg = k.to(acc)[safe]  # [T, K, Hk, Dqk]
    vg = v.to(acc)[safe]  # [T, K, Hk, Dv]
    qf = q.to(acc).reshape(T, Hk, g, Dqk)
    scores = torch.einsum("tjgd,tkjd->tjgk", qf, kg) * scale  # [T, Hk, g, K]
    out, lse = _softmax_out(scores, valid[:, None, None, :], vg, "tjgk,tkjd->tjgd")
    return out.reshape(T, H, Dv).to(q.dtype), lse.reshape(T, H)


def attention_error_terms(q, k_abs_scores_max, spv, lse, Dqk, n_keys):
    """out: P may be rounded to the working dtype before P.V, and the row sum taken of the
    rounded or the exact P (flash kernels do: mid = 2 sum_k p|v|); a score error ds moves every p_k by at most 2 ds relative, and ds is an fp32
    dot over Dqk (sqrt(Dqk) scale sum|q k|, largest over the keys: m); P.V is an fp32 sum over
    the K keys and the final 1/l one more rounding (acc = (2 sqrt(Dqk) m + sqrt(K) + 2)
    sum_k p|v|). lse (fp32): the score error, an fp32 sum of K exponentials and the log (acc =
    sqrt(Dqk) m + sqrt(K)); no rounding to the working dtype."""
    m = k_abs_scores_max  # [T, H]
    grow = 2.0 * sqrt_n(Dqk) * m + sqrt_n(n_keys) + 2.0
    out = ErrorTerms(mid=2.0 * spv, acc=grow[..., None] * spv)
    fin = torch.isfinite(lse)
    lse_acc = (sqrt_n(Dqk) * m + sqrt_n(n_keys)).masked_fill(~fin, 0.0)
    return {"out": out, "lse": ErrorTerms(acc=lse_acc)}


def _gqa_check(op: str, s) -> None:
    require(
        s["H"] % s["Hk"] == 0,
        op,
        "k",
        f"a head count Hk dividing H={s['H']}",
        f"Hk={s['Hk']}",
    )


def sparse_attention_error(o, r, work):
    """See attention_error_terms (K = the idx width)."""
    q, k, v, idx, scale = o["q"], o["k"], o["v"], o["idx"], o["scale"]
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    g = H // Hk
    spv = sparse_attention_ref(q, k, v.abs(), idx, scale)[0]
    if S == 0:
        m = torch.zeros(T, H, dtype=torch.float64)
    else:
        valid = idx >= 0
        kg = k.abs()[idx.long().clamp(min=0)]  # [T, K, Hk, Dqk]
        mags = torch.einsum("tjgd,tkjd->tjgk", q.abs().reshape(T, Hk, g, Dqk), kg) * abs(scale)
        mags = mags.masked_fill(~valid[:, None, None, :], 0.0)
        m = mags.amax(-1).reshape(T, H) if idx.shape[1] else torch.zeros(T, H, dtype=q.dtype)
    return attention_error_terms(q, m, spv, r[1], Dqk, idx.shape[1])


def _sparse_check(a, s) -> None:
    _gqa_check("sparse_attention", s)
    require(a["v"].dtype == a["q"].dtype and a["k"].dtype == a["q"].dtype, "sparse_attention",
            "k", f"q, k and v of one dtype ({a['q'].dtype})", f"{a['k'].dtype}/{a['v'].dtype}")
    check_index_range("sparse_attention", "idx", a["idx"], 0, s["S"], "(rows of k)")


_ATTN_QKV = (
    TensorArg("q", ("T", "H", "Dqk")),
    TensorArg("k", ("S", "Hk", "Dqk")),
    TensorArg("v", ("S", "Hk", "Dv")),
)


def _attn_cost(a, s, n_keys: float):
    T, H, Dqk, Dv = s["T"], s["H"], s["Dqk"], s["Dv"]
    flops = 2.0 * T * H * n_keys * (Dqk + Dv)
    return flops


SPARSE_ATTENTION = OpDef(
    name="sparse_attention",
    summary="softmax attention of each query over its selected rows idx[t] (-1 = none)",
    params=_ATTN_QKV + (
        TensorArg("idx", ("T", "K"), INDEX_DTYPES),
        scalar("scale", float),
    ),
    outputs=(
        OutArg("out", ("T", "H", "Dv"), "like:q"),
        OutArg("lse", ("T", "H"), "acc"),
    ),
    reference=sparse_attention_ref,
    cost=lambda a, s: (
        _attn_cost(a, s, s["K"]),
        # Each query reads its K rows once per KV head (MQA: the latent row is read once).
        tensor_bytes(a["q"])
        + s["T"] * s["K"] * s["Hk"] * (s["Dqk"] + s["Dv"]) * a["k"].element_size()
        + 4.0 * s["T"] * s["K"] + s["T"] * s["H"] * (s["Dv"] * a["q"].element_size() + 4),
    ),
    error=sparse_attention_error,
    check=_sparse_check,
    category="dsa",
)


# --------------------------------------------------------------------------- attention
def attention_ref(q, k, v, k_start, k_end, scale):
    acc = acc_of(q)
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    g = H // Hk
    qf = q.to(acc).reshape(T, Hk, g, Dqk)
    scores = torch.einsum("tjgd,sjd->tjgs", qf, k.to(acc)) * scale
    valid = range_mask(k_start, k_end, S)[:, None, None, :]
    out, lse = _softmax_out(scores, valid, v.to(acc), "tjgs,sjd->tjgd")
    return out.reshape(T, H, v.shape[-1]).to(q.dtype), lse.reshape(T, H)


def attention_error(o, r, work):
    """See attention_error_terms (K = the widest key range)."""
    q, k, v, ks, ke, scale = o["q"], o["k"], o["v"], o["k_start"], o["k_end"], o["scale"]
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    g = H // Hk
    spv = attention_ref(q, k, v.abs(), ks, ke, scale)[0]
    mags = torch.einsum("tjgd,sjd->tjgs", q.abs().reshape(T, Hk, g, Dqk), k.abs()) * abs(scale)
    valid = range_mask(ks, ke, S)[:, None, None, :]
    m = mags.masked_fill(~valid, 0.0).amax(-1).reshape(T, H) if S else \
        torch.zeros(T, H, dtype=q.dtype)
    n = int((ke - ks).max()) if T else 0
    return attention_error_terms(q, m, spv, r[1], Dqk, n)


def _attention_check(a, s) -> None:
    _gqa_check("attention", s)
    require(a["v"].dtype == a["q"].dtype and a["k"].dtype == a["q"].dtype, "attention",
            "k", f"q, k and v of one dtype ({a['q'].dtype})", f"{a['k'].dtype}/{a['v'].dtype}")
    check_ranges("attention", a["k_start"], a["k_end"], s["S"])


def _attention_cost(a, s):
    n = float((a["k_end"] - a["k_start"]).sum()) / max(1, s["T"]) if has_data(a["k_end"]) else s["S"]
    esz = a["k"].element_size()
    return (
        _attn_cost(a, s, n),
        tensor_bytes(a["q"], a["k"], a["v"]) + s["T"] * s["H"] * (s["Dv"] * esz + 4),
    )


ATTENTION = OpDef(
    name="attention",
    summary="dense attention over k_start[t] <= s < k_end[t] (the baseline DSA is compared with)",
    params=_ATTN_QKV + (
        TensorArg("k_start", ("T",), INDEX_DTYPES),
        TensorArg("k_end", ("T",), INDEX_DTYPES),
        scalar("scale", float),
    ),
    outputs=(
        OutArg("out", ("T", "H", "Dv"), "like:q"),
        OutArg("lse", ("T", "H"), "acc"),
    ),
    reference=attention_ref,
    cost=_attention_cost,
    error=attention_error,
    check=_attention_check,
    category="dsa",
)

OPS = (LIGHTNING_INDEXER, TOPK_INDICES, INDEXER_TOPK, INDEXER_TOPK_FP8, PAGED_INDEXER_TOPK,
       PAGED_INDEXER_TOPK_FP8, SPARSE_ATTENTION, ATTENTION)
