"""transformers' GlmMoeDsaForCausalLM as the test oracle (dev dependency only)."""

from __future__ import annotations

import dataclasses

import torch

from glm5.core.config import GLM5Config

GLM5_ONLY = {"dsa_selection", "dsa_block_size", "dsa_block_topk", "num_nextn_predict_layers"}


def hf_config(cfg: GLM5Config):
    from transformers import GlmMoeDsaConfig

    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in GLM5_ONLY}
    return GlmMoeDsaConfig(**d)


def random_hf_model(cfg: GLM5Config, seed: int, std: float = 0.1):
    """A transformers model with random weights large enough to exercise every path, and a
    non-zero router correction bias."""
    from transformers import GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    m = GlmMoeDsaForCausalLM(hf_config(cfg)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif n.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return m


def randomize(model, seed: int = 0, std: float = 0.1):
    """Random weights for a glm5 model (norm weights around 1), non-zero router bias."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 and
                                                               n.endswith("weight") else 0.0))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * std)
    return model


def _stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.topk with ties to the smaller index (docs/ops.md's rule) via a stable sort."""
    vals, idx = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((vals.narrow(dim, 0, k), idx.narrow(dim, 0, k)))


def install_deterministic_indexer_topk() -> None:
    """Make transformers' DSA indexer break exact score ties to the smaller index, as glm5 does
    (docs/ops.md). Its own `torch.topk` leaves tie order unspecified, and random-weight models have
    exact ties (ReLU zeros under negative head weights), so without this the two models select
    different — equally valid — token sets. Only the indexer's top-k changes."""
    import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as M

    cls = M.GlmMoeDsaIndexer
    if getattr(cls.forward, "_glm5_stable", False):
        return
    original = cls.forward

    def forward(self, *a, **kw):
        saved = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk
        try:
            return original(self, *a, **kw)
        finally:
            torch.Tensor.topk = saved

    forward._glm5_stable = True
    cls.forward = forward
