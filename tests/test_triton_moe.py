"""Triton `moe_experts` as a sorted grouped GEMM (glm5.kernels.triton.moe): the float64 oracle
over random shapes, ids (-1, repeats, idle experts), dtypes, both tile regimes and both grid
policies; the device tile schedule against a plain-Python one; the regime choice; and no host
synchronisation in the launcher (faked CUDA tensors: an op whose output shape depends on values,
a scalar read or a copy to the host is refused or counted)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from glm5.kernels.triton import moe  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"
I32 = torch.int32

# Tiles small enough for the interpreter, still crossing every boundary at the shapes below;
# prefill rows 32 vs decode rows 16 so the two regimes run different tiles.
SMALL = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_N2": 16, "BLOCK_K": 16, "GROUP_M": 2,
         "BLOCK_M_DECODE": 16, "BLOCK_N_DECODE": 16, "BLOCK_N2_DECODE": 32,
         "BLOCK_K_DECODE": 32, "BLOCK_D": 16}
REGIMES = {"decode": {"DECODE_ROWS_PER_EXPERT": 10 ** 9},
           "prefill": {"DECODE_ROWS_PER_EXPERT": 0}}
POLICIES = {"tiles": {}, "persistent": {"grid": "persistent", "programs": 3}}


def _fn(**over):
    return moe.make_moe_experts({**moe.DEFAULTS["moe_experts"], **SMALL, **over})


def _cpu(vals: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in vals.items()}


# --------------------------------------------------------------------------- oracle
@settings(max_examples=min(10, settings().max_examples))  # the interpreter: at most 10
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       regime=st.sampled_from(sorted(REGIMES)), policy=st.sampled_from(sorted(POLICIES)))
def test_matches_oracle(data, dtype, regime, policy):
    T = data.draw(st.integers(1, 24), label="T")
    E = data.draw(st.integers(1, 5), label="E")
    k = data.draw(st.integers(1, 3), label="k")
    D = data.draw(st.sampled_from([16, 33, 48]), label="D")  # 33: K tail and N clamp of gemm2
    I = data.draw(st.sampled_from([8, 17, 32]), label="I")  # 17: K tail and N clamp of gemm13
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, E, (T, k), generator=g, dtype=I32)  # -1s, repeats, idle experts
    wide = torch.randn(T, D + 3, generator=g).to(dtype)
    x = wide[:, 1:D + 1] if data.draw(st.booleans(), label="strided x") else wide[:, :D].clone()
    wdt = data.draw(st.sampled_from([torch.float32, dtype]), label="weights dtype")
    weights = torch.rand(k, T, generator=g).to(wdt).t()  # column-major: strides (1, T)
    w13 = (torch.randn(E, 2 * I, D, generator=g) * D ** -0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g) * I ** -0.5).to(dtype)
    vals = {"x": x, "ids": ids, "weights": weights, "w13": w13, "w2": w2}
    dev = {n: v.to(DEV) for n, v in vals.items()}
    y = _fn(**REGIMES[regime], **POLICIES[policy])(**dev)
    assert y.dtype == dtype and y.shape == (T, D)
    assert_matches("moe_experts", y.cpu(), vals, what=f"{regime}/{policy}")
    assert (y.cpu()[(ids < 0).all(1)] == 0).all()  # a token without experts sums nothing


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_many_tiles_per_expert_and_determinism(regime):
    """One busy expert spanning several row tiles beside single-row experts, GROUP_M larger than
    the tile count's remainder; two calls agree bit for bit (ordered combine, no atomics)."""
    g = torch.Generator().manual_seed(3)
    T, D, I, E, k = 40, 24, 24, 6, 2
    ids = torch.full((T, k), 2, dtype=I32)
    ids[:, 1] = -1
    ids[3, 1], ids[7, 1], ids[9, 0] = 5, 0, 4  # experts 0, 4, 5: one row each; 1, 3 idle
    x = torch.randn(T, D, generator=g, dtype=torch.float32).to(torch.bfloat16)
    wts = torch.rand(T, k, generator=g)
    w13 = (torch.randn(E, 2 * I, D, generator=g) * D ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    vals = {"x": x, "ids": ids, "weights": wts, "w13": w13, "w2": w2}
    fn = _fn(**REGIMES[regime], GROUP_M=3)
    dev = {n: v.to(DEV) for n, v in vals.items()}
    y = fn(**dev)
    assert_matches("moe_experts", y.cpu(), vals)
    assert torch.equal(fn(**dev), y)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_tile_real_in_a_partial_group(policy):
    """Decode's usual case: each routed pair its own expert, so every tile of the bound is real
    (T k of them) and the last GROUP_M group is partial (3 tiles, GROUP_M 2): the swizzle must
    still give every (row tile, N-block) exactly once."""
    g = torch.Generator().manual_seed(11)
    T, D, I, E, k = 1, 48, 40, 5, 3
    ids = torch.tensor([[4, 0, 2]], dtype=I32)
    vals = {"x": torch.randn(T, D, generator=g), "ids": ids, "weights": torch.rand(T, k),
            "w13": torch.randn(E, 2 * I, D, generator=g) * D ** -0.5,
            "w2": torch.randn(E, D, I, generator=g) * I ** -0.5}
    assert (moe.schedule(ids, E, 16)[2] >= 0).all()
    y = _fn(**REGIMES["decode"], **POLICIES[policy], GROUP_M=2)(
        **{n: v.to(DEV) for n, v in vals.items()})
    assert_matches("moe_experts", y.cpu(), vals)


def test_empty_and_degenerate_shapes():
    fn = _fn()
    x = torch.randn(3, 16, device=DEV)
    ids = torch.full((3, 2), -1, dtype=I32, device=DEV)
    w13, w2 = torch.randn(2, 16, 16, device=DEV), torch.randn(2, 16, 8, device=DEV)
    assert (fn(x, ids, torch.ones(3, 2, device=DEV), w13, w2) == 0).all()  # every id -1
    assert fn(x[:0], ids[:0], torch.ones(0, 2, device=DEV), w13, w2).shape == (0, 16)
    y = fn(x, ids[:, :0], torch.ones(3, 0, device=DEV), w13, w2)  # k = 0
    assert (y == 0).all()


# --------------------------------------------------------------------------- schedule
def _schedule_py(ids: torch.Tensor, E: int, bm: int):
    """The schedule written out plainly: pairs by expert (stable), then bm-row tiles."""
    k = ids.shape[1]
    flat = ids.reshape(-1).tolist()
    pairs = [p for e in range(E) for p in range(len(flat)) if flat[p] == e]
    tiles, row = [], 0
    for e in range(E):
        c = sum(1 for v in flat if v == e)
        for lo in range(row, row + c, bm):
            tiles.append((e, lo, min(lo + bm, row + c)))
        row += c
    return pairs, [p // k for p in pairs], tiles


@pytest.mark.parametrize("bm", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_schedule_matches_plain_python(bm, seed):
    g = torch.Generator().manual_seed(seed)
    T, k, E = int(torch.randint(1, 30, (1,), generator=g)), 1 + seed % 3, 2 + seed
    ids = torch.randint(-1, E + 1, (T, k), generator=g, dtype=I32)  # E: out of range, skipped
    pair, tok, tile_e, lo, hi = moe.schedule(ids, E, bm)
    pairs, toks, tiles = _schedule_py(ids, E, bm)
    n = len(pairs)
    assert pair[:n].tolist() == pairs and tok[:n].tolist() == toks
    real = [(int(e), int(a), int(b)) for e, a, b in zip(tile_e, lo, hi) if e >= 0]
    assert real == tiles
    assert (tile_e[len(tiles):] == -1).all()  # the padding tiles are the last ones
    assert tile_e.shape[0] == max(1, min(T * k, -(-T * k // bm) + E))  # the shape-only bound


# --------------------------------------------------------------------------- regimes
def test_regime_from_shapes_and_fp32_block_k():
    p = {**moe.DEFAULTS["moe_experts"], "DECODE_ROWS_PER_EXPERT": 4, "num_warps": 8,
         "decode_num_warps": 2}
    dec = moe.tiles(p, 8, 2, 4, 2)  # 16 rows <= 4 x 4
    pre = moe.tiles(p, 9, 2, 4, 2)
    assert dec["decode"] and not pre["decode"]
    assert dec["BLOCK_M"] == p["BLOCK_M_DECODE"] and pre["BLOCK_M"] == p["BLOCK_M"]
    assert dec["opts"]["num_warps"] == 2 and pre["opts"]["num_warps"] == 8
    assert dec["opts"]["num_stages"] == pre["opts"]["num_stages"] == p["num_stages"]
    f32 = moe.tiles(p, 9, 2, 4, 4)  # fp32: FMA dots, half the K and N tiles
    assert [f32[n] * 2 for n in ("BLOCK_K", "BLOCK_N", "BLOCK_N2")] == \
        [pre[n] for n in ("BLOCK_K", "BLOCK_N", "BLOCK_N2")] and f32["BLOCK_M"] == pre["BLOCK_M"]


def test_default_regimes_at_glm5_shapes():
    p = moe.DEFAULTS["moe_experts"]
    assert moe.tiles(p, 32, 8, 64, 2)["decode"]  # a decode batch of 32 on a 64-expert shard
    t = moe.tiles(p, 2048, 8, 64, 2)  # issue 16's prefill row
    assert not t["decode"] and t["BLOCK_M"] >= 64 and t["opts"]["num_warps"] >= 4


# --------------------------------------------------------------------------- no host sync
class _Stub:
    """Stands in for a kernel: records the launch, runs nothing (the arguments are fake)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append(grid)


def _count_syncs(fn, *args_cpu: torch.Tensor) -> tuple[list[str], int]:
    """Run fn on CUDA-faked copies of args_cpu with the kernels stubbed; returns (the ops that
    would synchronise with the host on a GPU, launches). Ops with value-dependent output shapes
    (bincount, nonzero, unique, boolean indexing) and scalar reads raise under FakeTensorMode;
    _local_scalar_dense, nonzero and device-to-host copies are counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from glm5.kernels.triton import _moe_kernels

    syncs: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            if name in ("aten._local_scalar_dense", "aten.nonzero", "aten.item"):
                syncs.append(name)
            out = func(*args, **kwargs)
            ins = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            outs = out if isinstance(out, (tuple, list)) else [out]
            if any(a.device.type == "cuda" for a in ins) and any(
                    isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs):
                syncs.append(f"{name} to the host")
            return out

    log: list = []
    names = ("moe_gemm13_kernel", "moe_gemm2_kernel", "moe_combine_kernel")
    saved = {n: getattr(_moe_kernels, n) for n in names}
    try:
        for n in names:
            setattr(_moe_kernels, n, _Stub(log))
        with FakeTensorMode():
            # fake CUDA tensors of the same layout (no CUDA build needed: nothing runs)
            args = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
                    for a in args_cpu]
            with Count():
                fn(*args)
    finally:
        for n, kern in saved.items():
            setattr(_moe_kernels, n, kern)
    return syncs, len(log)


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_launcher_never_syncs_with_the_host(regime):
    T, D, I, E, k = 5, 32, 16, 4, 2
    ids = torch.randint(-1, E, (T, k), dtype=I32)
    args = (torch.randn(T, D, dtype=torch.bfloat16), ids, torch.rand(T, k),
            torch.randn(E, 2 * I, D, dtype=torch.bfloat16),
            torch.randn(E, D, I, dtype=torch.bfloat16))
    syncs, launches = _count_syncs(_fn(**REGIMES[regime]), *args)
    assert syncs == [] and launches == 3


def test_sync_counter_catches_a_planted_sync():
    def bincount_sync(x, ids, *rest):
        torch.bincount(ids.reshape(-1).long().clamp(min=0), minlength=4)

    def item_sync(x, ids, *rest):
        ids.sum().item()

    def host_copy(x, ids, *rest):
        ids.cpu()

    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)

    ids = torch.zeros(2, 2, dtype=I32)
    with pytest.raises(DynamicOutputShapeException):
        _count_syncs(bincount_sync, torch.zeros(2, 4), ids)
    with pytest.raises(DataDependentOutputException):
        _count_syncs(item_sync, torch.zeros(2, 4), ids)
    assert _count_syncs(host_copy, torch.zeros(2, 4), ids)[0] == ["aten._to_copy to the host"]


@pytest.mark.skipif(INTERP or not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_sync_on_gpu():
    T, D, I, E, k = 300, 256, 128, 8, 4
    ids = torch.randint(-1, E, (T, k), dtype=I32, device="cuda")
    args = (torch.randn(T, D, dtype=torch.bfloat16, device="cuda"), ids,
            torch.rand(T, k, device="cuda"),
            torch.randn(E, 2 * I, D, dtype=torch.bfloat16, device="cuda") * D ** -0.5,
            torch.randn(E, D, I, dtype=torch.bfloat16, device="cuda") * I ** -0.5)
    fn = moe.make_moe_experts(moe.DEFAULTS["moe_experts"])
    first = fn(*args)  # compile first (Triton's first launch may query the device)
    torch.cuda.synchronize()
    # a host synchronisation inside the launcher raises here ("error" mode)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = fn(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, first)  # deterministic, and the synced-free call computed it
