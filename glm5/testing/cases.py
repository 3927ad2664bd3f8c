"""Input generators ("strategies") per op, covering the edges: T = 1, S < k, rows with no valid
key, −1 indices, non-contiguous inputs, tiny and large magnitudes, every claimed dtype.

A generator is written once against a small `Draw` interface, so the same definition drives
hypothesis (`HypothesisDraw`, used by the pytest plugin, with shrinking) and the `glm5 parity`
CLI (`RandomDraw`, no hypothesis needed at runtime). Tensors come from a torch.Generator seeded
by a drawn integer; shapes, flags and magnitudes are drawn so that they shrink.
"""

from __future__ import annotations

import abc
import random
from typing import Any, Callable, Sequence

import torch

from glm5.ir.quant_formats import SCHEMES, quantize_weight

# The dtypes a kernel declaring `dtypes=None` is exercised with.
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


class Draw(abc.ABC):
    """Primitive choices; implemented over random.Random or hypothesis."""

    @abc.abstractmethod
    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (inclusive)."""

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def flag(self) -> bool:
        return self.int(0, 1) == 1


class RandomDraw(Draw):
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)


class HypothesisDraw(Draw):
    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))


class Maker:
    """Seeded tensors in the case's dtype, optionally non-contiguous."""

    def __init__(self, d: Draw, dtype: torch.dtype) -> None:
        self.d = d
        self.dtype = dtype
        self.g = torch.Generator().manual_seed(d.int(0, 2**31 - 1))

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None,
              noncontig: bool | None = None) -> torch.Tensor:
        dt = dtype or self.dtype
        nc = self.d.flag() if noncontig is None else noncontig
        if nc and len(shape) >= 1 and shape[-1] > 0:
            base = torch.randn(*shape[:-1], 2 * shape[-1], generator=self.g) * scale
            return base.to(dt)[..., ::2]
        return (torch.randn(*shape, generator=self.g) * scale).to(dt)

    def uniform(self, *shape: int, lo: float, hi: float, dtype: torch.dtype | None = None):
        t = torch.rand(*shape, generator=self.g) * (hi - lo) + lo
        return t.to(dtype or self.dtype)

    def randint(self, lo: int, hi: int, *shape: int) -> torch.Tensor:  # [lo, hi)
        return torch.randint(lo, hi, shape, generator=self.g)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)

    def magnitude(self) -> float:
        # Tiny and large inputs; fp16's range caps the large end where products accumulate.
        big = 30.0 if self.dtype != torch.float16 else 8.0
        return self.d.choice((1e-2, 1.0, big))

    def angles(self, T: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.randint(0, 4096, T).double()
        inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / max(half, 1))
        th = pos[:, None] * inv[None, :]
        return th.cos().to(self.dtype), th.sin().to(self.dtype)


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32)


def _ranges(m: Maker, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key ranges: causal (prefill/decode), random, or with empty rows."""
    mode = m.d.choice(("causal", "random", "empty_rows", "full"))
    if mode == "full":
        return _i32(torch.zeros(T)), _i32(torch.full((T,), S))
    if mode == "causal":
        end = (torch.arange(T) + (S - T) + 1).clamp(0, S)
        return _i32(torch.zeros(T)), _i32(end)
    a = m.randint(0, S + 1, T)
    b = m.randint(0, S + 1, T)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    if mode == "empty_rows":
        hi = torch.where(m.randint(0, 2, T) == 1, lo, hi)
    return _i32(lo), _i32(hi)


# --------------------------------------------------------------------------- per-op generators
def gen_rms_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    lead = [d.int(1, 4) for _ in range(d.int(0, 2))]
    D = d.choice((1, 3, 8, 16, 33, 64))
    return {"x": m.randn(*lead, D, scale=m.magnitude()), "weight": m.randn(D),
            "eps": d.choice((1e-6, 1e-5))}


def gen_layer_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    lead = [d.int(1, 4) for _ in range(d.int(0, 2))]
    D = d.choice((2, 3, 8, 16, 33, 64))
    return {"x": m.randn(*lead, D, scale=m.magnitude()), "weight": m.randn(D),
            "bias": m.randn(D), "eps": d.choice((1e-6, 1e-5))}


def gen_rope(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T = d.int(1, 6)
    mid = [d.int(1, 3) for _ in range(d.int(0, 2))]
    R = d.choice((2, 4, 8, 64))
    cos, sin = m.angles(T, R // 2)
    return {"x": m.randn(T, *mid, R, scale=m.magnitude()), "cos": cos, "sin": sin,
            "interleaved": d.flag()}


def gen_silu_mul(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    lead = [d.int(1, 4) for _ in range(d.int(1, 2))]
    I = d.choice((1, 3, 8, 32))
    return {"x": m.randn(*lead, 2 * I, scale=d.choice((1e-2, 1.0, 8.0)))}


def _indexer_inputs(d: Draw, m: Maker) -> dict[str, Any]:
    T, S = d.int(1, 6), d.int(1, 12)
    Hi, Di = d.int(1, 4), d.choice((4, 8, 16))
    ks, ke = _ranges(m, T, S)
    mag = m.magnitude() if m.dtype != torch.float16 else 1.0
    return {"q": m.randn(T, Hi, Di, scale=mag), "k": m.randn(S, Di, scale=mag),
            "w": m.randn(T, Hi, scale=Hi ** -0.5), "k_start": ks, "k_end": ke}


def gen_lightning_indexer(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    return _indexer_inputs(d, Maker(d, dtype))


def gen_topk_indices(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, S = d.int(1, 6), d.int(1, 16)
    kind = d.choice(("random", "ties", "masked"))
    if kind == "ties":  # few distinct values: ties decided by index
        scores = m.randint(-2, 3, T, S).to(dtype)
    else:
        scores = m.randn(T, S, scale=m.magnitude(), noncontig=False)
    if kind == "masked":
        holes = m.randint(0, 4, T, S) == 0
        scores = scores.masked_fill(holes, float("-inf"))
        if d.flag():
            scores[0] = float("-inf")  # a row with no finite score
        if d.flag():
            scores[-1, 0] = float("nan")
    if d.flag() and S > 1:
        scores = scores.t().contiguous().t()  # column-major storage
    return {"scores": scores, "k": d.int(1, S + 3)}


def gen_indexer_topk(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    a = _indexer_inputs(d, m)
    a["topk"] = d.int(1, a["k"].shape[0] + 2)
    return a


def _attn_qkv(d: Draw, m: Maker, T: int, S: int) -> dict[str, Any]:
    mqa_view = d.flag()
    if mqa_view:  # absorbed MLA: one KV head, v = the first Dv columns of k
        H, Hk = d.choice((1, 2, 4)), 1
        Dqk = d.choice((8, 16))
        Dv = Dqk // 2
    else:
        Hk = d.choice((1, 2))
        H = Hk * d.choice((1, 2))
        Dqk, Dv = d.choice((4, 8, 16)), d.choice((4, 8))
    mag = d.choice((0.1, 1.0, 4.0))
    q = m.randn(T, H, Dqk, scale=mag)
    k = m.randn(S, Hk, Dqk, scale=mag)
    v = k[..., :Dv] if mqa_view else m.randn(S, Hk, Dv)
    return {"q": q, "k": k, "v": v, "scale": Dqk ** -0.5}


def gen_sparse_attention(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, S = d.int(1, 5), d.int(1, 10)
    a = _attn_qkv(d, m, T, S)
    K = d.int(1, S + 2)
    rows = []
    for _ in range(T):
        r = torch.full((K,), -1, dtype=torch.int64)
        n = min(K, S)
        r[:n] = m.perm(S)[:n]
        if d.flag():  # -1 holes anywhere in the row, valid ones not only first
            r = torch.where(m.randint(0, 3, K) == 0, torch.full_like(r, -1), r)
            r = r[m.perm(K)]
        rows.append(r)
    idx = _i32(torch.stack(rows))
    if d.flag():
        idx[d.int(0, T - 1)] = -1  # a query with no valid key
    return {"q": a["q"], "k": a["k"], "v": a["v"], "idx": idx, "scale": a["scale"]}


def gen_attention(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, S = d.int(1, 5), d.int(1, 10)
    a = _attn_qkv(d, m, T, S)
    ks, ke = _ranges(m, T, S)
    return {"q": a["q"], "k": a["k"], "v": a["v"], "k_start": ks, "k_end": ke,
            "scale": a["scale"]}


def gen_mla_prolog(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, D = d.int(1, 4), d.choice((8, 16))
    Rq, H, Dn, Dr, Rkv = d.choice((8, 16)), d.choice((1, 2)), d.choice((4, 8)), d.choice((4, 8)), 8
    N = T + d.int(0, 3)
    cos, sin = m.angles(T, Dr // 2)
    slots = m.perm(N)[:T]
    if d.flag():
        slots[d.int(0, T - 1)] = -1
    return {
        "x": m.randn(T, D, scale=d.choice((0.1, 1.0, 10.0))),
        "w_qa": m.randn(Rq, D, scale=D ** -0.5, noncontig=False),
        "g_qa": m.randn(Rq),
        "w_qb": m.randn(H * (Dn + Dr), Rq, scale=Rq ** -0.5),
        "w_kva": m.randn(Rkv + Dr, D, scale=D ** -0.5),
        "g_kva": m.randn(Rkv),
        "w_uk": m.randn(H, Dn, Rkv, scale=Dn ** -0.5),
        "cos": cos, "sin": sin, "eps": 1e-5,
        "kv_cache": m.randn(N, Rkv + Dr, noncontig=False),
        "slots": _i32(slots),
        "absorb": d.flag(),
    }


def gen_moe_route(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, E = d.int(1, 5), d.choice((4, 8, 16))
    groups = [g for g in (1, 2, 4) if E // g >= 2 and E % g == 0]
    n_group = d.choice(groups)
    topk_group = d.int(1, n_group)
    reach = E if n_group == 1 else topk_group * (E // n_group)
    if d.flag():  # exact ties between experts, decided by the smaller id
        logits = m.randint(-2, 3, T, E).to(dtype)
        bias = torch.zeros(E, dtype=dtype)
    else:
        logits = m.randn(T, E, scale=d.choice((0.5, 3.0)))
        bias = m.randn(E, scale=0.1, noncontig=False)
    return {"logits": logits, "bias": bias, "top_k": d.int(1, min(reach, 8)),
            "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": d.flag(),
            "routed_scaling": d.choice((1.0, 2.5))}


def _routing(d: Draw, m: Maker, T: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = d.int(1, min(E, 3))
    ids = torch.stack([m.perm(E)[:k] for _ in range(T)])
    if d.flag():  # expert-parallel padding
        ids = torch.where(m.randint(0, 3, T, k) == 0, torch.full_like(ids, -1), ids)
    w = m.uniform(T, k, lo=0.05, hi=1.0, dtype=torch.float32)
    return _i32(ids), w


def gen_moe_experts(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, D, I, E = d.int(1, 5), d.choice((4, 8, 16)), d.choice((4, 8)), d.int(1, 4)
    ids, w = _routing(d, m, T, E)
    return {"x": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))), "ids": ids, "weights": w,
            "w13": m.randn(E, 2 * I, D, scale=D ** -0.5),
            "w2": m.randn(E, D, I, scale=I ** -0.5)}


def gen_quantize_per_token(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    M, K = d.int(1, 4), d.choice((1, 7, 16, 130))
    x = m.randn(M, K, scale=m.magnitude())
    if d.flag():
        x[d.int(0, M - 1)] = 0  # amax 0: scale 1, zero codes
    return {"x": x, "bits": d.choice((8, 12))}


def _qweight(m: Maker, N: int, K: int, scheme: str, lead: tuple[int, ...] = ()):
    w = torch.randn(*lead, N, K, generator=m.g) * K ** -0.5
    if lead:
        packs = [quantize_weight(w[e], scheme) for e in range(lead[0])]
        return torch.stack([p for p, _ in packs]), torch.stack([s for _, s in packs])
    return quantize_weight(w, scheme)


def gen_quant_linear(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    scheme = d.choice(tuple(SCHEMES))
    M, N, K = d.int(1, 4), d.int(1, 8), d.choice((8, 64, 130, 200))
    wp, ws = _qweight(m, N, K, scheme)
    return {"x": m.randn(M, K, scale=d.choice((0.1, 1.0, 8.0))), "w_packed": wp, "w_scale": ws,
            "scheme": scheme, "bias": m.randn(N, noncontig=False) if d.flag() else None}


def gen_moe_experts_quant(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    scheme = d.choice(tuple(SCHEMES))
    T, D, I, E = d.int(1, 4), d.choice((8, 16, 130)), d.choice((4, 8)), d.int(1, 3)
    ids, w = _routing(d, m, T, E)
    w13p, w13s = _qweight(m, 2 * I, D, scheme, (E,))
    w2p, w2s = _qweight(m, D, I, scheme, (E,))
    return {"x": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))), "ids": ids, "weights": w,
            "w13_packed": w13p, "w13_scale": w13s, "w2_packed": w2p, "w2_scale": w2s,
            "scheme": scheme}


def gen_token_logprobs(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T, D = d.int(1, 4), d.choice((4, 16))
    V = d.choice((3, 50, 4099))  # 4099 crosses the reference's 4096-row vocabulary chunk
    return {"h": m.randn(T, D, scale=d.choice((0.1, 1.0, 4.0))),
            "w_vocab": m.randn(V, D, scale=D ** -0.5),
            "targets": _i32(m.randint(0, V, T)), "temperature": d.choice((0.7, 1.0, 1.5))}


def gen_grpo_advantages(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    std = d.flag()
    g = d.int(2 if std else 1, 6)
    n = d.int(1, 4)
    kind = d.choice(("normal", "binary", "constant"))
    if kind == "binary":
        r = m.randint(0, 2, n * g).to(dtype)
    elif kind == "constant":
        r = torch.full((n * g,), 0.5, dtype=dtype)
    else:
        r = m.randn(n * g, noncontig=False)
    return {"rewards": r, "group_size": g, "std_normalize": std, "eps": 1e-6}


def gen_policy_loss(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    m = Maker(d, dtype)
    T = d.int(1, 10)
    logp = -m.uniform(T, lo=0.01, hi=5.0)
    old = logp.float() + m.randn(T, scale=d.choice((0.01, 0.3)), dtype=torch.float32)
    mask = m.randint(0, 4, T) > 0
    if d.flag():
        mask = mask.to(dtype)
    rollout = None
    if d.flag():
        rollout = (old + m.randn(T, scale=0.3, dtype=torch.float32)).to(dtype)
    return {"logp": logp, "old_logp": old.to(dtype), "adv": m.randn(T), "mask": mask,
            "clip_low": d.choice((0.2, 0.1)), "clip_high": d.choice((0.25, 0.28)),
            "rollout_logp": rollout, "tis_cap": d.choice((2.0, 1.5))}


GENERATORS: dict[str, Callable[[Draw, torch.dtype], dict[str, Any]]] = {
    name[4:]: fn for name, fn in list(globals().items()) if name.startswith("gen_")
}


def case_dtypes(op: Any, kernel_dtypes: frozenset[torch.dtype] | None) -> list[torch.dtype]:
    """Dtypes to exercise: those the kernel claims within those the op allows for its dispatch
    argument (defaults when the kernel claims any)."""
    arg = next(p for p in op.tensor_params if p.name == op.dispatch_arg)
    allowed = arg.dtypes or frozenset(DEFAULT_DTYPES)
    claimed = kernel_dtypes if kernel_dtypes is not None else frozenset(DEFAULT_DTYPES)
    out = [dt for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
           if dt in allowed and dt in claimed]
    if not out and kernel_dtypes is None:
        out = [dt for dt in (torch.float32, torch.float64) if dt in allowed][:1]
    return out


def example_seed(seed: int, op: str, dtype: torch.dtype, i: int) -> int:
    """A stable per-example seed (no Python hash randomisation)."""
    h = 0
    for ch in f"{op}/{dtype}/{i}":
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return (seed * 1_000_003 + h) % (2**63)


__all__ = ["GENERATORS", "Draw", "RandomDraw", "HypothesisDraw", "case_dtypes", "example_seed",
]
