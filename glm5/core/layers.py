"""Norms, the dense MLP and the MoE block. Hot paths go through glm5.ops.

Module and parameter names mirror transformers' GlmMoeDsa so checkpoints map by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm5 import ops
from glm5.core.config import GLM5Config


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


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, inter)
        self.up_proj = linear(hidden, inter)
        self.down_proj = linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat((F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)), -1)
        return F.linear(ops.silu_mul(h), self.down_proj.weight)


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
    [E, D, I]. Checkpoints store them per expert; glm5.core.checkpoint maps the names."""

    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))


class MoE(nn.Module):
    def __init__(self, cfg: GLM5Config) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = ops.moe_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        return y + self.shared_experts(x)
