"""Triton dense `attention` (the flash kernel of glm5.kernels.triton.attention) against the float64
oracle in each tile regime, across query blocks, key tiles, Dv slices and the Dqk tail; key
ranges with holes (a packed batch's query block straddling sequences: the keys no row sees are
never read); empty rows and degenerate shapes; the tuning entry's rules."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from glm5.kernels.triton import attention as A  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
I32 = torch.int32
# Small tiles pinned for every regime, so tiny shapes cross query blocks, key tiles, Dv slices.
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_DV": 16}


def _fn(over: dict | None = None):
    return A.make_attention({**A.DEFAULTS["attention"], **(over or {})})


def _case(T, S, H, Hk, Dqk, Dv, ks, ke, dtype=torch.float32, mqa_view=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, Dqk, generator=g).to(dtype)
    k = torch.randn(S, Hk, Dqk, generator=g).to(dtype)
    v = k[..., :Dv] if mqa_view else torch.randn(S, Hk, Dv, generator=g).to(dtype)
    return {"q": q, "k": k, "v": v, "k_start": torch.as_tensor(ks, dtype=I32),
            "k_end": torch.as_tensor(ke, dtype=I32), "scale": Dqk ** -0.5}


def _run(fn, vals):
    dev = {n: (x.to(DEV) if isinstance(x, torch.Tensor) else x) for n, x in vals.items()}
    out, lse = fn(dev["q"], dev["k"], dev["v"], dev["k_start"], dev["k_end"], dev["scale"])
    return out.cpu(), lse.cpu()


def _causal(T, S):
    return torch.zeros(T), torch.arange(S - T + 1, S + 1)


def _random_ranges(T, S, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randint(0, S + 1, (2, T), generator=g)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    hi[::5] = lo[::5]  # empty rows
    return lo, hi


CASES = {
    # name: (tuning, T, S, H, Hk, Dqk, Dv, ranges, mqa_view, regime)
    # 40 queries over 3 query blocks, keys in 7 tiles: masked head / unmasked interior / tail;
    # Dqk 36 = 32 + a tail of 4 (padded to 16), Dv 24 in two slices (the second one partial)
    "mha_causal": (SMALL, 40, 100, 2, 2, 36, 24, _causal(40, 100), False, "MHA"),
    # G = 3 heads per KV head in blocks of 4 rows (a padding head), random and empty ranges
    "gqa_random": ({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_DV": 16}, 33, 70, 6, 2, 20, 12,
                   _random_ranges(33, 70, 1), False, "MHA"),
    # absorbed MLA in miniature: Hk = 1, G = 20 (blocks of 32 heads), v a view of k
    "mqa_view": ({"BLOCK_N": 16, "BLOCK_DV": 16}, 5, 60, 20, 1, 48, 32,
                 ([0, 10, 7, 0, 59], [60, 30, 7, 1, 60]), True, "MQA"),
    # a few queries: the DECODE regime's 16-row blocks hold all of them
    "decode": ({"BLOCK_N": 16}, 3, 90, 4, 2, 16, 16, ([0, 0, 41], [88, 89, 90]), False,
               "DECODE"),
    # the default (GPU) tiles: one 128-query block, 64 keys in two 32-key tiles
    "mha_defaults": ({}, 20, 64, 2, 2, 16, 16, _causal(20, 64), False, "MHA"),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_reference(name, dtype):
    over, T, S, H, Hk, Dqk, Dv, (ks, ke), view, reg = CASES[name]
    vals = _case(T, S, H, Hk, Dqk, Dv, ks, ke, dtype, view)
    p = {**A.DEFAULTS["attention"], **over}
    assert A.regime(p, T, H // Hk, dtype == torch.float32) == (
        "FP32" if dtype == torch.float32 else reg)
    out, lse = _run(_fn(over), vals)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_matches("attention", (out, lse), vals)
    empty = vals["k_start"] == vals["k_end"]
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("split", [2, 5])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_split_kv(name, split, dtype):
    """Split-KV: each program block's union of ranges cut into `split` tile-aligned windows,
    every row's range clipped to its window, the partials merged by their lse. 5 windows of
    16-key tiles leave windows no row of a block reaches (lse -inf partials) and rows whose
    whole range lies in one window."""
    over, T, S, H, Hk, Dqk, Dv, (ks, ke), view, reg = CASES[name]
    vals = _case(T, S, H, Hk, Dqk, Dv, ks, ke, dtype, view)
    out, lse = _run(_fn({**over, "SPLIT_K": split}), vals)
    assert_matches("attention", (out, lse), vals)
    empty = vals["k_start"] == vals["k_end"]
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    one, one_lse = _run(_fn({**over, "SPLIT_K": 1}), vals)
    # the merge reorders the same sums: far inside the op's tolerance of one pass
    assert torch.allclose(lse, one_lse, atol=1e-5, rtol=0, equal_nan=True)
    assert torch.allclose(out.float(), one.float(), rtol=0,
                          atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_attention_split_rule():
    """Decode at GLM-5 shapes splits; a prefill does not (the rule of glm5.kernels.triton.
    splitkv, reached through attention's tiles)."""
    from glm5.kernels.triton.splitkv import split_keys

    d = {**A.DEFAULTS["attention"], "TARGET_PROGRAMS_INTERPRETED": 264}
    c = A.tiles(d, 1, 64, 576, 512)  # absorbed MLA, batch 1: 1 x 1 x 2 Dv halves
    assert split_keys(d, 1 * 1 * 2, 2048, c["BLOCK_N"]) == (16, 128)
    c = A.tiles(d, 4096, 1, 256, 256)  # MHA prefill: 32 query blocks x 64 heads
    assert split_keys(d, 32 * 64, 4096, c["BLOCK_N"])[0] == 1


def _holes_case(ks, ke, S, seed=0, BN=16):
    """Ranges leaving whole BLOCK_N tiles that no row sees; those tiles' v rows are NaN (any
    read of them would reach out as 0 * NaN), the oracle gets zeros there instead."""
    vals = _case(len(ks), S, 2, 2, 16, 16, ks, ke, seed=seed)
    seen = torch.zeros(S, dtype=torch.bool)
    for a, b in zip(ks, ke):
        seen[a:b] = True
    tile_seen = seen.reshape(-1, BN).any(1).repeat_interleave(BN)
    assert (~tile_seen).any()
    oracle = {**vals, "v": vals["v"].clone()}
    oracle["v"][~tile_seen] = 0.0
    vals["v"][~tile_seen] = float("nan")
    return vals, oracle


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("layout", ["packed", "scattered"])
def test_attention_never_reads_keys_no_row_sees(layout, split):
    if layout == "packed":
        # one 32-row block holding two sequences' queries: [0, 10 + t) then [200, 205 + t)
        ks = [0] * 10 + [200] * 12
        ke = [10 + t for t in range(10)] + [205 + t for t in range(12)]
    else:
        # disjoint ranges in no order, one crossing a tile edge, one empty
        ks = [300, 40, 0, 150, 90, 33, 250]
        ke = [330, 41, 5, 170, 90, 47, 260]
    S = 336
    vals, oracle = _holes_case(ks, ke, S)
    out, lse = _run(_fn({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_DV": 16, "SPLIT_K": split}), vals)
    assert torch.isfinite(out).all()
    assert_matches("attention", (out, lse), oracle)


def test_attention_degenerate_shapes():
    fn = _fn(SMALL)
    # no row has a key: nothing is walked
    vals = _case(5, 40, 2, 1, 8, 8, [3, 0, 40, 7, 7], [3, 0, 40, 7, 7])
    out, lse = _run(fn, vals)
    assert (out == 0).all() and torch.isneginf(lse).all()
    # no key rows at all
    vals = _case(3, 0, 2, 2, 8, 8, [0, 0, 0], [0, 0, 0])
    out, lse = _run(fn, vals)
    assert out.shape == (3, 2, 8) and (out == 0).all() and torch.isneginf(lse).all()
    # Dv = 0: out is empty, lse is still the scores' logsumexp
    vals = _case(3, 10, 2, 1, 8, 0, [0, 2, 4], [10, 5, 4])
    out, lse = _run(fn, vals)
    assert out.shape == (3, 2, 0)
    assert_matches("attention", (out, lse), vals)
    # no query
    out, lse = _run(fn, _case(0, 10, 2, 1, 8, 8, [], []))
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_tuning_rules():
    d = A.DEFAULTS["attention"]
    assert A.regime(d, 4096, 1) == "MHA" and A.regime(d, 1, 1) == "DECODE"
    assert A.regime(d, 1, 64) == A.regime(d, 4096, 64) == "MQA"
    assert A.regime(d, 4096, 1, fp32=True) == A.regime(d, 1, 64, fp32=True) == "FP32"
    # GLM-5: non-absorbed prefill 128 queries x 1 head; absorbed 2 queries x 64 heads
    c = A.tiles(d, 4096, 1, 256, 256)
    assert (c["BLOCK_T"], c["BLOCK_G"], c["BLOCK_DA"], c["BLOCK_DB"]) == (128, 1, 256, 0)
    c = A.tiles(d, 1, 64, 576, 512)
    assert (c["BLOCK_T"], c["BLOCK_G"], c["BLOCK_DA"], c["BLOCK_DB"]) == (2, 64, 512, 64)
    # an unprefixed key pins every regime (ascend: BLOCK_DV 128; cambricon: num_warps 1)
    pinned = {**d, "BLOCK_DV": 128, "num_warps": 1}
    for T, G, fp32 in ((4096, 1, False), (1, 1, False), (1, 64, False), (1, 64, True)):
        c = A.tiles(pinned, T, G, 576, 512, fp32)
        assert c["BLOCK_DV"] == 128 and c["num_warps"] == 1
    assert A.tiles(d, 4096, 1, 256, 256)["num_warps"] == d["MHA_num_warps"]
    with pytest.raises(ValueError, match="attention: tuning 'MHA_BLOCK_N' expected a power of "
                                         "two >= 16, got 48"):
        A.tiles({**d, "MHA_BLOCK_N": 48}, 4096, 1, 256, 256)
    with pytest.raises(ValueError, match="neither 'BLOCK_M' nor 'MQA_BLOCK_M'"):
        A.tiles({k: v for k, v in d.items() if k != "MQA_BLOCK_M"}, 1, 64, 576, 512)
