"""Rotary position tables (cos, sin) [T, R/2] for the MLA and indexer rope dims.

`default` and `yarn` (as transformers computes them) are supported; the tables are fp32 and
are applied by `glm5.ops.rope` (interleaved pairs for GLM-5).
"""

from __future__ import annotations

import math

import torch

from glm5.core.config import ConfigError, GLM5Config


def _yarn(cfg: GLM5Config, dim: int, base: float) -> tuple[torch.Tensor, float]:
    rp = cfg.rope_parameters
    orig = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or cfg.max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rp.get("attention_factor")
    if att is None:
        if rp.get("mscale") and rp.get("mscale_all_dim"):
            att = mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"])
        else:
            att = mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos)) * (1 - extra) + (1.0 / pos) * extra
    return inv, float(att)


def inv_freq(cfg: GLM5Config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] fp32, cos/sin scaling) for R = qk_rope_head_dim."""
    dim = cfg.qk_rope_head_dim
    rp = cfg.rope_parameters
    base = float(rp["rope_theta"])
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    if kind == "yarn":
        return _yarn(cfg, dim, base)
    raise ConfigError(f"glm5 config: rope_parameters.rope_type {kind!r} is not supported "
                      f"(supported: default, yarn)")


def rope_tables(freqs: torch.Tensor, scaling: float, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R/2] for integer positions [T]."""
    ang = positions.to(torch.float32)[:, None] * freqs.to(positions.device)[None, :]
    return (ang.cos() * scaling).to(dtype), (ang.sin() * scaling).to(dtype)
