"""Bindings of glm5 ops onto torch_npu's fused ops (the ascend backend's vendor kernels).

Each binding takes the glm5 op's arguments exactly as docs/ops.md lists them, converts layouts to the
vendor op's contract (TND / PA_BSND / block tables / prefix-sum sequence lengths / transposed
weights), calls the vendor op through ``npu()`` and converts the result back. Its ``supports``
predicate declines the calls the vendor op cannot express (head dims, head counts, dtypes, quant
schemes), so the dispatcher passes them to the next backend.

``npu()`` returns the namespace to call: the real ``torch_npu`` module on Ascend hardware, or
:mod:`glm5.backends.ascend.contract` (CPU emulators of the documented contracts) in emulation.
It is resolved at call time; this module never imports torch_npu.

Each binding carries the implementation label of the vendor op it calls
(``torch_npu.npu_lightning_indexer``, ...; `glm5.backends.api.implemented_by`); quant_linear,
which calls one of two vendor ops by scheme, and moe_experts, which calls none for an all-padding
routing, report the one they ran (`glm5.backends.api.report_impl`).

The facts each binding relies on are cited in its docstring and collected in docs/vendors.md
("Ascend vendor ops"). Bindings read index tensors on the host (segmentation of the indexer's key
ranges, expert counts): one device sync per call, as vllm-ascend's metadata builders do.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from glm5.backends.api import implemented_by, report_impl
from glm5.ir.quant_formats import SCHEMES

HALF = (torch.bfloat16, torch.float16)
POW2_HEADS = frozenset({1, 2, 4, 8, 16, 32, 64, 128})

# Lightning indexer (aclnnLightningIndexer constraints): N1 <= 64, D = 128, N2 = 1.
LI_MAX_HEADS, LI_HEAD_DIM = 64, 128
LI_SPARSE_COUNTS = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
# Key block size used to page glm5's flat indexer keys (multiple of 16, <= 1024; vllm-ascend runs
# its caches with 128-token blocks).
LI_BLOCK_SIZE = 128
# Sparse flash attention, MLA-absorb (torch_npu page): D = 512, Dr = 64, N1 power of 2 <= 128.
SFA_D, SFA_DR = 512, 64
# MLA prolog v3 documented shapes (torch_npu page): DeepSeek-V3 sizes only.
MLA_HE, MLA_HCQ, MLA_D, MLA_DR, MLA_HCKV = frozenset({7168, 7680}), 1536, 128, 64, 512
MLA_BLOCK_SIZE = 16
# npu_grouped_matmul: at most 1024 groups (single-single-single), inner dims < 65536.
GMM_MAX_GROUPS, GMM_INNER_LIMIT = 1024, 65536
# npu_quant_matmul: last dims <= 65535.
QMM_MAX_DIM = 65535
# npu_moe_gating_top_k: E <= 2048.
GATING_MAX_EXPERTS = 2048

# Implementation labels (the vendor ops the bindings call).
LI_IMPL = "torch_npu.npu_lightning_indexer"
SFA_IMPL = "torch_npu.npu_sparse_flash_attention"
MLA_IMPL = "torch_npu.npu_mla_prolog_v3"
WQBMM_IMPL = "torch_npu.npu_weight_quant_batchmatmul"
QMM_IMPL = "torch_npu.npu_dynamic_quant+npu_quant_matmul"
QL_IMPL = "torch_npu.npu_weight_quant_batchmatmul|npu_quant_matmul"
GMM_IMPL = "torch_npu.npu_grouped_matmul"
GMM_EMPTY_IMPL = "torch:no-routed-rows"  # every id is -1: zeros, no vendor op is called
GATING_IMPL = "torch_npu.npu_moe_gating_top_k"


def _i32(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=device)


# =========================================================================== indexer_topk
def _indexer_segments(k_start: list[int], k_end: list[int]) -> list[tuple[int, int, int, int]]:
    """Split queries into vendor batches: ``(t0, t1, key_start, S2)`` per batch.

    A batch of S1 queries with S2 keys under rightDownCausal (sparse_mode 3) gives query i the
    key positions [0, max(0, S2 - S1 + i + 1)). So a run of consecutive queries sharing
    ``k_start`` whose range lengths grow by one per query (after any leading empty rows) is one
    batch, keys ``k_start .. k_start + S2``. Greedy grouping always succeeds (a single query is a
    batch of S1 = 1 whose range is all of its S2 keys), so every glm5 call is expressible.
    """
    segs: list[tuple[int, int, int, int]] = []
    t0 = 0
    T = len(k_start)
    for t in range(1, T + 1):
        if t < T:
            prev, cur = k_end[t - 1] - k_start[t - 1], k_end[t] - k_start[t]
            same = k_start[t] == k_start[t - 1] and (cur == prev + 1 or cur == prev == 0)
            if same:
                continue
        segs.append((t0, t, k_start[t0], k_end[t - 1] - k_start[t0]))
        t0 = t
    return segs


def _page_keys(k: torch.Tensor, segs: list[tuple[int, int, int, int]], bs: int,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """glm5's flat keys [S, D] as a PA_BSND cache [blocks, bs, 1, D] plus a block table.

    Sequences starting on a block boundary address the padded key tensor directly (a view when
    S is a multiple of bs); an unaligned start gets its rows gathered once into extra blocks
    (shared by every batch with that start)."""
    S, D = k.shape
    nb = max(1, math.ceil(S / bs))
    main = k if S == nb * bs else torch.cat((k, k.new_zeros(nb * bs - S, D)))
    extra: list[torch.Tensor] = []
    start_block: dict[int, int] = {}
    longest: dict[int, int] = {}
    for _, _, a, n in segs:
        if a % bs:
            longest[a] = max(longest.get(a, 0), n)
    next_block = nb
    for a, n in longest.items():
        nblk = max(1, math.ceil(n / bs))
        rows = k[a: a + n]
        extra.append(torch.cat((rows, k.new_zeros(nblk * bs - n, D))))
        start_block[a] = next_block
        next_block += nblk
    width = max(1, max(math.ceil(n / bs) for _, _, _, n in segs))
    table = []
    for _, _, a, n in segs:
        first = a // bs if a % bs == 0 else start_block[a]
        used = math.ceil(n / bs)
        table.append([first + j for j in range(used)] + [0] * (width - used))
    cache = torch.cat([main] + extra) if extra else main
    return cache.reshape(-1, bs, 1, D), _i32(table, k.device)


def indexer_topk_supports(q, k, w, k_start, k_end, topk) -> bool:
    """What npu_lightning_indexer can express: q/k fp16 or bf16 of one dtype, Hi <= 64 heads,
    Di = 128, a documented sparse_count, no empty tensors."""
    T, Hi, Di = q.shape
    return (q.dtype in HALF and k.dtype == q.dtype and Hi <= LI_MAX_HEADS and Di == LI_HEAD_DIM
            and topk in LI_SPARSE_COUNTS and T > 0 and k.shape[0] > 0)


def make_indexer_topk(npu: Callable[[], Any]) -> Callable[..., torch.Tensor]:
    @implemented_by(LI_IMPL)
    def indexer_topk(q, k, w, k_start, k_end, topk):
        """glm5 ``indexer_topk`` -> int32 [T, topk] through ``npu_lightning_indexer``.

        q [T, Hi, 128] is the TND query; the per-query key ranges become vendor batches (see
        ``_indexer_segments``): ``actual_seq_lengths_query`` = prefix sums of the batch sizes
        (TND convention), ``actual_seq_lengths_key`` = per-batch key counts (PA_BSND convention),
        keys paged into 128-token blocks with a block table, ``sparse_count = topk``,
        ``sparse_mode = 3``. w is passed as fp32 (a widening, exact; the op accepts fp32
        weights with fp16/bf16 queries). The returned request-local positions are shifted by each
        batch's key start; -1 stays -1. Tie order comes from the device top-k: the CANN golden
        breaks ties to the smaller position (= smaller glm5 key index), the API page is silent.
        """
        T = q.shape[0]
        dev = q.device
        ks, ke = [int(v) for v in k_start.tolist()], [int(v) for v in k_end.tolist()]
        segs = _indexer_segments(ks, ke)
        key, table = _page_keys(k.contiguous(), segs, LI_BLOCK_SIZE)
        cu_q, acc = [], 0
        for t0, t1, _, _ in segs:
            acc += t1 - t0
            cu_q.append(acc)
        idx, _ = npu().npu_lightning_indexer(
            q.contiguous(), key, w.float().contiguous(),
            actual_seq_lengths_query=_i32(cu_q, dev),
            actual_seq_lengths_key=_i32([n for _, _, _, n in segs], dev),
            block_table=table, layout_query="TND", layout_key="PA_BSND",
            sparse_count=topk, sparse_mode=3)
        idx = idx.reshape(T, topk)
        base = torch.as_tensor(ks, dtype=torch.int32, device=dev)[:, None]
        return torch.where(idx >= 0, idx + base, torch.full_like(idx, -1))

    return indexer_topk


# =========================================================================== sparse_attention
def _v_is_latent_prefix(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v holds the first Dv columns of k (a view, or equal values after a copy)."""
    Dv = v.shape[-1]
    if v.shape[:-1] != k.shape[:-1] or Dv > k.shape[-1]:
        return False
    if v.data_ptr() == k.data_ptr() and v.stride() == k.stride():
        return True
    return bool(torch.equal(v, k[..., :Dv]))


def sparse_attention_supports(q, k, v, idx, scale) -> bool:
    """The absorbed-MLA case npu_sparse_flash_attention serves: Hk = 1, Dqk = 512 + 64,
    Dv = 512 with v the first 512 columns of k, H in {1, 2, 4, ..., 128}, fp16/bf16, no empty
    tensors."""
    T, H, Dqk = q.shape
    S, Hk, _ = k.shape
    return (q.dtype in HALF and Hk == 1 and Dqk == SFA_D + SFA_DR and v.shape[-1] == SFA_D
            and H in POW2_HEADS and T > 0 and S > 0 and idx.shape[1] > 0
            and _v_is_latent_prefix(k, v))


def make_sparse_attention(npu: Callable[[], Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    @implemented_by(SFA_IMPL)
    def sparse_attention(q, k, v, idx, scale):
        """glm5 ``sparse_attention`` (absorbed MLA) -> (out [T, H, 512], lse [T, H] fp32)
        through ``npu_sparse_flash_attention`` with ``attention_mode=2``.

        q splits into query [T, H, 512] | query_rope [T, H, 64]; k [S, 1, 576] into key
        [S, 1, 512] | key_rope [S, 1, 64] (copies: the op wants contiguous nope/rope tensors;
        value is key, as MLA-absorb requires). One batch: TND query and TND key with
        ``actual_seq_lengths_query = [T]``, ``actual_seq_lengths_kv = [S]`` (prefix sums),
        ``sparse_mode = 0`` (glm5's indices carry no causal rule). TND rather than PA_BSND
        because the torch_npu page returns softmax_max/softmax_sum only when layout_kv is not
        PA_BSND. glm5 allows -1 anywhere in a row; the op wants valid entries first, so each row
        is compacted stably. ``lse = softmax_max + log(softmax_sum)`` (natural log of the scaled
        scores). Rows with no valid index get out 0 and lse -inf (docs/ops.md; the vendor pages do
        not define that case). To confirm on A2/A3: the torch_npu page calls the lse outputs
        "supported only during training when layout_kv is not PA_BSND" (docs/vendors.md).
        """
        T, H, _ = q.shape
        S = k.shape[0]
        dev = q.device
        qn, qr = q[..., :SFA_D].contiguous(), q[..., SFA_D:].contiguous()
        kn, kr = k[..., :SFA_D].contiguous(), k[..., SFA_D:].contiguous()
        invalid = idx < 0
        order = torch.sort(invalid.to(torch.int8), dim=1, stable=True).indices
        si = torch.gather(idx, 1, order).to(torch.int32).reshape(T, 1, -1).contiguous()
        out, smax, ssum = npu().npu_sparse_flash_attention(
            qn, kn, kn, si, float(scale),
            actual_seq_lengths_query=_i32([T], dev), actual_seq_lengths_kv=_i32([S], dev),
            query_rope=qr, key_rope=kr, sparse_block_size=1, layout_query="TND",
            layout_kv="TND", sparse_mode=0, attention_mode=2, return_softmax_lse=True)
        lse = (smax.reshape(T, H) + torch.log(ssum.reshape(T, H))).float()
        empty = invalid.all(dim=1)
        if bool(empty.any()):
            out = out.masked_fill(empty[:, None, None], 0)
            lse = lse.masked_fill(empty[:, None], float("-inf"))
        return out.reshape(T, H, SFA_D), lse

    return sparse_attention


# =========================================================================== mla_prolog
def _interleave_halves(x: torch.Tensor) -> torch.Tensor:
    """[a_0..a_{h-1} | b_0..b_{h-1}] -> [a_0, b_0, a_1, b_1, ...] (the prolog's half-split rope
    output back to glm5's interleaved layout)."""
    h = x.shape[-1] // 2
    return torch.stack((x[..., :h], x[..., h:]), dim=-1).flatten(-2)


def mla_prolog_supports(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots,
                        absorb) -> bool:
    """The documented npu_mla_prolog_v3 shapes: He in {7168, 7680}, Hcq 1536, N a power of 2
    <= 128, D 128, Dr 64, Hckv 512, everything bf16, and ``absorb`` (the op only returns the
    absorbed query). GLM-5's own sizes (6144 / 2048 / 192) are not documented and decline."""
    T, D = x.shape
    H, Dn, Rkv = w_uk.shape
    tensors = (x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin)
    return (bool(absorb) and all(t.dtype == torch.bfloat16 for t in tensors)
            and D in MLA_HE and w_qa.shape[0] == MLA_HCQ and H in POW2_HEADS and Dn == MLA_D
            and Rkv == MLA_HCKV and cos.shape[-1] * 2 == MLA_DR
            and w_qb.shape[0] == H * (MLA_D + MLA_DR))


def make_mla_prolog(npu: Callable[[], Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    @implemented_by(MLA_IMPL)
    def mla_prolog(x, w_qa, g_qa, w_qb, w_kva, g_kva, w_uk, cos, sin, eps, kv_cache, slots,
                   absorb):
        """glm5 ``mla_prolog`` (absorb) -> (q_main [T, H, 512], q_pe [T, H, 64], c_q [T, 1536])
        through ``npu_mla_prolog_v3(..., query_norm_flag=True)``.

        v3, not v2: only v3 returns ``query_norm`` (c^Q, the indexer's input, glm5's c_q).
        Weights go in the vendor's orientation: weight_dq = w_qaᵀ [He, Hcq], weight_uq_qr =
        w_qbᵀ [Hcq, N(D+Dr)] (same per-head nope|rope split), weight_uk = w_uk [N, D, Hckv],
        weight_dkv_kr = w_kvaᵀ [He, Hckv+Dr] (transposed per call here; a deployment repacks
        once, to FRACTAL_NZ). rope_sin/rope_cos are full width [T, 64] = the half-angle tables
        repeated twice, because the op rotates de-interleaved halves NeoX-style; its query_rope
        and kr rows come back half-split and are re-interleaved to glm5's layout. glm5's
        kv_cache [N, 512+64] is not the op's split PA_BSND pair, so the op writes token t into
        row t of scratch kv/kr caches (16-token blocks, cache_index = arange(T)) and the binding
        copies rows with slot >= 0 into kv_cache[slot] (slot -1 skipped, as docs/ops.md says).
        """
        T = x.shape[0]
        dev = x.device
        nblk = max(1, math.ceil(T / MLA_BLOCK_SIZE))
        kv_tmp = torch.zeros(nblk, MLA_BLOCK_SIZE, 1, MLA_HCKV, dtype=torch.bfloat16, device=dev)
        kr_tmp = torch.zeros(nblk, MLA_BLOCK_SIZE, 1, MLA_DR, dtype=torch.bfloat16, device=dev)
        rope_sin = torch.cat((sin, sin), dim=-1).contiguous()
        rope_cos = torch.cat((cos, cos), dim=-1).contiguous()
        q_main, q_rope, _, c_q, _ = npu().npu_mla_prolog_v3(
            x.contiguous(), w_qa.t().contiguous(), w_qb.t().contiguous(), w_uk.contiguous(),
            w_kva.t().contiguous(), g_qa.contiguous(), g_kva.contiguous(), rope_sin, rope_cos,
            kv_tmp, kr_tmp, cache_index=torch.arange(T, dtype=torch.int64, device=dev),
            rmsnorm_epsilon_cq=float(eps), rmsnorm_epsilon_ckv=float(eps), cache_mode="PA_BSND",
            query_norm_flag=True)
        keep = slots >= 0
        if bool(keep.any()):
            rows = torch.cat((kv_tmp.reshape(-1, MLA_HCKV)[:T],
                              _interleave_halves(kr_tmp.reshape(-1, MLA_DR)[:T])), dim=-1)
            kv_cache[slots[keep].long()] = rows[keep].to(kv_cache.dtype)
        return q_main, _interleave_halves(q_rope).contiguous(), c_q

    return mla_prolog


# =========================================================================== quant_linear
def quant_linear_supports(x, w_packed, w_scale, scheme, bias=None) -> bool:
    """w8a16 (npu_weight_quant_batchmatmul) and w8a8 (npu_dynamic_quant + npu_quant_matmul
    with per-token scales) for fp16/bf16 activations. The grouped schemes decline: w4a8 /
    w6a12 are per-group-of-128 and vllm-ascend has no per-group W4A8 linear (its W4A8 is
    per-channel, MoE-only, and rejects group_size > 0; msModelSlim has no int6)."""
    M, K = x.shape
    N = w_packed.shape[0]
    return (scheme in ("w8a16", "w8a8") and x.dtype in HALF and M > 0 and N > 0 and K > 0
            and (scheme == "w8a16" or max(K, N) <= QMM_MAX_DIM))


def make_quant_linear(npu: Callable[[], Any]) -> Callable[..., torch.Tensor]:
    @implemented_by(QL_IMPL)
    def quant_linear(x, w_packed, w_scale, scheme, bias=None):
        """glm5 ``quant_linear`` for w8a16 / w8a8 -> [M, N] of x's dtype.

        w8a16: ``npu_weight_quant_batchmatmul(x, weight=w_packedᵀ [K, N], antiquant_scale=
        w_scale [N] in x's dtype)`` (the op takes its antiquant scale in the activation dtype,
        as vllm-ascend's w8a16 method stores it; a bf16/fp16 rounding of the fp32 scale). w8a8:
        ``npu_dynamic_quant(x)`` (per-token, amax/127) then ``npu_quant_matmul(x_q, w_packedᵀ,
        scale=w_scale [N] fp32, pertoken_scale=s_x, output_dtype=x.dtype)``: exact int8 sums
        times both scales, as docs/ops.md defines. bias is passed to the vendor op in fp32 (exact).
        """
        sc = SCHEMES[scheme]
        w = w_packed.contiguous().t()  # [K, N]: both ops accept the transpose of contiguous
        b = bias.float() if bias is not None else None
        if sc.act_bits is None:
            report_impl(WQBMM_IMPL)
            return npu().npu_weight_quant_batchmatmul(x, w, w_scale.to(x.dtype), bias=b)
        report_impl(QMM_IMPL)
        xq, sx = npu().npu_dynamic_quant(x)
        return npu().npu_quant_matmul(xq, w, w_scale.float(), pertoken_scale=sx.reshape(-1),
                                      bias=b, output_dtype=x.dtype)

    return quant_linear


# =========================================================================== moe_experts
def moe_experts_supports(x, ids, weights, w13, w2) -> bool:
    """npu_grouped_matmul single-single-single along m: fp16/bf16/fp32 (x, w13, w2 of one
    dtype), at most 1024 experts, inner dims < 65536."""
    E, I2, D = w13.shape
    return (x.dtype in (torch.float16, torch.bfloat16, torch.float32) and E <= GMM_MAX_GROUPS
            and max(D, I2) < GMM_INNER_LIMIT and x.shape[0] > 0)


def make_moe_experts(npu: Callable[[], Any]) -> Callable[..., torch.Tensor]:
    @implemented_by(GMM_IMPL)
    def moe_experts(x, ids, weights, w13, w2):
        """glm5 ``moe_experts`` -> [T, D] through two ``npu_grouped_matmul`` calls and
        ``npu_swiglu``.

        The (token, slot) pairs with id >= 0 are sorted stably by expert; the gathered rows
        x_sorted [M, D] run through ``npu_grouped_matmul([x_sorted], [w13ᵀ per expert
        [E, D, 2I]], group_type=0, split_item=3, group_list=counts)`` with per-expert counts
        (``group_list_type=1``) — or their cumsum (type 0) when E = 1, since type 1 may not have
        length 1 — then ``npu_swiglu`` (silu of the first half times the second, glm5's
        silu_mul), the second grouped matmul with w2ᵀ [E, I, D], and a weighted scatter-add in
        fp32 back to the tokens. Ids -1 never reach the vendor op.
        """
        T, D = x.shape
        k = ids.shape[1]
        E = w13.shape[0]
        flat = ids.reshape(-1).long()
        sel = torch.nonzero(flat >= 0).squeeze(1)
        y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
        if sel.numel() == 0:  # all padding: the vendor op rejects empty tensors
            report_impl(GMM_EMPTY_IMPL)
            return y.to(x.dtype)
        order = torch.sort(flat[sel], stable=True).indices
        pairs = sel[order]
        tok = pairs // k
        counts = torch.bincount(flat[pairs], minlength=E).to(torch.int64)
        glist, gtype = (counts, 1) if E > 1 else (counts.cumsum(0), 0)
        gmm = npu().npu_grouped_matmul
        # The op takes each weight contiguous [K, N] or as the transpose of a contiguous
        # [N, K]: a strided view is copied once (a no-op for contiguous weights).
        h = gmm([x[tok].contiguous()], [w13.contiguous().transpose(1, 2)], group_list=glist,
                group_list_type=gtype, group_type=0, split_item=3)[0]
        a = npu().npu_swiglu(h, dim=-1)
        o = gmm([a.contiguous()], [w2.contiguous().transpose(1, 2)], group_list=glist,
                group_list_type=gtype, group_type=0, split_item=3)[0]
        wsel = weights.reshape(-1)[pairs].float()
        y.index_add_(0, tok, o.float() * wsel[:, None])
        return y.to(x.dtype)

    return moe_experts


# =========================================================================== moe_route
def moe_route_supports(logits, bias, top_k, n_group, topk_group, norm_topk_prob,
                       routed_scaling) -> bool:
    """npu_moe_gating_top_k limits: fp32 logits and bias, E <= 2048; with groups, more than
    2 experts per group and ceil32(E / n_group) * n_group <= 2048."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or T == 0:
        return False
    if E > GATING_MAX_EXPERTS:
        return False
    if n_group > 1:
        per = E // n_group
        return per > 2 and math.ceil(per / 32) * 32 * n_group <= GATING_MAX_EXPERTS
    return True


def make_moe_route(npu: Callable[[], Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    @implemented_by(GATING_IMPL)
    def moe_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling):
        """glm5 ``moe_route`` -> (weights [T, k] fp32, ids [T, k] int32) through
        ``npu_moe_gating_top_k(norm_type=1 (sigmoid), bias, group_select_mode=1 (top-2 sum),
        renorm=0, eps=1e-20)``.

        With sigmoid the op always returns ``s[ids] / (sum + eps) * routed_scaling_factor``,
        which is glm5's ``norm_topk_prob=True``. For ``norm_topk_prob=False`` the binding asks
        for ``out_flag=True`` and takes the op's fp32 sigmoid output ``norm_out`` at the
        selected ids times ``routed_scaling`` instead, so both settings are served. n_group = 1
        maps to group_count = k_group = 1 (no group stage).
        """
        grouped = n_group > 1
        y, ids, norm = npu().npu_moe_gating_top_k(
            logits, top_k, bias=bias, k_group=topk_group if grouped else 1,
            group_count=n_group, group_select_mode=1, renorm=0, norm_type=1,
            out_flag=not norm_topk_prob, routed_scaling_factor=float(routed_scaling), eps=1e-20)
        ids = ids.to(torch.int32)
        if norm_topk_prob:
            w = y.float()
        else:
            w = norm.float().gather(1, ids.long()) * float(routed_scaling)
        return w, ids

    return moe_route


# =========================================================================== rows
def vendor_kernels(
    npu: Callable[[], Any],
) -> list[tuple[str, Callable, tuple[torch.dtype, ...] | None, Callable[..., bool] | None]]:
    """Rows ``(op name, kernel, dtypes, supports)`` for the ascend backend, like
    glm5/kernels/triton/registry.py rows. ``npu()`` returns the namespace the kernels call
    (``torch_npu`` on hardware, :mod:`glm5.backends.ascend.contract` in emulation); it is called
    at kernel-call time, never at import or registration."""
    return [
        ("indexer_topk", make_indexer_topk(npu), HALF, indexer_topk_supports),
        ("sparse_attention", make_sparse_attention(npu), HALF, sparse_attention_supports),
        ("mla_prolog", make_mla_prolog(npu), (torch.bfloat16,), mla_prolog_supports),
        ("quant_linear", make_quant_linear(npu), HALF, quant_linear_supports),
        ("moe_experts", make_moe_experts(npu), (torch.bfloat16, torch.float16, torch.float32),
         moe_experts_supports),
        ("moe_route", make_moe_route(npu), (torch.float32,), moe_route_supports),
    ]
