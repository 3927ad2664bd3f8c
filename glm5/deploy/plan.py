"""Per-chip deployment planner (`glm5 plan`): memory per device and a roofline time estimate for
a decode step and a prefill of GLM-5 on one accelerator type, with tensor / expert parallelism.

Nothing is allocated and nothing runs: the model's layers are built on the meta device (their
parameter names and shapes are the model's own), and every op the model runs is costed with its
``OpDef.cost`` (glm5/ir) on meta tensors of the shapes one device sees. docs/planner.md states
the formulas and assumptions; the main ones:

* time of an op = max(flops / peak(dtype of the op), bytes / HBM bandwidth); a phase's compute
  time is the sum over its ops (no overlap between ops), communication is added on top.
* communication (per device; link bytes = what one device sends, B = the whole tensor):
  ring all-reduce 2 (N-1)/N * B, reduce-scatter and all-gather (N-1)/N * B each, all-to-all
  (N-1)/N * B; each collective takes ``chip.collective_latency_us`` + link bytes / per-direction
  link bandwidth. Each layer sums the TP group's partial outputs twice (after o_proj, after
  the MLP / MoE) by one of: a plain all-reduce; **FlashComm** (reduce-scatter over the tokens
  padded to a multiple of N, residual add + RMSNorm on the local 1/N of them, all-gather before
  the next column-parallel linear); FlashComm with an int8 all-gather (per-token fp32 scales).
  ``auto`` takes FlashComm from the token count where its time line crosses the all-reduce's
  (:func:`flashcomm_threshold`). EP beyond the TP group (ep > tp), per MoE layer: with
  data-parallel attention four all-to-alls (pair counts, dispatch, expert ids, combine:
  :func:`moe_all_to_alls`), with replicated tokens an all-reduce; with ep <= tp the MoE output
  is summed by the TP reduction. :func:`layer_comm` lists one layer's collectives as the model
  (glm5.parallel.layouts) issues them (tests/test_plan_measured.py counts them).
* parallel layout on ``devices = max(tp, ep)`` devices: attention heads, the dense / shared MLP
  columns and the vocabulary are split ``tp`` ways (the MLA latent cache cannot be split by head,
  so each TP rank keeps the whole latent cache of its sequences); ``devices / tp`` data-parallel
  attention groups each serve ``ceil(batch / dp)`` sequences; routed experts are split ``ep``
  ways by expert and ``devices / ep`` ways by column, so every device holds 1/devices of them.
* decode at batch B touches, on one device, E/ep * (1 - (1 - k/E)^B) experts in expectation
  (uniform routing; each token picks k distinct experts of E): the expert weight bytes read.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from glm5.core.config import GLM5Config, attends_densely
from glm5.core.model import DecoderLayer
from glm5.core.quant_policy import is_quantized
from glm5.deploy.chips import Chip, get_chip
from glm5.deploy.costs import OpCost, PlanError, meta_tensor, op_cost, plan_error  # noqa: F401
from glm5.deploy.flashcomm import (  # noqa: F401  (the planner's names, importable from here too)
    COMM_CHOICES,
    COMM_OPTIONS,
    PER_POINT_SUMS,
    THRESHOLD_MAX_TOKENS,
    all_to_all_link_bytes,
    choose_comm,
    collective_seconds,
    flashcomm_threshold,
    int8_rows_bytes,
    link_bytes,
    padded_tokens,
    sync_ops,
    sync_point,
    tp_collectives,
)
from glm5.deploy.plan_comm import (  # noqa: F401  (the planner's names, importable from here)
    A2A_COUNT_DTYPE,
    A2A_ID_DTYPE,
    ACT_SCALE_DTYPE,
    act_scale_gathers,
    comm_section,
    expert_load,
    layer_comm,
    moe_all_to_alls,
    route_pairs,
)
from glm5.deploy.info import (
    KV_DTYPES,
    count_params,
    index_key_row_bytes,
    kv_cache_per_token,
)
from glm5.deploy.plan_text import format_comm, format_plan  # noqa: F401  (importable from here too)
from glm5.ir.quant_formats import SCHEMES, Scheme

#: the unquantized choice of ``--quant``
NO_QUANT = "bf16"
QUANT_CHOICES = (NO_QUANT, *SCHEMES)
#: default activation / workspace reserve: this fraction of device memory
RESERVE_FRACTION = 0.10
#: prefill queries are costed in chunks of this many (so causal ranges are approximated by
#: the chunk end: sum over chunks ~ L^2/2 + L*CHUNK/2 key rows instead of L^2)
PREFILL_CHUNK = 1024
FORMULA = ("op time = max(flops / peak_flops(op dtype), bytes / hbm_bandwidth); phase compute "
           "time = sum over ops; collective time = latency + link bytes / link_bw_per_direction, "
           "link bytes per device: all-reduce 2(N-1)/N * B (ring), reduce-scatter, all-gather, "
           "all-to-all (N-1)/N * B; step time = compute + communication (no overlap assumed)")
#: ``--indexer-dtype``: the indexer's key cache and selection (None: the model's own)
INDEXER_DTYPES = ("bf16", "fp8")
#: rows per page of the fp8 index cache the planner costs: the serving engine's default
#: (``glm5.engine.EngineConfig.page_size``; a test keeps the two equal)
INDEX_PAGE_SIZE = 64

# Tensors kept in fp32 by the model (the router runs `F.linear(x.float(), weight.float())`, the
# indexer head weights likewise; quant_policy keeps them out of every scheme).
_FP32_NAMES = ("e_score_correction_bias", "mlp.gate.weight", "indexer.weights_proj.")
_TP_NAMES = ("self_attn.q_b_proj.", "self_attn.kv_b_proj.", "self_attn.o_proj.",
             "mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.", "mlp.shared_experts.",
             "embed_tokens.", "lm_head.")
_EXPERT_NAMES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# --------------------------------------------------------------------------- weights
def _hp_bytes(name: str) -> int:
    return 4 if any(s in name for s in _FP32_NAMES) else 2


def tensor_bytes(name: str, shape: tuple[int, ...], scheme: Scheme | None) -> float:
    """Stored bytes of the tensor ``name`` of ``shape`` under ``scheme`` (None = bf16).

    A tensor the scheme quantizes (``quant_policy.is_quantized``), viewed as ``[..., N, K]``,
    takes ``N * packed_k(K)`` code bytes plus 4 bytes per fp32 scale (per output channel, or per
    group of 128 along K); any other tensor keeps 2 bytes (bf16) per element, or 4 for the fp32
    router and indexer head weights.
    """
    numel = math.prod(shape)
    if scheme is not None and len(shape) >= 2 and is_quantized(name):
        lead = math.prod(shape[:-2])
        n, k = shape[-2], shape[-1]
        return float(lead * (n * scheme.packed_k(k) + 4 * math.prod(scheme.scale_shape(n, k))))
    return float(numel * _hp_bytes(name))


def shard_class(name: str) -> str:
    """'tp' (split across tensor-parallel ranks), 'experts' (split across all devices) or
    'replicated'."""
    if any(s in name for s in _EXPERT_NAMES):
        return "experts"
    if any(s in name for s in _TP_NAMES):
        return "tp"
    return "replicated"


def _kinds(cfg: GLM5Config) -> dict[tuple[str, str], list[int]]:
    """(mlp type, indexer type) -> layer indices of that kind."""
    out: dict[tuple[str, str], list[int]] = {}
    for i, (m, x) in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
        out.setdefault((m, x), []).append(i)
    return out


def _meta_layer(cfg: GLM5Config, idx: int, mlp_type: str | None = None) -> torch.nn.Module:
    with torch.device("meta"):
        return DecoderLayer(cfg, idx, mlp_type)


def _mtp_cfg(cfg: GLM5Config) -> GLM5Config:
    return cfg.replace(num_hidden_layers=1, indexer_types=["full"], mlp_layer_types=["sparse"])


def named_tensors(cfg: GLM5Config, mtp: bool = False) -> list[tuple[str, tuple[int, ...], int]]:
    """(checkpoint-style name, shape, number of layers sharing that name pattern) for every
    saved tensor of the model (parameters + persistent buffers), one layer of each kind built
    on the meta device. ``mtp`` adds the MTP block(s)."""
    rows: list[tuple[str, tuple[int, ...], int]] = []
    V, D = cfg.vocab_size, cfg.hidden_size
    rows.append(("model.embed_tokens.weight", (V, D), 1))
    if not cfg.tie_word_embeddings:
        rows.append(("lm_head.weight", (V, D), 1))
    rows.append(("model.norm.weight", (D,), 1))
    for (mlp, _), layers in _kinds(cfg).items():
        layer = _meta_layer(cfg, layers[0])
        pre = f"model.layers.{layers[0]}."
        for n, t in layer.state_dict(keep_vars=True).items():
            rows.append((pre + n, tuple(t.shape), len(layers)))
    if mtp:
        for i in range(cfg.num_nextn_predict_layers):
            pre = f"model.layers.{cfg.num_hidden_layers + i}."
            layer = _meta_layer(_mtp_cfg(cfg), 0, "sparse" if "sparse" in cfg.mlp_layer_types
                                else "dense")
            for n, t in layer.state_dict(keep_vars=True).items():
                rows.append((pre + n, tuple(t.shape), 1))
            for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                rows.append((pre + n, (D,), 1))
            rows.append((pre + "eh_proj.weight", (D, 2 * D), 1))
    return rows


def weight_bytes(cfg: GLM5Config, scheme: Scheme | None, mtp: bool = False) -> dict[str, Any]:
    """Stored weight bytes of the whole model under ``scheme``, split by shard class."""
    by_class = {"replicated": 0.0, "tp": 0.0, "experts": 0.0}
    params = 0
    quantized = 0
    for name, shape, n in named_tensors(cfg, mtp):
        b = tensor_bytes(name, shape, scheme) * n
        by_class[shard_class(name)] += b
        params += math.prod(shape) * n
        if scheme is not None and len(shape) >= 2 and is_quantized(name):
            quantized += math.prod(shape) * n
    return {"total": sum(by_class.values()), "by_class": by_class, "params": params,
            "quantized_params": quantized}


# --------------------------------------------------------------------------- op costs
def _chunks(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + PREFILL_CHUNK, n)) for a in range(0, n, PREFILL_CHUNK)]


@dataclass
class Layout:
    """What one device sees."""

    batch: int
    context: int
    tp: int
    ep: int
    #: with ep > tp: each of the devices / tp attention groups runs its own sequences and the
    #: MoE layers dispatch by all-to-all (True), or every device runs every sequence (tp 1) and
    #: the MoE outputs are all-reduced over the EP group ("replicated tokens", False)
    dp_attention: bool = True
    devices: int = field(init=False)
    dp: int = field(init=False)
    expert_tp: int = field(init=False)
    local_batch: int = field(init=False)

    def __post_init__(self) -> None:
        self.devices = max(self.tp, self.ep)
        self.dp = self.devices // self.tp if self.dp_attention else 1
        self.expert_tp = self.devices // self.ep
        self.local_batch = -(-self.batch // self.dp)


class _Coster:
    """Builds the per-device op list of one phase."""

    def __init__(self, cfg: GLM5Config, scheme: Scheme | None, lay: Layout,
                 comm: str = "none") -> None:
        self.cfg, self.scheme, self.lay, self.comm = cfg, scheme, lay, comm

    # -- helpers
    def linear(self, label: str, name: str, M: int, N: int, K: int, count: float = 1.0) -> OpCost:
        """y[M, N] = x[M, K] W[N, K]^T for the weight ``name``: the quant_linear OpDef cost when
        the scheme quantizes it, else a bf16 (or fp32) matmul: 2MNK flops, weight + x + y bytes."""
        sc = self.scheme
        if sc is None or not is_quantized(name):
            eb = _hp_bytes(name)
            nbytes = float(N * K * eb + (M * K + M * N) * eb)
            return OpCost(label, "matmul", 2.0 * M * N * K, nbytes, "bf16", count)
        f, b = op_cost("quant_linear", x=meta_tensor(M, K), w_packed=meta_tensor(N, sc.packed_k(K),
                       dtype=sc.weight_dtype()), w_scale=meta_tensor(*sc.scale_shape(N, K),
                       dtype=torch.float32), scheme=sc.name)
        return OpCost(label, "quant_linear", f, b, self.mm_dtype, count)

    @property
    def mm_dtype(self) -> str:
        """Peak for a quantized matmul: int8 units for 8-bit activations; w8a16 and w6a12 run on
        16-bit float units (12-bit codes and 6-bit weights are exact in fp16, and the group sums
        of 128 products stay below 2^24, exact in the fp32 accumulator)."""
        sc = self.scheme
        return "int8" if sc is not None and sc.act_bits == 8 else "bf16"

    # -- one decoder layer
    def layer(self, tokens: int, sequences: int, phase: str, count: float,
              attn: torch.nn.Module, pre: str) -> list[OpCost]:
        c, lay = self.cfg, self.lay
        D, H = c.hidden_size, c.num_attention_heads
        Hl = H // lay.tp
        Dn, Dr, Dv, R, Rq = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                             c.kv_lora_rank, c.q_lora_rank)
        c_len = lay.context
        T = tokens
        a = pre + "self_attn."
        # the residual add and norm before attention close the previous layer's MLP reduction
        # (the embedding's, for the first layer): on the token shard under FlashComm
        ops: list[OpCost] = sync_ops(c.hidden_size, c.rms_norm_eps, lay.tp, T, self.comm,
                                     "input_layernorm", count)
        rows = sequences * c_len
        sparse = not attends_densely(c_len, c.index_topk)
        # the model's own choice; 2-byte (bf16) cache elements
        absorb = attn.use_absorbed(T, rows, sparse, 2)
        # MLA prolog: the fused op when nothing is quantized, its parts otherwise
        if self.scheme is None:
            f, b = op_cost("mla_prolog", x=meta_tensor(T, D), w_qa=meta_tensor(Rq, D), g_qa=meta_tensor(Rq),
                           w_qb=meta_tensor(Hl * (Dn + Dr), Rq), w_kva=meta_tensor(R + Dr, D), g_kva=meta_tensor(R),
                           w_uk=meta_tensor(Hl, Dn, R), cos=meta_tensor(T, Dr // 2), sin=meta_tensor(T, Dr // 2),
                           eps=1e-6, kv_cache=meta_tensor(T, R + Dr), slots=meta_tensor(T, dtype=torch.int32),
                           absorb=absorb)
            ops.append(OpCost("mla_prolog", "mla_prolog", f, b, "bf16", count))
        else:
            ops.append(self.linear("q_a_proj", a + "q_a_proj.weight", T, Rq, D, count))
            f, b = op_cost("rms_norm", x=meta_tensor(T, Rq), weight=meta_tensor(Rq), eps=1e-6)
            ops.append(OpCost("q_a_layernorm", "rms_norm", f, b, "bf16", count))
            ops.append(self.linear("q_b_proj", a + "q_b_proj.weight", T, Hl * (Dn + Dr), Rq,
                                   count))
            f, b = op_cost("rope", x=meta_tensor(T, Hl, Dr), cos=meta_tensor(T, Dr // 2), sin=meta_tensor(T, Dr // 2),
                           interleaved=True)
            ops.append(OpCost("q_rope", "rope", f, b, "bf16", count))
            if absorb:
                ops.append(OpCost("absorb_w_uk", "bmm", 2.0 * T * Hl * Dn * R,
                                  2.0 * (Hl * Dn * R + T * Hl * (Dn + R)), "bf16", count))
            ops.append(self.linear("kv_a_proj", a + "kv_a_proj_with_mqa.weight", T, R + Dr, D,
                                   count))
            f, b = op_cost("rms_norm", x=meta_tensor(T, R), weight=meta_tensor(R), eps=1e-6)
            ops.append(OpCost("kv_a_layernorm", "rms_norm", f, b, "bf16", count))
            f, b = op_cost("rope", x=meta_tensor(T, Dr), cos=meta_tensor(T, Dr // 2), sin=meta_tensor(T, Dr // 2),
                           interleaved=True)
            ops.append(OpCost("k_rope", "rope", f, b, "bf16", count))
            ops.append(OpCost("latent_cache_write", "copy", 0.0, 2.0 * T * (R + Dr), "bf16",
                              count))
        ops += self.indexer(attn, a, T, sequences, phase, sparse, count)
        ops += self.attention(absorb, sparse, T, sequences, phase, count, a)
        ops.append(self.linear("o_proj", a + "o_proj.weight", T, D, Hl * Dv, count))
        ops += sync_ops(D, c.rms_norm_eps, lay.tp, T, self.comm, "post_attention_layernorm",
                        count)
        return ops

    def indexer(self, attn: torch.nn.Module, a: str, T: int, sequences: int, phase: str,
                sparse: bool, count: float) -> list[OpCost]:
        c = self.cfg
        if attn.indexer is None:  # a 'shared' layer reuses the previous selection
            return []
        D, Rq, Hi, Di, Dr = (c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                             c.qk_rope_head_dim)
        x = a + "indexer."
        ops = [self.linear("indexer.wk", x + "wk.weight", T, Di, D, count)]
        f, b = op_cost("layer_norm", x=meta_tensor(T, Di), weight=meta_tensor(Di), bias=meta_tensor(Di), eps=1e-6)
        ops.append(OpCost("indexer.k_norm", "layer_norm", f, b, "bf16", count))
        f, b = op_cost("rope", x=meta_tensor(T, Dr), cos=meta_tensor(T, Dr // 2), sin=meta_tensor(T, Dr // 2),
                       interleaved=True)
        ops.append(OpCost("indexer.k_rope", "rope", f, b, "bf16", count))
        ops += self.hadamard("indexer.k_hadamard", T, Di, count)
        fp8 = c.dsa_indexer_dtype == "fp8"
        ops.append(OpCost("indexer_key_cache_write", "copy", 0.0,
                          float(T * index_key_row_bytes(Di, 2, fp8)), "bf16", count))
        if not sparse:  # every causal range fits in index_topk: dense attention, no selection
            return ops
        ops.append(self.linear("indexer.wq_b", x + "wq_b.weight", T, Hi * Di, Rq, count))
        f, b = op_cost("rope", x=meta_tensor(T, Hi, Dr), cos=meta_tensor(T, Dr // 2), sin=meta_tensor(T, Dr // 2),
                       interleaved=True)
        ops.append(OpCost("indexer.q_rope", "rope", f, b, "bf16", count))
        ops += self.hadamard("indexer.q_hadamard", T * Hi, Di, count)
        ops.append(self.linear("indexer.weights_proj", x + "weights_proj.weight", T, Hi, D,
                               count))
        for q_rows, keys, n in self._ranges(phase, sequences):
            if fp8:  # the paged engine's fp8 index cache: e4m3 codes + a scale per key row
                pages = -(-keys // INDEX_PAGE_SIZE)
                f, b = op_cost("paged_indexer_topk_fp8", q=meta_tensor(q_rows, Hi, Di),
                               k=meta_tensor(pages * INDEX_PAGE_SIZE, Di, dtype=torch.float8_e4m3fn),
                               k_scale=meta_tensor(pages * INDEX_PAGE_SIZE, dtype=torch.float32),
                               w=meta_tensor(q_rows, Hi, dtype=torch.float32),
                               block_table=meta_tensor(1, pages, dtype=torch.int32),
                               seq=meta_tensor(q_rows, dtype=torch.int32),
                               k_len=meta_tensor(q_rows, dtype=torch.int32),
                               page_size=INDEX_PAGE_SIZE, topk=c.index_topk)
                ops.append(OpCost("indexer_topk_fp8", "paged_indexer_topk_fp8", f, b, "fp8",
                                  count * n))
                continue
            f, b = op_cost("indexer_topk", q=meta_tensor(q_rows, Hi, Di), k=meta_tensor(keys, Di),
                           w=meta_tensor(q_rows, Hi, dtype=torch.float32),
                           k_start=meta_tensor(q_rows, dtype=torch.int32),
                           k_end=meta_tensor(q_rows, dtype=torch.int32), topk=c.index_topk)
            ops.append(OpCost("indexer_topk", "indexer_topk", f, b, "bf16", count * n))
        return ops

    def hadamard(self, label: str, rows: int, n: int, count: float) -> list[OpCost]:
        """``dsa_indexer_hadamard``: rows x n bf16 values times the n x n fp32 rotation (a
        matmul; read, written and the matrix once)."""
        if not self.cfg.dsa_indexer_hadamard:
            return []
        return [OpCost(label, "matmul", 2.0 * rows * n * n, 4.0 * rows * n + 4.0 * n * n,
                       "bf16", count)]

    def _ranges(self, phase: str, sequences: int) -> list[tuple[int, int, int]]:
        """(query rows, key rows, how many such calls) of the causal ranges: decode = one query
        per sequence over its L keys; prefill = chunks of PREFILL_CHUNK queries over the keys up
        to the chunk's end, per sequence."""
        L = self.lay.context
        if phase == "decode":
            return [(1, L, sequences)]
        return [(e - s, e, sequences) for s, e in _chunks(L)]

    def attention(self, absorb: bool, sparse: bool, T: int, sequences: int, phase: str,
                  count: float, a: str) -> list[OpCost]:
        c, lay = self.cfg, self.lay
        Hl = c.num_attention_heads // lay.tp
        Dn, Dr, Dv, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        rows = sequences * lay.context
        ops: list[OpCost] = []
        if absorb:  # MQA over the latent cache: Dqk = R + Dr, Dv = R, one KV head
            hk, dqk, dv = 1, R + Dr, R
        else:  # MHA: expand the latent rows in use with kv_b_proj first
            ops.append(self.linear("kv_b_proj(expand)", a + "kv_b_proj.weight", rows,
                                   Hl * (Dn + Dv), R, count))
            hk, dqk, dv = Hl, Dn + Dr, Dv
        scale = c.softmax_scale
        if sparse:
            f, b = op_cost("sparse_attention", q=meta_tensor(T, Hl, dqk), k=meta_tensor(rows, hk, dqk),
                           v=meta_tensor(rows, hk, dv), idx=meta_tensor(T, c.index_topk, dtype=torch.int32),
                           scale=scale)
            ops.append(OpCost("sparse_attention", "sparse_attention", f, b, "bf16", count))
        else:
            for q_rows, keys, n in self._ranges(phase, sequences):
                f, b = op_cost("attention", q=meta_tensor(q_rows, Hl, dqk), k=meta_tensor(keys, hk, dqk),
                               v=meta_tensor(keys, hk, dv), k_start=meta_tensor(q_rows, dtype=torch.int32),
                               k_end=meta_tensor(q_rows, dtype=torch.int32), scale=scale)
                ops.append(OpCost("attention", "attention", f, b, "bf16", count * n))
        if absorb:
            ops.append(OpCost("absorb_w_uv", "bmm", 2.0 * T * Hl * R * Dv,
                              2.0 * (Hl * Dv * R + T * Hl * (R + Dv)), "bf16", count))
        return ops

    # -- MLPs
    def dense_mlp(self, pre: str, T: int, inter: int, label: str, count: float) -> list[OpCost]:
        D = self.cfg.hidden_size
        Il = inter // self.lay.tp
        return [
            self.linear(f"{label}.gate_proj", pre + "gate_proj.weight", T, Il, D, count),
            self.linear(f"{label}.up_proj", pre + "up_proj.weight", T, Il, D, count),
            OpCost(f"{label}.silu_mul", "silu_mul", *op_cost("silu_mul", x=meta_tensor(T, 2 * Il)),
                   "bf16", count),
            self.linear(f"{label}.down_proj", pre + "down_proj.weight", T, D, Il, count),
        ]

    def moe(self, pre: str, T: int, global_tokens: int, count: float) -> list[OpCost]:
        c, lay, sc = self.cfg, self.lay, self.scheme
        D, E, k = c.hidden_size, c.n_routed_experts, c.num_experts_per_tok
        ops = [self.linear("router", pre + "mlp.gate.weight", T, E, D, count)]
        f, b = op_cost("moe_route", logits=meta_tensor(T, E, dtype=torch.float32),
                       bias=meta_tensor(E, dtype=torch.float32), top_k=k, n_group=c.n_group,
                       topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                       routed_scaling=c.routed_scaling_factor)
        ops.append(OpCost("moe_route", "moe_route", f, b, "bf16", count))
        slots, touched = expert_load(E, k, global_tokens, lay.ep)
        Il = c.moe_intermediate_size // lay.expert_tp
        x, ids, w = (meta_tensor(slots, D), meta_tensor(slots, 1, dtype=torch.int32),
                     meta_tensor(slots, 1, dtype=torch.float32))
        if sc is None:
            f, b = op_cost("moe_experts", x=x, ids=ids, weights=w, w13=meta_tensor(touched, 2 * Il, D),
                           w2=meta_tensor(touched, D, Il))
            ops.append(OpCost("moe_experts", "moe_experts", f, b, "bf16", count))
        else:
            wd = sc.weight_dtype()
            f, b = op_cost("moe_experts_quant", x=x, ids=ids, weights=w,
                           w13_packed=meta_tensor(touched, 2 * Il, sc.packed_k(D), dtype=wd),
                           w13_scale=meta_tensor(touched, *sc.scale_shape(2 * Il, D), dtype=torch.float32),
                           w2_packed=meta_tensor(touched, D, sc.packed_k(Il), dtype=wd),
                           w2_scale=meta_tensor(touched, *sc.scale_shape(D, Il), dtype=torch.float32),
                           scheme=sc.name)
            ops.append(OpCost("moe_experts_quant", "moe_experts_quant", f, b, self.mm_dtype,
                              count))
        if c.n_shared_experts:
            ops += self.dense_mlp(pre + "mlp.shared_experts.", T,
                                  c.moe_intermediate_size * c.n_shared_experts, "shared_expert",
                                  count)
        return ops


def phase_cost(cfg: GLM5Config, chip: Chip, scheme: Scheme | None, lay: Layout, phase: str,
               mtp: bool = False, comm: str = "auto") -> dict[str, Any]:
    """Per-device flops, bytes, op list, communication and times of one decode step or one
    prefill, with the TP reductions done the ``comm`` way (:data:`COMM_CHOICES`).

    decode: each of the device's ``local_batch`` sequences adds one token at context L;
    prefill: each processes L tokens (causal) in one forward. Logits only for the last token of
    each sequence.
    """
    if phase not in ("decode", "prefill"):
        raise plan_error("phase", "'decode' or 'prefill'", phase)
    seqs = lay.local_batch
    T = seqs if phase == "decode" else seqs * lay.context  # tokens per TP group
    global_tokens = lay.batch if phase == "decode" else lay.batch * lay.context
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    thresholds = {o: flashcomm_threshold(chip, D, lay.tp, o, eps)
                  for o in ("flashcomm", "flashcomm-int8")}
    option = choose_comm(comm, lay.tp, T, thresholds["flashcomm"])
    co = _Coster(cfg, scheme, lay, option)
    ops: list[OpCost] = []
    kinds = [("moe" if mlp == "sparse" else "dense", mlp, layers[0], len(layers), cfg)
             for (mlp, _), layers in _kinds(cfg).items()]
    n_mtp = cfg.num_nextn_predict_layers if mtp else 0
    for _ in range(n_mtp):
        mk = "sparse" if "sparse" in cfg.mlp_layer_types else "dense"
        kinds.append(("mtp", mk, 0, 1, _mtp_cfg(cfg)))
    layer_counts: dict[str, list[int]] = {}  # kind -> [layers, of which MoE]
    for kind, mlp, first, n, kcfg in kinds:
        layer = _meta_layer(kcfg, first, mlp)
        pre = f"model.layers.{first}."
        co.cfg = kcfg
        ops += co.layer(T, seqs, phase, float(n), layer.self_attn, pre)
        if mlp == "sparse":
            ops += co.moe(pre, T, global_tokens, float(n))
        else:
            ops += co.dense_mlp(pre + "mlp.", T, cfg.intermediate_size, "mlp", float(n))
        cnt = layer_counts.setdefault(kind, [0, 0])
        cnt[0] += n
        cnt[1] += n if mlp == "sparse" else 0
    co.cfg = cfg
    out_rows = seqs  # logits for the last token of each sequence
    f, b = op_cost("rms_norm", x=meta_tensor(out_rows, D), weight=meta_tensor(D), eps=eps)
    ops.append(OpCost("final_norm", "rms_norm", f, b, "bf16"))
    heads = 1 + n_mtp
    if mtp:
        mp = f"model.layers.{cfg.num_hidden_layers}."
        ops.append(co.linear("mtp.eh_proj", mp + "eh_proj.weight", T, D, 2 * D, n_mtp))
    ops.append(co.linear("lm_head", "lm_head.weight", out_rows, cfg.vocab_size // lay.tp, D,
                         heads))
    compute_s = sum(o.seconds(chip) for o in ops)
    cm = comm_section(cfg, chip, lay, T, global_tokens, layer_counts, n_mtp, option, thresholds,
                      scheme)
    tp_s, ep_s, ar_s = cm["tp_ms"] / 1e3, cm["ep_ms"] / 1e3, cm["ep_allreduce_ms"] / 1e3
    total_s = compute_s + tp_s + ep_s + ar_s
    res: dict[str, Any] = {
        "tokens_per_device": T,
        "flops": sum(o.flops * o.count for o in ops),
        "bytes": sum(o.bytes * o.count for o in ops),
        "compute_ms": compute_s * 1e3,
        "comm_option": option,
        "tp_comm_link_bytes": cm["tp_link_bytes"],
        "tp_comm_ms": tp_s * 1e3,
        "ep_alltoall_link_bytes": cm["ep_link_bytes"],
        "ep_alltoall_ms": ep_s * 1e3,
        "ep_allreduce_link_bytes": cm["ep_allreduce_link_bytes"],
        "ep_allreduce_ms": ar_s * 1e3,
        "total_ms": total_s * 1e3,
        "comm": cm,
        "ops": _summarise(ops, chip),
    }
    if phase == "decode":
        res["ms_per_token"] = total_s * 1e3
        res["tokens_per_s"] = lay.batch / total_s
    else:
        res["time_s"] = total_s
        res["tokens_per_s"] = lay.batch * lay.context / total_s
    return res


def _summarise(ops: list[OpCost], chip: Chip) -> list[dict[str, Any]]:
    """Ops aggregated by label (over layers and sequences), slowest first."""
    agg: dict[str, dict[str, Any]] = {}
    for o in ops:
        r = agg.setdefault(o.label, {"label": o.label, "op": o.op, "dtype": o.dtype,
                                     "calls": 0.0, "flops": 0.0, "bytes": 0.0, "ms": 0.0,
                                     "bound": o.bound(chip)})
        r["calls"] += o.count
        r["flops"] += o.flops * o.count
        r["bytes"] += o.bytes * o.count
        r["ms"] += o.seconds(chip) * 1e3
    return sorted(agg.values(), key=lambda r: -r["ms"])


# --------------------------------------------------------------------------- the plan
def check_inputs(cfg: GLM5Config, batch: int, context: int, tp: int, ep: int) -> None:
    """Raise PlanError naming the argument for nonsense input."""
    for arg, v in (("batch", batch), ("context", context), ("tp", tp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise plan_error(arg, "a positive integer", v)
    if context > cfg.max_position_embeddings:
        raise plan_error("context", f"<= max_position_embeddings={cfg.max_position_embeddings}",
                   context)
    if cfg.num_attention_heads % tp:
        raise plan_error("tp", f"a divisor of num_attention_heads={cfg.num_attention_heads}", tp)
    if cfg.n_routed_experts % ep:
        raise plan_error("ep", f"a divisor of n_routed_experts={cfg.n_routed_experts}", ep)
    if max(tp, ep) % min(tp, ep):
        raise plan_error("ep", f"a multiple or a divisor of tp={tp} (devices = max(tp, ep))", ep)
    n = max(tp, ep)
    for what, size in (("intermediate_size", cfg.intermediate_size),
                       ("moe_intermediate_size", cfg.moe_intermediate_size)):
        div = tp if what == "intermediate_size" else n // ep
        if size % div:
            raise plan_error("tp", f"a split of {what}={size} into whole columns", tp)
    if cfg.dsa_selection != "token":
        raise plan_error("model", "dsa_selection 'token' (the planner costs the published DSA)",
                   cfg.dsa_selection)


def get_quant(name: str) -> Scheme | None:
    if name == NO_QUANT:
        return None
    if name not in SCHEMES:
        raise plan_error("quant", f"one of {', '.join(QUANT_CHOICES)}", name)
    return SCHEMES[name]


def memory(cfg: GLM5Config, chip: Chip, wb: dict[str, Any], lay: Layout, kv_dtype: str,
           reserve_bytes: float, mtp: bool) -> dict[str, Any]:
    """Per-device weights + KV cache + reserve against the chip's memory."""
    cls = wb["by_class"]
    w_dev = cls["replicated"] + cls["tp"] / lay.tp + cls["experts"] / lay.devices
    kv = kv_cache_per_token(cfg)
    per_token = kv["bytes"][kv_dtype] + (kv["mtp_bytes"][kv_dtype] if mtp else 0)
    kv_dev = float(lay.local_batch * lay.context * per_token)
    need = w_dev + kv_dev + reserve_bytes
    cap = chip.memory_bytes
    return {
        "weights_bytes_per_device": w_dev,
        "kv_cache_bytes_per_device": kv_dev,
        "kv_cache_bytes_per_token": per_token,
        "reserve_bytes": reserve_bytes,
        "needed_bytes": need,
        "capacity_bytes": cap,
        "fits": need <= cap,
        "shortfall_bytes": max(0.0, need - cap),
    }


def _candidates(cfg: GLM5Config, max_devices: int = 4096) -> list[tuple[int, int]]:
    """(tp, ep) pairs in order of device count: powers of two, tp | heads, ep | experts."""
    out = []
    n = 1
    while n <= max_devices:
        for tp in (2 ** i for i in range(n.bit_length())):
            eps = [n] if tp < n else [2 ** i for i in range(n.bit_length())]
            for ep in eps:
                if (cfg.num_attention_heads % tp == 0 and cfg.n_routed_experts % ep == 0
                        and cfg.intermediate_size % tp == 0
                        and cfg.moe_intermediate_size % (n // ep) == 0):
                    out.append((tp, ep))
        n *= 2
    return out


def plan(cfg: GLM5Config, chip: str | Chip, quant: str, batch: int, context: int, tp: int = 1,
         ep: int = 1, kv_dtype: str = "bf16", reserve_gb: float | None = None,
         mtp: bool = False, suggest: bool = True, comm: str = "auto",
         indexer_dtype: str | None = None, dp_attention: bool = True) -> dict[str, Any]:
    """The full plan as a JSON-serializable dict (see docs/planner.md for every field).
    ``comm`` (:data:`COMM_CHOICES`): how TP groups sum partial outputs in the step times;
    FlashComm needs tp > 1. ``indexer_dtype`` (:data:`INDEXER_DTYPES`) overrides the model's
    ``dsa_indexer_dtype``: 'fp8' costs the paged engine's fp8 index cache (key rows of
    index_head_dim + 4 bytes, selection at the chip's FP8 rate). ``dp_attention`` False (tp 1, ep > 1): every device
    runs every sequence and the MoE outputs are all-reduced over the EP group (replicated
    tokens) instead of data-parallel attention with all-to-all dispatch."""
    ch = chip if isinstance(chip, Chip) else get_chip(chip)
    sc = get_quant(quant)
    if indexer_dtype is not None:
        if indexer_dtype not in INDEXER_DTYPES:
            raise plan_error("indexer_dtype", f"one of {', '.join(INDEXER_DTYPES)}", indexer_dtype)
        cfg = cfg.replace(dsa_indexer_dtype=indexer_dtype, dsa_indexer_hadamard=(
            cfg.dsa_indexer_hadamard and indexer_dtype == "fp8"))
    check_inputs(cfg, batch, context, tp, ep)
    if not dp_attention and ep > tp > 1:
        raise plan_error("dp_attention", f"True with ep {ep} > tp {tp} > 1 (replicated tokens "
                                         f"over an EP group wider than the TP group is not a "
                                         f"layout of the model)", dp_attention)
    if comm not in COMM_CHOICES:
        raise plan_error("comm", f"one of {', '.join(COMM_CHOICES)}", comm)
    if tp == 1 and comm in ("flashcomm", "flashcomm-int8"):
        raise plan_error("comm", "allreduce or auto with tp 1 (FlashComm replaces the TP all-reduce)",
                   comm)
    if kv_dtype not in KV_DTYPES:
        raise plan_error("kv_dtype", f"one of {', '.join(KV_DTYPES)}", kv_dtype)
    if reserve_gb is not None and not (reserve_gb >= 0):
        raise plan_error("reserve_gb", "a non-negative number of GB", reserve_gb)
    reserve = RESERVE_FRACTION * ch.memory_bytes if reserve_gb is None else reserve_gb * 1e9
    lay = Layout(batch, context, tp, ep, dp_attention)
    wb = weight_bytes(cfg, sc, mtp)
    mem = memory(cfg, ch, wb, lay, kv_dtype, reserve, mtp)
    p = count_params(cfg)
    out: dict[str, Any] = {
        "inputs": {"chip": ch.name, "quant": quant, "batch": batch, "context": context,
                   "tp": tp, "ep": ep, "kv_dtype": kv_dtype,
                   "indexer_dtype": cfg.dsa_indexer_dtype, "mtp": mtp,
                   "reserve_gb": reserve / 1e9, "comm": comm, "dp_attention": dp_attention},
        "chip": ch.as_dict(),
        "layout": asdict(lay),
        "formula": FORMULA,
        "model": {"total_params": p["total_params"], "active_params": p["active_params"],
                  "mtp_params": p["mtp_params"], "weight_bytes_total": wb["total"],
                  "weight_bytes_by_class": wb["by_class"], "params_counted": wb["params"],
                  "quantized_params": wb["quantized_params"]},
        "memory": mem,
        "decode": phase_cost(cfg, ch, sc, lay, "decode", mtp, comm),
        "prefill": phase_cost(cfg, ch, sc, lay, "prefill", mtp, comm),
        "suggestion": None,
    }
    if suggest and not mem["fits"]:
        out["suggestion"] = smallest_fit(cfg, ch, sc, wb, batch, context, kv_dtype, reserve, mtp,
                                         comm)
    return out


def smallest_fit(cfg: GLM5Config, chip: Chip, sc: Scheme | None, wb: dict[str, Any], batch: int,
                 context: int, kv_dtype: str, reserve: float, mtp: bool,
                 comm: str = "auto") -> dict[str, Any] | None:
    """The (tp, ep) with the fewest devices whose memory fits; among those, the fastest decode
    step (``comm`` as asked where tp > 1; a tp 1 candidate has no TP reduction). None when
    nothing up to 4096 devices fits."""
    best: tuple[int, float, int, int] | None = None
    for tp, ep in _candidates(cfg):
        lay = Layout(batch, context, tp, ep)
        if best is not None and lay.devices > best[0]:
            break
        if not memory(cfg, chip, wb, lay, kv_dtype, reserve, mtp)["fits"]:
            continue
        ms = phase_cost(cfg, chip, sc, lay, "decode", mtp,
                        comm if tp > 1 else "auto")["total_ms"]
        if best is None or ms < best[1]:
            best = (lay.devices, ms, tp, ep)
    if best is None:
        return None
    return {"tp": best[2], "ep": best[3], "devices": best[0], "decode_ms": best[1]}

