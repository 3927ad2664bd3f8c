"""Input generators of the RL ops: token_logprobs, grpo_advantages and policy_loss (tiers and
profiles: :mod:`glm5.testing.cases`)."""

from __future__ import annotations

from typing import Any

import torch

from glm5.testing.case_draw import GLM5, Draw, Maker, i32


def gen_token_logprobs(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    # 4099 crosses the reference's 4096-row vocabulary chunk; tile crosses BLOCK_T 64,
    # BLOCK_D 64 and BLOCK_V 128; huge is GLM-5's vocabulary.
    T, D, V = {"edge": lambda: (d.int(1, 4), d.choice((4, 16)), d.cover((4099, 3, 50))),
               "tile": lambda: (d.int(65, 130), d.choice((65, 200)), d.cover((129, 1000))),
               "model": lambda: (d.int(1, 2), GLM5["hidden"], d.cover((4100, 8192))),
               "large": lambda: (d.int(16, 32), 64, d.choice((16384, 33000))),
               "huge": lambda: (d.int(2, 4), 16, GLM5["vocab"])}[tier]()
    return {"h": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))),
            "w_vocab": m.randn(V, D, scale=D ** -0.5),
            "targets": i32(m.randint(0, V, T)), "temperature": d.choice((0.7, 1.0, 1.5))}


def gen_grpo_advantages(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    std = d.cover((True, False))
    g, n = {"edge": lambda: (d.int(2 if std else 1, 6), d.cover((1, d.int(2, 4)))),
            "tile": lambda: (d.int(8, 16), d.int(20, 40)),
            "model": lambda: (16, 64),
            "large": lambda: (8, d.int(400, 600)),
            "huge": lambda: (16, 4096)}[tier]()
    kind = d.choice(("normal", "binary", "constant"))
    if kind == "binary":
        r = m.randint(0, 2, n * g).to(dtype)
    elif kind == "constant":
        r = torch.full((n * g,), 0.5, dtype=dtype)
    else:
        r = m.randn(n * g, noncontig=False)
    return {"rewards": r, "group_size": g, "std_normalize": std, "eps": 1e-6}


def gen_policy_loss(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    T = {"edge": lambda: d.int(1, 10), "tile": lambda: d.int(100, 1000),
         "model": lambda: 4096, "large": lambda: 32768, "huge": lambda: 1 << 20}[tier]()
    logp = -m.uniform(T, lo=0.01, hi=5.0)
    old = logp.float() + m.randn(T, scale=d.choice((0.01, 0.3)), dtype=torch.float32)
    mask = m.randint(0, 4, T) > 0
    if d.flag():
        mask = mask.to(dtype)
    rollout = None
    if d.cover((True, False)):  # truncated importance sampling against rollout logprobs
        rollout = (old + m.randn(T, scale=0.3, dtype=torch.float32)).to(dtype)
    return {"logp": logp, "old_logp": old.to(dtype), "adv": m.randn(T), "mask": mask,
            "clip_low": d.choice((0.2, 0.1)), "clip_high": d.choice((0.25, 0.28)),
            "rollout_logp": rollout, "tis_cap": d.choice((2.0, 1.5))}
