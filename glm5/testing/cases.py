"""Input generators ("strategies") per op.

Every generator draws a *tier* first, then shapes within it:

* ``edge``  — the corner cases: T = 1, S < k, rows with no valid key, −1 indices, empty
  groups, non-contiguous inputs, tiny and large magnitudes, exact ties;
* ``tile``  — past the first tile of every shipped kernel: hundreds of keys (Triton BLOCK_S 64,
  BLOCK_K 32, BLOCK_T 16, BLOCK_V 128), head dims that are and are not multiples of the tiles;
* ``model`` — GLM-5's real shapes at small T: MQA attention 64 heads x 576/512 over 2048
  selected keys, the indexer's 32 heads x 128, the MLA prolog's 6144 -> 2048 / 512 + 64
  projections (alternating with DeepSeek-V3's 7168 -> 1536, the sizes torch_npu's MLA prolog
  documents), 256 experts choosing 8, the hidden size and the MoE intermediate size;
* ``large`` — thousands: S and K up to 2048-4500, T past the cpu kernels' 64-query blocks,
  rows past the torch-path thresholds of quant_linear (384) and moe_experts (1024 routed rows);
* ``huge``  — past the largest blocks: S > 8192 (the TVM indexer's key tile), k rows larger
  than the TVM sparse-attention key-block size (its multi-pass path), a 154,880-word vocabulary.

A profile (``PROFILES``) names the tiers a run cycles through: ``glm5 parity`` gives example
``i`` the tier ``tiers[i % len(tiers)]``, so every run of at least ``len(tiers)`` examples
reaches every tier; hypothesis draws the tier (and shrinks towards ``edge``). ``default`` is
what ``glm5 parity`` runs; ``quick`` (edge, tile, model) keeps interpreted backends fast;
``smoke`` (edge, tile) is for unit tests of interpreted kernels; ``full`` is ``default`` with
100 examples, for vendors.

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

from glm5.ir.fp8 import quantize_rows_e4m3
from glm5.ir.quant_formats import SCHEMES, quantize_weight

# The dtypes a kernel declaring `dtypes=None` is exercised with.
DEFAULT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

TIERS = ("edge", "model", "tile", "large", "huge")
PROFILES: dict[str, tuple[str, ...]] = {
    "smoke": ("edge", "tile"),
    "quick": ("edge", "tile", "model"),
    "default": ("edge", "model", "tile", "large", "huge"),
    "full": ("edge", "model", "tile", "large", "huge"),
}
DEFAULT_PROFILE = "default"
# Examples per (op, dtype) of a profile when the caller does not say.
PROFILE_EXAMPLES = {"smoke": 4, "quick": 6, "default": 10, "full": 100}

# GLM-5's shapes (glm5.core.config preset "glm-5"; the kit does not import the model layer).
GLM5 = dict(hidden=6144, q_lora=2048, kv_lora=512, rope=64, nope=192, heads=64,
            index_heads=32, index_dim=128, index_topk=2048, experts=256, top_k=8,
            moe_inter=2048, vocab=154880)


class Draw(abc.ABC):
    """Primitive choices; implemented over random.Random or hypothesis."""

    tiers: tuple[str, ...] = PROFILES[DEFAULT_PROFILE]

    @abc.abstractmethod
    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (inclusive)."""

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def flag(self) -> bool:
        return self.int(0, 1) == 1

    def tier(self) -> str:
        """The size tier of this example (one of ``self.tiers``)."""
        return self.choice(self.tiers)

    def cover(self, options: Sequence[Any]) -> Any:
        """A choice that consecutive examples of a parity run rotate through (a flag that
        decides which code path runs: every option is reached within len(options) examples,
        whatever the seed); hypothesis draws it."""
        return self.choice(options)

    def variant(self, options: Sequence[Any]) -> Any:
        """A variant of the example's tier that successive passes over the tiers rotate through
        (the first pass takes the first option)."""
        return self.choice(options)


class RandomDraw(Draw):
    """Choices from random.Random(seed); ``tier`` fixes the example's tier and ``index`` (the
    example's number) drives ``cover`` (the parity runner cycles through both)."""

    def __init__(self, seed: int, tier: str | None = None,
                 tiers: tuple[str, ...] | None = None, index: int | None = None) -> None:
        self.r = random.Random(seed)
        self._tier = tier
        self._index = index
        self._covers = 0
        if tiers is not None:
            self.tiers = tiers

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def tier(self) -> str:
        return self._tier if self._tier is not None else super().tier()

    def cover(self, options: Sequence[Any]) -> Any:
        if self._index is None:
            return self.choice(options)
        # Each cover call of a generator rotates with its own offset, so two flags of one
        # example do not move in lockstep.
        self._covers += 1
        return options[(self._index + self._covers * (self._index // len(options) + 1))
                       % len(options)]

    def variant(self, options: Sequence[Any]) -> Any:
        if self._index is None:
            return self.choice(options)
        return options[(self._index // len(self.tiers)) % len(options)]


class HypothesisDraw(Draw):
    def __init__(self, data: Any, tiers: tuple[str, ...] | None = None) -> None:
        from hypothesis import strategies as st

        self.data, self.st = data, st
        if tiers is not None:
            self.tiers = tiers

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
        # Tiny inputs (mean(x^2) near a norm's eps: 1e-3), small, unit and large ones; fp16's
        # range caps the large end where products accumulate.
        big = 30.0 if self.dtype != torch.float16 else 8.0
        return self.d.cover((1e-3, 1.0, big, 1e-2))

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


# --------------------------------------------------------------------------- per-op generators
def _norm_dim(d: Draw, tier: str, edge: tuple[int, ...]) -> int:
    return {
        "edge": lambda: d.choice(edge),
        "tile": lambda: d.choice((100, 257, 1000)),
        "model": lambda: d.choice((GLM5["hidden"], GLM5["q_lora"], GLM5["kv_lora"])),
        "large": lambda: d.choice((8193, 8400)),  # past the Triton norm's one-pass 8192
        "huge": lambda: d.choice((64, 130)),
    }[tier]()


def gen_rms_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    lead = _rows(d, tier, (1, 4))
    D = _norm_dim(d, tier, (1, 3, 8, 16, 33, 64))
    if tier == "large":
        lead = lead[:1]
    return {"x": m.randn(*lead, D, scale=m.magnitude()), "weight": m.randn(D),
            "eps": d.choice((1e-6, 1e-5))}


def gen_layer_norm(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    lead = _rows(d, tier, (1, 4))
    D = _norm_dim(d, tier, (2, 3, 8, 16, 33, 64))
    if tier == "large":
        lead = lead[:1]
    x = m.randn(*lead, D, scale=m.magnitude())
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


def _indexer_shape(d: Draw, tier: str) -> tuple[int, int, int, int]:
    """(T, S, Hi, Di)."""
    if tier == "edge":
        return d.int(1, 6), d.int(1, 12), d.int(1, 4), d.choice((4, 8, 16))
    if tier == "tile":  # past BLOCK_T 16 / BLOCK_S 64; Di a multiple and not of the tiles
        return d.int(17, 40), d.int(65, 300), d.int(2, 8), d.choice((24, 48, 128, 160))
    if tier == "model":
        return (d.int(1, 4), d.int(GLM5["index_topk"] + 1, 3000), GLM5["index_heads"],
                GLM5["index_dim"])
    if tier == "large":  # past the TVM 64-query block
        return d.int(65, 130), d.int(1000, 4500), d.int(4, 8), 64
    return d.int(1, 3), d.int(8193, 9000), 4, 32  # past the TVM 8192-key tile


def _indexer_inputs(d: Draw, m: Maker, tier: str) -> dict[str, Any]:
    T, S, Hi, Di = _indexer_shape(d, tier)
    ks, ke = _ranges(m, T, S)
    mag = m.magnitude() if m.dtype != torch.float16 else 1.0
    if tier != "edge":
        mag = d.choice((0.3, 1.0))
    return {"q": m.randn(T, Hi, Di, scale=mag), "k": m.randn(S, Di, scale=mag),
            "w": m.randn(T, Hi, scale=Hi ** -0.5), "k_start": ks, "k_end": ke}


def gen_lightning_indexer(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    return _indexer_inputs(d, Maker(d, dtype), tier)


def _ties(m: Maker, T: int, S: int, dtype: torch.dtype) -> torch.Tensor:
    return m.randint(-2, 3, T, S).to(dtype)


def gen_topk_indices(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    T, S = {"edge": lambda: (d.int(1, 6), d.int(1, 16)),
            "tile": lambda: (d.int(17, 40), d.int(100, 600)),
            "model": lambda: (d.int(1, 4), d.int(GLM5["index_topk"] + 1, 9000)),
            "large": lambda: (d.int(64, 130), d.int(2000, 4500)),
            "huge": lambda: (d.int(1, 3), d.int(9000, 20000))}[tier]()
    kind = d.choice(("random", "ties", "masked"))
    if kind == "ties":  # few distinct values: ties decided by index
        scores = _ties(m, T, S, dtype)
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
    k = {"edge": lambda: d.int(1, S + 3),
         "tile": lambda: d.choice((1, 16, 64, S // 2, S + 3)),
         "model": lambda: GLM5["index_topk"],
         "large": lambda: d.choice((256, 2048)),
         "huge": lambda: GLM5["index_topk"]}[tier]()
    return {"scores": scores, "k": max(1, k)}


def gen_indexer_topk(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    a = _indexer_inputs(d, m, tier)
    S = a["k"].shape[0]
    if d.flag() and tier in ("edge", "tile") and S >= 2:  # duplicated keys: exact ties
        a["k"][S // 2:] = a["k"][: S - S // 2].clone()
    a["topk"] = {"edge": lambda: d.int(1, S + 2),
                 "tile": lambda: d.choice((1, 16, 64, S // 2, S + 5)),
                 "model": lambda: GLM5["index_topk"],
                 "large": lambda: d.choice((64, 512, 2048)),
                 "huge": lambda: GLM5["index_topk"]}[tier]()
    a["topk"] = max(1, a["topk"])
    return a


def gen_indexer_topk_fp8(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    """indexer_topk's cases (the op quantizes q and k itself: 4-bit significands make exact
    score ties common, which the order contract decides by index)."""
    return gen_indexer_topk(d, dtype)


def _paged_pool(d: Draw, m: Maker, lens: list[int], ps: int, Di: int,
                mag: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A serving engine's paged key pool for sequences of lengths ``lens``: (k [pages * ps, Di],
    block_table [B, P] int32). Page ids are a shuffled permutation of the pool (non-identity
    physical order) with free pages left over; a sequence's row holds its pages, sometimes one
    pre-allocated page past its length, then at least one -1 (unallocated); sequences may share a
    page-aligned prefix with sequence 0 (a prefix cache); the table may be a column slice of a
    wider one (non-contiguous rows)."""
    B = len(lens)
    used = [-(-n // ps) for n in lens]
    extra = [int(u < 64 and d.int(0, 3) == 0) for u in used]  # a page allocated ahead
    P = max(u + e for u, e in zip(used, extra)) + d.int(1, 2)  # -1 columns at the end
    shared = 0
    if B > 1 and d.flag():
        shared = d.int(0, min([lens[0] // ps] + used[1:]))
    need = sum(u + e for u, e in zip(used, extra)) - shared * (B - 1)
    n_pages = need + d.int(0, 3)  # free pages: a kernel reading one selects keys no query sees
    ids = m.perm(n_pages).tolist()
    if ids == sorted(ids):  # never the identity: a kernel ignoring the table must fail
        ids.reverse()
    wide = P + (d.int(1, 3) if d.flag() else 0)
    table = torch.full((B, wide), -1, dtype=torch.int32)
    nxt = 0
    for b in range(B):
        for p in range(used[b] + extra[b]):
            if b > 0 and p < shared:
                table[b, p] = table[0, p]
            else:
                table[b, p] = ids[nxt]
                nxt += 1
    k = m.randn(n_pages * ps, Di, scale=mag)
    return k, table[:, :P]


def gen_paged_indexer_topk(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    """indexer_topk through a paged pool (`_paged_pool`): B sequences, lengths ending mid-page
    and on page boundaries; queries as prefill chunks (causal k_len ending at the sequence's
    length, grouped by sequence), decode steps (k_len = the length, sequences interleaved) or
    random (any k_len in [0, length], empty rows included, interleaved)."""
    tier = d.tier()
    m = Maker(d, dtype)
    if tier == "edge":
        B, ps, T = d.int(1, 3), d.choice((1, 2, 3, 4, 8)), d.int(1, 6)
        Hi, Di, lo, hi = d.int(1, 4), d.choice((4, 8, 16)), 0, 12
    elif tier == "tile":  # past BLOCK_T 16 / BLOCK_S 64; pages smaller and larger than tiles
        B, ps, T = d.int(1, 4), d.choice((16, 5, 64)), d.int(17, 40)
        Hi, Di, lo, hi = d.int(2, 8), d.choice((24, 48, 128, 160)), 65, 300
    elif tier == "model":
        B, ps, T = d.int(1, 3), 64, d.int(1, 4)
        Hi, Di, lo, hi = GLM5["index_heads"], GLM5["index_dim"], GLM5["index_topk"] + 1, 3000
    elif tier == "large":  # past the TVM 64-query block
        B, ps, T = d.int(1, 3), d.choice((64, 16)), d.int(65, 130)
        Hi, Di, lo, hi = d.int(4, 8), 64, 1000, 4500
    else:  # past the TVM 8192-key tile
        B, ps, T = d.int(1, 2), 64, d.int(1, 3)
        Hi, Di, lo, hi = 4, 32, 8193, 9000
    lens = []
    for _ in range(B):
        n = d.int(lo, hi)
        if d.flag() and n >= ps:  # ends on a page boundary
            n -= n % ps
        lens.append(n)
    mag = m.magnitude() if dtype != torch.float16 else 1.0
    if tier != "edge":
        mag = d.choice((0.3, 1.0))
    k, table = _paged_pool(d, m, lens, ps, Di, mag)
    S = k.shape[0]
    if d.flag() and tier in ("edge", "tile") and S >= 2:  # duplicated keys: exact ties
        k[S // 2:] = k[: S - S // 2].clone()
    mode = d.cover(("prefill", "decode", "random"))
    if mode == "prefill":  # T split into consecutive chunks, one per sequence
        cuts = sorted(d.int(0, T) for _ in range(B - 1))
        bounds = [0, *cuts, T]
        seq, kl = [], []
        for b in range(B):
            n = bounds[b + 1] - bounds[b]
            seq += [b] * n
            kl += [max(0, lens[b] - n + 1 + i) for i in range(n)]
        seq_t, kl_t = torch.tensor(seq), torch.tensor(kl)
    else:
        seq_t = m.randint(0, B, T)
        full = torch.tensor(lens)[seq_t]
        if mode == "decode":
            kl_t = full
        else:
            kl_t = (torch.rand(T, generator=m.g) * (full + 1).double()).long().clamp(max=full)
    Lmax = max(lens)
    topk = {"edge": lambda: d.int(1, Lmax + 2),
            "tile": lambda: d.choice((1, 16, 64, Lmax // 2, Lmax + 5)),
            "model": lambda: GLM5["index_topk"],
            "large": lambda: d.choice((64, 512, 2048)),
            "huge": lambda: GLM5["index_topk"]}[tier]()
    return {"q": m.randn(T, Hi, Di, scale=mag), "k": k, "w": m.randn(T, Hi, scale=Hi ** -0.5),
            "block_table": table, "seq": _i32(seq_t), "k_len": _i32(kl_t), "page_size": ps,
            "topk": max(1, topk)}


def gen_paged_indexer_topk_fp8(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    """paged_indexer_topk's cases with the key pool quantized as the serving engine writes it
    (`glm5.ir.fp8.quantize_rows_e4m3` per row: e4m3 codes and a power-of-two scale); in half
    the cases the pages no sequence holds are as a fresh pool holds them (codes 0, scale 0:
    never written; no query sees them, and a kernel reading them must not select them)."""
    a = gen_paged_indexer_topk(d, dtype)
    codes, scale = quantize_rows_e4m3(a["k"])
    if d.flag():  # the pages no table row holds: as a fresh pool has them
        ps = a["page_size"]
        free = torch.ones(codes.shape[0] // ps, dtype=torch.bool)
        held = a["block_table"].flatten().long()
        free[held[held >= 0]] = False
        rows = free.repeat_interleave(ps)
        codes = codes.view(torch.uint8).masked_fill(rows[:, None], 0).view(codes.dtype)
        scale[rows] = 0
    return {"q": a["q"], "k": codes, "k_scale": scale, "w": a["w"],
            **{n: a[n] for n in ("block_table", "seq", "k_len", "page_size", "topk")}}


def _attn_heads(d: Draw, tier: str) -> tuple[int, int, int, int, bool]:
    """(H, Hk, Dqk, Dv, mqa_view): mqa_view = absorbed MLA, v the first Dv columns of k."""
    if tier in ("model", "huge"):
        H = GLM5["heads"] if tier == "model" else d.choice((16, GLM5["heads"]))
        return H, 1, GLM5["kv_lora"] + GLM5["rope"], GLM5["kv_lora"], True
    mode = d.cover(("gqa", "mqa"))  # grouped heads (Hk = 2 or 3, H > Hk) or absorbed MQA
    if tier == "edge":
        if mode == "mqa":
            Dqk = d.choice((8, 16))
            return d.choice((1, 2, 4)), 1, Dqk, Dqk // 2, True
        Hk = d.choice((2, 3))
        return Hk * d.choice((2, 3)), Hk, d.choice((4, 8, 16)), d.choice((4, 8)), False
    if tier == "tile":  # head dims a multiple of the 64-wide tiles and not
        if mode == "mqa":
            Dqk = d.choice((80, 144, 192))
            return d.int(3, 20), 1, Dqk, Dqk - 16, True
        Hk = d.choice((2, 3))
        return Hk * d.int(2, 6), Hk, d.choice((64, 80, 130)), d.choice((64, 96, 130)), False
    return d.choice((8, 16)), 1, 160, 128, True  # large


def _qkv(d: Draw, m: Maker, T: int, S: int, tier: str) -> dict[str, Any]:
    H, Hk, Dqk, Dv, mqa = _attn_heads(d, tier)
    mag = d.choice((0.1, 1.0, 4.0))
    q = m.randn(T, H, Dqk, scale=mag)
    k = m.randn(S, Hk, Dqk, scale=mag)
    v = k[..., :Dv] if mqa else m.randn(S, Hk, Dv)
    return {"q": q, "k": k, "v": v, "scale": Dqk ** -0.5}


def gen_sparse_attention(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    topk = GLM5["index_topk"]
    T, S, K = {"edge": lambda: (d.int(1, 5), d.int(1, 10), None),
               "tile": lambda: (d.int(17, 40), d.int(100, 400), d.int(33, 300)),
               "model": lambda: (d.int(1, 4), d.int(topk + 1, 3000), topk),
               "large": lambda: (d.int(65, 130), d.int(2000, 5000), d.choice((256, 2048))),
               # k rows past the TVM kernel's 6 MiB key block (its multi-pass path)
               "huge": lambda: (8, d.int(6000, 7000), topk)}[tier]()
    if K is None:
        K = d.int(1, S + 2)
    a = _qkv(d, m, T, S, tier)
    n = min(K, S)
    idx = torch.full((T, K), -1, dtype=torch.int64)
    for t in range(T):
        idx[t, :n] = m.perm(S)[:n]
    if d.flag():  # -1 holes anywhere in the rows, valid ones not only first
        holes = m.randint(0, 3 if tier == "edge" else 16, T, K) == 0
        idx = torch.where(holes, torch.full_like(idx, -1), idx)
        idx = idx[:, m.perm(K)]
    idx = _i32(idx)
    if d.flag():
        idx[d.int(0, T - 1)] = -1  # a query with no valid key
    return {"q": a["q"], "k": a["k"], "v": a["v"], "idx": idx, "scale": a["scale"]}


def gen_attention(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    T, S = {"edge": lambda: (d.int(1, 5), d.int(1, 10)),
            "tile": lambda: (d.int(17, 40), d.int(100, 400)),
            "model": lambda: (d.int(1, 4), d.int(GLM5["index_topk"], 3000)),
            "large": lambda: (d.int(65, 130), d.int(1000, 2000)),
            "huge": lambda: (d.int(2, 4), d.int(6000, 7000))}[tier]()
    a = _qkv(d, m, T, S, tier)
    ks, ke = _ranges(m, T, S)
    return {"q": a["q"], "k": a["k"], "v": a["v"], "k_start": ks, "k_end": ke,
            "scale": a["scale"]}


def gen_mla_prolog(d: Draw, dtype: torch.dtype) -> dict[str, Any]:
    tier = d.tier()
    m = Maker(d, dtype)
    if tier == "edge":
        T, D = d.int(1, 4), d.choice((8, 16))
        Rq, H, Dn, Dr, Rkv = (d.choice((8, 16)), d.choice((1, 2)), d.choice((4, 8)),
                              d.choice((4, 8)), 8)
    elif tier == "model" and d.variant(("deepseek-v3", "glm-5")) == "deepseek-v3":
        # the MLA sizes torch_npu's npu_mla_prolog_v3 documents (DeepSeek-V3: 7168 -> 1536,
        # 128 + 64 head dims; 16 of its 128 heads), absorbed: what reaches that binding
        T, D, Rq, H, Dn, Dr, Rkv = d.int(1, 2), 7168, 1536, 16, 128, GLM5["rope"], GLM5["kv_lora"]
    elif tier == "model":
        T, D, Rq, H = d.int(1, 2), GLM5["hidden"], GLM5["q_lora"], GLM5["heads"]
        Dn, Dr, Rkv = GLM5["nope"], GLM5["rope"], GLM5["kv_lora"]
    elif tier == "tile":
        T, D, Rq, H = d.int(17, 40), d.choice((200, 300)), d.choice((96, 160)), d.int(3, 17)
        Dn, Dr, Rkv = d.choice((40, 48)), d.choice((16, 32)), d.choice((48, 80))
    else:  # many tokens at small widths (a prefill chunk)
        T, D, Rq, H = d.int(200, 600), 256, 128, d.choice((4, 8))
        Dn, Dr, Rkv = 64, 32, 128
    N = T + d.int(0, 3)
    cos, sin = m.angles(T, Dr // 2)
    slots = m.perm(N)[:T]
    if d.flag():
        slots[d.int(0, T - 1)] = -1
    return {
        "x": m.randn(T, D, scale=d.choice((0.1, 1.0, 10.0))),
        "w_qa": m.randn(Rq, D, scale=D ** -0.5, noncontig=False),
        "g_qa": m.randn(Rq),
        "w_qb": m.randn(H * (Dn + Dr), Rq, scale=Rq ** -0.5, noncontig=tier == "edge" and None),
        "w_kva": m.randn(Rkv + Dr, D, scale=D ** -0.5, noncontig=tier == "edge" and None),
        "g_kva": m.randn(Rkv),
        "w_uk": m.randn(H, Dn, Rkv, scale=Dn ** -0.5, noncontig=tier == "edge" and None),
        "cos": cos, "sin": sin, "eps": 1e-5,
        "kv_cache": m.randn(N, Rkv + Dr, noncontig=False),
        "slots": _i32(slots),
        "absorb": True if D == 7168 else d.flag(),
    }


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
    return _i32(ids), w


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
            "targets": _i32(m.randint(0, V, T)), "temperature": d.choice((0.7, 1.0, 1.5))}


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


def example(op: str, dtype: torch.dtype, seed: int, i: int,
            profile: str = DEFAULT_PROFILE) -> dict[str, Any]:
    """Example ``i`` of (op, dtype) for a run with ``seed`` under ``profile``: its tier is the
    profile's i-th (cycling)."""
    tiers = PROFILES[profile]
    draw = RandomDraw(example_seed(seed, op, dtype, i), tier=tiers[i % len(tiers)], tiers=tiers,
                      index=i)
    return GENERATORS[op](draw, dtype)


__all__ = ["GENERATORS", "PROFILES", "TIERS", "Draw", "RandomDraw", "HypothesisDraw",
           "case_dtypes", "example", "example_seed"]
