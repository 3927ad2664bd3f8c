"""Norms, the dense MLP and the MoE block. Hot paths go through glm5.ops.

Module and parameter names mirror transformers' GlmMoeDsa so checkpoints map by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5 import ops
from glm5.core.config import GLM5Config
from glm5.ir.quant_formats import get_scheme


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def linear(d_in: int, d_out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=bias)


class QuantLinear(nn.Module):
    """A linear layer whose weight is held in a canonical quantized scheme (docs/ops.md).

    Buffers (names as in a glm5-quantized checkpoint): ``weight_packed`` [N, P] int8/uint8
    (the scheme's packed codes), ``weight_scale`` fp32 [N] or [N, ceil(K/128)], optional
    ``bias`` [N] (fp32; from an imported msModelSlim static W8A8 layer). ``forward`` is
    ``glm5.ops.quant_linear`` on x flattened to [M, K]; the output takes x's dtype.
    """

    def __init__(self, d_in: int, d_out: int, scheme: str, bias: bool = False) -> None:
        super().__init__()

        sc = get_scheme(scheme, "QuantLinear")
        self.in_features, self.out_features, self.scheme = d_in, d_out, scheme
        self.register_buffer("weight_packed",
                             torch.zeros(d_out, sc.packed_k(d_in), dtype=sc.weight_dtype()))
        self.register_buffer("weight_scale",
                             torch.ones(sc.scale_shape(d_out, d_in), dtype=torch.float32))
        self.register_buffer("bias", torch.zeros(d_out) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = ops.quant_linear(x.reshape(-1, x.shape[-1]), self.weight_packed, self.weight_scale,
                             self.scheme, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


def apply_linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x·Wᵀ`` through ``mod``: F.linear on an unquantized nn.Linear (the bias-free hot path,
    no module-call overhead), quant_linear on a QuantLinear (or a subclass: a tensor-parallel
    part, glm5.parallel.layouts.RowParallelQuantLinear)."""
    if isinstance(mod, QuantLinear):
        return mod(x)
    return F.linear(x, mod.weight)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, inter)
        self.up_proj = linear(hidden, inter)
        self.down_proj = linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat((apply_linear(self.gate_proj, x), apply_linear(self.up_proj, x)), -1)
        return apply_linear(self.down_proj, ops.silu_mul(h))


class Router(nn.Module):
    """Sigmoid router with the fp32 correction bias (names as transformers: mlp.gate.*)."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size,
                                               dtype=torch.float32))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = F.linear(x.float(), self.weight.float())
        return ops.moe_route(logits, self.e_score_correction_bias.float(), c.num_experts_per_tok,
                             c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


class Experts(nn.Module):
    """Routed experts as stacked tensors: gate_up_proj [E, 2I, D] (gate rows first), down_proj
    [E, D, I]. Checkpoints store them per expert; glm5.core.checkpoint maps the names. Allocated
    uninitialised (as transformers does): `init_weights` or a checkpoint gives them values."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


def init_weights(module: nn.Module, std: float, pad_token_id: int | None = None) -> None:
    """Initialise ``module`` and its children as transformers initialises GlmMoeDsa
    (``PreTrainedModel._init_weights`` + ``GlmMoeDsaPreTrainedModel._init_weights``):
    nn.Linear / nn.Embedding weights, the router weight and the stacked expert weights
    ~ normal(0, ``std``) (the config's ``initializer_range``); linear biases zero; the norms'
    weights one and biases zero; the router's ``e_score_correction_bias`` zero; the embedding
    row ``pad_token_id`` zero (transformers builds the embedding with that padding index).
    Quantized modules (their codes come from a checkpoint) are left alone. In place, no grad;
    a tensor on the meta device is left as it is."""
    seen: set[int] = set()  # a tied weight (lm_head = embed_tokens) is initialised once

    def first(t: torch.Tensor) -> bool:
        if id(t) in seen:
            return False
        seen.add(id(t))
        return True

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                if first(m.weight):
                    m.weight.normal_(0.0, std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                if first(m.weight):
                    m.weight.normal_(0.0, std)
                    if pad_token_id is not None and 0 <= pad_token_id < m.weight.shape[0]:
                        m.weight[pad_token_id].zero_()
            elif isinstance(m, (RMSNorm, LayerNorm)):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, Router):
                m.weight.normal_(0.0, std)
                m.e_score_correction_bias.zero_()
            elif isinstance(m, Experts):
                m.gate_up_proj.normal_(0.0, std)
                m.down_proj.normal_(0.0, std)


class QuantExperts(nn.Module):
    """Routed experts in a canonical quantized scheme, stacked like `Experts`: buffers
    ``gate_up_proj_packed`` [E, 2I, P(D)] with ``gate_up_proj_scale`` ([E, 2I] or
    [E, 2I, ceil(D/128)], fp32, one scale set per expert) and ``down_proj_packed`` [E, D, P(I)]
    with ``down_proj_scale``; served by ``glm5.ops.moe_experts_quant``."""

    def __init__(self, cfg: GLM5Config, scheme: str) -> None:
        super().__init__()

        sc = get_scheme(scheme, "QuantExperts")
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.scheme = scheme
        for name, (N, K) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
            self.register_buffer(f"{name}_packed",
                                 torch.zeros(E, N, sc.packed_k(K), dtype=sc.weight_dtype()))
            self.register_buffer(f"{name}_scale",
                                 torch.ones(E, *sc.scale_shape(N, K), dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_experts_quant(x, ids, weights, self.gate_up_proj_packed,
                                     self.gate_up_proj_scale, self.down_proj_packed,
                                     self.down_proj_scale, self.scheme)


class MoE(nn.Module):
    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if type(self.experts) is QuantExperts:
            y = self.experts(x, ids, weights)
        else:
            y = ops.moe_experts(x, ids, weights, self.experts.gate_up_proj,
                                self.experts.down_proj)
        return y + self.shared_experts(x)
