"""Input generators of the MoE and quantization ops: moe_route, moe_experts, quantize_per_token,
quant_linear and moe_experts_quant (tiers and profiles: :mod:`glm5.testing.cases`). Exact ties
between experts and exact rounding halves are drawn on purpose."""

from __future__ import annotations

from typing import Any

import torch

from glm5.ir.quant_formats import SCHEMES, quantize_weight
from glm5.testing.case_draw import GLM5, Draw, Maker, i32


def gen_moe_route(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    if tier == "edge":
        T, E = d.int(1, 5), d.choice((4, 8, 16))
    elif tier == "model":  # GLM-5: 256 experts, no groups; DeepSeek-V3: 8 groups, 4 kept
        T, E = d.int(1, 4), GLM5["experts"]
    elif tier == "tile":
        T, E = d.int(17, 40), d.choice((64, 160))
    else:
        T, E = d.int(300, 1100) if tier == "large" else d.int(2048, 3000), GLM5["experts"]
    groups = [g for g in (1, 2, 4, 8) if E // g >= 2 and E % g == 0]
    n_group = d.choice(groups)
    topk_group = d.int(1, n_group)
    reach = E if n_group == 1 else topk_group * (E // n_group)
    if d.cover((True, False)):  # exact ties between experts, decided by the smaller id
        logits = m.randint(-2, 3, T, E).to(dtype)
        bias = torch.zeros(E, dtype=dtype)
        if d.flag():  # ties in (logit, bias) pairs with a non-zero bias
            bias = m.randint(-1, 2, E).to(dtype) * 0.25
    else:
        logits = m.randn(T, E, scale=d.choice((0.5, 3.0)))
        bias = m.randn(E, scale=0.1, noncontig=False)
    k = GLM5["top_k"] if tier != "edge" else d.int(1, 8)
    return {"logits": logits, "bias": bias, "top_k": min(reach, k),
            "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": d.flag(),
            "routed_scaling": d.choice((1.0, 2.5))}


def _routing(d: Draw, m: Maker, T: int, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([m.perm(E)[:k] for _ in range(T)])
    if d.flag():  # expert-parallel padding
        ids = torch.where(m.randint(0, 3, T, k) == 0, torch.full_like(ids, -1), ids)
    w = m.uniform(T, k, lo=0.05, hi=1.0, dtype=torch.float32)
    return i32(ids), w


def _expert_shape(d: Draw, tier: str) -> tuple[int, int, int, int, int]:
    """(T, D, I, E, k)."""
    if tier == "edge":
        E = d.int(1, 4)
        return d.int(1, 5), d.choice((4, 8, 16)), d.choice((4, 8)), E, d.int(1, min(E, 3))
    if tier == "tile":
        return d.int(17, 40), d.choice((130, 200)), d.choice((40, 96)), d.int(3, 8), d.int(1, 3)
    if tier == "model":  # the MoE intermediate size; a narrower hidden keeps weights small
        return d.int(1, 3), 512, GLM5["moe_inter"], 4, 2
    # past the cpu backend's 1024 routed rows (its torch per-expert path)
    return d.int(400, 600), 64, 32, 8, 3


def gen_moe_experts(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    T, D, I, E, k = _expert_shape(d, tier)
    ids, w = _routing(d, m, T, E, k)
    return {"x": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))), "ids": ids, "weights": w,
            "w13": m.randn(E, 2 * I, D, scale=D ** -0.5),
            "w2": m.randn(E, D, I, scale=I ** -0.5)}


def _halves(m: Maker, M: int, K: int, qmax: int) -> torch.Tensor:
    """Rows whose quotients x / s are exact halves (s a power of two, amax = qmax s): the
    round-half-to-even rule decides every code."""
    e = m.randint(-6, 3, M, 1).double()
    s = torch.pow(2.0, e)
    j = m.randint(-qmax, qmax, M, K).double()
    x = (j + 0.5) * s
    x[:, 0] = qmax * s[:, 0]
    return x


def gen_quantize_per_token(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    M, K = {"edge": lambda: (d.int(1, 4), d.choice((1, 7, 16, 130))),
            "tile": lambda: (d.int(17, 40), d.choice((300, 1000))),
            "model": lambda: (d.int(1, 4), d.choice((GLM5["hidden"], GLM5["q_lora"]))),
            "large": lambda: (2, d.choice((8193, 9000))),  # past QUANT_BLOCK_K 8192
            "huge": lambda: (d.int(2048, 4096), 256)}[tier]()
    bits = d.cover((8, 12))
    if d.cover((True, False)) and not (dtype != torch.float32 and bits == 12):
        # exact halves (12-bit codes up to 2047.5 need 12 significant bits: fp32 only)
        x = _halves(m, M, K, 127 if bits == 8 else 2047).to(dtype)
    else:
        x = m.randn(M, K, scale=m.magnitude())
    if d.flag():
        x[d.int(0, M - 1)] = 0  # amax 0: scale 1, zero codes
    return {"x": x, "bits": bits}


def _qweight(m: Maker, N: int, K: int, scheme: str, lead: tuple[int, ...] = ()):
    w = torch.randn(*lead, N, K, generator=m.g) * K ** -0.5
    if lead:
        packs = [quantize_weight(w[e], scheme) for e in range(lead[0])]
        return torch.stack([p for p, _ in packs]), torch.stack([s for _, s in packs])
    return quantize_weight(w, scheme)


def gen_quant_linear(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    scheme = d.cover(tuple(SCHEMES))
    M, N, K = {"edge": lambda: (d.int(1, 4), d.int(1, 8), d.choice((8, 64, 130, 200))),
               # past BLOCK_M 16/64, BLOCK_N 64, BLOCK_K 128 and a partial 128-group
               "tile": lambda: (d.int(17, 70), d.int(65, 130), d.choice((129, 300))),
               "model": lambda: (d.int(1, 2), GLM5["q_lora"], GLM5["hidden"]),
               "large": lambda: (d.int(385, 450), 64, 256),  # the cpu torch path (> 384 rows)
               "huge": lambda: (1024, 128, 512)}[tier]()
    wp, ws = _qweight(m, N, K, scheme)
    sc = SCHEMES[scheme]
    if sc.act_bits is not None and d.cover((False, True)) and (dtype == torch.float32 or
                                                              sc.act_bits == 8):
        x = _halves(m, M, K, sc.act_qmax).to(dtype)
    else:
        x = m.randn(M, K, scale=d.choice((0.1, 1.0, 8.0)))
    return {"x": x, "w_packed": wp, "w_scale": ws,
            "scheme": scheme, "bias": m.randn(N, noncontig=False) if d.flag() else None}


def gen_moe_experts_quant(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    scheme = d.cover(tuple(SCHEMES))
    if tier == "edge":
        T, D, I, E = d.int(1, 4), d.choice((8, 16, 130)), d.choice((4, 8)), d.int(1, 3)
        k = d.int(1, min(E, 3))
    else:
        T, D, I, E, k = _expert_shape(d, tier)
    ids, w = _routing(d, m, T, E, k)
    w13p, w13s = _qweight(m, 2 * I, D, scheme, (E,))
    w2p, w2s = _qweight(m, D, I, scheme, (E,))
    return {"x": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))), "ids": ids, "weights": w,
            "w13_packed": w13p, "w13_scale": w13s, "w2_packed": w2p, "w2_scale": w2s,
            "scheme": scheme}
