"""Input generators of the row-wise ops: rms_norm, layer_norm, rope and silu_mul (tiers and
profiles: :mod:`glm5.testing.cases`)."""

from __future__ import annotations

from typing import Any

import torch

from glm5.testing.case_draw import GLM5, Draw, Maker


def _rows(d: Draw, tier: str, edge: tuple[int, int]) -> list[int]:
    """Leading dims of a row-wise op: small in edge, past 16/64-row blocks in tile and large,
    thousands of rows in huge."""
    if tier == "edge":
        return [d.int(1, edge[1]) for _ in range(d.int(0, 2))] or [d.int(1, 4)]
    if tier == "tile":
        return [d.int(17, 70)]
    if tier == "model":
        return [d.int(1, 4)]
    if tier == "large":
        return [d.int(2, 3), d.int(30, 60)]
    return [d.int(2048, 4096)]


def _norm_dim(d: Draw, tier: str, edge: tuple[int, ...]) -> int:
    return {
        "edge": lambda: d.choice(edge),
        "tile": lambda: d.choice((100, 257, 1000)),
        "model": lambda: d.choice((GLM5["hidden"], GLM5["q_lora"], GLM5["kv_lora"])),
        "large": lambda: d.choice((8193, 8400)),  # past the Triton norm's one-pass 8192
        "huge": lambda: d.choice((64, 130)),
    }[tier]()


def _norm_input(d: Draw, dtype: torch.dtype, edge: tuple[int, ...]) -> tuple[Maker, torch.Tensor]:
    """A norm's x [*rows, D] (and the maker that drew it, for the rest of the example)."""
    tier = d.tier()
    m = Maker(d, dtype)
    lead = _rows(d, tier, (1, 4))
    D = _norm_dim(d, tier, edge)
    if tier == "large":
        lead = lead[:1]
    return m, m.randn(*lead, D, scale=m.magnitude())


def gen_rms_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m, x = _norm_input(d, dtype, (1, 3, 8, 16, 33, 64))
    return {"x": x, "weight": m.randn(x.shape[-1]), "eps": d.choice((1e-6, 1e-5))}


def gen_layer_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m, x = _norm_input(d, dtype, (2, 3, 8, 16, 33, 64))
    D = x.shape[-1]
    if d.flag():  # an offset mean: the variance then cancels
        x = (x.float() + 3.0 * float(x.float().abs().mean())).to(dtype)
    return {"x": x, "weight": m.randn(D), "bias": m.randn(D), "eps": d.choice((1e-6, 1e-5))}


def gen_rope(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    if tier == "edge":
        T, mid, R = d.int(1, 6), [d.int(1, 3) for _ in range(d.int(0, 2))], d.choice((2, 4, 8, 64))
    elif tier == "tile":
        T, mid, R = d.int(17, 40), [d.int(1, 20)], d.choice((32, 64, 96))
    elif tier == "model":  # q_pe [T, 64 heads, 64] and k_pe [T, 64]
        T, mid, R = d.int(1, 4), d.choice(([GLM5["heads"]], [])), GLM5["rope"]
    elif tier == "large":
        T, mid, R = d.int(300, 600), [d.int(9, 16)], GLM5["rope"]
    else:
        T, mid, R = d.int(512, 1024), [d.int(17, 24)], GLM5["rope"]
    cos, sin = m.angles(T, R // 2)
    return {"x": m.randn(T, *mid, R, scale=m.magnitude()), "cos": cos, "sin": sin,
            "interleaved": d.cover((True, False))}


def gen_silu_mul(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    lead = _rows(d, tier, (1, 4))
    I = {"edge": lambda: d.choice((1, 3, 8, 32)), "tile": lambda: d.choice((100, 300)),
         "model": lambda: d.choice((GLM5["moe_inter"], 12288)),
         "large": lambda: d.choice((1025, 4100)),  # past the Triton BLOCK_I 1024
         "huge": lambda: d.choice((64, 128))}[tier]()
    if tier == "large":
        lead = lead[:1]
    return {"x": m.randn(*lead, 2 * I, scale=d.choice((1e-2, 1.0, 8.0)))}
