"""Triton Lightning Indexer: `lightning_indexer` (scores) and `indexer_topk` (fused selection).

Scores (all three ops): the rows of one tensor-core dot are (query, head) pairs, as DeepGEMM's
mqa_logits lays them out: a block of BLOCK_T queries x HP = next_pow2(Hi) heads (padded rows
masked) times a [Di, BLOCK_S] key tile, then ReLU, times w[t, h] per row, summed over the heads
of each query. At GLM-5's Hi = 32 the dot is [256, 128] x [128, 64] (BLOCK_M = 256): a
warpgroup MMA (wgmma) on Hopper, where a [16, Di] dot per head lowered to mma.sync; the query
tile is loaded once per program and stays in shared memory.

lightning_indexer: one program per [BLOCK_T queries x SPAN keys] (SPAN a run of BLOCK_S tiles);
key tiles outside every query's range are written -inf without a dot.

indexer_topk (served whole): one program per block of BLOCK_T queries streams over the union of
their key ranges in BLOCK_S tiles and keeps a threshold-filtered running top-k per query (see
_indexer_kernels): only keys above the query's current TOPK-th best order key are appended to
its workspace row of 2*CH int64 keys (CH = next_pow2(topk)); a row is merged (bitonic tl.sort,
best TOPK kept, threshold raised) only when a key tile could overflow it, and once at the end.
Runs of key tiles between merges contain no merge, so their loads pipeline. The first topk keys
decode to int32 indices, -1 for empty slots. No [T, S] score matrix is ever formed; the host
only allocates the workspace and splits very large T into launches so it stays bounded.

indexer_topk_fp8 (served whole where tl.dot takes e4m3: `fp8_dots`): q and k quantized per row
to e4m3 with power-of-two scales (glm5.ir.fp8) by torch ops on the device, then indexer_topk's
kernel on the codes (fp8 tensor-core dots, fp32 accumulation) with the q scales folded into w
and each key's head sum times its scale (constexpr KSCALE): exact, so the selection is the one
of indexer_topk on the dequantized inputs, up to fp32 accumulation order.

paged_indexer_topk (served whole): indexer_topk's streaming top-k with the key rows read through
the block table (the pool row of logical key j of sequence b is computed per key tile from
block_table[b, j // page_size]). A block of queries makes one pass per distinct sequence among
them, so prefill chunks (one sequence) stream once and a decode batch (one query per sequence)
needs no host-side regrouping; order keys hold the logical position (ties to the smaller one)
and the final decode maps them to pool rows. No host sync: the table is read on the device.

paged_indexer_topk_fp8 (served whole where tl.dot takes e4m3): the same kernel on an fp8 key
pool as the serving engine stores it (e4m3 codes written once per token, one fp32 scale per
row: half the bytes a decode step streams), q quantized per call as indexer_topk_fp8 does, each
key's head sum times its pool row's scale.

Split top-k (the top-k ops, decode): when the query blocks are short of about TARGET_PROGRAMS
programs, each block's keys (paged: each sequence pass) are cut into SPLIT windows of whole
BLOCK_S tiles (glm5.kernels.triton.splitkv's rule, at least SPLIT_MIN_KEYS keys each); each
(block, window) program selects over its window in its own workspace rows and stores its best
topk order keys, and ``indexer_topk_merge_kernel`` selects the best topk of each query's
SPLIT x topk candidates and decodes them. Exact: the windows are disjoint, the keys distinct.

Both top-k launchers take an optional keyword ``merge_counts`` (an int32 [T] tensor, for tests
and diagnostics; the op's dispatcher never passes it) that receives each query's number of
merges (given, the launch does not split).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.ir.fp8 import quantize_rows_e4m3
from glm5.kernels.triton import splitkv
from glm5.kernels.triton.launch import (FLOATS, cdiv, check_device, dot_fp32, interpreted,
                                        launch, launch_opts, next_pow2)

DEFAULTS: dict[str, dict[str, Any]] = {
    # BLOCK_M: rows of the score dot = (query, head) pairs; a block holds BLOCK_T = BLOCK_M //
    # next_pow2(Hi) queries (8 for GLM-5's 32 heads: M = 256, so a 16 KiB key tile feeds
    # 4.2 MFLOP), at most MAX_BLOCK_T, unless the entry sets BLOCK_T itself. A
    # lightning_indexer program computes SPAN = BLOCK_S * min(S_TILES, tiles / PROGRAMS) keys
    # of its query block (the query tile read once), at least one tile: long rows reuse the
    # query tile over S_TILES key tiles, short ones still spread over about PROGRAMS programs.
    "lightning_indexer": {"BLOCK_M": 256, "MAX_BLOCK_T": 16, "BLOCK_S": 64, "BLOCK_D": 128,
                          "num_warps": 8, "num_stages": 2, "S_TILES": 8, "PROGRAMS": 2048},
    # MERGE: "sort" (bitonic top-k per query row), "rank" (rank-by-comparison of a block
    # of rows, O((2*CH)^2): fast under the interpreter), "auto" = rank interpreted, else sort.
    # MAX_TOPK bounds the in-register bitonic sorts (CH = max(next_pow2(topk), 2*BLOCK_S)
    # int64 keys per query, a 2*CH workspace row); WS_BYTES bounds the workspace (queries are
    # launched in groups that fit).
    # Split top-k (decode): blocks short of TARGET_PROGRAMS programs cut their keys into
    # windows of at least SPLIT_MIN_KEYS (each window's best topk keys are merged after:
    # 4 x topk 2048 keys scanned per 2048 merged), MERGE_BLOCK_T queries per merge program
    # (sm_90: the paged merge's pool-row decode spills at 4 and 8, not at 2).
    "indexer_topk": {"BLOCK_M": 256, "MAX_BLOCK_T": 16, "BLOCK_S": 64, "BLOCK_D": 128,
                     "num_warps": 8, "num_stages": 2, "MERGE": "auto", "MAX_TOPK": 4096,
                     "WS_BYTES": 1 << 28, "TARGET_PROGRAMS": 264,
                     "TARGET_PROGRAMS_INTERPRETED": 0, "SPLIT_MIN_KEYS": 8192,
                     "MERGE_BLOCK_T": 2},
    # paged_indexer_topk: as indexer_topk (same merge and workspace rules); keys are read
    # through the block table.
    # M = 128: the page gather's extra state spills at 256 rows, and decode blocks hold one
    # query per sequence anyway.
    "paged_indexer_topk": {"BLOCK_M": 128, "MAX_BLOCK_T": 16, "BLOCK_S": 64, "BLOCK_D": 128,
                           "num_warps": 8, "num_stages": 2, "MERGE": "auto", "MAX_TOPK": 4096,
                           "WS_BYTES": 1 << 28, "TARGET_PROGRAMS": 264,
                           "TARGET_PROGRAMS_INTERPRETED": 0, "SPLIT_MIN_KEYS": 8192,
                           "MERGE_BLOCK_T": 2},
}
# The fp8 ops run their bf16 op's kernel on e4m3 codes: entries of their own (fp8 dots may want
# other tiles), the bf16 op's defaults until measured.
DEFAULTS["indexer_topk_fp8"] = dict(DEFAULTS["indexer_topk"])
DEFAULTS["paged_indexer_topk_fp8"] = dict(DEFAULTS["paged_indexer_topk"])


def _k():
    # lazy: optional dependency: _indexer_kernels imports triton (on the first launch)
    from glm5.kernels.triton import _indexer_kernels

    return _indexer_kernels


def _tiles(p: dict[str, Any], Hi: int, Di: int) -> dict[str, Any]:
    """The constexpr tiles of a launch: BLOCK_T queries x HP padded heads (the dot's M, at
    least 16), BLOCK_S keys, BLOCK_D dims, and ONE_D (Di fits one BLOCK_D: the query tile is
    loaded once per program)."""
    hp = next_pow2(Hi)
    if "BLOCK_T" in p:
        bt = next_pow2(int(p["BLOCK_T"]))
    else:
        bt = max(1, next_pow2(int(p.get("BLOCK_M", 128))) // hp)
        bt = min(bt, next_pow2(int(p.get("MAX_BLOCK_T", 16))))
    bt = max(bt, next_pow2(cdiv(16, hp)))  # tl.dot needs M >= 16
    bs = max(16, next_pow2(int(p.get("BLOCK_S", 64))))
    bd = max(16, min(next_pow2(int(p.get("BLOCK_D", 128))), next_pow2(Di)))
    return {"BLOCK_T": bt, "HP": hp, "BLOCK_S": bs, "BLOCK_D": bd, "ONE_D": Di <= bd}


def make_lightning_indexer(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def lightning_indexer(q, k, w, k_start, k_end):
        check_device("lightning_indexer", q=q, k=k, w=w, k_start=k_start, k_end=k_end)
        k_start, k_end = k_start.contiguous(), k_end.contiguous()
        T, Hi, Di = q.shape
        S = k.shape[0]
        out = torch.empty((T, S), dtype=torch.float32, device=q.device)
        if T == 0 or S == 0:
            return out
        c = _tiles(p, Hi, Di)
        n_t, n_s = cdiv(T, c["BLOCK_T"]), cdiv(S, c["BLOCK_S"])
        per = max(1, min(int(p.get("S_TILES", 8)), (n_t * n_s) // int(p.get("PROGRAMS", 2048))))
        span = per * c["BLOCK_S"]
        launch(
            _k().lightning_indexer_kernel, (n_t, cdiv(S, span)), p, "lightning_indexer",
            q, k, w, k_start, k_end, out, T, S, Hi, Di,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            w.stride(0), w.stride(1), out.stride(0), out.stride(1), span,
            DOT_FP32=dot_fp32(q.dtype, k.dtype), **c, **launch_opts(p))
        return out

    return lightning_indexer


MAX_TENSOR_NUMEL = 1 << 20  # triton.language.TRITON_MAX_TENSOR_NUMEL


def _check_counts(op: str, merge_counts: torch.Tensor | None, T: int,
                  device: torch.device) -> None:
    if merge_counts is None:
        return
    if (merge_counts.dtype != torch.int32 or tuple(merge_counts.shape) != (T,)
            or not merge_counts.is_contiguous() or merge_counts.device != device):
        raise ValueError(f"glm5 triton {op}: argument 'merge_counts' expected a contiguous "
                         f"int32 tensor of shape ({T},) on {device}, got "
                         f"{merge_counts.dtype} {tuple(merge_counts.shape)} on "
                         f"{merge_counts.device}")


def make_indexer_topk(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def indexer_topk(q, k, w, k_start, k_end, topk, *,
                     merge_counts: torch.Tensor | None = None):
        """The op; ``merge_counts`` (tests, diagnostics: an int32 [T] tensor) receives each
        query's number of selection merges (overflow merges plus the final one)."""
        check_device("indexer_topk", q=q, k=k, w=w, k_start=k_start, k_end=k_end,
                     merge_counts=merge_counts)
        return _topk(p, "indexer_topk", q, k, w, None, k_start, k_end, topk, merge_counts)

    return indexer_topk


def make_indexer_topk_fp8(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def indexer_topk_fp8(q, k, w, k_start, k_end, topk, *,
                         merge_counts: torch.Tensor | None = None):
        """The op: q and k quantized per row to e4m3 with power-of-two scales
        (`glm5.ir.fp8`, the op's one definition), the dot in fp8, the q scales folded into w
        and the key scales applied to each key's head sum (all exact); then indexer_topk's
        streaming selection. ``merge_counts`` as for indexer_topk."""
        check_device("indexer_topk_fp8", q=q, k=k, w=w, k_start=k_start, k_end=k_end,
                     merge_counts=merge_counts)
        q8, sq = quantize_rows_e4m3(q)
        k8, sk = quantize_rows_e4m3(k)
        return _topk(p, "indexer_topk_fp8", q8, k8, w.to(torch.float32) * sq, sk, k_start,
                     k_end, topk, merge_counts)

    return indexer_topk_fp8


def _topk(p: dict[str, Any], op: str, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
          sk: torch.Tensor | None, k_start: torch.Tensor, k_end: torch.Tensor, topk: int,
          merge_counts: torch.Tensor | None) -> torch.Tensor:
    """indexer_topk's launches (``sk``: fp8 codes in q and k, each key's sum times sk[s])."""
    k_start, k_end = k_start.contiguous(), k_end.contiguous()
    T, Hi, Di = q.shape
    S = k.shape[0]
    topk = int(topk)
    _check_counts(op, merge_counts, T, q.device)
    out = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    if S == 0:
        if merge_counts is not None:
            merge_counts.zero_()
        return out.fill_(-1)
    c, ch, rows, rank, split = _merge_plan(p, topk, Hi, Di, T, S, merge_counts is None)
    ws, pk = _buffers(split, rows, ch, topk, q.device)
    kern = _k().indexer_topk_kernel
    for t0, t1, qs, ws_, o, mc in _groups(T, rows, q, w, out, merge_counts, ws):
        n = t1 - t0
        launch(
            kern, (cdiv(n, c["BLOCK_T"]), split), p, op,
            qs, k, ws_, k_start[t0:t1], k_end[t0:t1], ws, o, mc, pk,
            ws if sk is None else sk, n, S, Hi, Di, topk,
            split, ws.stride(0), pk.stride(0),
            qs.stride(0), qs.stride(1), qs.stride(2), k.stride(0), k.stride(1),
            ws_.stride(0), ws_.stride(1), o.stride(0), o.stride(1),
            CH=ch, LOG_CH=ch.bit_length() - 1, RANK_MERGE=rank,
            COUNT_MERGES=merge_counts is not None, SPLIT_OUT=split > 1,
            DOT_FP32=dot_fp32(q.dtype, k.dtype), KSCALE=sk is not None, **c,
            **launch_opts(p))
        if split > 1:
            _merge_splits(p, op, c, ch, rank, split, n, topk, ws, pk, o, mc, None)
    return out


def _merge_plan(p: dict[str, Any], topk: int, Hi: int, Di: int, T: int, keys: int,
                split_ok: bool) -> tuple[dict[str, Any], int, int, bool, int]:
    """(tiles, CH, rows per launch, rank merge, SPLIT) of a top-k launch over at most ``keys``
    keys per query. SPLIT > 1 (split top-k, ``split_ok``): too few query blocks for the GPU,
    so each block's keys are cut into SPLIT windows (glm5.kernels.triton.splitkv's rule)."""
    c = _tiles(p, Hi, Di)
    bt = c["BLOCK_T"]
    # CH >= 2 * BLOCK_S: after a merge keeps CH keys, a row's buffer still takes CH - BLOCK_S
    # >= CH / 2 appended keys before the next merge
    ch = max(next_pow2(topk), 2 * c["BLOCK_S"], 16)
    # group queries so the workspace (8 bytes x 2*CH per query and split) stays within WS_BYTES
    per = max(bt, (int(p.get("WS_BYTES", 1 << 28)) // (16 * ch)) // bt * bt)
    split = 1
    if split_ok:
        split, _ = splitkv.split_keys(p, cdiv(min(T, per), bt), keys, c["BLOCK_S"])
        per = max(bt, (per // split) // bt * bt)
    merge = str(p.get("MERGE", "auto"))
    # The rank merge holds a [BLOCK_T, 2CH, 2CH] comparison tile: only while that fits in
    # Triton's largest tensor (the bitonic sort takes over beyond, e.g. topk = 2048).
    fits = bt * (2 * ch) ** 2 <= MAX_TENSOR_NUMEL
    rank = fits and (merge == "rank" or (merge == "auto" and interpreted()))
    return c, ch, min(T, per), rank, split


def _groups(T: int, rows: int, q: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            merge_counts: torch.Tensor | None, ws: torch.Tensor):
    """The launches' query groups of at most ``rows`` queries: (t0, t1, q, w, out and merge
    counts of the group; the workspace stands in for absent merge counts)."""
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        mc = ws if merge_counts is None else merge_counts[t0:t1]
        yield t0, t1, q[t0:t1], w[t0:t1], out[t0:t1], mc


def _buffers(split: int, rows: int, ch: int, topk: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace [SPLIT, rows, 2CH], partial keys [SPLIT, rows, topk] or the workspace when
    there is one split) of a top-k launch, int64."""
    ws = torch.empty((split, rows, 2 * ch), dtype=torch.int64, device=device)
    pk = ws if split == 1 else torch.empty((split, rows, topk), dtype=torch.int64, device=device)
    return ws, pk


def _merge_splits(p: dict[str, Any], op: str, c: dict[str, Any], ch: int, rank: bool,
                  split: int, n: int, topk: int, ws: torch.Tensor, pk: torch.Tensor,
                  o: torch.Tensor, mc: torch.Tensor, paged: tuple | None) -> None:
    """Launch the split top-k's merge over n queries (``paged``: (block_table, seq,
    page_size) to decode pool rows)."""
    bt_, seq_, ps = paged if paged is not None else (ws, ws, 1)  # unread when not paged
    sbb, sbp = (bt_.stride(0), bt_.stride(1)) if paged is not None else (0, 0)
    bt = next_pow2(int(p.get("MERGE_BLOCK_T", c["BLOCK_T"])))
    launch(_k().indexer_topk_merge_kernel, (cdiv(n, bt),), p, op,
           pk, ws, o, mc, bt_, seq_, n, topk, split, pk.stride(0), int(ps), sbb, sbp,
           o.stride(0), o.stride(1),
           BLOCK_T=bt, BLOCK_S=c["BLOCK_S"], CH=ch, LOG_CH=ch.bit_length() - 1,
           RANK_MERGE=rank, COUNT_MERGES=False, PAGED=paged is not None,
           **launch_opts(p, "merge_", **launch_opts(p)))


def make_paged_indexer_topk(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def paged_indexer_topk(q, k, w, block_table, seq, k_len, page_size, topk, *,
                           merge_counts: torch.Tensor | None = None):
        """The op; ``merge_counts`` as for indexer_topk."""
        check_device("paged_indexer_topk", q=q, k=k, w=w, block_table=block_table, seq=seq,
                     k_len=k_len, merge_counts=merge_counts)
        return _paged_topk(p, "paged_indexer_topk", q, k, w, None, block_table, seq, k_len,
                           page_size, topk, merge_counts)

    return paged_indexer_topk


def make_paged_indexer_topk_fp8(p: dict[str, Any]) -> Callable[..., torch.Tensor]:
    def paged_indexer_topk_fp8(q, k, k_scale, w, block_table, seq, k_len, page_size, topk, *,
                               merge_counts: torch.Tensor | None = None):
        """The op: the pool's e4m3 codes read as they are (one byte a value), q quantized per
        row (`glm5.ir.fp8`) with its scales folded into w, each key's head sum times its row's
        scale (exact for power-of-two scales); then paged_indexer_topk's selection.
        ``merge_counts`` as for indexer_topk."""
        check_device("paged_indexer_topk_fp8", q=q, k=k, k_scale=k_scale, w=w,
                     block_table=block_table, seq=seq, k_len=k_len, merge_counts=merge_counts)
        q8, sq = quantize_rows_e4m3(q)
        return _paged_topk(p, "paged_indexer_topk_fp8", q8, k, w.to(torch.float32) * sq,
                           k_scale.contiguous(), block_table, seq, k_len, page_size, topk,
                           merge_counts)

    return paged_indexer_topk_fp8


def _paged_topk(p: dict[str, Any], op: str, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor,
                sk: torch.Tensor | None, block_table: torch.Tensor, seq: torch.Tensor,
                k_len: torch.Tensor, page_size: int, topk: int,
                merge_counts: torch.Tensor | None) -> torch.Tensor:
    """paged_indexer_topk's launches (``sk``: fp8 codes in q and k, each key's sum times
    sk[pool row])."""
    seq, k_len = seq.contiguous(), k_len.contiguous()
    T, Hi, Di = q.shape
    topk = int(topk)
    _check_counts(op, merge_counts, T, q.device)
    out = torch.empty((T, topk), dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    if k.shape[0] == 0 or block_table.shape[1] == 0:  # no page: no query sees a key
        if merge_counts is not None:
            merge_counts.zero_()
        return out.fill_(-1)
    keys = block_table.shape[1] * int(page_size)  # no sequence has more
    c, ch, rows, rank, split = _merge_plan(p, topk, Hi, Di, T, keys, merge_counts is None)
    ws, pk = _buffers(split, rows, ch, topk, q.device)
    for t0, t1, qs, ws_, o, mc in _groups(T, rows, q, w, out, merge_counts, ws):
        n = t1 - t0
        launch(
            _k().paged_indexer_topk_kernel, (cdiv(n, c["BLOCK_T"]), split), p, op,
            qs, k, ws_, block_table, seq[t0:t1], k_len[t0:t1], ws, o, mc, pk,
            ws if sk is None else sk, n, int(page_size), Hi, Di, topk, split, ws.stride(0),
            pk.stride(0), qs.stride(0), qs.stride(1), qs.stride(2),
            k.stride(0), k.stride(1), ws_.stride(0), ws_.stride(1), block_table.stride(0),
            block_table.stride(1), o.stride(0), o.stride(1),
            CH=ch, LOG_CH=ch.bit_length() - 1, RANK_MERGE=rank,
            COUNT_MERGES=merge_counts is not None, SPLIT_OUT=split > 1,
            DOT_FP32=dot_fp32(q.dtype, k.dtype), KSCALE=sk is not None, **c, **launch_opts(p))
        if split > 1:
            _merge_splits(p, op, c, ch, rank, split, n, topk, ws, pk, o, mc,
                          (block_table, seq[t0:t1], page_size))
    return out


def fp8_dots(device: torch.device) -> bool:
    """Whether Triton's tl.dot takes e4m3 operands on ``device``: the interpreter (exact fp32
    dots of the codes), NVIDIA GPUs from sm_89 (Ada, Hopper); other devices are not known to
    (the op then runs as its decomposition: indexer_topk on the dequantized inputs)."""
    if interpreted():
        return True
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    pt = tuning("indexer_topk")
    max_topk = int(pt.get("MAX_TOPK", 4096))
    p8 = tuning("indexer_topk_fp8")
    max_topk8 = int(p8.get("MAX_TOPK", 4096))
    pp = tuning("paged_indexer_topk")
    paged_max = int(pp.get("MAX_TOPK", 4096))
    pp8 = tuning("paged_indexer_topk_fp8")
    paged_max8 = int(pp8.get("MAX_TOPK", 4096))

    def topk_ok(q, k, w, k_start, k_end, topk) -> bool:
        return int(topk) <= max_topk

    def fp8_ok(q, k, w, k_start, k_end, topk) -> bool:
        return int(topk) <= max_topk8 and fp8_dots(q.device)

    def paged_ok(q, k, w, block_table, seq, k_len, page_size, topk) -> bool:
        return int(topk) <= paged_max

    def paged_fp8_ok(q, k, k_scale, w, block_table, seq, k_len, page_size, topk) -> bool:
        return int(topk) <= paged_max8 and fp8_dots(q.device)

    return [
        ("lightning_indexer", make_lightning_indexer(tuning("lightning_indexer")), FLOATS, None),
        ("indexer_topk", make_indexer_topk(pt), FLOATS, topk_ok),
        ("indexer_topk_fp8", make_indexer_topk_fp8(p8), FLOATS, fp8_ok),
        ("paged_indexer_topk", make_paged_indexer_topk(pp), FLOATS, paged_ok),
        ("paged_indexer_topk_fp8", make_paged_indexer_topk_fp8(pp8), FLOATS, paged_fp8_ok),
    ]
