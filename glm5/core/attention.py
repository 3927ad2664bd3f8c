"""MLA attention with DSA (Lightning Indexer + sparse attention).

Two execution modes, chosen per call by cost (same math; `Attention.use_absorbed`):
- MHA (short dense prefill / training): the latent rows are expanded with kv_b into per-head
  keys/values;
- MQA ("absorbed": decode, and sparse prefill, where each query gathers its own rows): queries
  are moved into the latent space with W_UK, attention runs over the latent cache directly
  (Dqk = kv_lora + rope, Dv = kv_lora), W_UV is applied after.
Selection: when every query's causal range fits in index_topk the selection is the whole range,
so dense `attention` over the range is used; otherwise `indexer_topk` + `sparse_attention` (no
[T, S] score matrix or [T, H, S] tensor beyond the op's tiles). Layers marked "shared" reuse the
previous full layer's selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from glm5 import ops
from glm5.core import hadamard
from glm5.core.block_select import block_select
from glm5.core.config import GLM5Config, attends_densely
from glm5.core.index_cache import FP8Keys, IndexKeys, write_index_keys
from glm5.core.layers import LayerNorm, QuantLinear, RMSNorm, apply_linear, linear
from glm5.ir.paging import pool_rows

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm (transformers: RMSNorm default eps)
INDEXER_NORM_EPS = 1e-6  # indexer k_norm (LayerNorm)


# Long prefills are processed QUERY_CHUNK queries at a time through selection and sparse
# attention: the working set of any kernel (the reference's [T, Hi, S] indexer products
# included) stays bounded however long the context is.
QUERY_CHUNK = 1024

# A gathered byte costs about as much as this many FLOPs (random row gathers miss the caches;
# CPUs sustain ~10 FLOP per byte of such traffic, GPUs/NPUs far more): used to choose the MLA mode.
GATHER_FLOPS_PER_BYTE = 8.0


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + QUERY_CHUNK, n)) for a in range(0, n, QUERY_CHUNK)]


@dataclass
class Pages:
    """A paged cache's layout for one forward (the serving engine's): the caches are pools of
    pages of ``page_size`` rows; sequence b's logical position j lives in physical row
    `glm5.ir.paging.pool_rows` (``block_table[b, j // page_size] * page_size + j %
    page_size``)."""

    block_table: torch.Tensor  # [B, P] int32 page ids (-1: not allocated)
    seq: torch.Tensor  # [N] int32: the block_table row of each query
    k_len: torch.Tensor  # [N] int32: query n sees logical keys 0 .. k_len[n] - 1 (causal)
    page_size: int
    # all_slots by width: every layer of a dense step asks for the same selection
    _all_slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False,
                                                compare=False)

    def rows(self, a: int, b: int) -> "Pages":
        return Pages(self.block_table, self.seq[a:b], self.k_len[a:b], self.page_size)

    def all_slots(self, width: int) -> torch.Tensor:
        """[N, width] int32 physical rows of logical keys 0 .. width - 1 of each query, -1 past
        k_len: the selection when every query attends to all its keys (context <= top-k).
        Computed once per width for this layout (the layers of a step share it; nothing
        writes the tables during a forward)."""
        got = self._all_slots.get(width)
        if got is None:
            j = torch.arange(width, device=self.seq.device)
            rows = pool_rows(self.block_table, self.seq[:, None], j, self.page_size)
            got = self._all_slots[width] = torch.where(j[None, :] < self.k_len[:, None], rows,
                                                       -1).to(torch.int32)
        return got


@dataclass
class Step:
    """Per-forward layout shared by all layers: rope tables, cache slots, key ranges (or, for
    a paged cache, the block tables in ``pages``; k_start / k_end are then None)."""

    cos: torch.Tensor  # [N, R/2]
    sin: torch.Tensor
    slots: torch.Tensor  # [N] int32 flat cache rows written by this step
    k_start: torch.Tensor | None  # [N] int32
    k_end: torch.Tensor | None  # [N] int32
    max_range: int  # longest causal key range of any query
    max_len: int  # rows per sequence in the flat caches (0 for a paged cache)
    pages: Pages | None = None

    def rows(self, a: int, b: int) -> "Step":
        """The layout of queries a..b-1."""
        if self.pages is not None:
            return Step(self.cos[a:b], self.sin[a:b], self.slots[a:b], None, None,
                        self.max_range, self.max_len, self.pages.rows(a, b))
        return Step(self.cos[a:b], self.sin[a:b], self.slots[a:b], self.k_start[a:b],
                    self.k_end[a:b], self.max_range, self.max_len)


def _rope_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    """Interleaved rope on the first r dims of the last axis (indexer: rope-first layout)."""
    if x.shape[-1] == r:
        return ops.rope(x, cos, sin, True)
    return torch.cat((ops.rope(x[..., :r].contiguous(), cos, sin, True), x[..., r:]), -1)


class Indexer(nn.Module):
    """The Lightning Indexer of one layer (names as transformers: self_attn.indexer.*)."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.wk = linear(cfg.hidden_size, cfg.index_head_dim)
        self.k_norm = LayerNorm(cfg.index_head_dim, INDEXER_NORM_EPS)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        # softmax scale and H^-0.5 do not change the top-k order but are folded into the head
        # weights as the published model does (relu(a*c) = c*relu(a) for c > 0).
        self.w_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5

    def keys(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        k = self.k_norm(apply_linear(self.wk, x))
        return self._rotated(_rope_head(k, st.cos, st.sin, self.cfg.qk_rope_head_dim))

    def _rotated(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., index_head_dim] after rope, Hadamard-rotated with ``dsa_indexer_hadamard``
        (keys when cached, queries when scored: every q.k is kept)."""
        return hadamard.rotate(x) if self.cfg.dsa_indexer_hadamard else x

    def select(self, x: torch.Tensor, c_q: torch.Tensor, key_cache: IndexKeys,
               st: Step) -> torch.Tensor:
        c = self.cfg
        N = x.shape[0]
        q = apply_linear(self.wq_b, c_q).reshape(N, c.index_n_heads, c.index_head_dim)
        q = self._rotated(_rope_head(q, st.cos, st.sin, c.qk_rope_head_dim))
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.w_scale
        with torch.no_grad():  # the selection is not differentiable; the indexer is trained apart
            if st.pages is not None:
                if c.dsa_selection == "block":
                    raise ValueError("glm5 paged cache: dsa_selection='block' is not supported "
                                     "(use 'token', the published model's selection)")
                p = st.pages
                if isinstance(key_cache, FP8Keys):
                    return ops.paged_indexer_topk_fp8(q, key_cache.codes, key_cache.scale, w,
                                                      p.block_table, p.seq, p.k_len,
                                                      p.page_size, c.index_topk)
                if c.dsa_indexer_dtype != "bf16":
                    raise ValueError("glm5 paged cache: dsa_indexer_dtype='fp8' expects an "
                                     "fp8 key cache (FP8Keys, as KVPool makes for the model), "
                                     f"got a {key_cache.dtype} tensor")
                return ops.paged_indexer_topk(q, key_cache, w, p.block_table, p.seq, p.k_len,
                                              p.page_size, c.index_topk)
            if isinstance(key_cache, FP8Keys):
                raise ValueError("glm5: an fp8 key cache (FP8Keys) is read through pages only "
                                 "(the paged engine); the flat cache holds the model's dtype")
            if c.dsa_selection == "block":
                return block_select(q, w, key_cache, st.k_start, st.k_end, st.max_len,
                                    c.dsa_block_size, c.dsa_block_topk, c.index_topk)
            if c.dsa_indexer_dtype == "fp8":
                return ops.indexer_topk_fp8(q, key_cache, w, st.k_start, st.k_end,
                                            c.index_topk)
            return ops.indexer_topk(q, key_cache, w, st.k_start, st.k_end, c.index_topk)


class Attention(nn.Module):
    def __init__(self, cfg: GLM5Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.num_attention_heads, cfg.hidden_size
        self.q_a_proj = linear(D, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS)
        self.q_b_proj = linear(cfg.q_lora_rank, H * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(D, cfg.kv_cache_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.o_proj = linear(H * cfg.v_head_dim, D)
        self.shared = cfg.indexer_types[layer_idx] == "shared"
        self.indexer = None if self.shared else Indexer(cfg)

    # ------------------------------------------------------------------ helpers
    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, Rkv] and W_UV [H, Dv, Rkv] as views of kv_b_proj.weight."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim,
                                       c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]

    def _latent_rows(self, x: torch.Tensor, st: Step) -> torch.Tensor:
        """[ckv | k_pe] of x, as mla_prolog writes them to the cache (differentiable)."""
        c = self.cfg
        kv = apply_linear(self.kv_a_proj_with_mqa, x)
        ckv = ops.rms_norm(kv[:, : c.kv_lora_rank], self.kv_a_layernorm.weight, MLA_NORM_EPS)
        k_pe = ops.rope(kv[:, c.kv_lora_rank :], st.cos, st.sin, True)
        return torch.cat((ckv, k_pe), -1)

    def quantized_prolog(self) -> bool:
        """True when q_a / q_b / kv_a are quantized: the prolog then runs decomposed."""
        return QuantLinear in (type(self.q_a_proj), type(self.q_b_proj),
                               type(self.kv_a_proj_with_mqa))

    def _prolog_quant(self, x: torch.Tensor, w_uk: torch.Tensor, st: Step,
                      latent: torch.Tensor, absorb: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mla_prolog by its docs/ops.md decomposition with quantized projections (quant_linear for
        q_a / q_b / kv_a): same outputs, same in-place cache write at ``st.slots``."""
        c = self.cfg
        H, Dn, R = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        c_q = ops.rms_norm(apply_linear(self.q_a_proj, x), self.q_a_layernorm.weight,
                           MLA_NORM_EPS)
        q = apply_linear(self.q_b_proj, c_q).view(x.shape[0], H, -1)
        q_pe = ops.rope(q[..., Dn:].contiguous(), st.cos, st.sin, True)
        q_nope = q[..., :Dn]
        q_main = torch.einsum("thd,hdc->thc", q_nope, w_uk) if absorb else q_nope.contiguous()
        rows = self._latent_rows(x, st)
        # The model never passes slot -1 (mla_prolog's "skip"; the indexer-key write in
        # `forward` relies on it too), so no mask: a boolean one would cost a host read.
        with torch.no_grad():
            latent[st.slots.long()] = rows.detach().to(latent.dtype)
        return q_main, q_pe, c_q

    def use_absorbed(self, n_queries: int, n_rows: int, sparse: bool,
                     elem_bytes: int = 4) -> bool:
        """MQA (absorbed) when it costs less than expanding n_rows latent rows (MHA).

        Cost = FLOPs + GATHER_FLOPS_PER_BYTE x bytes gathered by the sparse kernel. Dense
        attention streams keys in tiles shared by many queries, so only FLOPs count there. A
        sparse query gathers its own top-k rows: H x (Dqk + Dv) values per row in MHA mode, one
        latent row (Rkv + Dr) shared by all heads in MQA mode, H times fewer bytes; that is why
        sparse prefill kernels (FlashMLA's, Ascend's) run in MQA mode.
        """
        c = self.cfg
        H, Dn, Dv, R, Dr = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim,
                            c.kv_lora_rank, c.qk_rope_head_dim)
        keys = min(n_rows, c.index_topk)
        mha = 2.0 * n_rows * R * H * (Dn + Dv) + 2.0 * n_queries * keys * H * (Dn + Dr + Dv)
        mqa = (2.0 * n_queries * H * R * (Dn + Dv)
               + 2.0 * n_queries * keys * H * (R + Dr + R))
        if sparse:
            mha += GATHER_FLOPS_PER_BYTE * n_queries * keys * H * (Dn + Dr + Dv) * elem_bytes
            mqa += GATHER_FLOPS_PER_BYTE * n_queries * keys * (R + Dr) * elem_bytes
        return mqa < mha

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, st: Step, latent: torch.Tensor,
                index_keys: IndexKeys | None, prev_idx: torch.Tensor | None,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, D] -> ([N, D], the selection [N, topk] or None when the range is dense).

        ``latent`` / ``index_keys`` are this layer's flat caches (written in place at
        ``st.slots``); ``rows`` [S'] are the cache rows in use (keys are gathered from them in
        MHA mode).
        """
        c = self.cfg
        H, Dn = c.num_attention_heads, c.qk_nope_head_dim
        w_uk, w_uv = self._w_kv()
        dense = attends_densely(st.max_range, c.index_topk)
        # A paged cache is read through the block table by sparse attention in MQA (absorbed)
        # mode, as FlashMLA's paged kernels do; the MHA mode's row gather assumes flat rows.
        absorb = st.pages is not None or self.use_absorbed(
            x.shape[0], rows.numel(), not dense, latent.element_size())
        if self.quantized_prolog():
            q_main, q_pe, c_q = self._prolog_quant(x, w_uk, st, latent, absorb)
        else:
            q_main, q_pe, c_q = ops.mla_prolog(
                x, self.q_a_proj.weight, self.q_a_layernorm.weight, self.q_b_proj.weight,
                self.kv_a_proj_with_mqa.weight, self.kv_a_layernorm.weight, w_uk, st.cos,
                st.sin, MLA_NORM_EPS, latent, st.slots, absorb,
            )
        kva = self.kv_a_proj_with_mqa
        if torch.is_grad_enabled() and (x.requires_grad or (type(kva) is not QuantLinear
                                                            and kva.weight.requires_grad)):
            # Training: the cache write is a side effect without gradient, so this step's
            # latent rows are recomputed differentiably and put in place of the cached ones.
            latent = latent.detach().index_put((st.slots.long(),), self._latent_rows(x, st))
        if self.indexer is not None:
            with torch.no_grad():
                write_index_keys(index_keys, st.slots, self.indexer.keys(x, st))
        idx = None
        if not dense:
            if self.indexer is not None:
                idx = torch.cat([self.indexer.select(x[a:b], c_q[a:b], index_keys, st.rows(a, b))
                                 for a, b in _chunks(x.shape[0])])
            elif prev_idx is None:
                raise ValueError("glm5: a 'shared' indexer layer needs an earlier 'full' layer")
            else:
                idx = prev_idx
        elif st.pages is not None:
            idx = st.pages.all_slots(st.max_range)
        # Keys from the cache (after this step's write): the latent rows in use.
        if absorb:
            q = torch.cat((q_main, q_pe), -1)  # [N, H, Rkv + Dr]
            kv = latent.unsqueeze(1)  # [S, 1, Rkv + Dr]; v = the first Rkv columns
            o_lat = self._attend(q, kv, kv[..., : c.kv_lora_rank], idx, st, None)
            o = torch.einsum("nhc,hdc->nhd", o_lat, w_uv)
        else:
            lat = latent[rows]
            kvx = F.linear(lat[:, : c.kv_lora_rank], self.kv_b_proj.weight)
            kvx = kvx.view(-1, H, Dn + c.v_head_dim)
            k_pe = lat[:, c.kv_lora_rank :].unsqueeze(1).expand(-1, H, -1)
            k = torch.cat((kvx[..., :Dn], k_pe), -1)
            v = kvx[..., Dn:]
            q = torch.cat((q_main, q_pe), -1)
            o = self._attend(q, k, v, idx, st, rows)
        return apply_linear(self.o_proj, o.reshape(x.shape[0], -1)), idx

    def _attend(self, q, k, v, idx, st: Step, rows: torch.Tensor | None) -> torch.Tensor:
        """Attention over flat cache rows, or over the gathered ``rows`` (indices remapped)."""
        scale = self.cfg.softmax_scale
        ks, ke = st.k_start, st.k_end
        if rows is not None:  # compact row space: sequence b's used rows start at b * used
            L, used = st.max_len, st.max_range

            def compact(r: torch.Tensor) -> torch.Tensor:
                return (r // L) * used + r % L

            ks, ke = compact(ks), compact(ke - 1) + 1
            if idx is not None:
                idx = torch.where(idx >= 0, compact(idx), idx)
        if idx is None:
            return ops.attention(q, k, v, ks, ke, scale)[0]
        return torch.cat([ops.sparse_attention(q[a:b], k, v, idx[a:b], scale)[0]
                          for a, b in _chunks(q.shape[0])])
