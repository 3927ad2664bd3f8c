"""The decode GEMV of the Triton quant_linear (M <= GEMV_M): every scheme against the float64
reference, interpreted on CPU (TRITON_INTERPRET=1, set by conftest.py) or on a CUDA device.

* exact: integer activations whose row maximum is the scheme's qmax (so s_x = 1 and the codes
  are x itself), random full-range packed bytes and power-of-two scales that differ per K-group
  make every fp32 operation of a correct kernel exact, so y must equal the float64 sum bit for
  bit. A dropped last group, a K-split boundary one unit off or a scale taken per split instead
  of per group changes y.
* tolerance: random inputs in fp32 / bf16 / fp16, bias or not, judged by the conformance kit.
* structure: the split rule (group-aligned, no empty split, about GEMV_TARGET_PROGRAMS
  programs), the packed layout the GEMV reads, the regime boundary, no host read of tensor
  values, one reduction order (bitwise repeatable).
"""

from __future__ import annotations

import os

import pytest
import torch

from glm5.ir.quant_formats import GROUP, SCHEMES, quantize_weight, unpack
from glm5.testing.compare import assert_matches

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest.py) or a CUDA device",
                allow_module_level=True)

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
SCHEME_NAMES = ("w8a16", "w8a8", "w4a8", "w6a12")
# Small tiles so that tiny shapes still cross N-blocks, K-steps and K-splits:
#   SPLITS: one 128-code step per split (every split boundary is a step boundary);
#   STEPS: two steps per split (the in-program K loop and its prefetch across steps).
SPLITS = {"GEMV_BLOCK_N": 8, "GEMV_BLOCK_K": 128, "GEMV_TARGET_PROGRAMS": 1000,
          "GEMV_REDUCE_BLOCK_N": 16}
STEPS = {"GEMV_BLOCK_N": 8, "GEMV_BLOCK_K": 128, "GEMV_TARGET_PROGRAMS": 4,
         "GEMV_REDUCE_BLOCK_N": 16}


def _fn(over: dict | None = None):
    from glm5.kernels.triton.quant_linear import DEFAULTS, make_quant_linear

    return make_quant_linear({**DEFAULTS["quant_linear"], **(over or {})})


def _run(fn, x, wp, ws, scheme, bias=None):
    d = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return fn(d(x), d(wp), d(ws), scheme, d(bias)).cpu()


def _exact_case(scheme: str, M: int, N: int, K: int, seed: int):
    """(x, w_packed, w_scale, bias, y) with y the exact result (see the module docstring)."""
    sc = SCHEMES[scheme]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-15, 16, (M, K), generator=g).double()
    if sc.act_bits is not None:
        x[:, (torch.arange(M) * 7) % K] = 0.0
        x[torch.arange(M), (torch.arange(M) * 7) % K] = float(sc.act_qmax)  # s_x = 1
    if sc.weight_bits == 8:
        wp = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    else:
        wp = torch.randint(0, 256, (N, sc.packed_k(K)), generator=g).to(torch.uint8)
    wq = unpack(wp, sc, K).double()
    ws = torch.pow(2.0, -torch.randint(0, 4, sc.scale_shape(N, K), generator=g).double())
    bias = torch.randint(-64, 65, (N,), generator=g).double() / 8
    if sc.grouped:
        s = ws.repeat_interleave(GROUP, dim=1)[:, :K]
        y = x @ (wq * s).T
    else:
        y = (x @ wq.T) * ws
    return x, wp, ws.float(), bias, y


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("K", [421, 256])  # 3 * 128 + 37; 2 * 128 (int4 / int6 word layouts)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
def test_gemv_exact(scheme, K, M):
    """Bit-exact y for every split shape: one split, splits of one step, splits of two steps
    (M = 16, the slowest to interpret: the last)."""
    x, wp, ws, bias, want = _exact_case(scheme, M, 11, K, seed=M * 1000 + K)
    tilings = ({}, SPLITS, STEPS) if M < 16 else (STEPS,)
    for over in tilings:
        b = bias if over is not STEPS or M == 16 else None
        got = _run(_fn(over), x.float(), wp, ws, scheme, None if b is None else b.float())
        assert got.dtype == torch.float32 and got.shape == (M, 11)
        ref = want if b is None else want + b
        assert torch.equal(got.double(), ref), (over, (got.double() - ref).abs().max())


@pytest.mark.parametrize("scheme,dtype", [
    (s, d) for s in SCHEME_NAMES for d in (torch.bfloat16, torch.float16)
    if not (s == "w6a12" and d == torch.bfloat16)])  # bf16 cannot hold qmax 2047: s_x != 1
def test_gemv_exact_half_dtypes(scheme, dtype):
    """bf16 / fp16 x: the fp32 result is exact, then rounded once to x's dtype."""
    x, wp, ws, bias, want = _exact_case(scheme, 3, 13, 300, seed=5)
    got = _run(_fn(STEPS), x.to(dtype), wp, ws, scheme, bias.to(dtype))
    assert got.dtype == dtype
    assert torch.equal(got, (want + bias).to(dtype))


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,over,has_bias", [
    (1, 33, 128 * 3 + 5, SPLITS, True), (2, 21, 128, {}, False), (5, 9, 77, STEPS, True),
    (16, 9, 128 * 2 + 100, STEPS, False)])
def test_gemv_matches_reference(scheme, dtype, M, N, K, over, has_bias):
    """Random inputs (row 1 all zeros: s_x = 1, zero codes) within the kit's tolerance."""
    g = torch.Generator().manual_seed(M + N + K)
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    x = (torch.randn(M, K, generator=g) * 3).to(dtype)
    if M > 1:
        x[1] = 0
    b = torch.randn(N, generator=g).to(dtype) if has_bias else None
    got = _run(_fn(over), x, wp, ws, scheme, b)
    assert got.dtype == dtype and got.shape == (M, N)
    assert_matches("quant_linear", got,
                   {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": b})


def test_gemv_non_contiguous_x_w8a16():
    """w8a16 reads x in place (its strides are arguments)."""
    g = torch.Generator().manual_seed(3)
    wp, ws = quantize_weight(torch.randn(11, 200, generator=g), "w8a16")
    x = torch.randn(3, 400, generator=g)[:, ::2]
    got = _run(_fn(STEPS), x, wp, ws, "w8a16")
    assert_matches("quant_linear", got,
                   {"x": x, "w_packed": wp, "w_scale": ws, "scheme": "w8a16", "bias": None})


# --------------------------------------------------------------------------- structure
def test_split_rule():
    from glm5.kernels.triton.quant_linear import DEFAULTS, gemv_split

    p = DEFAULTS["quant_linear"]
    # GLM-5's 6144 x 6144 at the defaults: 384 N-blocks x 3 splits of 2048 codes
    assert gemv_split(6144, 6144, p) == (16, 256, 3, 2048)
    for N, K, target in ((6144, 6144, 1056), (576, 6144, 1056), (33, 421, 7), (40, 128, 1000),
                         (6144, 16384, 24), (100000, 6144, 1056)):
        bn, bk, split, kps = gemv_split(N, K, {**p, "GEMV_TARGET_PROGRAMS": target})
        assert bk % GROUP == 0 and kps % bk == 0  # splits start on a group and a step
        assert (split - 1) * kps < K <= split * kps  # covered, and no split is empty
        n_blocks = -(-N // bn)
        # about the target: more splits only while they stay under it and steps remain
        assert split == 1 or n_blocks * (split - 1) < target
        assert split == -(-K // kps)


def test_layouts():
    """The packed layout the GEMV reads: 32-bit words where rows allow, else bytes / quads."""
    from glm5.kernels.triton.quant_linear import _gemv_layout

    def lay(scheme, K):
        wp, _ = quantize_weight(torch.randn(4, K), scheme)
        return _gemv_layout(wp, SCHEMES[scheme], K)

    assert lay("w8a8", 421) == (0, 421, 1)
    assert lay("w4a8", 256) == (4, 32, 8) and lay("w4a8", 421) == (1, 211, 2)
    assert lay("w6a12", 256) == (3, 16, 16) and lay("w6a12", 421) == (2, 106, 4)
    # rows 193 bytes apart: not on 4-byte boundaries, so quads
    assert _gemv_layout(torch.empty(4, 193, dtype=torch.uint8)[:, 1:], SCHEMES["w6a12"],
                        256)[0] == 2


def _launched(fn, *args) -> list[str]:
    from glm5.kernels.triton import compile_check, static_check

    with static_check._device_checks_off(), compile_check.record_launches() as log:
        fn(*args)
    return [name for name, _ in log]


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_regimes(scheme):
    """M <= GEMV_M: the GEMV (+ its reduction when K is split); larger M: the GEMM."""
    wp, ws = quantize_weight(torch.randn(40, 640), scheme)
    act = ["quantize_rows_kernel"] if SCHEMES[scheme].act_bits else []
    fn = _fn()
    assert _launched(fn, torch.zeros(16, 640), wp, ws, scheme) == act + [
        "quant_gemv_kernel", "quant_gemv_reduce_kernel"]
    wp1, ws1 = quantize_weight(torch.randn(40, 200), scheme)
    assert _launched(fn, torch.zeros(1, 200), wp1, ws1, scheme) == act + [
        "quant_gemv_kernel"]  # K in one step: no split, the GEMV writes y
    gemm = "quant_linear_w8a16_kernel" if scheme == "w8a16" else "quant_linear_int_kernel"
    assert _launched(fn, torch.zeros(17, 640), wp, ws, scheme) == act + [gemm]
    assert _launched(_fn({"GEMV_M": 0}), torch.zeros(1, 640), wp, ws, scheme) == act + [gemm]


def test_no_host_reads(monkeypatch):
    """The GEMV's host code reads no tensor value (on a GPU each read is a synchronisation)."""
    weights = {s: quantize_weight(torch.randn(40, 640), s) for s in SCHEME_NAMES}
    x = torch.zeros(3, 640)

    def refuse(*a, **k):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy",
                 "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for scheme, (wp, ws) in weights.items():
        assert _launched(_fn(), x, wp, ws, scheme)[-1] == "quant_gemv_reduce_kernel"


def test_repeatable():
    """One reduction order: two runs agree bit for bit."""
    g = torch.Generator().manual_seed(9)
    wp, ws = quantize_weight(torch.randn(9, 300, generator=g), "w6a12")
    x = torch.randn(2, 300, generator=g)
    fn = _fn(SPLITS)
    assert torch.equal(_run(fn, x, wp, ws, "w6a12"), _run(fn, x, wp, ws, "w6a12"))
