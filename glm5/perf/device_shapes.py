"""Operator arguments at GLM-5's sizes built directly on a device (``DEV``): the shapes
`bench/gpu_suite.py` times and `glm5 tune` (`glm5.perf.tune`) searches tiles on.

Each ``b_*`` returns ``build(dtype) -> dict`` of the op's arguments, made on the device named by
the module's ``DEV`` at the time of the call (seeded generators on that device: the same
arguments on every run; ``"meta"``: shapes only, no data).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from glm5.ir.fp8 import quantize_rows_e4m3
from glm5.ir.quant_formats import quantize_weight

DEV = "cuda"


def _gen(seed: int) -> torch.Generator | None:
    if DEV == "meta":  # the dry run: shapes only
        return None
    return torch.Generator(device=DEV).manual_seed(seed)


def rn(*shape: int, dt: torch.dtype = torch.bfloat16, scale: float = 1.0,
       seed: int = 0) -> torch.Tensor:
    t = torch.randn(*shape, device=DEV, dtype=torch.float32, generator=_gen(seed + len(shape)))
    return (t * scale).to(dt)


def causal(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    end = (torch.arange(T, device=DEV) + S - T + 1).clamp(1, S).to(torch.int32)
    return torch.zeros(T, dtype=torch.int32, device=DEV), end


def rand_idx(T: int, S: int, K: int, seed: int = 1) -> torch.Tensor:
    r = torch.rand(T, S, device=DEV, generator=_gen(seed))
    return r.topk(K, dim=1).indices.to(torch.int32)


def angles(T: int, half: int, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(T, device=DEV, dtype=torch.float64)
    inv = 1e6 ** (-torch.arange(half, device=DEV, dtype=torch.float64) / half)
    th = pos[:, None] * inv[None, :]
    return th.cos().to(dt), th.sin().to(dt)


def b_norm(T: int, D: int) -> Callable:
    return lambda dt: {"x": rn(T, D, dt=dt), "weight": rn(D, dt=dt, seed=1), "eps": 1e-5}


def b_layer_norm(T: int, D: int) -> Callable:
    return lambda dt: {"x": rn(T, D, dt=dt), "weight": rn(D, dt=dt, seed=1),
                       "bias": rn(D, dt=dt, seed=2), "eps": 1e-5}


def b_rope(T: int, H: int, R: int, inter: bool) -> Callable:
    def build(dt):
        c, s = angles(T, R // 2, dt)
        return {"x": rn(T, H, R, dt=dt), "cos": c, "sin": s, "interleaved": inter}
    return build


def b_indexer(T: int, S: int, Hi: int, Di: int, topk: int | None = None) -> Callable:
    def build(dt):
        ks, ke = causal(T, S)
        a = {"q": rn(T, Hi, Di, dt=dt), "k": rn(S, Di, dt=dt, seed=1),
             "w": rn(T, Hi, dt=torch.float32, scale=Hi ** -0.5, seed=2), "k_start": ks,
             "k_end": ke}
        if topk is not None:
            a["topk"] = topk
        return a
    return build


def b_paged(B: int, L: int, Hi: int, Di: int, topk: int, ps: int, fp8: bool) -> Callable:
    """A decode step of B sequences of L keys each (one query per sequence) through a shuffled
    pool of ps-row pages; ``fp8``: paged_indexer_topk_fp8's pool (e4m3 codes + row scales)."""
    def build(dt):
        n = -(-L // ps)
        g = torch.Generator().manual_seed(3)
        table = torch.randperm(B * n, generator=g).to(torch.int32).reshape(B, n).to(DEV)
        k = rn(B * n * ps, Di, dt=dt, seed=1)
        pool = dict(zip(("k", "k_scale"), quantize_rows_e4m3(k))) if fp8 else {"k": k}
        return {"q": rn(B, Hi, Di, dt=dt), **pool,
                "w": rn(B, Hi, dt=torch.float32, scale=Hi ** -0.5, seed=2),
                "block_table": table, "seq": torch.arange(B, device=DEV, dtype=torch.int32),
                "k_len": torch.full((B,), L, device=DEV, dtype=torch.int32), "page_size": ps,
                "topk": topk}
    return build


def b_sparse(T: int, S: int, K: int, H: int, Hk: int, Dqk: int, Dv: int) -> Callable:
    def build(dt):
        k = rn(S, Hk, Dqk, dt=dt, seed=1)
        v = k[..., :Dv] if Hk == 1 and Dv < Dqk else rn(S, Hk, Dv, dt=dt, seed=2)
        return {"q": rn(T, H, Dqk, dt=dt), "k": k, "v": v, "idx": rand_idx(T, S, K),
                "scale": Dqk ** -0.5}
    return build


def b_attention(T: int, S: int, H: int, Hk: int, Dqk: int, Dv: int) -> Callable:
    def build(dt):
        ks, ke = causal(T, S)
        return {"q": rn(T, H, Dqk, dt=dt), "k": rn(S, Hk, Dqk, dt=dt, seed=1),
                "v": rn(S, Hk, Dv, dt=dt, seed=2), "k_start": ks, "k_end": ke,
                "scale": Dqk ** -0.5}
    return build


def b_mla(T: int, absorb: bool, D=6144, Rq=2048, H=64, Dn=192, Dr=64, Rkv=512) -> Callable:
    def build(dt):
        N = T + 128
        c, s = angles(T, Dr // 2, dt)
        slots = torch.randperm(N, device=DEV, generator=_gen(3))[:T].to(torch.int32)
        return {"x": rn(T, D, dt=dt), "w_qa": rn(Rq, D, dt=dt, scale=D ** -0.5, seed=1),
                "g_qa": rn(Rq, dt=dt, seed=2),
                "w_qb": rn(H * (Dn + Dr), Rq, dt=dt, scale=Rq ** -0.5, seed=3),
                "w_kva": rn(Rkv + Dr, D, dt=dt, scale=D ** -0.5, seed=4),
                "g_kva": rn(Rkv, dt=dt, seed=5),
                "w_uk": rn(H, Dn, Rkv, dt=dt, scale=Dn ** -0.5, seed=6),
                "cos": c, "sin": s, "eps": 1e-5,
                "kv_cache": torch.zeros(N, Rkv + Dr, dtype=dt, device=DEV),
                "slots": slots, "absorb": absorb}
    return build


def _route_ids(T: int, E: int, k: int) -> torch.Tensor:
    return rand_idx(T, E, k, seed=4)


def b_moe(T: int, k: int, E: int, D: int, I: int) -> Callable:
    def build(dt):
        return {"x": rn(T, D, dt=dt), "ids": _route_ids(T, E, k),
                "weights": torch.rand(T, k, device=DEV, generator=_gen(5)),
                "w13": rn(E, 2 * I, D, dt=dt, scale=D ** -0.5, seed=1),
                "w2": rn(E, D, I, dt=dt, scale=I ** -0.5, seed=2)}
    return build


def _qweight(N: int, K: int, scheme: str, seed: int = 7):
    return quantize_weight(rn(N, K, dt=torch.float32, scale=K ** -0.5, seed=seed), scheme)


def b_quant_linear(M: int, K: int, N: int, scheme: str) -> Callable:
    def build(dt):
        wp, ws = _qweight(N, K, scheme)
        return {"x": rn(M, K, dt=dt), "w_packed": wp, "w_scale": ws, "scheme": scheme,
                "bias": None}
    return build


def b_moe_quant(T: int, k: int, E: int, D: int, I: int, scheme: str) -> Callable:
    def build(dt):
        w13 = [_qweight(2 * I, D, scheme, seed=10 + e) for e in range(E)]
        w2 = [_qweight(D, I, scheme, seed=1000 + e) for e in range(E)]
        return {"x": rn(T, D, dt=dt), "ids": _route_ids(T, E, k),
                "weights": torch.rand(T, k, device=DEV, generator=_gen(5)),
                "w13_packed": torch.stack([p for p, _ in w13]),
                "w13_scale": torch.stack([s for _, s in w13]),
                "w2_packed": torch.stack([p for p, _ in w2]),
                "w2_scale": torch.stack([s for _, s in w2]), "scheme": scheme}
    return build


def b_logprobs(T: int, D: int, V: int) -> Callable:
    def build(dt):
        return {"h": rn(T, D, dt=dt), "w_vocab": rn(V, D, dt=dt, scale=D ** -0.5, seed=1),
                "targets": torch.randint(0, V, (T,), device=DEV, generator=_gen(2)).to(
                    torch.int32), "temperature": 1.0}
    return build


@contextmanager
def on(device: str) -> Iterator[None]:
    """Build on ``device`` inside the block (``DEV`` restored after)."""
    global DEV
    old, DEV = DEV, device
    try:
        yield
    finally:
        DEV = old
