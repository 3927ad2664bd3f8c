"""Input generators of the DSA ops: the lightning indexer and its top-k (dense, paged, fp8),
top-k over scores, sparse and dense attention, and the MLA prolog (tiers and profiles:
:mod:`glm5.testing.cases`). Index and range tensors are int32; ties, -1 holes, empty rows, shuffled
page tables and non-contiguous tables are drawn on purpose."""

from __future__ import annotations

from typing import Any

import torch

from glm5.ir.fp8 import quantize_rows_e4m3
from glm5.testing.case_draw import GLM5, Draw, Maker, i32


def _ranges(m: Maker, T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key ranges: causal (prefill/decode), random, or with empty rows."""
    mode = m.d.choice(("causal", "random", "empty_rows", "full"))
    if mode == "full":
        return i32(torch.zeros(T)), i32(torch.full((T,), S))
    if mode == "causal":
        end = (torch.arange(T) + (S - T) + 1).clamp(0, S)
        return i32(torch.zeros(T)), i32(end)
    a = m.randint(0, S + 1, T)
    b = m.randint(0, S + 1, T)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    if mode == "empty_rows":
        hi = torch.where(m.randint(0, 2, T) == 1, lo, hi)
    return i32(lo), i32(hi)


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
            "block_table": table, "seq": i32(seq_t), "k_len": i32(kl_t), "page_size": ps,
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
    idx = i32(idx)
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
        "slots": i32(slots),
        "absorb": True if D == 7168 else d.flag(),
    }
