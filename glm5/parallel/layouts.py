"""Tensor, expert and data-parallel layouts of a GLM-5 model, and FlashComm.

`parallelize(model, config)` turns a `GLM5ForCausalLM` (built or loaded whole, or a skeleton for
`glm5.parallel.loading`) into this rank's part of a parallel model, in place:

- **Tensor parallel** over ``layout.tp_group`` (size T): MLA attention heads split T ways
  (q_b_proj and kv_b_proj rows of this rank's heads, o_proj columns: a row-parallel linear whose
  output is a partial sum); the latent cache, its projections and the DSA indexer are
  replicated (the latent cache has no head axis: every rank keeps the whole of it); dense MLPs
  and shared experts split by intermediate columns (gate/up rows, down columns); routed experts
  split T ways by expert (expert parallel over the same group), unowned experts skipped with
  id -1. Each layer's partial outputs are summed across the group either by an all-reduce or,
  with **FlashComm** (from ``layout.flashcomm_min_tokens`` tokens on), by a reduce-scatter over
  tokens (padded to a multiple of T): the residual add and RMSNorm run on this rank's 1/T of the
  tokens, and an all-gather (optionally int8, per-token scales) rebuilds the whole input of the
  next column-parallel linear. Same result, less norm work and activation memory per rank.
- **Expert parallel with data-parallel attention** (``layout.dp_attention``, ``ep_group`` of
  size P, tp 1): each rank runs attention on its own sequences with whole weights; the routed
  experts are split P ways, and each MoE layer sends every (token, expert) pair to the expert's
  owner (all-to-all dispatch), runs them there and sends the results back (all-to-all
  combine); the shared expert runs locally. Dense layers are replicated.
- **Expert parallel with replicated tokens** (``ep_group`` without dp_attention, tp 1): every
  rank runs the same tokens, owns E/P experts, and the MoE outputs are all-reduced.

Embeddings, the LM head and the final norm are replicated. Communication goes through
`glm5.parallel.comm` (collectives as ops).

**Quantized layers** (`QuantLinear`, `QuantExperts`: a model loaded from a `glm5 quantize`
checkpoint) are cut along the same dims as their float counterparts, in the packed tensors' own
coordinates: a column-parallel QuantLinear keeps rows of ``weight_packed`` [N, P],
``weight_scale`` ([N] or [N, G]) and ``bias``; a row-parallel one (o_proj, down_proj) keeps the
packed columns of its input range and, for per-group scales [N, ceil(K/128)], the scale columns
of its groups (per-channel scales [N] stay whole); its bias is kept by rank 0 of the group only
(the partial sums are added once). A cut that would split a packed byte (int4: 2 codes a byte,
int6: 4 codes in 3 bytes) or straddle a 128-wide scale group is refused (`ParallelError` naming
the layer, K, the group size and the parts); a part lying inside one group keeps that group's
scale. Schemes with quantized activations (w8a8, w4a8, w6a12) quantize per token over the whole
K in one process; a row-parallel part sees only its 1/T of K, so `RowParallelQuantLinear`
all-gathers each token's max |x| over the group (M floats) and appends it as one extra input
column with zero weights: every rank then takes the single process's activation scale, and
the result equals the single process's up to fp32 summation order. Routed `QuantExperts` are
split by expert (dim 0 of the four buffers) and run with `ops.moe_experts_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from glm5 import ops
from glm5.core.layers import MLP, Experts, MoE, QuantExperts, QuantLinear
from glm5.deploy.chips import get_chip
from glm5.deploy.flashcomm import flashcomm_threshold
from glm5.ir.quant_formats import GROUP, get_scheme, n_groups
from glm5.parallel import comm
from glm5.parallel.groups import as_group

FLASHCOMM_MIN_TOKENS = 1000  # vllm-ascend's empirical threshold for dense models (the planner
# computes one per chip: `glm5 plan`)


class ParallelError(ValueError):
    """A layout that does not fit the model (sizes that do not divide, a cut inside a packed
    byte or a quantization group)."""


def flashcomm_min_tokens_for(chip: str, hidden_size: int, tp: int, int8: bool = False) -> int:
    """The planner's token threshold (`glm5.deploy.flashcomm.flashcomm_threshold`) for ``chip`` (a
    `glm5 plan` chip name): from this many tokens per forward on, FlashComm beats a plain
    all-reduce there. ``2**62`` when it never does (tp 1, or latency-bound up to the planner's
    search limit)."""

    t = flashcomm_threshold(get_chip(chip), hidden_size, tp,
                            "flashcomm-int8" if int8 else "flashcomm")
    return 2**62 if t is None else t


def _size_rank(group: Any) -> tuple[int, int]:
    g = as_group(group, "glm5 parallelize")
    return (1, 0) if g is None else (g.size, g.rank)


@dataclass
class ParallelConfig:
    """This rank's place in a parallel layout. ``tp_group``: the tensor-parallel group (None:
    tp 1); ``ep_group``: the expert-parallel group (None: the TP group serves as EP group, or
    no EP); ``dp_attention``: ranks of the EP group hold different tokens (all-to-all MoE);
    ``flashcomm``: reduce-scatter / all-gather instead of all-reduce from
    ``flashcomm_min_tokens`` tokens per forward on; ``comm_quant``: "int8" quantizes
    FlashComm's all-gather (per-token scales)."""

    tp_group: Any = None
    ep_group: Any = None
    dp_attention: bool = False
    flashcomm: bool = False
    flashcomm_min_tokens: int = FLASHCOMM_MIN_TOKENS
    comm_quant: str | None = None

    def __post_init__(self) -> None:
        self.tp, self.tp_rank = _size_rank(self.tp_group)
        self.ep, self.ep_rank = _size_rank(self.expert_group)
        if self.tp > 1 and self.ep_group is not None and self.ep != self.tp:
            raise ParallelError(f"glm5 parallelize: with tp {self.tp} > 1 the experts are split "
                                f"over the TP group; ep_group of size {self.ep} expected None or "
                                f"the TP group")
        if self.dp_attention and self.tp > 1:
            raise ParallelError("glm5 parallelize: dp_attention expected tp 1 (each rank runs "
                                "attention on its own sequences with whole weights)")
        if self.dp_attention and self.ep_group is None:
            raise ParallelError("glm5 parallelize: dp_attention needs an ep_group")
        if self.flashcomm and self.tp == 1:
            raise ParallelError("glm5 parallelize: flashcomm expected tp > 1 (it replaces the "
                                "TP all-reduce)")
        if self.comm_quant not in (None, "int8"):
            raise ParallelError(f"glm5 parallelize: comm_quant expected None or 'int8', got "
                                f"{self.comm_quant!r}")
        if isinstance(self.flashcomm_min_tokens, bool) or not isinstance(
                self.flashcomm_min_tokens, int) or self.flashcomm_min_tokens < 0:
            raise ParallelError(f"glm5 parallelize: flashcomm_min_tokens expected an int >= 0, "
                                f"got {self.flashcomm_min_tokens!r}")

    @property
    def expert_group(self) -> Any:
        return self.ep_group if self.ep_group is not None else self.tp_group

    @classmethod
    def from_context(cls, ctx: Any, tp: int = 1, ep: int = 1, dp_attention: bool = False,
                     **kw: Any) -> "ParallelConfig":
        """The config of sizes ``tp`` / ``ep`` over a `glm5.parallel.DistContext`'s groups
        (`DistContext.new_groups`; collective: every rank calls it alike). ``tp`` > 1: the
        experts are split over the TP group (``ep`` must be 1 or ``tp``); ``tp`` 1, ``ep`` > 1:
        the EP group, with data-parallel attention when ``dp_attention``."""
        if tp > 1 and ep not in (1, tp):
            raise ParallelError(f"glm5 ParallelConfig.from_context: with tp {tp} > 1, ep "
                                f"expected 1 or {tp} (experts split over the TP group), got "
                                f"{ep}")
        groups = ctx.new_groups(tp=tp, ep=ep if tp == 1 else tp)
        return cls(tp_group=groups.tp if tp > 1 else None,
                   ep_group=groups.ep if tp == 1 and ep > 1 else None,
                   dp_attention=dp_attention, **kw)


def _split(n: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if n % parts:
        raise ParallelError(f"glm5 parallelize: {what} ({n}) expected divisible by {parts}")
    step = n // parts
    return rank * step, (rank + 1) * step


_spec: dict[str, tuple[int, int, int]] | None = None  # the spec being recorded


def _record(name: str, dim: int, a: int, b: int) -> None:
    """Record that this rank keeps [a, b) of dim ``dim`` of checkpoint tensor ``name`` (module
    name); (0, 0, 0): this rank keeps none of it (a row-parallel bias off tp rank 0)."""
    if _spec is not None:
        _spec[name] = (dim, a, b)


@dataclass(frozen=True)
class _Cut:
    """Where a cut happens: the group it is taken over, its size and this rank's index (every
    cut is into ``parts`` equal ranges, this rank's is the ``rank``-th)."""

    group: Any
    parts: int
    rank: int


def _keep(lin: nn.Module, dim: int, a: int, b: int, where: str, cut: _Cut) -> nn.Module:
    """Keep output rows (dim 0) or input columns (dim 1) [a, b) of a linear (``where``: its
    module name, recorded in the shard spec); returns the module to install (a quantized
    row-parallel linear becomes a `RowParallelQuantLinear`). A row-parallel linear's bias is
    kept by rank 0 of the group only: the partial outputs are summed over the group."""
    if isinstance(lin, QuantLinear):
        return _keep_quant(lin, dim, a, b, where, cut)
    if not isinstance(lin, nn.Linear):
        raise ParallelError(f"glm5 parallelize: {where} is {type(lin).__name__}; expected "
                            f"nn.Linear or QuantLinear")
    _record(f"{where}.weight", dim, a, b)
    w = lin.weight.detach().narrow(dim, a, b - a).clone()
    lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
    if dim == 0:
        lin.out_features = b - a
        if lin.bias is not None:
            _record(f"{where}.bias", 0, a, b)
            lin.bias = nn.Parameter(lin.bias.detach()[a:b].clone())
    else:
        lin.in_features = b - a
        if lin.bias is not None and cut.rank != 0:
            _record(f"{where}.bias", 0, 0, 0)
            lin.bias = None
    return lin


def _packed_cols(scheme: str, K: int, a: int, b: int, parts: int, where: str
                 ) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The packed columns and (per-group scales) the scale columns holding input features
    [a, b) of a K-wide quantized weight cut into ``parts`` equal ranges. Every part is checked
    (not only this rank's) so that all ranks refuse alike: a boundary inside a packed unit
    (int4: 2 codes in a byte, int6: 4 codes in 3 bytes) or a part spanning the border of a
    128-wide scale group (its local groups would mix two scales) is a ParallelError."""
    sc = get_scheme(scheme, "parallelize")
    unit = {8: 1, 4: 2, 6: 4}[sc.weight_bits]
    step = b - a
    for i in range(parts):
        pa, pb = i * step, (i + 1) * step
        if pa % unit or (pb % unit and pb != K):
            raise ParallelError(
                f"glm5 parallelize: {where} ({scheme}): cutting K={K} input features into "
                f"{parts} parts of {step} puts a boundary inside a packed unit of {unit} "
                f"codes (part {i}: [{pa}, {pb})); expected part boundaries at multiples of "
                f"{unit}")
        aligned = pa % GROUP == 0 and (pb % GROUP == 0 or pb == K)
        if sc.grouped and not aligned and pa // GROUP != (pb - 1) // GROUP:
            raise ParallelError(
                f"glm5 parallelize: {where} ({scheme}): cutting K={K} input features into "
                f"{parts} parts of {step} splits a quantization group of {GROUP} (part {i}: "
                f"[{pa}, {pb}) spans groups {pa // GROUP}..{(pb - 1) // GROUP} unaligned); "
                f"expected parts that are whole groups or lie inside one group")
    p0 = sc.packed_k(a)  # exact: a is a multiple of the packing unit
    cols = (p0, p0 + sc.packed_k(b - a))
    return cols, ((a // GROUP, a // GROUP + n_groups(b - a)) if sc.grouped else None)


def _keep_quant(lin: QuantLinear, dim: int, a: int, b: int, where: str, cut: _Cut
                ) -> QuantLinear:
    """`_keep` for a QuantLinear: rows of weight_packed / weight_scale / bias, or packed
    columns and per-group scale columns (`_packed_cols`); recorded in checkpoint coordinates."""
    if dim == 0:
        for name in ("weight_packed", "weight_scale", "bias"):
            t = getattr(lin, name)
            if t is not None:
                _record(f"{where}.{name}", 0, a, b)
                setattr(lin, name, t[a:b].clone())
        lin.out_features = b - a
        return lin
    (c0, c1), groups = _packed_cols(lin.scheme, lin.in_features, a, b, cut.parts, where)
    _record(f"{where}.weight_packed", 1, c0, c1)
    lin.weight_packed = lin.weight_packed[:, c0:c1].clone()
    if groups is not None:
        _record(f"{where}.weight_scale", 1, *groups)
        lin.weight_scale = lin.weight_scale[:, groups[0]:groups[1]].clone()
    if lin.bias is not None and cut.rank != 0:
        _record(f"{where}.bias", 0, 0, 0)
        lin.bias = None
    lin.in_features = b - a
    if get_scheme(lin.scheme).act_bits is None:
        return lin  # float activations: the parts are exact as they are
    return RowParallelQuantLinear(lin, cut.group, cut.parts)


class RowParallelQuantLinear(QuantLinear):
    """A row-parallel part of a QuantLinear whose scheme quantizes activations per token
    (w8a8, w4a8, w6a12), computing exactly what the whole layer computes on its K range.

    The whole layer takes each token's scale from max |x| over all K; this part sees
    ``in_features`` = K/T of them. ``forward`` all-gathers each token's local max |x| over
    ``group`` (M floats a rank) and appends the group max as one extra input column whose
    weight codes are zero: quant_linear's per-token max is then the whole row's, so are the
    scale and the codes, and the extra column adds nothing. Buffers: ``weight_packed``
    [N, P(K/T + 1)] (the checkpoint slice, zero bytes appended), ``weight_scale`` [N] or
    [N, ceil((K/T + 1)/128)] (the slice, a 1.0 group appended where the extra column starts a
    new group), ``bias`` [N] fp32 or None (tp rank 0 only)."""

    def __init__(self, lin: QuantLinear, group: Any, parts: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.scheme = (lin.in_features, lin.out_features,
                                                            lin.scheme)
        self.group, self.parts = group, parts
        self.register_buffer("weight_packed", self.widen("weight_packed", lin.weight_packed))
        self.register_buffer("weight_scale", self.widen("weight_scale", lin.weight_scale))
        self.register_buffer("bias", lin.bias)

    def widen(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Checkpoint slice -> this module's buffer ``name`` (``weight_packed``: zero bytes for
        the extra column; ``weight_scale``: a 1.0 group if the column starts one; anything else
        unchanged). `glm5.parallel.loading` passes each slice it reads through here."""
        sc = get_scheme(self.scheme)
        K = self.in_features
        if name == "weight_packed":
            return F.pad(t, (0, sc.packed_k(K + 1) - sc.packed_k(K)))
        if name == "weight_scale" and sc.grouped:
            return F.pad(t, (0, n_groups(K + 1) - n_groups(K)), value=1.0)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, K)
        M = x2.shape[0]
        amax = x2.abs().amax(-1, keepdim=True)  # [M, 1] (every rank of the group has M rows)
        amax = comm.all_gather(amax, self.group).reshape(self.parts, M, 1).amax(0)
        y = ops.quant_linear(torch.cat((x2, amax), -1), self.weight_packed, self.weight_scale,
                             self.scheme, self.bias)
        return y.reshape(*lead, self.out_features)


# ---------------------------------------------------------------------------- modules
def _out_features(lin: nn.Module) -> int:
    return lin.out_features  # nn.Linear and QuantLinear alike


def _split_mlp(mlp: nn.Module, cut: _Cut, where: str) -> None:
    a, b = _split(_out_features(mlp.gate_proj), cut.parts, cut.rank,
                  f"{where} intermediate size")
    mlp.gate_proj = _keep(mlp.gate_proj, 0, a, b, f"{where}.gate_proj", cut)
    mlp.up_proj = _keep(mlp.up_proj, 0, a, b, f"{where}.up_proj", cut)
    mlp.down_proj = _keep(mlp.down_proj, 1, a, b, f"{where}.down_proj", cut)


def _split_attention(attn: nn.Module, cut: _Cut, where: str) -> None:
    c = attn.cfg
    H = c.num_attention_heads
    h0, h1 = _split(H, cut.parts, cut.rank, f"{where} attention heads")
    attn.q_b_proj = _keep(attn.q_b_proj, 0, h0 * c.qk_head_dim, h1 * c.qk_head_dim,
                          f"{where}.q_b_proj", cut)
    per = c.qk_nope_head_dim + c.v_head_dim
    attn.kv_b_proj = _keep(attn.kv_b_proj, 0, h0 * per, h1 * per, f"{where}.kv_b_proj", cut)
    attn.o_proj = _keep(attn.o_proj, 1, h0 * c.v_head_dim, h1 * c.v_head_dim,
                        f"{where}.o_proj", cut)
    # the module computes with its own heads (MLA: as many key/value heads as query heads)
    attn.cfg = c.replace(num_attention_heads=h1 - h0, num_key_value_heads=h1 - h0)


class ParallelMoE(nn.Module):
    """The routed experts this rank owns ([e0, e1) of E; `Experts` or `QuantExperts`) and the
    shared expert; the router is replicated. Replicated tokens: returns this rank's partial sum
    (the layer reduces it). Data-parallel attention: dispatches (token, expert) pairs to their
    owners by all-to-all and combines the results; returns the whole MoE output of this rank's
    tokens. An empty batch (x [0, D]) is valid in every mode: under data-parallel attention the
    rank still takes part in the all-to-alls (it sends nothing and runs the pairs others send
    it), so an idle data-parallel rank keeps the group in step."""

    # the stacked tensors of each kind of routed experts (all cut by expert, dim 0)
    _STACKED = {Experts: ("gate_up_proj", "down_proj"),
                QuantExperts: ("gate_up_proj_packed", "gate_up_proj_scale", "down_proj_packed",
                               "down_proj_scale")}

    def __init__(self, moe: nn.Module, layout: ParallelConfig, where: str) -> None:
        super().__init__()

        names = self._STACKED.get(type(moe.experts))
        if names is None:
            raise ParallelError(f"glm5 parallelize: {where}.experts is "
                                f"{type(moe.experts).__name__}; expected Experts or "
                                f"QuantExperts")
        self.layout = layout
        E = getattr(moe.experts, names[0]).shape[0]
        self.e0, self.e1 = _split(E, layout.ep, layout.ep_rank, f"{where} routed experts")
        self.n_local = self.e1 - self.e0
        self.gate = moe.gate
        self.experts = moe.experts
        for name in names:
            _record(f"{where}.experts.{name}", 0, self.e0, self.e1)
            p = getattr(moe.experts, name)
            kept = p.detach()[self.e0:self.e1].clone()
            setattr(moe.experts, name, nn.Parameter(kept, requires_grad=p.requires_grad)
                    if isinstance(p, nn.Parameter) else kept)
        self.shared_experts = moe.shared_experts
        if not layout.dp_attention:  # replicated tokens: the output is summed over the group,
            # so the shared expert is split like a dense MLP (each rank adds its columns' part)
            _split_mlp(moe.shared_experts, _Cut(layout.expert_group, layout.ep, layout.ep_rank),
                       f"{where}.shared_experts")

    def _run_experts(self, x: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """The local experts on x [M, D] with local ids [M, k] (-1: skip) and weights [M, k]."""
        ex = self.experts
        if type(ex) is QuantExperts:
            return ops.moe_experts_quant(x, ids, weights, ex.gate_up_proj_packed,
                                         ex.gate_up_proj_scale, ex.down_proj_packed,
                                         ex.down_proj_scale, ex.scheme)
        return ops.moe_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.layout.dp_attention:
            if x.shape[0] == 0:  # every rank holds the same (no) tokens: nothing to sum
                return torch.zeros_like(x)
            weights, ids = self.gate(x)
            local = ids - self.e0
            mine = (ids >= self.e0) & (ids < self.e1)
            y = self._run_experts(x, torch.where(mine, local, torch.full_like(local, -1)),
                                  weights)
            return y + self.shared_experts(x)
        weights, ids = self.gate(x)
        y = self._dispatch_combine(x, ids, weights)
        # the shared expert is whole here (no collective inside): skipped on no tokens
        return y + self.shared_experts(x) if x.shape[0] else y

    def _dispatch_combine(self, x: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor:
        g, P, El = self.layout.ep_group, self.layout.ep, self.n_local
        N, k = ids.shape
        tok = torch.arange(N, device=x.device).repeat_interleave(k)
        e = ids.reshape(-1).long()
        w = weights.reshape(-1)
        keep = e >= 0  # -1: a slot the router left empty
        tok, e, w = tok[keep], e[keep], w[keep]
        owner = torch.div(e, El, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        tok, e, w, owner = tok[order], e[order], w[order], owner[order]
        send = torch.bincount(owner, minlength=P).tolist()
        # every rank learns how many pairs it receives from each rank
        recv = comm.all_to_all(torch.tensor(send, dtype=torch.int64), [1] * P, [1] * P,
                               g).tolist()
        rx = comm.all_to_all(x[tok], send, recv, g)
        re = comm.all_to_all(e - owner * El, send, recv, g)
        ones = torch.ones(re.shape[0], 1, dtype=x.dtype, device=x.device)
        ry = self._run_experts(rx, re[:, None].to(ids.dtype), ones) if re.numel() else rx
        y = comm.all_to_all(ry, recv, send, g)
        out = torch.zeros_like(x)
        return out.index_add_(0, tok, y * w[:, None].to(y.dtype))


class ParallelDecoderLayer(nn.Module):
    """A decoder layer whose attention and MLP run split over the TP group, with the partial
    sums reduced by all-reduce or FlashComm. With FlashComm the residual stream between layers
    is this rank's token shard: the first layer cuts it, the last gathers it back."""

    def __init__(self, layer: nn.Module, layout: ParallelConfig, first: bool, last: bool) -> None:
        super().__init__()
        # the decoder layer's own modules, under the same names (checkpoint names unchanged)
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self.layout, self.first, self.last = layout, first, last
        # the MLP output is a partial sum across the group unless tokens differ per rank
        self.mlp_partial = layout.tp > 1 or (layout.ep > 1 and not layout.dp_attention and
                                             isinstance(layer.mlp, ParallelMoE))

    def _flashcomm(self, st: Any) -> bool:
        lay = self.layout
        return lay.flashcomm and st.slots.numel() >= lay.flashcomm_min_tokens

    def forward(self, h, st, latent, index_keys, prev_idx, rows):
        L, lay = self, self.layout
        if not self._flashcomm(st):
            a, idx = L.self_attn(L.input_layernorm(h), st, latent, index_keys, prev_idx, rows)
            h = h + (comm.all_reduce(a, lay.tp_group) if lay.tp > 1 else a)
            m = L.mlp(L.post_attention_layernorm(h))
            if self.mlp_partial:
                m = comm.all_reduce(m, lay.expert_group if lay.tp == 1 else lay.tp_group)
            return h + m, idx
        N, T, g = st.slots.numel(), lay.tp, lay.tp_group
        pad = -N % T
        if self.first:  # the residual stream becomes this rank's 1/T of the (padded) tokens
            h = F.pad(h, (0, 0, 0, pad)).chunk(T)[lay.tp_rank]
        x = self._gather(L.input_layernorm(h), N)
        a, idx = L.self_attn(x, st, latent, index_keys, prev_idx, rows)
        h = h + comm.reduce_scatter(F.pad(a, (0, 0, 0, pad)), g)
        m = L.mlp(self._gather(L.post_attention_layernorm(h), N))
        h = h + comm.reduce_scatter(F.pad(m, (0, 0, 0, pad)), g)
        if self.last:
            h = comm.all_gather(h, g)[:N]
        return h, idx

    def _gather(self, x: torch.Tensor, n: int) -> torch.Tensor:
        lay = self.layout
        if lay.comm_quant is not None:
            return comm.all_gather(x, lay.tp_group, quant=lay.comm_quant)[:n]
        return comm.all_gather(x, lay.tp_group)[:n]


# ---------------------------------------------------------------------------- the model
def parallelize(model: nn.Module, layout: ParallelConfig) -> nn.Module:
    """Make ``model`` (a GLM5ForCausalLM) this rank's part of ``layout``, in place; returns it.
    Every rank must call it with the same model (same weights) and its own groups. Sets
    ``model.parallel_layout`` and ``model.shard_spec`` ({tensor name: (dim, start, end)} of
    every parameter or buffer cut from the whole model's, in the checkpoint tensor's own
    coordinates — packed code columns, scale columns —: what `glm5.parallel.loading` reads;
    (0, 0, 0): this rank keeps none of it, a row-parallel bias off rank 0). A quantized layer
    whose cut would split a packed byte or a scale group raises `ParallelError` on every rank
    (module docstring)."""

    global _spec

    if getattr(model, "parallel_layout", None) is not None:
        raise ParallelError("glm5 parallelize: the model is already parallelized")
    model.parallel_layout = layout
    model.shard_spec = {}
    if layout.tp == 1 and layout.ep == 1:
        return model
    _spec = model.shard_spec
    try:
        _parallelize(model, layout)
    finally:
        _spec = None
    return model


def _parallelize(model: nn.Module, layout: ParallelConfig) -> None:
    def one(layer: nn.Module, where: str, first: bool, last: bool) -> nn.Module:
        if layout.tp > 1:
            cut = _Cut(layout.tp_group, layout.tp, layout.tp_rank)
            _split_attention(layer.self_attn, cut, f"{where}.self_attn")
            if type(layer.mlp) is MLP:
                _split_mlp(layer.mlp, cut, f"{where}.mlp")
        if type(layer.mlp) is MoE and layout.ep > 1:
            layer.mlp = ParallelMoE(layer.mlp, layout, f"{where}.mlp")
        elif type(layer.mlp) is MoE and layout.tp > 1:  # pragma: no cover - ep == tp here
            raise ParallelError(f"glm5 parallelize: {where}: MoE under TP needs ep > 1")
        return ParallelDecoderLayer(layer, layout, first, last)

    layers = model.model.layers
    n = len(layers)
    for i in range(n):
        layers[i] = one(layers[i], f"model.layers.{i}", i == 0, i == n - 1)
    for d, m in enumerate(model.mtp or ()):
        m.block = one(m.block, f"mtp.{d}.block", True, True)
