"""TVM (llvm) cpu kernels: rms_norm, rope, silu_mul, moe_experts, quant_linear (all schemes, the
TVM GEMV and the torch GEMM paths) and moe_experts_quant, against the float64 oracle.

One module-scoped backend on a temporary build cache: each kernel variant compiles once
(about a second each) and every test reuses it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tvm")

import glm5  # noqa: E402
from glm5.ir.catalog import OPS  # noqa: E402
from glm5.ir.quant_formats import SCHEMES, quantize_weight  # noqa: E402
from glm5.kernels.tvm import moe, norm, quant, route, tirlib  # noqa: E402
from glm5.kernels.tvm.build import TVMContext  # noqa: E402
from glm5.testing.compare import Verdict, assert_matches, check_example  # noqa: E402
from glm5.testing.parity import format_table, run_parity  # noqa: E402

OPS_SERVED = ("rms_norm", "rope", "silu_mul", "moe_experts", "quant_linear", "moe_experts_quant")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return TVMContext(cache_dir=tmp_path_factory.mktemp("tvm_nmq_cache"))


@pytest.fixture(scope="module")
def backend(ctx):
    b = glm5.Backend("cpu_nmq_test", vendor="t", device_type="cpu")
    for mod in (norm, moe, quant):
        for op, fn, dtypes, supports in mod.kernels(lambda: ctx):
            b.kernel(op, dtypes=dtypes, supports=supports)(fn)
    return b


def _check(backend, op: str, values: dict, dtype=torch.float32) -> Verdict:
    """The kit's verdict for the backend's kernel on one case (the caller asserts it)."""
    return check_example(OPS[op], backend.kernels[op].fn, values, dtype)


def test_parity(backend):
    rows = run_parity(backend, list(OPS_SERVED), examples=8, seed=0)
    assert {(r.op, r.dtype) for r in rows} == {
        (op, dt) for op in OPS_SERVED for dt in ("float32", "bfloat16")}
    assert all(r.status == "pass" and r.examples == 8 for r in rows), format_table(rows)


def test_quant_torch_paths(backend, monkeypatch):
    """Every row count sent to torch's kernels (`quant.PATHS` of this CPU's tier): same
    parity."""
    monkeypatch.setitem(quant.PATHS, quant.cpu_tier(),
                        {s: ((None, "torch:gemm"),) for s in SCHEMES})
    rows = run_parity(backend, ["quant_linear", "moe_experts_quant"], examples=8, seed=1)
    assert all(r.status == "pass" for r in rows), format_table(rows)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quant_paths_agree_across_blocks(ctx, backend, scheme):
    """Rows not a multiple of the 4-row block, K with a short last group and a partial packing
    unit, 12-bit codes at the extremes: the GEMV and the torch path both match the oracle."""
    g = torch.Generator().manual_seed(3)
    K, N = 331, 37
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    for M in (1, 3, 6, 9):
        x = torch.randn(M, K, generator=g) * 3
        x[0, 0] = 50.0  # one large value: the row's amax, codes at ±qmax
        vals = {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": None}
        v = _check(backend, "quant_linear", vals)
        assert v.ok, v.message
        # two exact-integer paths that differ only in fp32 scale products: each one judged
        assert_matches("quant_linear", quant.gemv(lambda: ctx, x, wp, ws, scheme), vals,
                       what="gemv")
        assert_matches("quant_linear", quant.gemm_torch(x, wp, ws, scheme), vals,
                       what="gemm_torch")


def test_w8a16_torch_path_in_row_blocks(monkeypatch):
    """The torch path widens w8a16's weight a block of rows at a time: blocks of 1, 3 (N = 37
    leaves a short last one) and all rows: each within the op's tolerance, fp32 and bf16 x
    (not bit-equal to each other: MKL's summation order depends on the block's width)."""
    g = torch.Generator().manual_seed(5)
    K, N = 200, 37
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, "w8a16")
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(6, K, generator=g) * 3).to(dtype)
        vals = {"x": x, "w_packed": wp, "w_scale": ws, "scheme": "w8a16", "bias": None}
        for rows in (1, 3, N):
            monkeypatch.setattr(quant, "W8A16_BLOCK", rows * K)
            y = quant.gemm_torch(x, wp, ws, "w8a16")
            assert y.dtype == torch.float32 and y.shape == (6, N)
            assert_matches("quant_linear", y.to(dtype), vals, what=f"rows={rows}")


def test_moe_torch_path_and_chunks(backend, monkeypatch):
    """Many routed rows take the torch composition; tiny scratch forces many token chunks."""
    monkeypatch.setattr(moe, "ROWS_TVM", 0)
    rows = run_parity(backend, ["moe_experts"], examples=6, seed=2)
    assert all(r.status == "pass" for r in rows), format_table(rows)
    monkeypatch.setattr(moe, "ROWS_TVM", 2**31)
    monkeypatch.setattr(moe, "SCRATCH_BYTES", 64)  # one or two tokens per chunk
    rows = run_parity(backend, ["moe_experts"], examples=6, seed=3)
    assert all(r.status == "pass" for r in rows), format_table(rows)


def test_exact_chunks():
    """The torch path's fp32 GEMM chunks hold every integer partial sum exactly (< 2^24)."""
    for sc in SCHEMES.values():
        if sc.act_bits is not None:
            assert quant.exact_chunk(sc) * sc.act_qmax * sc.weight_qmax < 2**24


def test_shapes_and_edges(backend):
    g = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.bfloat16):
        # rope on 2-D x [T, R], NeoX with R/2 not a multiple of the vector width
        x = torch.randn(3, 40, generator=g).to(dt)
        ang = torch.rand(3, 20, generator=g)
        for il in (True, False):
            rope_args = {"x": x, "cos": ang.cos().to(dt), "sin": ang.sin().to(dt),
                         "interleaved": il}
            v = _check(backend, "rope", rope_args, dt)
            assert v.ok, v.message
        # rms_norm with D past one vector plus a tail, 3-D leading dims
        v = _check(backend, "rms_norm", {"x": torch.randn(2, 3, 37, generator=g).to(dt),
                                         "weight": torch.randn(37, generator=g).to(dt),
                                         "eps": 1e-6}, dt)
        assert v.ok, v.message
        # silu_mul: large |x| saturates exp without inf/NaN
        x = torch.tensor([[-100.0, -3.0, 0.0, 95.0, 1.0, 2.0, 3.0, 4.0]]).to(dt)
        v = _check(backend, "silu_mul", {"x": x}, dt)
        assert v.ok, v.message


def test_moe_skips_and_empty_experts(backend):
    g = torch.Generator().manual_seed(7)
    T, D, I, E, k = 6, 20, 12, 5, 3
    x = torch.randn(T, D, generator=g)
    ids = torch.tensor([[0, 4, -1], [4, 0, 2], [-1, -1, -1], [2, 2, 0], [4, -1, 0],
                        [0, 4, 2]], dtype=torch.int32)  # expert 1, 3 unused; row 2 all skipped
    vals = {"x": x, "ids": ids, "weights": torch.rand(T, k, generator=g),
            "w13": torch.randn(E, 2 * I, D, generator=g) * D ** -0.5,
            "w2": torch.randn(E, D, I, generator=g) * I ** -0.5}
    v = _check(backend, "moe_experts", vals)
    assert v.ok, v.message
    y = backend.kernels["moe_experts"].fn(*(vals[n] for n in OPS["moe_experts"].param_names))
    assert torch.equal(y[2], torch.zeros(D))
    # deterministic: same bits on a second call
    y2 = backend.kernels["moe_experts"].fn(*(vals[n] for n in OPS["moe_experts"].param_names))
    assert torch.equal(y, y2)
    vals["ids"] = torch.full((T, k), -1, dtype=torch.int32)
    v = _check(backend, "moe_experts", vals)
    assert v.ok, v.message


def test_claims_and_declines(backend):
    x = torch.randn(2, 8)
    w = torch.randn(8)
    e = backend.kernels["rms_norm"]
    assert e.dtypes == frozenset({torch.float32, torch.bfloat16})
    assert e.accepts((x, w, 1e-5))
    assert not e.accepts((x.to("meta"), w, 1e-5))
    r = backend.kernels["rope"]
    assert not r.accepts((torch.randn(2, 3), torch.randn(2, 1), torch.randn(2, 1), True))
    m = backend.kernels["moe_experts"]
    ids = torch.zeros(2, 1, dtype=torch.int32)
    w13, w2 = torch.randn(1, 4, 8), torch.randn(1, 8, 2)
    assert m.accepts((x, ids, torch.ones(2, 1), w13, w2))
    assert not m.accepts((x, ids, torch.ones(2, 1), w13.bfloat16(), w2))  # mixed dtypes
    q = backend.kernels["quant_linear"]
    wp, ws = quantize_weight(torch.randn(4, 8), "w4a8")
    assert q.accepts((x, wp, ws, "w4a8", None))
    assert not q.accepts((x, wp, ws, "w5a5", None))
    w8, s8 = quantize_weight(torch.randn(1, 140000), "w8a8")  # int32 group sum could overflow
    assert not q.accepts((torch.randn(1, 140000), w8, s8, "w8a8", None))
    with pytest.raises(ValueError, match="quant_linear.*scheme"):
        q.fn(x, wp, ws, "w5a5", None)


def _rows_above(D: int) -> int:
    """Rows of D elements (and of 2D, 4D) at or above every `tirlib.SERIAL_MAX`: the parallel
    builds."""
    return max(tirlib.SERIAL_MAX.values()) // D + 1


def test_symbolic_shapes_build_once(ctx, backend):
    """Rows, D, R, I, M, N, K are runtime values: new shapes reuse the built kernels (both
    the serial and the parallel build of each row kernel: `tirlib.serial`)."""
    g = torch.Generator().manual_seed(9)
    for T, D in ((1, 5), (7, 70), (33, 16), (_rows_above(16), 16)):
        backend.kernels["rms_norm"].fn(torch.randn(T, D, generator=g), torch.randn(D), 1e-5)
        backend.kernels["rope"].fn(torch.randn(T, 2, 2 * D, generator=g), torch.randn(T, D),
                                   torch.randn(T, D), True)
        backend.kernels["silu_mul"].fn(torch.randn(T, 2 * D, generator=g))
    n = len(ctx.builds)
    after_first = []
    for T, D in ((2, 9), (_rows_above(130), 130), (40, 130)):
        backend.kernels["rms_norm"].fn(torch.randn(T, D, generator=g), torch.randn(D), 1e-5)
        backend.kernels["rope"].fn(torch.randn(T, 3, 2 * D, generator=g), torch.randn(T, D),
                                   torch.randn(T, D), True)
        backend.kernels["silu_mul"].fn(torch.randn(T, 2 * D, generator=g))
        if T > 40:
            continue
        wp, ws = quantize_weight(torch.randn(T + 3, 2 * D, generator=g), "w4a8")
        backend.kernels["quant_linear"].fn(torch.randn(5, 2 * D, generator=g), wp, ws, "w4a8",
                                           None)
        after_first.append(len(ctx.builds))
    # only the first w4a8 call may build (the 5-row path's kernel and its activation
    # preparation: `quant.PATHS`); norms / rope / silu none, the second w4a8 call none
    new = [b["op"] for b in ctx.builds[n:]]
    assert all(op.startswith("quant_linear") for op in new) and len(new) <= 2, new
    assert after_first[1] == after_first[0], new


def test_disk_cache_hit(ctx, backend):
    """A fresh context on the same directory loads the built library instead of compiling."""
    backend.kernels["rms_norm"].fn(torch.randn(2, 4), torch.randn(4), 1e-5)
    fresh = TVMContext(cache_dir=ctx.cache_dir)
    y = norm.rms_norm(lambda: fresh, torch.randn(3, 4), torch.randn(4), 1e-5)
    assert y.shape == (3, 4)
    assert [b["how"] for b in fresh.builds] == ["loaded"]


def _both_builds(monkeypatch, limits: dict, key, call):
    """``call()`` with the serial build forced, then the parallel build, then the default pick."""
    out = []
    for limit in (2**62, 0, None):
        if limit is None:
            monkeypatch.undo()
        else:
            monkeypatch.setitem(limits, key, limit) if isinstance(limits, dict) \
                else monkeypatch.setattr(limits, key, limit)
        out.append(call())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serial_builds_bit_identical(ctx, monkeypatch, dtype):
    """The serial build of each row kernel (`tirlib.serial`, taken by small calls) gives the
    parallel build's bits, on shapes below and at/above its threshold (tails: D, R/2, I not
    multiples of the vector width; interleaved rope's first/last-row scalar path); the
    default pick is the serial build below the threshold and the parallel one above."""
    g = torch.Generator().manual_seed(11)
    C = lambda: ctx  # noqa: E731

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 2).to(dtype)

    cases = []
    for rows, D in ((1, 37), (5, 40), (tirlib.SERIAL_MAX["rms_norm"] // 37 + 1, 37)):
        x, w, b = rnd(rows, D), rnd(D), rnd(D)
        cases.append(("rms_norm", x.numel(), lambda x=x, w=w: norm.rms_norm(C, x, w, 1e-6)))
        cases.append(("layer_norm", x.numel(),
                      lambda x=x, w=w, b=b: norm.layer_norm(C, x, w, b, 1e-5)))
    for rows, I in ((1, 19), (6, 24), (tirlib.SERIAL_MAX["silu_mul"] // 38 + 1, 19)):
        x = rnd(rows, 2 * I)
        cases.append(("silu_mul", x.numel(), lambda x=x: norm.silu_mul(C, x)))
    for T, H, R in ((1, 1, 40), (3, 2, 40), (tirlib.SERIAL_MAX["rope"] // 120 + 1, 3, 40)):
        x, ang = rnd(T, H, R), torch.rand(T, R // 2, generator=g) * 6
        for il in (True, False):
            cases.append(("rope", x.numel(), lambda x=x, ang=ang, il=il: norm.rope(
                C, x, ang.cos().to(dtype), ang.sin().to(dtype), il)))
    sides = set()
    for op, n, call in cases:
        ser, par, default = _both_builds(monkeypatch, tirlib.SERIAL_MAX, op, call)
        assert torch.equal(ser, par), (op, n)
        assert torch.equal(default, par), (op, n)
        sides.add((op, tirlib.serial(op, n)))
    row_ops = ("rms_norm", "layer_norm", "rope", "silu_mul")  # moe_route: the next test
    assert sides == {(op, s) for op in row_ops for s in (True, False)}
    picked = {(b["op"], b["key"]["serial"]) for b in ctx.builds if "serial" in b["key"]}
    assert {(op, s) for op in row_ops for s in (True, False)} <= picked


def test_serial_route_bit_identical(ctx, monkeypatch):
    """moe_route's serial build (few tokens: `SERIAL_MAX["moe_route"]`) gives the parallel
    build's weights and ids, with and without the group limit, below and above the threshold."""
    g = torch.Generator().manual_seed(12)
    E = 64
    for T_ in (1, 3, tirlib.SERIAL_MAX["moe_route"] // E + 1):
        logits, bias = torch.randn(T_, E, generator=g), torch.randn(E, generator=g) * 0.1
        logits[0, :8] = 0.5  # ties: the smaller id first, in every build
        for n_group, topk_group in ((1, 1), (8, 3)):
            def call():
                return route.moe_route(lambda: ctx, logits, bias, 6, n_group, topk_group,
                                       True, 2.5)
            (ws, ids), (wp, idp), (wd, idd) = _both_builds(monkeypatch, tirlib.SERIAL_MAX,
                                                         "moe_route", call)
            assert torch.equal(ws, wp) and torch.equal(ids, idp), (T_, n_group)
            assert torch.equal(wd, wp) and torch.equal(idd, idp), (T_, n_group)
    serial_keys = {b["key"].get("serial") for b in ctx.builds if b["op"] == "moe_route"}
    assert serial_keys == {True, False}


def test_rope_lane_tables_follow_the_tables_they_came_from(backend):
    """The interleaved rope keeps the last cos / sin's lane tables: reused for the same
    tensors, rebuilt when either is modified in place or another tensor is passed."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 8, generator=g)
    cos, sin = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    fn = backend.kernels["rope"].fn
    ref = glm5.get_op("rope").reference
    torch.testing.assert_close(fn(x, cos, sin, True), ref(x, cos, sin, True))
    torch.testing.assert_close(fn(x, cos, sin, True), ref(x, cos, sin, True))  # reused
    cos.mul_(-0.5)  # in place: the kept tables are stale
    torch.testing.assert_close(fn(x, cos, sin, True), ref(x, cos, sin, True))
    other = sin.clone().add_(1.0)
    torch.testing.assert_close(fn(x, cos, other, True), ref(x, cos, other, True))
    with torch.inference_mode():  # inference tensors have no version counter: never kept
        ci, si = cos.clone(), sin.clone()
        torch.testing.assert_close(fn(x, ci, si, True), ref(x, ci, si, True))
        ci.mul_(2.0)
        torch.testing.assert_close(fn(x, ci, si, True), ref(x, ci, si, True))
