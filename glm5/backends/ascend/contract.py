"""Contract emulators of the torch_npu fused ops the ascend backend binds to.

This module stands in for the ``torch_npu`` namespace when there is no NPU (torch_npu/CANN must
never be installed on a CPU machine: its autoload entry point breaks ``import torch``). Each
function has the vendor op's name, argument names, argument order and keyword-only split, and
implements the op on CPU tensors from the vendor's *documented* semantics:

- it validates its inputs as the documentation states the real op does (layout strings, head
  counts, head dims, block sizes, dtypes, index conventions) and raises ``ValueError`` naming the
  op and the argument, so a binding that breaks the contract fails here too;
- a documented mode this emulator does not implement (quantized MLA prolog modes, int4 matmuls,
  activation fusion in grouped matmul, ...) raises ``NotImplementedError`` naming the mode, so
  nothing is silently approximated;
- numerics follow the vendor's published golden references where they exist (fp32 accumulation,
  bf16 rounding between stages of the MLA prolog, stable top-k with ties to the smaller index).

Sources (cited per function): the torch_npu API pages (Ascend/op-plugin ``docs``; copies read in
public repositories), the CANN ``ops-transformer`` / ``ops-nn`` aclnn pages and their golden test
files, and vllm-ascend's call sites (``vllm_ascend/device/device_op.py``,
``vllm_ascend/attention/sfa_v1.py``). See docs/vendors.md, "Ascend vendor ops".

Emulation is a contract check, not proof of hardware behaviour: what the documents leave open
(tie order inside the device top-k, rows whose every sparse index is invalid, the rounding rule of
``round``) is stated where it arises.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

I64_MAX = 2**63 - 1
POW2_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
HALF_DTYPES = (torch.float16, torch.bfloat16)

__all__ = [
    "npu_lightning_indexer",
    "npu_sparse_flash_attention",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
    "npu_dynamic_quant",
    "npu_quant_matmul",
    "npu_weight_quant_batchmatmul",
    "npu_grouped_matmul",
    "npu_swiglu",
    "npu_moe_gating_top_k",
]


# --------------------------------------------------------------------------- helpers
def _fail(op: str, arg: str, expected: str, got: Any) -> None:
    raise ValueError(f"contract.{op}: argument {arg!r} expected {expected}, got {got}")


def _req(cond: bool, op: str, arg: str, expected: str, got: Any) -> None:
    if not cond:
        _fail(op, arg, expected, got)


def _tensor(op: str, arg: str, t: Any, dims: Sequence[int] | int | None = None,
            dtypes: Sequence[torch.dtype] | None = None, contiguous: bool = False,
            nonempty: bool = True) -> torch.Tensor:
    _req(isinstance(t, torch.Tensor), op, arg, "a tensor", type(t).__name__)
    if dims is not None:
        ds = (dims,) if isinstance(dims, int) else tuple(dims)
        _req(t.dim() in ds, op, arg, f"a {'/'.join(map(str, ds))}-D tensor", list(t.shape))
    if dtypes is not None:
        _req(t.dtype in dtypes, op, arg, f"dtype in {[str(d) for d in dtypes]}", t.dtype)
    if contiguous:
        _req(t.is_contiguous(), op, arg, "a contiguous tensor (the op rejects non-contiguous "
             "input)", f"strides {t.stride()}")
    if nonempty:
        _req(t.numel() > 0, op, arg, "a non-empty tensor", list(t.shape))
    return t


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]


def _block_size_ok(op: str, arg: str, bs: int) -> None:
    # LI/SFA/MLA-prolog docs: block_size a multiple of 16, at most 1024.
    _req(bs % 16 == 0 and 16 <= bs <= 1024, op, arg,
         "a block_size (dim 1) that is a multiple of 16 and <= 1024", bs)


def _seq_lengths(op: str, arg: str, t: torch.Tensor | None, B: int | None, prefix: bool,
                 ) -> list[int] | None:
    """Per-batch lengths from ``actual_seq_lengths_*`` (int32 [B]); prefix sums for TND."""
    if t is None:
        return None
    _tensor(op, arg, t, 1, (torch.int32,))
    v = _ints(t)
    if B is not None:
        _req(len(v) == B, op, arg, f"length B={B}", len(v))
    _req(all(x >= 0 for x in v), op, arg, "non-negative entries", v)
    if not prefix:
        return v
    _req(all(b >= a for a, b in zip(v, v[1:])), op, arg,
         "a non-decreasing prefix sum (TND layout)", v)
    return [b - a for a, b in zip([0] + v[:-1], v)]


def _split_q(op: str, layout: str, q: torch.Tensor, act_q: torch.Tensor | None,
             arg: str = "actual_seq_lengths_query") -> list[tuple[int, int]]:
    """(row offset into the flattened [T, ...] view, length) per batch for a query tensor."""
    if layout == "TND":
        _req(act_q is not None, op, arg, "a tensor (required when layout_query is TND)", None)
        lens = _seq_lengths(op, arg, act_q, None, prefix=True)
        assert lens is not None
        _req(sum(lens) <= q.shape[0], op, arg, f"a last prefix sum <= T={q.shape[0]}", sum(lens))
        out, off = [], 0
        for n in lens:
            out.append((off, n))
            off += n
        return out
    B, S1 = q.shape[0], q.shape[1]
    lens = _seq_lengths(op, arg, act_q, B, prefix=False) or [S1] * B
    _req(all(n <= S1 for n in lens), op, arg, f"entries <= S1={S1}", lens)
    return [(b * S1, n) for b, n in enumerate(lens)]


def _kv_rows(op: str, layout: str, key: torch.Tensor, act_kv: torch.Tensor | None,
             block_table: torch.Tensor | None, B: int, arg: str) -> list[torch.Tensor]:
    """Per batch, the key rows [S2_b, N2, D] in request-local order (PA_BSND via block_table)."""
    if layout == "PA_BSND":
        _req(act_kv is not None, op, arg, "a tensor (required when the key layout is PA_BSND)",
             None)
        _req(block_table is not None, op, "block_table", "a tensor (required for PA_BSND)", None)
        _tensor(op, "block_table", block_table, 2, (torch.int32,))
        _req(block_table.shape[0] == B, op, "block_table", f"B={B} rows", list(block_table.shape))
        lens = _seq_lengths(op, arg, act_kv, B, prefix=False)
        assert lens is not None
        nb, bs = key.shape[0], key.shape[1]
        _block_size_ok(op, "key", bs)
        need = max((math.ceil(n / bs) for n in lens), default=0)
        _req(block_table.shape[1] >= need, op, "block_table",
             f"at least ceil(max S2 / block_size)={need} columns", block_table.shape[1])
        flat = key.reshape(nb * bs, *key.shape[2:])
        rows = []
        for b, n in enumerate(lens):
            blocks = _ints(block_table[b, : math.ceil(n / bs)])
            _req(all(0 <= i < nb for i in blocks), op, "block_table",
                 f"block ids in [0, {nb})", blocks)
            pos = torch.arange(n)
            phys = torch.tensor(blocks, dtype=torch.long)[pos // bs] * bs + pos % bs \
                if n else pos
            rows.append(flat[phys])
        return rows
    if layout == "TND":
        _req(act_kv is not None, op, arg, "a tensor (required when the key layout is TND)", None)
        lens = _seq_lengths(op, arg, act_kv, B, prefix=True)
        assert lens is not None
        _req(sum(lens) <= key.shape[0], op, arg, f"a last prefix sum <= T2={key.shape[0]}",
             sum(lens))
        out, off = [], 0
        for n in lens:
            out.append(key[off: off + n])
            off += n
        return out
    _req(key.shape[0] == B, op, "key", f"batch B={B} in BSND layout", list(key.shape))
    S2 = key.shape[1]
    lens = _seq_lengths(op, arg, act_kv, B, prefix=False) or [S2] * B
    _req(all(n <= S2 for n in lens), op, arg, f"entries <= S2={S2}", lens)
    return [key[b, :n] for b, n in enumerate(lens)]


def _causal_limit(sparse_mode: int, n_q: int, n_k: int, i: int) -> int:
    """Keys j < limit are visible to query i of a batch. rightDownCausal (sparse_mode 3):
    j <= (L_kv - L_q) + i (ops-transformer torchapi_sparse_flash_attention.md; the
    lightning_indexer golden masks j >= L_kv - L_q + i + 1)."""
    if sparse_mode == 3:
        return max(0, min(n_k, n_k - n_q + i + 1))
    return n_k


def _stable_desc_order(x: torch.Tensor) -> torch.Tensor:
    # Stable sort of -x: equal scores keep ascending index order (ties -> smaller index).
    return torch.sort(x, descending=True, stable=True).indices


# --------------------------------------------------------------------------- lightning indexer
LI_SPARSE_COUNTS = set(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None,
                          actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                          layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=I64_MAX, next_tokens=I64_MAX, return_value=False):
    """Emulates ``torch_npu.npu_lightning_indexer`` -> ``(sparse_indices, sparse_values)``.

    Contract (CANN ops-transformer ``attention/lightning_indexer/docs/aclnnLightningIndexer_en.md``;
    sgl-kernel-npu ``csrc/dsa/docs/custom-npu_lightning_indexer.md``; call site vllm-ascend
    ``device_op.py``: TND query, PA_BSND key, sparse_count 2048, sparse_mode 3):

    - ``query`` fp16/bf16, TND ``[T1, N1, D]`` or BSND ``[B, S1, N1, D]``; N1 <= 64; D = 128.
    - ``key`` same dtype; PA_BSND ``[blocks, block_size, N2, D]`` (block_size a multiple of 16,
      <= 1024, paged through ``block_table`` [B, >= ceil(max S2 / block_size)] int32), BSND
      ``[B, S2, N2, D]`` or TND ``[T2, N2, D]``; N2 = 1.
    - ``weights`` [T1, N1] / [B, S1, N1]: fp16/bf16 matching query, or fp32.
    - ``actual_seq_lengths_query`` int32 [B]: prefix sums for TND (required), per-batch counts
      for BSND. ``actual_seq_lengths_key`` int32 [B]: required for PA_BSND/TND; per-batch counts
      for PA_BSND and BSND, prefix sums for TND.
    - ``sparse_count`` in [1, 2048] or 3072..8192 step 1024; ``sparse_mode`` 0 (no mask) or 3
      (rightDownCausal: query i of a batch sees keys j <= S2 - S1 + i); pre/next_tokens only at
      their default 2^63 - 1.
    - output ``sparse_indices`` int32 [T1, N2, sparse_count] (BSND: [B, S1, N2, sparse_count]):
      request-local key positions in descending score, valid entries first, -1 after. Scores are
      ``sum_h w[h] * relu(q[h] . k)`` in fp32.
    - ``return_value`` (training only; not with PA_BSND) adds ``sparse_values`` of query's dtype.

    Tie order: the op pages do not state one; the CANN golden
    (``tests/pytest/lightning_indexer_golden.py``) sorts stably, ties to the smaller position,
    and so does this emulator (it is also what glm5's docs/ops.md requires).
    """
    op = "npu_lightning_indexer"
    _req(layout_query in ("BSND", "TND"), op, "layout_query", "'BSND' or 'TND'", layout_query)
    _req(layout_key in ("PA_BSND", "BSND", "TND"), op, "layout_key",
         "'PA_BSND', 'BSND' or 'TND'", layout_key)
    qdims = 3 if layout_query == "TND" else 4
    kdims = 3 if layout_key == "TND" else 4
    _tensor(op, "query", query, qdims, HALF_DTYPES, contiguous=True)
    _tensor(op, "key", key, kdims, (query.dtype,), contiguous=True)
    _tensor(op, "weights", weights, qdims - 1, (query.dtype, torch.float32), contiguous=True)
    N1, D = query.shape[-2], query.shape[-1]
    N2 = key.shape[-2]
    _req(N1 <= 64, op, "query", "N1 <= 64 heads", N1)
    _req(D == 128, op, "query", "head dim D = 128", D)
    _req(key.shape[-1] == D, op, "key", f"head dim {D} like query", key.shape[-1])
    _req(N2 == 1, op, "key", "N2 = 1 key head", N2)
    _req(tuple(weights.shape) == tuple(query.shape[:-1]), op, "weights",
         f"shape {list(query.shape[:-1])}", list(weights.shape))
    _req(sparse_count in LI_SPARSE_COUNTS, op, "sparse_count",
         "a value in [1, 2048] or one of 3072..8192 step 1024", sparse_count)
    _req(sparse_mode in (0, 3), op, "sparse_mode", "0 or 3", sparse_mode)
    _req(pre_tokens == I64_MAX and next_tokens == I64_MAX, op, "pre_tokens",
         "the default 2^63-1 (the only supported value)", (pre_tokens, next_tokens))
    if return_value:
        _req(layout_key != "PA_BSND", op, "return_value",
             "False with layout_key PA_BSND (values are a training-only output)", return_value)
    q_batches = _split_q(op, layout_query, query, actual_seq_lengths_query)
    B = len(q_batches)
    k_rows = _kv_rows(op, layout_key, key, actual_seq_lengths_key, block_table, B,
                      "actual_seq_lengths_key")
    qf = query.reshape(-1, N1, D).float()
    wf = weights.reshape(-1, N1).float()
    kf = [r.reshape(r.shape[0], D).float() for r in k_rows]
    rows = qf.shape[0]
    idx = torch.full((rows, 1, sparse_count), -1, dtype=torch.int32)
    vals = torch.full((rows, 1, sparse_count), float("-inf"), dtype=query.dtype)
    for (off, n_q), kb in zip(q_batches, kf):
        n_k = kb.shape[0]
        if n_q == 0 or n_k == 0:
            continue
        scores = torch.einsum("thd,sd->ths", qf[off: off + n_q], kb).relu_()
        scores = torch.einsum("ths,th->ts", scores, wf[off: off + n_q])
        for i in range(n_q):
            lim = _causal_limit(sparse_mode, n_q, n_k, i)
            if lim == 0:
                continue
            order = _stable_desc_order(scores[i, :lim])[:sparse_count]
            idx[off + i, 0, : order.numel()] = order.to(torch.int32)
            vals[off + i, 0, : order.numel()] = scores[i, order].to(query.dtype)
    shape = (query.shape[0], 1, sparse_count) if layout_query == "TND" else \
        (query.shape[0], query.shape[1], 1, sparse_count)
    idx = idx.reshape(shape)
    vals = vals.reshape(shape) if return_value else torch.empty(0, dtype=query.dtype)
    return idx, vals


# --------------------------------------------------------------------------- sparse flash attn
SFA_D, SFA_DR = 512, 64


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *,
                               block_table=None, actual_seq_lengths_query=None,
                               actual_seq_lengths_kv=None, query_rope=None, key_rope=None,
                               sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=I64_MAX, next_tokens=I64_MAX,
                               attention_mode=0, return_softmax_lse=False):
    """Emulates ``torch_npu.npu_sparse_flash_attention`` ->
    ``(attention_out, softmax_max, softmax_sum)``.

    Contract (torch_npu API page ``torch_npu.npu_sparse_flash_attention``; CANN ops-transformer
    ``attention/sparse_flash_attention/docs/torchapi_sparse_flash_attention.md``; call site
    vllm-ascend ``device_op.py`` ``execute_sparse_flash_attention_process``):

    - MLA-absorb only: ``attention_mode`` must be 2 (the only supported value); ``query`` /
      ``key`` carry the nope part (D = 512), ``query_rope`` / ``key_rope`` the rope part
      (Dr = 64, both required); ``value`` shares ``key``'s storage (or is None).
    - ``query`` fp16/bf16, TND ``[T1, N1, 512]`` or BSND ``[B, S1, N1, 512]``; N1 in
      {1, 2, 4, ..., 128}. ``key`` PA_BSND ``[blocks, block_size, 1, 512]`` (block_size a
      multiple of 16, <= 1024, with ``block_table``), BSND or TND; N2 = 1. With a BSND/TND key
      the query layout must be the same.
    - ``sparse_indices`` int32 [T1, 1, K] (BSND: [B, S1, 1, K]), K > 0: block ids (token ids for
      ``sparse_block_size`` 1) into the request's own key sequence; valid entries first, -1 after.
      Index b selects keys [b * sparse_block_size, (b+1) * sparse_block_size) clipped to the
      batch's kv length. ``sparse_block_size`` a power of 2 in [1, 128] dividing block_size.
    - ``sparse_mode`` 0 (only the selection) or 3 (selection plus rightDownCausal,
      j <= L_kv - L_q + i).
    - out = softmax(scale * [q|q_rope] . [k|k_rope]) @ k over the selected keys, query's dtype.
      ``return_softmax_lse`` returns fp32 ``softmax_max`` (max of the scaled scores) and
      ``softmax_sum`` (sum of exp(score - max)), both [N2, T1, N1/N2] (BSND: [B, N2, S1, N1/N2]);
      otherwise empty [0] placeholders. The torch_npu page allows it only when layout_kv is not
      PA_BSND; the emulator enforces that.

    A row with no valid selected key is not described by the documents; the emulator returns the
    online-softmax initial state (out 0, softmax_max -inf, softmax_sum 0).
    """
    op = "npu_sparse_flash_attention"
    _req(attention_mode == 2, op, "attention_mode", "2 (MLA-absorb, the only supported mode)",
         attention_mode)
    _req(layout_query in ("BSND", "TND"), op, "layout_query", "'BSND' or 'TND'", layout_query)
    _req(layout_kv in ("PA_BSND", "BSND", "TND"), op, "layout_kv",
         "'PA_BSND', 'BSND' or 'TND'", layout_kv)
    if layout_kv != "PA_BSND":
        _req(layout_kv == layout_query, op, "layout_kv",
             f"the query layout {layout_query!r} when it is not PA_BSND", layout_kv)
    qdims = 3 if layout_query == "TND" else 4
    kdims = 3 if layout_kv == "TND" else 4
    _tensor(op, "query", query, qdims, HALF_DTYPES, contiguous=True)
    _tensor(op, "key", key, kdims, (query.dtype,), contiguous=layout_kv != "PA_BSND")
    if value is not None:
        _req(value.shape == key.shape and value.data_ptr() == key.data_ptr()
             and value.stride() == key.stride(), op, "value",
             "None or the key tensor itself (key and value share storage in attention_mode 2)",
             "a different tensor")
    _req(query_rope is not None and key_rope is not None, op, "query_rope",
         "query_rope and key_rope tensors (rope may not be empty)", None)
    _tensor(op, "query_rope", query_rope, qdims, (query.dtype,), contiguous=True)
    _tensor(op, "key_rope", key_rope, kdims, (query.dtype,), contiguous=layout_kv != "PA_BSND")
    N1 = query.shape[-2]
    _req(N1 in POW2_HEADS, op, "query", f"N1 in {POW2_HEADS}", N1)
    _req(query.shape[-1] == SFA_D and key.shape[-1] == SFA_D, op, "query",
         f"D = {SFA_D} for query and key", (query.shape[-1], key.shape[-1]))
    _req(query_rope.shape[-1] == SFA_DR and key_rope.shape[-1] == SFA_DR, op, "query_rope",
         f"Dr = {SFA_DR} for query_rope and key_rope",
         (query_rope.shape[-1], key_rope.shape[-1]))
    _req(tuple(query_rope.shape[:-1]) == tuple(query.shape[:-1]), op, "query_rope",
         f"leading shape {list(query.shape[:-1])}", list(query_rope.shape))
    _req(tuple(key_rope.shape[:-1]) == tuple(key.shape[:-1]), op, "key_rope",
         f"leading shape {list(key.shape[:-1])}", list(key_rope.shape))
    _req(key.shape[-2] == 1, op, "key", "N2 = 1 key head", key.shape[-2])
    _req(sparse_block_size in (1, 2, 4, 8, 16, 32, 64, 128), op, "sparse_block_size",
         "a power of 2 in [1, 128]", sparse_block_size)
    if layout_kv == "PA_BSND":
        _req(key.shape[1] % sparse_block_size == 0, op, "sparse_block_size",
             f"a divisor of block_size={key.shape[1]}", sparse_block_size)
        _req(not return_softmax_lse, op, "return_softmax_lse",
             "False with layout_kv PA_BSND (the torch_npu page allows it only otherwise)",
             return_softmax_lse)
    _req(sparse_mode in (0, 3), op, "sparse_mode", "0 or 3", sparse_mode)
    _req(pre_tokens == I64_MAX and next_tokens == I64_MAX, op, "pre_tokens",
         "the default 2^63-1 (the only supported value)", (pre_tokens, next_tokens))
    _tensor(op, "sparse_indices", sparse_indices, qdims, (torch.int32,), contiguous=True)
    _req(tuple(sparse_indices.shape[:-2]) == tuple(query.shape[:-2])
         and sparse_indices.shape[-2] == 1 and sparse_indices.shape[-1] > 0, op,
         "sparse_indices", f"shape {list(query.shape[:-2]) + [1, 'K>0']}",
         list(sparse_indices.shape))
    q_batches = _split_q(op, layout_query, query, actual_seq_lengths_query)
    B = len(q_batches)
    k_rows = _kv_rows(op, layout_kv, key, actual_seq_lengths_kv, block_table, B,
                      "actual_seq_lengths_kv")
    kr_rows = _kv_rows(op, layout_kv, key_rope, actual_seq_lengths_kv, block_table, B,
                       "actual_seq_lengths_kv")
    qf = torch.cat((query, query_rope), -1).reshape(-1, N1, SFA_D + SFA_DR).float()
    si = sparse_indices.reshape(-1, sparse_indices.shape[-1])
    rows = qf.shape[0]
    out = torch.zeros(rows, N1, SFA_D, dtype=torch.float32)
    smax = torch.full((rows, N1), float("-inf"))
    ssum = torch.zeros(rows, N1)
    for (off, n_q), kb, krb in zip(q_batches, k_rows, kr_rows):
        n_k = kb.shape[0]
        kcat = torch.cat((kb.reshape(n_k, SFA_D), krb.reshape(n_k, SFA_DR)), -1).float()
        n_blocks = math.ceil(n_k / sparse_block_size)
        for i in range(n_q):
            row = _ints(si[off + i])
            nv = next((j for j, v in enumerate(row) if v == -1), len(row))
            _req(all(v == -1 for v in row[nv:]), op, "sparse_indices",
                 "valid entries first and -1 after them in each row", row)
            valid = row[:nv]
            _req(all(0 <= v < n_blocks for v in valid), op, "sparse_indices",
                 f"entries in [0, {n_blocks}) (blocks of the batch's kv length {n_k}) or -1",
                 valid)
            keys = torch.cat([torch.arange(v * sparse_block_size,
                                           min((v + 1) * sparse_block_size, n_k))
                              for v in valid]) if valid else torch.zeros(0, dtype=torch.long)
            keys = keys[keys < _causal_limit(sparse_mode, n_q, n_k, i)]
            if keys.numel() == 0:
                continue
            s = scale_value * (qf[off + i] @ kcat[keys].T)  # [N1, n]
            m = s.amax(-1)
            p = torch.exp(s - m[:, None])
            out[off + i] = (p @ kcat[keys, :SFA_D]) / p.sum(-1, keepdim=True)
            smax[off + i], ssum[off + i] = m, p.sum(-1)
    out = out.to(query.dtype).reshape(query.shape)
    if not return_softmax_lse:
        return out, torch.empty(0), torch.empty(0)
    if layout_query == "TND":
        return out, smax[None], ssum[None]
    Bq, S1 = query.shape[0], query.shape[1]
    shape = (Bq, S1, 1, N1)
    return out, smax.reshape(shape).transpose(1, 2), ssum.reshape(shape).transpose(1, 2)


# --------------------------------------------------------------------------- MLA prolog
MLA_HE = (7168, 7680)
MLA_HCQ, MLA_D, MLA_DR, MLA_HCKV = 1536, 128, 64, 512
MLA_CACHE_MODES = ("PA_BSND", "PA_NZ", "PA_BLK_BSND", "PA_BLK_NZ", "BSND", "TND")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back to fp32: the golden rounds each matmul output to bf16."""
    return x.to(torch.bfloat16).float()


def _rope_deinterleaved(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """The prolog golden's ROPE: de-interleave pairs (x[2i], x[2i+1]) into halves, then rotate
    NeoX-style with full-width cos/sin [.., Dr]. The result stays in half-split order."""
    h = x.shape[-1] // 2
    xd = torch.cat((x[..., 0::2], x[..., 1::2]), -1)
    rot = torch.cat((-xd[..., h:], xd[..., :h]), -1)
    return xd * cos + rot * sin


def _mla_prolog_core(op, token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
                     rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache,
                     kr_cache, cache_index, eps_cq, eps_ckv, cache_mode, quant):
    _req(cache_mode in MLA_CACHE_MODES, op, "cache_mode", f"one of {MLA_CACHE_MODES}",
         cache_mode)
    if cache_mode != "PA_BSND":
        raise NotImplementedError(f"contract.{op}: cache_mode {cache_mode!r} is documented but "
                                  f"not emulated (only 'PA_BSND')")
    if any(v is not None for v in quant):
        raise NotImplementedError(f"contract.{op}: quantized inputs/outputs (dequant/quant "
                                  f"scales) are documented but not emulated")
    bf = (torch.bfloat16,)
    _tensor(op, "token_x", token_x, 2, bf, contiguous=True, nonempty=False)
    T, He = token_x.shape
    _req(He in MLA_HE, op, "token_x", f"He in {MLA_HE}", He)
    _tensor(op, "weight_dq", weight_dq, 2, bf, contiguous=True)
    _req(tuple(weight_dq.shape) == (He, MLA_HCQ), op, "weight_dq", f"shape [{He}, {MLA_HCQ}]",
         list(weight_dq.shape))
    _tensor(op, "weight_uk", weight_uk, 3, bf, contiguous=True)
    N = weight_uk.shape[0]
    _req(N in POW2_HEADS, op, "weight_uk", f"N in {POW2_HEADS}", N)
    _req(tuple(weight_uk.shape) == (N, MLA_D, MLA_HCKV), op, "weight_uk",
         f"shape [N, {MLA_D}, {MLA_HCKV}]", list(weight_uk.shape))
    _tensor(op, "weight_uq_qr", weight_uq_qr, 2, bf, contiguous=True)
    _req(tuple(weight_uq_qr.shape) == (MLA_HCQ, N * (MLA_D + MLA_DR)), op, "weight_uq_qr",
         f"shape [{MLA_HCQ}, N*(D+Dr)={N * (MLA_D + MLA_DR)}]", list(weight_uq_qr.shape))
    _tensor(op, "weight_dkv_kr", weight_dkv_kr, 2, bf, contiguous=True)
    _req(tuple(weight_dkv_kr.shape) == (He, MLA_HCKV + MLA_DR), op, "weight_dkv_kr",
         f"shape [{He}, {MLA_HCKV + MLA_DR}]", list(weight_dkv_kr.shape))
    _tensor(op, "rmsnorm_gamma_cq", rmsnorm_gamma_cq, 1, bf)
    _req(rmsnorm_gamma_cq.shape[0] == MLA_HCQ, op, "rmsnorm_gamma_cq", f"[{MLA_HCQ}]",
         list(rmsnorm_gamma_cq.shape))
    _tensor(op, "rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, 1, bf)
    _req(rmsnorm_gamma_ckv.shape[0] == MLA_HCKV, op, "rmsnorm_gamma_ckv", f"[{MLA_HCKV}]",
         list(rmsnorm_gamma_ckv.shape))
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        _tensor(op, name, t, 2, bf, contiguous=True, nonempty=False)
        _req(tuple(t.shape) == (T, MLA_DR), op, name, f"shape [T={T}, {MLA_DR}]", list(t.shape))
    for name, t, d in (("kv_cache", kv_cache, MLA_HCKV), ("kr_cache", kr_cache, MLA_DR)):
        _tensor(op, name, t, 4, bf, contiguous=True, nonempty=False)
        _req(t.shape[2] == 1 and t.shape[3] == d, op, name, f"shape [blocks, block_size, 1, {d}]",
             list(t.shape))
        _block_size_ok(op, name, t.shape[1])
    _req(kv_cache.shape[:2] == kr_cache.shape[:2], op, "kr_cache",
         f"the block layout of kv_cache {list(kv_cache.shape[:2])}", list(kr_cache.shape[:2]))
    L = kv_cache.shape[0] * kv_cache.shape[1]
    _tensor(op, "cache_index", cache_index, 1, (torch.int64,), nonempty=False)
    _req(cache_index.shape[0] == T, op, "cache_index", f"shape [T={T}]", list(cache_index.shape))
    ci = _ints(cache_index)
    _req(all(0 <= v < L for v in ci), op, "cache_index", f"entries in [0, {L})", ci)

    # Stage order and bf16 roundings follow ops-transformer's prolog golden (GeneralizedPrologV2).
    x = token_x.float()
    c_q = _bf16(x @ weight_dq.float())
    c_q = c_q / torch.sqrt(c_q.pow(2).mean(-1, keepdim=True) + eps_cq) * rmsnorm_gamma_cq.float()
    c_q = _bf16(c_q)
    q = _bf16(c_q @ weight_uq_qr.float()).reshape(T, N, MLA_D + MLA_DR)
    q_n = torch.einsum("tnd,ndc->tnc", q[..., :MLA_D], weight_uk.float())
    sin, cos = rope_sin.float()[:, None], rope_cos.float()[:, None]
    q_r = _rope_deinterleaved(q[..., MLA_D:], sin, cos)
    kv = _bf16(x @ weight_dkv_kr.float())
    ckv = kv[:, :MLA_HCKV]
    ckv = ckv / torch.sqrt(ckv.pow(2).mean(-1, keepdim=True) + eps_ckv) * \
        rmsnorm_gamma_ckv.float()
    k_r = _rope_deinterleaved(kv[:, MLA_HCKV:], sin[:, 0], cos[:, 0])
    if T:
        idx = torch.tensor(ci, dtype=torch.long)
        kv_cache.view(L, MLA_HCKV)[idx] = ckv.to(kv_cache.dtype)
        kr_cache.view(L, MLA_DR)[idx] = k_r.to(kr_cache.dtype)
    return q_n.to(torch.bfloat16), q_r.to(torch.bfloat16), c_q.to(torch.bfloat16)


def npu_mla_prolog_v3(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
                      rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache,
                      kr_cache, *, cache_index=None, dequant_scale_x=None,
                      dequant_scale_w_dq=None, dequant_scale_w_uq_qr=None,
                      dequant_scale_w_dkv_kr=None, quant_scale_ckv=None, quant_scale_ckr=None,
                      smooth_scales_cq=None, actual_seq_len=None, k_nope_clip_alpha=None,
                      rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND",
                      query_norm_flag=False, weight_quant_mode=0, kv_cache_quant_mode=0,
                      query_quant_mode=0, ckvkr_repo_mode=0, quant_scale_repo_mode=0,
                      tile_size=128, qc_qr_scale=1.0, kc_scale=1.0):
    """Emulates ``torch_npu.npu_mla_prolog_v3`` (non-quantized mode) -> ``(query, query_rope,
    dequant_scale_q_nope, query_norm, dequant_scale_q_norm)``; kv_cache/kr_cache updated in place.

    Contract (torch_npu API page ``torch_npu.npu_mla_prolog_v3``): token_x bf16 [T, He],
    He in {7168, 7680}; weight_dq [He, Hcq=1536]; weight_uq_qr [Hcq, N*(D+Dr)] with per-head
    [q_nope(128) | q_rope(64)]; weight_uk [N, 128, Hckv=512]; weight_dkv_kr [He, 512+64];
    N in {1, 2, ..., 128}; rope_sin, rope_cos [T, Dr] (note: sin before cos); kv_cache
    [blocks, block_size, 1, 512] and kr_cache [blocks, block_size, 1, 64] in PA_BSND with
    block_size a multiple of 16 in [16, 1024]; cache_index int64 [T] linear slots in
    [0, blocks*block_size). Outputs: query q^N = (RmsNorm(x W^DQ) W^UQ) W^UK [T, N, 512] bf16,
    query_rope [T, N, 64] bf16, dequant_scale_q_nope [0] (non-quantized), query_norm c^Q
    [T, Hcq] bf16 when ``query_norm_flag`` (else [0]), dequant_scale_q_norm [0].

    ROPE layout (ops-transformer prolog golden): the rope input pairs (x[2i], x[2i+1]) are
    de-interleaved and rotated NeoX-style with full-width cos/sin, so query_rope and the kr_cache
    rows come out in half-split order [rotated evens | rotated odds].
    Only weight_quant_mode/kv_cache_quant_mode/query_quant_mode 0, ckvkr/quant_scale repo mode 0
    and qc_qr_scale = kc_scale = 1.0 are emulated.
    """
    op = "npu_mla_prolog_v3"
    if (weight_quant_mode, kv_cache_quant_mode, query_quant_mode, ckvkr_repo_mode,
            quant_scale_repo_mode) != (0, 0, 0, 0, 0) or (qc_qr_scale, kc_scale) != (1.0, 1.0):
        raise NotImplementedError(f"contract.{op}: only the non-quantized mode with unit scale "
                                  f"corrections is emulated")
    _req(cache_index is not None, op, "cache_index", "a tensor for the PA_BSND cache mode", None)
    q, qr, cq = _mla_prolog_core(
        op, token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index,
        rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode,
        (dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
         quant_scale_ckv, quant_scale_ckr, smooth_scales_cq, k_nope_clip_alpha, actual_seq_len))
    empty = torch.empty(0)
    return q, qr, empty, (cq if query_norm_flag else torch.empty(0, dtype=torch.bfloat16)), \
        empty.clone()


def npu_mla_prolog_v2(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
                      rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index,
                      kv_cache, kr_cache, *, dequant_scale_x=None, dequant_scale_w_dq=None,
                      dequant_scale_w_uq_qr=None, dequant_scale_w_dkv_kr=None,
                      quant_scale_ckv=None, quant_scale_ckr=None, smooth_scales_cq=None,
                      rmsnorm_epsilon_cq=1e-05, rmsnorm_epsilon_ckv=1e-05, cache_mode="PA_BSND"):
    """Emulates ``torch_npu.npu_mla_prolog_v2`` (non-quantized mode) -> ``(query, query_rope,
    kv_cache_out, kr_cache_out, dequant_scale_q_nope)``.

    Same computation and constraints as v3 (torch_npu API page ``torch_npu.npu_mla_prolog_v2``;
    v2 fixes He = 7168 and block_size in {16, 128}), ``cache_index`` positional before the caches,
    and **no query_norm output**: v2 cannot serve glm5's ``mla_prolog`` (whose ``c_q`` feeds the
    indexer), which is why the binding uses v3.
    """
    op = "npu_mla_prolog_v2"
    _req(isinstance(token_x, torch.Tensor) and token_x.dim() == 2 and token_x.shape[1] == 7168,
         op, "token_x", "[T, He=7168]", getattr(token_x, "shape", None))
    _req(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4
         and kv_cache.shape[1] in (16, 128), op, "kv_cache", "block_size 16 or 128",
         getattr(kv_cache, "shape", None))
    q, qr, _ = _mla_prolog_core(
        op, token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index,
        rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode,
        (dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
         quant_scale_ckv, quant_scale_ckr, smooth_scales_cq))
    return q, qr, kv_cache, kr_cache, torch.empty(1)


# --------------------------------------------------------------------------- quantized matmuls
def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
    """Emulates ``torch_npu.npu_dynamic_quant`` -> ``(y int8, scale fp32 [x.shape[:-1]])``.

    Contract (torch_npu API page ``torch_npu.npu_dynamic_quant``): x fp16/bf16, dim > 1;
    per-token symmetric ``scale = rowMax(|x|) / 127``, ``y = round(x / scale)`` in fp32.
    The page does not state the rounding tie rule (half-to-even is used here) nor what an
    all-zero row gives (the emulator returns scale 0 and codes 0). Only ``dst_type`` int8 /
    None and no smooth scales are emulated.
    """
    op = "npu_dynamic_quant"
    _tensor(op, "x", x, None, HALF_DTYPES)
    _req(x.dim() > 1, op, "x", "a tensor of dim > 1", x.dim())
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"contract.{op}: dst_type {dst_type} (int4) is not emulated")
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError(f"contract.{op}: smooth_scales/group_index are not emulated")
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(xf / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return y, scale


def _matrix_rhs(op: str, arg: str, t: torch.Tensor) -> None:
    # The right matrix may be a contiguous [k, n] tensor or the transpose view of a contiguous
    # [n, k] one (the pages list transposed weights as supported; NZ formats are not emulated).
    _req(t.is_contiguous() or t.transpose(-1, -2).is_contiguous(), op, arg,
         "a contiguous [k, n] tensor or the transpose of a contiguous [n, k] one",
         f"strides {t.stride()}")


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, group_sizes=None):
    """Emulates ``torch_npu.npu_quant_matmul`` for the int8 per-token path (W8A8 dynamic).

    Contract (torch_npu API page ``torch_npu.npu_quant_matmul``, Table 2; call site vllm-ascend
    ``quantization/methods/w8a8_dynamic.py``): x1 int8 [m, k], x2 int8 [k, n], last dims
    <= 65535; scale fp32/bf16 [1 or n]; pertoken_scale fp32 [m]; bias int32/bf16/fp16/fp32 [n];
    output_dtype bf16 (scale fp32/bf16) or fp16 (scale fp32). Computes
    ``(x1 @ x2 [+ int32 bias]) * scale * pertoken_scale [+ float bias]`` with an exact integer
    product. int8/int32 outputs, int64 scales, offsets, int4 (int32-packed) inputs and >2-D
    batches are documented but not emulated.
    """
    op = "npu_quant_matmul"
    _tensor(op, "x1", x1, 2, (torch.int8,))
    _tensor(op, "x2", x2, 2, (torch.int8,))
    _matrix_rhs(op, "x2", x2)
    m, k = x1.shape
    _req(x2.shape[0] == k, op, "x2", f"k = {k} rows", list(x2.shape))
    n = x2.shape[1]
    _req(k <= 65535 and n <= 65535, op, "x2", "last dims <= 65535", (k, n))
    if offset is not None or group_sizes is not None:
        raise NotImplementedError(f"contract.{op}: offset/group_sizes are not emulated")
    _req(pertoken_scale is not None, op, "pertoken_scale",
         "a tensor (only the per-token path is emulated)", None)
    _tensor(op, "pertoken_scale", pertoken_scale, 1, (torch.float32,))
    _req(pertoken_scale.shape[0] == m, op, "pertoken_scale", f"shape [m={m}]",
         list(pertoken_scale.shape))
    _req(output_dtype in HALF_DTYPES, op, "output_dtype",
         "bfloat16 or float16 with pertoken_scale", output_dtype)
    allowed = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else \
        (torch.float32,)
    _tensor(op, "scale", scale, 1, allowed)
    _req(scale.shape[0] in (1, n), op, "scale", f"shape [1] or [n={n}]", list(scale.shape))
    acc = x1.double() @ x2.double()  # exact: |sum| < 2^53
    if bias is not None:
        _tensor(op, "bias", bias, 1, (torch.int32, torch.bfloat16, torch.float16, torch.float32))
        _req(bias.shape[0] == n, op, "bias", f"shape [n={n}]", list(bias.shape))
        if bias.dtype == torch.int32:
            acc = acc + bias.double()
    y = acc.float() * scale.float() * pertoken_scale[:, None]
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
                                 quant_scale=None, quant_offset=None, bias=None,
                                 antiquant_group_size=0, inner_precise=0):
    """Emulates ``torch_npu.npu_weight_quant_batchmatmul`` (int8 weight, float output).

    Contract (torch_npu API page; CANN ops-nn ``aclnnWeightQuantBatchMatmulV2.md``; call site
    vllm-ascend ``quantization/methods/w8a16.py``): ``y = x @ ((weight + antiquant_offset) *
    antiquant_scale) + bias``. x fp16/bf16 [m, k]; weight int8 [k, n] (contiguous or a transpose
    view); antiquant_scale/offset of x's dtype, per channel [n] / [1, n] or per group
    [ceil(k / g), n] with ``antiquant_group_size`` g; bias [n] of x's dtype or fp32. Output x's
    dtype with fp32 accumulation. quant_scale/quant_offset (int8 output) are not emulated.
    """
    op = "npu_weight_quant_batchmatmul"
    _tensor(op, "x", x, 2, HALF_DTYPES)
    _tensor(op, "weight", weight, 2, (torch.int8,))
    _matrix_rhs(op, "weight", weight)
    k, n = weight.shape
    _req(x.shape[1] == k, op, "weight", f"k = {x.shape[1]} rows", list(weight.shape))
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError(f"contract.{op}: output quantization is not emulated")
    _tensor(op, "antiquant_scale", antiquant_scale, (1, 2), (x.dtype,))
    g = antiquant_group_size
    if g:
        _req(g % 32 == 0 and 32 <= g < k, op, "antiquant_group_size",
             "a multiple of 32 in [32, k)", g)
        want = (math.ceil(k / g), n)
    else:
        want = (n,) if antiquant_scale.dim() == 1 else (1, n)
    _req(tuple(antiquant_scale.shape) == want, op, "antiquant_scale", f"shape {list(want)}",
         list(antiquant_scale.shape))
    w = weight.float()
    if antiquant_offset is not None:
        _tensor(op, "antiquant_offset", antiquant_offset, antiquant_scale.dim(), (x.dtype,))
        _req(antiquant_offset.shape == antiquant_scale.shape, op, "antiquant_offset",
             f"the shape of antiquant_scale {list(antiquant_scale.shape)}",
             list(antiquant_offset.shape))
    off = antiquant_offset.float() if antiquant_offset is not None else None
    sc = antiquant_scale.float()
    if g:
        sc = sc.repeat_interleave(g, 0)[:k]
        off = off.repeat_interleave(g, 0)[:k] if off is not None else None
    else:
        sc = sc.reshape(1, n)
        off = off.reshape(1, n) if off is not None else None
    w = ((w + off) if off is not None else w) * sc
    y = x.float() @ w
    if bias is not None:
        _tensor(op, "bias", bias, 1, (x.dtype, torch.float32))
        _req(bias.shape[0] == n, op, "bias", f"shape [n={n}]", list(bias.shape))
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------- grouped matmul, swiglu
GMM_INNER_LIMIT = 65536


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    """Emulates ``torch_npu.npu_grouped_matmul`` (non-quantized) -> ``List[Tensor]``.

    Contract (torch_npu API page ``torch_npu.npu_grouped_matmul``, A2/A3 tables; MoE call sites
    vllm-ascend ``ops/fused_moe/moe_mlp.py``, ``device_op.py``):

    - ``group_type`` 0 (group along m), "single-single-single": ``x`` = [one 2-D tensor
      [M, K]] whose rows are sorted by group, ``weight`` = [one 3-D tensor [E, K, N]] (a
      transpose view of [E, N, K] is accepted), ``split_item`` 2 or 3 (one output [M, N]),
      ``group_list`` an int64 tensor of length E (at most 1024): cumulative row counts
      (``group_list_type`` 0, non-decreasing, last = M) or per-group counts (type 1,
      non-negative, sum = M, length not 1).
    - ``group_type`` -1 with ``group_list`` None: lists of 2-D x_i and weight_i, one output each
      (split_item 0/1).
    - dtypes: x and weight both fp16, bf16 or fp32 (fp32 only single-tensor); bias [N] per group
      (fp16 for fp16, fp32 for bf16/fp32). Last dims < 65536; list lengths <= 128.
    Quantized/fake-quantized paths, ``group_list_type`` 2 and ``act_type`` != 0 are documented
    but not emulated.
    """
    op = "npu_grouped_matmul"
    _req(isinstance(x, (list, tuple)) and 0 < len(x) <= 128, op, "x",
         "a list of 1..128 tensors", type(x).__name__)
    _req(isinstance(weight, (list, tuple)) and 0 < len(weight) <= 128, op, "weight",
         "a list of 1..128 tensors", type(weight).__name__)
    if any(v is not None for v in (scale, offset, antiquant_scale, antiquant_offset,
                                   per_token_scale, activation_input, activation_quant_scale,
                                   activation_quant_offset)):
        raise NotImplementedError(f"contract.{op}: quantized and fake-quantized paths are not "
                                  f"emulated")
    if act_type != 0:
        raise NotImplementedError(f"contract.{op}: act_type {act_type} is not emulated")
    dts = (torch.float16, torch.bfloat16, torch.float32)
    xd = x[0].dtype if isinstance(x[0], torch.Tensor) else None
    for i, t in enumerate(x):
        _tensor(op, f"x[{i}]", t, 2, dts, contiguous=True)
        _req(t.dtype == xd, op, f"x[{i}]", f"the dtype of x[0] ({xd})", t.dtype)
        _req(t.shape[-1] < GMM_INNER_LIMIT, op, f"x[{i}]", f"a last dim < {GMM_INNER_LIMIT}",
             t.shape[-1])
    for i, t in enumerate(weight):
        _tensor(op, f"weight[{i}]", t, (2, 3), (xd,))
        _matrix_rhs(op, f"weight[{i}]", t)
        _req(max(t.shape[-1], t.shape[-2]) < GMM_INNER_LIMIT, op, f"weight[{i}]",
             f"dims < {GMM_INNER_LIMIT}", list(t.shape))
    _req(output_dtype in (None, xd), op, "output_dtype", f"None or {xd} (non-quantized)",
         output_dtype)
    bias_dt = torch.float16 if xd == torch.float16 else torch.float32
    if group_type == 0:
        _req(isinstance(group_list, torch.Tensor), op, "group_list",
             "an int64 tensor with group_type 0", type(group_list).__name__)
        _tensor(op, "group_list", group_list, 1, (torch.int64,))
        _req(split_item in (2, 3), op, "split_item", "2 or 3 (single output) for "
             "single-single-single", split_item)
        _req(len(x) == 1 and len(weight) == 1 and weight[0].dim() == 3, op, "weight",
             "one 3-D [E, K, N] tensor with one 2-D x (single-single-single)",
             [list(w.shape) for w in weight])
        xs, w = x[0], weight[0]
        E = w.shape[0]
        _req(group_list.shape[0] == E and E <= 1024, op, "group_list",
             f"length E={E} (at most 1024 groups)", group_list.shape[0])
        _req(w.shape[1] == xs.shape[1], op, "weight", f"K = {xs.shape[1]}", list(w.shape))
        gl = _ints(group_list)
        if group_list_type == 0:
            _req(all(v >= 0 for v in gl) and all(b >= a for a, b in zip(gl, gl[1:]))
                 and gl[-1] == xs.shape[0], op, "group_list",
                 f"a non-decreasing cumsum ending at M={xs.shape[0]} (group_list_type 0)", gl)
            ends = gl
        elif group_list_type == 1:
            _req(len(gl) != 1 and all(v >= 0 for v in gl) and sum(gl) == xs.shape[0], op,
                 "group_list", f"non-negative counts summing to M={xs.shape[0]}, length not 1 "
                 f"(group_list_type 1)", gl)
            ends = list(torch.tensor(gl).cumsum(0).tolist())
        elif group_list_type == 2:
            raise NotImplementedError(f"contract.{op}: group_list_type 2 is not emulated")
        else:
            _fail(op, "group_list_type", "0, 1 or 2", group_list_type)
        bs = None
        if bias is not None:
            _req(len(bias) == 1, op, "bias", "one tensor like weight", len(bias))
            _tensor(op, "bias[0]", bias[0], 2, (bias_dt,))
            _req(tuple(bias[0].shape) == (E, w.shape[2]), op, "bias[0]", f"[{E}, {w.shape[2]}]",
                 list(bias[0].shape))
            bs = bias[0].float()
        y = torch.empty(xs.shape[0], w.shape[2], dtype=torch.float32)
        start = 0
        for e, end in enumerate(ends):
            y[start:end] = xs[start:end].float() @ w[e].float()
            if bs is not None:
                y[start:end] += bs[e]
            start = end
        return [y.to(xd)]
    if group_type in (None, -1):
        _req(group_list is None, op, "group_list", "None with group_type -1/None (list inputs)",
             type(group_list).__name__)
        _req(split_item in (0, 1), op, "split_item", "0 or 1 (one output per weight)",
             split_item)
        _req(len(x) == len(weight), op, "x", f"{len(weight)} tensors like weight", len(x))
        outs = []
        for i, (xi, wi) in enumerate(zip(x, weight)):
            _req(wi.dim() == 2 and wi.shape[0] == xi.shape[1], op, f"weight[{i}]",
                 f"a 2-D [{xi.shape[1]}, N] tensor", list(wi.shape))
            yi = xi.float() @ wi.float()
            if bias is not None:
                _tensor(op, f"bias[{i}]", bias[i], 1, (bias_dt,))
                yi = yi + bias[i].float()
            outs.append(yi.to(xd))
        return outs
    if group_type == 2:
        raise NotImplementedError(f"contract.{op}: group_type 2 (k-axis) is not emulated")
    _fail(op, "group_type", "-1, 0 or 2", group_type)


def npu_swiglu(x, dim=-1):
    """Emulates ``torch_npu.npu_swiglu``: ``silu(a) * b`` with ``a, b = chunk(x, 2, dim)``
    (torch_npu "PyTorch API mapping" page: native equivalent ``silu(chunk[0]) * chunk[1]``);
    x fp16/bf16/fp32, computed in fp32, output x's dtype."""
    op = "npu_swiglu"
    _tensor(op, "x", x, None, (torch.float16, torch.bfloat16, torch.float32), nonempty=False)
    _req(x.shape[dim] % 2 == 0, op, "x", f"an even size along dim {dim}", list(x.shape))
    a, b = x.float().chunk(2, dim)
    return (F.silu(a) * b).to(x.dtype)


# --------------------------------------------------------------------------- MoE gating
def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
                         renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """Emulates ``torch_npu.npu_moe_gating_top_k`` -> ``(y, expert_idx int32, norm_out fp32)``.

    Contract (torch_npu API page ``torch_npu.npu_moe_gating_top_k`` and its "equivalent
    computation logic"): x [T, E] fp16/bf16/fp32 with E <= 2048; bias [E] of x's dtype;
    ``norm_type`` 0 softmax / 1 sigmoid (the page's parameter text states the reverse, its
    equivalent code and vllm-ascend's DeepSeek call (norm_type=1 with a correction bias) use
    1 = sigmoid; the code is followed); ``sel = norm + bias``; with ``group_count`` > 1 the
    groups (E / group_count > 2 experts each, ceil32(E / group_count) * group_count <= 2048)
    are scored by their max (``group_select_mode`` 0) or top-2 sum (1), the best ``k_group``
    kept (stable: ties to the smaller group), others -inf; ``expert_idx`` = stable top-k of
    sel (ties to the smaller id), ``1 <= k <= E / group_count * k_group``;
    ``y = norm[idx]``, divided by ``(sum + eps)`` **only for sigmoid** (norm_type 1), times
    ``routed_scaling_factor``, in x's dtype. ``renorm`` must be 0. ``norm_out`` is the fp32
    normalised x when ``out_flag``; otherwise the page calls it invalid and the emulator fills
    it with NaN so that reading it shows.
    """
    op = "npu_moe_gating_top_k"
    _tensor(op, "x", x, 2, (torch.float16, torch.bfloat16, torch.float32))
    T, E = x.shape
    _req(E <= 2048, op, "x", "E <= 2048 experts", E)
    _req(renorm == 0, op, "renorm", "0 (the only supported value)", renorm)
    _req(norm_type in (0, 1), op, "norm_type", "0 (softmax) or 1 (sigmoid)", norm_type)
    _req(group_select_mode in (0, 1), op, "group_select_mode", "0 (max) or 1 (top-2 sum)",
         group_select_mode)
    _req(group_count > 0 and E % group_count == 0, op, "group_count", f"a divisor of E={E}",
         group_count)
    per = E // group_count
    if group_count > 1:
        _req(per > 2, op, "group_count", "groups of more than 2 experts", per)
        _req(math.ceil(per / 32) * 32 * group_count <= 2048, op, "group_count",
             "ceil32(E / group_count) * group_count <= 2048", group_count)
    _req(1 <= k_group <= group_count, op, "k_group", f"in [1, group_count={group_count}]",
         k_group)
    _req(1 <= k <= per * k_group, op, "k", f"in [1, E/group_count*k_group={per * k_group}]", k)
    if bias is not None:
        _tensor(op, "bias", bias, 1, (x.dtype,))
        _req(bias.shape[0] == E, op, "bias", f"shape [E={E}]", list(bias.shape))
    xf = x.float()
    norm = torch.softmax(xf, -1) if norm_type == 0 else torch.sigmoid(xf)
    sel = norm + bias.float() if bias is not None else norm.clone()
    if group_count > 1:
        g = sel.reshape(T, group_count, per)
        gscore = g.amax(-1) if group_select_mode == 0 else \
            torch.sort(g, dim=-1, descending=True).values[..., :2].sum(-1)
        keep = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group]
        mask = torch.ones(T, group_count, dtype=torch.bool).scatter_(1, keep, False)
        sel = g.masked_fill(mask[..., None], float("-inf")).reshape(T, E)
    idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    y = norm.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    norm_out = norm if out_flag else torch.full_like(norm, float("nan"))
    return y.to(x.dtype), idx.to(torch.int32), norm_out
