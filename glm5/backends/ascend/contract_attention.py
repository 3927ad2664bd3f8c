"""CPU emulators of torch_npu's DSA attention ops: ``npu_lightning_indexer``,
``npu_sparse_flash_attention`` and ``npu_mla_prolog_v2`` / ``npu_mla_prolog_v3``.

Exposed through :mod:`glm5.backends.ascend.contract` (the ``torch_npu`` stand-in); see its
docstring for the emulation rules. Per-op contracts and sources are in each function's docstring.
Numerics: scores in fp32; stable top-k with ties to the smaller key position (the CANN
lightning-indexer golden); the MLA prolog rounds each matmul output to bf16 and applies ROPE to
de-interleaved pairs, as ops-transformer's prolog golden does. What the documents leave open (a
sparse-attention row with no valid selected key) is stated where it arises.
"""

from __future__ import annotations

import math

import torch

from glm5.backends.ascend.contract_checks import (
    HALF_DTYPES, I64_MAX, POW2_HEADS, block_size_ok, causal_limit, ints, kv_rows, req, split_q,
    stable_desc_order, tensor)


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
    req(layout_query in ("BSND", "TND"), op, "layout_query", "'BSND' or 'TND'", layout_query)
    req(layout_key in ("PA_BSND", "BSND", "TND"), op, "layout_key",
         "'PA_BSND', 'BSND' or 'TND'", layout_key)
    qdims = 3 if layout_query == "TND" else 4
    kdims = 3 if layout_key == "TND" else 4
    tensor(op, "query", query, qdims, HALF_DTYPES, contiguous=True)
    tensor(op, "key", key, kdims, (query.dtype,), contiguous=True)
    tensor(op, "weights", weights, qdims - 1, (query.dtype, torch.float32), contiguous=True)
    N1, D = query.shape[-2], query.shape[-1]
    N2 = key.shape[-2]
    req(N1 <= 64, op, "query", "N1 <= 64 heads", N1)
    req(D == 128, op, "query", "head dim D = 128", D)
    req(key.shape[-1] == D, op, "key", f"head dim {D} like query", key.shape[-1])
    req(N2 == 1, op, "key", "N2 = 1 key head", N2)
    req(tuple(weights.shape) == tuple(query.shape[:-1]), op, "weights",
         f"shape {list(query.shape[:-1])}", list(weights.shape))
    req(sparse_count in LI_SPARSE_COUNTS, op, "sparse_count",
         "a value in [1, 2048] or one of 3072..8192 step 1024", sparse_count)
    req(sparse_mode in (0, 3), op, "sparse_mode", "0 or 3", sparse_mode)
    req(pre_tokens == I64_MAX and next_tokens == I64_MAX, op, "pre_tokens",
         "the default 2^63-1 (the only supported value)", (pre_tokens, next_tokens))
    if return_value:
        req(layout_key != "PA_BSND", op, "return_value",
             "False with layout_key PA_BSND (values are a training-only output)", return_value)
    q_batches = split_q(op, layout_query, query, actual_seq_lengths_query)
    B = len(q_batches)
    k_rows = kv_rows(op, layout_key, key, actual_seq_lengths_key, block_table, B,
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
            lim = causal_limit(sparse_mode, n_q, n_k, i)
            if lim == 0:
                continue
            order = stable_desc_order(scores[i, :lim])[:sparse_count]
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
    req(attention_mode == 2, op, "attention_mode", "2 (MLA-absorb, the only supported mode)",
         attention_mode)
    req(layout_query in ("BSND", "TND"), op, "layout_query", "'BSND' or 'TND'", layout_query)
    req(layout_kv in ("PA_BSND", "BSND", "TND"), op, "layout_kv",
         "'PA_BSND', 'BSND' or 'TND'", layout_kv)
    if layout_kv != "PA_BSND":
        req(layout_kv == layout_query, op, "layout_kv",
             f"the query layout {layout_query!r} when it is not PA_BSND", layout_kv)
    qdims = 3 if layout_query == "TND" else 4
    kdims = 3 if layout_kv == "TND" else 4
    tensor(op, "query", query, qdims, HALF_DTYPES, contiguous=True)
    tensor(op, "key", key, kdims, (query.dtype,), contiguous=layout_kv != "PA_BSND")
    if value is not None:
        req(value.shape == key.shape and value.data_ptr() == key.data_ptr()
             and value.stride() == key.stride(), op, "value",
             "None or the key tensor itself (key and value share storage in attention_mode 2)",
             "a different tensor")
    req(query_rope is not None and key_rope is not None, op, "query_rope",
         "query_rope and key_rope tensors (rope may not be empty)", None)
    tensor(op, "query_rope", query_rope, qdims, (query.dtype,), contiguous=True)
    tensor(op, "key_rope", key_rope, kdims, (query.dtype,), contiguous=layout_kv != "PA_BSND")
    N1 = query.shape[-2]
    req(N1 in POW2_HEADS, op, "query", f"N1 in {POW2_HEADS}", N1)
    req(query.shape[-1] == SFA_D and key.shape[-1] == SFA_D, op, "query",
         f"D = {SFA_D} for query and key", (query.shape[-1], key.shape[-1]))
    req(query_rope.shape[-1] == SFA_DR and key_rope.shape[-1] == SFA_DR, op, "query_rope",
         f"Dr = {SFA_DR} for query_rope and key_rope",
         (query_rope.shape[-1], key_rope.shape[-1]))
    req(tuple(query_rope.shape[:-1]) == tuple(query.shape[:-1]), op, "query_rope",
         f"leading shape {list(query.shape[:-1])}", list(query_rope.shape))
    req(tuple(key_rope.shape[:-1]) == tuple(key.shape[:-1]), op, "key_rope",
         f"leading shape {list(key.shape[:-1])}", list(key_rope.shape))
    req(key.shape[-2] == 1, op, "key", "N2 = 1 key head", key.shape[-2])
    req(sparse_block_size in (1, 2, 4, 8, 16, 32, 64, 128), op, "sparse_block_size",
         "a power of 2 in [1, 128]", sparse_block_size)
    if layout_kv == "PA_BSND":
        req(key.shape[1] % sparse_block_size == 0, op, "sparse_block_size",
             f"a divisor of block_size={key.shape[1]}", sparse_block_size)
        req(not return_softmax_lse, op, "return_softmax_lse",
             "False with layout_kv PA_BSND (the torch_npu page allows it only otherwise)",
             return_softmax_lse)
    req(sparse_mode in (0, 3), op, "sparse_mode", "0 or 3", sparse_mode)
    req(pre_tokens == I64_MAX and next_tokens == I64_MAX, op, "pre_tokens",
         "the default 2^63-1 (the only supported value)", (pre_tokens, next_tokens))
    tensor(op, "sparse_indices", sparse_indices, qdims, (torch.int32,), contiguous=True)
    req(tuple(sparse_indices.shape[:-2]) == tuple(query.shape[:-2])
         and sparse_indices.shape[-2] == 1 and sparse_indices.shape[-1] > 0, op,
         "sparse_indices", f"shape {list(query.shape[:-2]) + [1, 'K>0']}",
         list(sparse_indices.shape))
    q_batches = split_q(op, layout_query, query, actual_seq_lengths_query)
    B = len(q_batches)
    k_rows = kv_rows(op, layout_kv, key, actual_seq_lengths_kv, block_table, B,
                      "actual_seq_lengths_kv")
    kr_rows = kv_rows(op, layout_kv, key_rope, actual_seq_lengths_kv, block_table, B,
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
            row = ints(si[off + i])
            nv = next((j for j, v in enumerate(row) if v == -1), len(row))
            req(all(v == -1 for v in row[nv:]), op, "sparse_indices",
                 "valid entries first and -1 after them in each row", row)
            valid = row[:nv]
            req(all(0 <= v < n_blocks for v in valid), op, "sparse_indices",
                 f"entries in [0, {n_blocks}) (blocks of the batch's kv length {n_k}) or -1",
                 valid)
            keys = torch.cat([torch.arange(v * sparse_block_size,
                                           min((v + 1) * sparse_block_size, n_k))
                              for v in valid]) if valid else torch.zeros(0, dtype=torch.long)
            keys = keys[keys < causal_limit(sparse_mode, n_q, n_k, i)]
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
    req(cache_mode in MLA_CACHE_MODES, op, "cache_mode", f"one of {MLA_CACHE_MODES}",
         cache_mode)
    if cache_mode != "PA_BSND":
        raise NotImplementedError(f"contract.{op}: cache_mode {cache_mode!r} is documented but "
                                  f"not emulated (only 'PA_BSND')")
    if any(v is not None for v in quant):
        raise NotImplementedError(f"contract.{op}: quantized inputs/outputs (dequant/quant "
                                  f"scales) are documented but not emulated")
    bf = (torch.bfloat16,)
    tensor(op, "token_x", token_x, 2, bf, contiguous=True, nonempty=False)
    T, He = token_x.shape
    req(He in MLA_HE, op, "token_x", f"He in {MLA_HE}", He)
    tensor(op, "weight_dq", weight_dq, 2, bf, contiguous=True)
    req(tuple(weight_dq.shape) == (He, MLA_HCQ), op, "weight_dq", f"shape [{He}, {MLA_HCQ}]",
         list(weight_dq.shape))
    tensor(op, "weight_uk", weight_uk, 3, bf, contiguous=True)
    N = weight_uk.shape[0]
    req(N in POW2_HEADS, op, "weight_uk", f"N in {POW2_HEADS}", N)
    req(tuple(weight_uk.shape) == (N, MLA_D, MLA_HCKV), op, "weight_uk",
         f"shape [N, {MLA_D}, {MLA_HCKV}]", list(weight_uk.shape))
    tensor(op, "weight_uq_qr", weight_uq_qr, 2, bf, contiguous=True)
    req(tuple(weight_uq_qr.shape) == (MLA_HCQ, N * (MLA_D + MLA_DR)), op, "weight_uq_qr",
         f"shape [{MLA_HCQ}, N*(D+Dr)={N * (MLA_D + MLA_DR)}]", list(weight_uq_qr.shape))
    tensor(op, "weight_dkv_kr", weight_dkv_kr, 2, bf, contiguous=True)
    req(tuple(weight_dkv_kr.shape) == (He, MLA_HCKV + MLA_DR), op, "weight_dkv_kr",
         f"shape [{He}, {MLA_HCKV + MLA_DR}]", list(weight_dkv_kr.shape))
    tensor(op, "rmsnorm_gamma_cq", rmsnorm_gamma_cq, 1, bf)
    req(rmsnorm_gamma_cq.shape[0] == MLA_HCQ, op, "rmsnorm_gamma_cq", f"[{MLA_HCQ}]",
         list(rmsnorm_gamma_cq.shape))
    tensor(op, "rmsnorm_gamma_ckv", rmsnorm_gamma_ckv, 1, bf)
    req(rmsnorm_gamma_ckv.shape[0] == MLA_HCKV, op, "rmsnorm_gamma_ckv", f"[{MLA_HCKV}]",
         list(rmsnorm_gamma_ckv.shape))
    for name, t in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        tensor(op, name, t, 2, bf, contiguous=True, nonempty=False)
        req(tuple(t.shape) == (T, MLA_DR), op, name, f"shape [T={T}, {MLA_DR}]", list(t.shape))
    for name, t, d in (("kv_cache", kv_cache, MLA_HCKV), ("kr_cache", kr_cache, MLA_DR)):
        tensor(op, name, t, 4, bf, contiguous=True, nonempty=False)
        req(t.shape[2] == 1 and t.shape[3] == d, op, name, f"shape [blocks, block_size, 1, {d}]",
             list(t.shape))
        block_size_ok(op, name, t.shape[1])
    req(kv_cache.shape[:2] == kr_cache.shape[:2], op, "kr_cache",
         f"the block layout of kv_cache {list(kv_cache.shape[:2])}", list(kr_cache.shape[:2]))
    L = kv_cache.shape[0] * kv_cache.shape[1]
    tensor(op, "cache_index", cache_index, 1, (torch.int64,), nonempty=False)
    req(cache_index.shape[0] == T, op, "cache_index", f"shape [T={T}]", list(cache_index.shape))
    ci = ints(cache_index)
    req(all(0 <= v < L for v in ci), op, "cache_index", f"entries in [0, {L})", ci)

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
    req(cache_index is not None, op, "cache_index", "a tensor for the PA_BSND cache mode", None)
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
    req(isinstance(token_x, torch.Tensor) and token_x.dim() == 2 and token_x.shape[1] == 7168,
         op, "token_x", "[T, He=7168]", getattr(token_x, "shape", None))
    req(isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4
         and kv_cache.shape[1] in (16, 128), op, "kv_cache", "block_size 16 or 128",
         getattr(kv_cache, "shape", None))
    q, qr, _ = _mla_prolog_core(
        op, token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
        rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache, kr_cache, cache_index,
        rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode,
        (dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
         quant_scale_ckv, quant_scale_ckr, smooth_scales_cq))
    return q, qr, kv_cache, kr_cache, torch.empty(1)
