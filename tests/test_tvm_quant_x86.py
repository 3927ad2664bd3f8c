"""cpu `quant_linear` beyond the portable GEMV: the AVX-512 VNNI GEMV (`quant_vnni`), the AMX
tile GEMM (`quant_amx`), their activation preparation, and the per-CPU-tier path table
(`quant.PATHS`), against the float64 oracle and the kit's tolerance for the op.

Shapes cross every boundary of the kernels: K not a multiple of a weight vector (64 bytes),
of a tile chunk (64 int8 / 32 bf16 codes) or of a scale group (128); N not a multiple of the
GEMV's 8-row steps or of the 32-row n-blocks; M around the 4-row blocks, the 16-row tiles
and the 32-row tile pairs; AMX tasks with several n-blocks, with rows split between tasks,
and w8a8 tiles loaded straight from the weight. The kernels run only where this CPU has
the instructions (tests skip otherwise); the path table is checked on every tier.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tvm")

import glm5  # noqa: E402
from glm5.backends.api import run_recorded  # noqa: E402
from glm5.ir.quant_formats import SCHEMES, quantize_per_token_ref, quantize_weight  # noqa: E402
from glm5.kernels.tvm import quant, quant_amx, quant_vgemm, quant_vnni  # noqa: E402
from glm5.kernels.tvm.build import TVMContext  # noqa: E402
from glm5.testing.compare import assert_matches  # noqa: E402
from glm5.testing.parity import format_table, run_parity  # noqa: E402

VNNI = quant_vnni.vnni_available()[0]
AMX = VNNI and quant_amx.amx_available()[0]
BF16_DP = VNNI and quant_vgemm.bf16_available()[0]
needs_vnni = pytest.mark.skipif(not VNNI, reason=quant_vnni.vnni_available()[1])
needs_bf16 = pytest.mark.skipif(not BF16_DP, reason=quant_vgemm.bf16_available()[1])
needs_amx = pytest.mark.skipif(not AMX, reason=quant_amx.amx_available()[1])
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return TVMContext(cache_dir=tmp_path_factory.mktemp("tvm_quant_x86"))


def _case(M: int, K: int, N: int, scheme: str, dtype: torch.dtype, seed: int = 0,
          halves: bool = False) -> dict:
    """Values of one quant_linear call; ``halves``: a row whose quotients x / s_x are exact
    halves (ties of the activation quantizer, which must round to even like the oracle)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 3
    x[0, 0] = 40.0  # a large value: that row's codes reach ±qmax
    if halves and SCHEMES[scheme].act_bits is not None:
        qmax = SCHEMES[scheme].act_qmax
        s = 0.25  # a power of two: x / s exact
        row = (torch.randint(-qmax, qmax - 1, (K,), generator=g) + 0.5) * s
        row[0] = qmax * s  # amax = qmax·s: the scale is exactly s
        x[-1] = row
    wp, ws = quantize_weight(torch.randn(N, K, generator=g) * K ** -0.5, scheme)
    return {"x": x.to(dtype), "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": None}


def _check(got: torch.Tensor, vals: dict, what: str, dtype: torch.dtype = F32) -> None:
    """A path's [M, N] judged as the op's output: rounded once to x's dtype. ``dtype``: what
    the path returns (fp32; "onednn": x's dtype, rounded by its GEMM)."""
    assert got.dtype == dtype and got.shape == (vals["x"].shape[0],
                                                vals["w_packed"].shape[0]), what
    assert_matches("quant_linear", got.to(vals["x"].dtype), vals, what=what)


def _sweep(fn, shapes: tuple, scheme: str, what: str, dtypes: tuple = (F32, BF16),
           out: torch.dtype | None = F32) -> int:
    """``fn(x, w_packed, w_scale)`` over ``shapes`` (x of each of ``dtypes``, exact-tie rows
    where M > 1), each result judged by `_check` (raises on a wrong dtype, shape or value;
    ``out``: the dtype fn returns, None: x's). Returns the number of results judged."""
    n = 0
    for dtype in dtypes:
        for i, (M, K, N) in enumerate(shapes):
            vals = _case(M, K, N, scheme, dtype, seed=i, halves=M > 1)
            _check(fn(vals["x"], vals["w_packed"], vals["w_scale"]), vals,
                   f"{what} M={M} K={K} N={N} {dtype}", out or dtype)
            n += 1
    return n


# K: below one vector, not a multiple of 64 / 128 / 48 bytes, exact multiples; N: around the
# GEMV's 8-row steps
GEMV_SHAPES = ((1, 7, 3), (1, 331, 37), (1, 256, 8), (3, 200, 50), (4, 129, 17),
               (5, 1000, 9), (9, 130, 70), (2, 4096, 16))


@needs_vnni
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_vnni_gemv_matches_oracle(ctx, scheme):
    for mb in (1, 4):
        assert _sweep(lambda x, wp, ws: quant_vnni.gemv_vnni(lambda: ctx, x, wp, ws, scheme, mb),
                      GEMV_SHAPES, scheme, f"vnni mb={mb}") == 2 * len(GEMV_SHAPES)


@needs_vnni
def test_vnni_byte_operand_types_fall_back(tmp_path, monkeypatch):
    """LLVM releases disagree on vpdpbusd's operand types: with the wrong form first, the
    build falls back to the other one and the result is right."""
    monkeypatch.setattr(quant_vnni, "BYTE_OPERANDS", tuple(reversed(quant_vnni.BYTE_OPERANDS)))
    c = TVMContext(cache_dir=tmp_path)
    vals = _case(3, 200, 20, "w4a8", F32)
    got = quant_vnni.gemv_vnni(lambda: c, vals["x"], vals["w_packed"], vals["w_scale"], "w4a8", 4)
    _check(got, vals, "vnni, second operand form")
    assert [b["key"]["bytes"] for b in c.builds if b["op"] == "quant_linear_vnni"] == [
        quant_vnni.BYTE_OPERANDS[1]]


@needs_vnni
def test_vnni_gemv_row_chunks(ctx, monkeypatch):
    """Many rows: x goes through the GEMV in chunks that stay in L2 (here one 4-row block
    each, and chunks of 8 with a short last one): every chunk's rows are right, and equal bit
    for bit to one chunk's (rows are independent)."""
    whole_chunk = quant_vnni.XCHUNK
    for xchunk in (1, 8 * 4096):  # bytes: one block per chunk; 8 rows of K = 4096 bytes
        for scheme in SCHEMES:
            vals = _case(22, 4096 if xchunk > 1 else 200, 19, scheme, F32, seed=5)
            args = (vals["x"], vals["w_packed"], vals["w_scale"], scheme, 4)
            monkeypatch.setattr(quant_vnni, "XCHUNK", whole_chunk)
            whole = quant_vnni.gemv_vnni(lambda: ctx, *args)
            monkeypatch.setattr(quant_vnni, "XCHUNK", xchunk)
            got = quant_vnni.gemv_vnni(lambda: ctx, *args)
            _check(got, vals, f"vnni chunks of {xchunk} bytes {scheme}")
            assert torch.equal(got, whole), (xchunk, scheme)


# (M, K, N): partial tiles; whole 16 x 16 tiles (the transposed store); rows split between
# tasks (N = 32: one n-block); several n-blocks per task (N = 640); w8a8 loading whole tiles
# from the weight (K % 64 == 0) and from the scratch (K % 64 != 0); int6 rows whose last
# 64-byte load would leave the row (K = 1000), or shorter than one load (K = 7); one row;
# nine row tiles; a last row tile one row short of whole (M = 47)
AMX_SHAPES = ((3, 331, 37), (17, 200, 50), (16, 64, 16), (32, 128, 64), (70, 256, 32),
              (20, 128, 640), (33, 130, 70), (40, 1000, 33), (1, 4096, 48), (15, 7, 5),
              (130, 96, 40), (47, 64, 48))


@needs_amx
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_amx_gemm_matches_oracle(ctx, scheme):
    assert _sweep(lambda x, wp, ws: quant_amx.gemm_amx(lambda: ctx, x, wp, ws, scheme),
                  AMX_SHAPES, scheme, "amx") == 2 * len(AMX_SHAPES)


# (M, K, N): below one 16-row vector and one 48-row block, several blocks with a short last
# one; N not a multiple of the 4 / 2-row register tiles or of the 16-row transposed stores,
# N < 16 (only element stores); K inside one chunk, not a multiple of 64 / 128 / 48 bytes,
# int6 rows whose last 64-byte load would leave the row (K = 1000), an odd K (int4 padding
# nibble); w8a8 over many scale-free groups (K = 5000)
VGEMM_SHAPES = ((1, 64, 16), (3, 331, 37), (17, 200, 50), (48, 128, 32), (49, 96, 33),
                (70, 256, 5), (15, 7, 18), (40, 1000, 33), (130, 129, 70), (100, 5000, 24),
                (64, 63, 64))


@needs_vnni
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w6a12"])
def test_vgemm_matches_oracle(ctx, scheme):
    assert _sweep(lambda x, wp, ws: quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, scheme),
                  VGEMM_SHAPES, scheme, "vgemm") == 2 * len(VGEMM_SHAPES)


@needs_vnni
def test_vgemm_tasks_split_rows_and_columns(ctx, monkeypatch):
    """Small scratch slots (one or a few register tiles of weight rows per task, tasks that
    end inside a 16-row store block) and few weight rows (row blocks of x split between
    tasks): every output right, and equal to the one-task result bit for bit."""
    for scheme, dtype in (("w8a8", F32), ("w4a8", F32), ("w6a12", F32), ("w8a16", BF16),
                          ("w8a16", F32)):
        if not quant.serves("vgemm", scheme):
            continue
        vals = _case(150, 300, 45, scheme, dtype, seed=3)
        args = (vals["x"], vals["w_packed"], vals["w_scale"], scheme)
        whole = quant_vgemm.gemm_vnni(lambda: ctx, *args)
        _check(whole, vals, f"vgemm {scheme}")
        for slot in (1, 3 * 5 * 64):  # bytes: one tile of rows per task; 5 groups x 3 rows
            monkeypatch.setattr(quant_vgemm, "SCRATCH", slot)
            assert torch.equal(quant_vgemm.gemm_vnni(lambda: ctx, *args), whole), (scheme, slot)
        monkeypatch.undo()
        small = _case(150, 300, 3, scheme, dtype, seed=4)  # one task of rows: msplit > 1
        _check(quant_vgemm.gemm_vnni(lambda: ctx, small["x"], small["w_packed"],
                                     small["w_scale"], scheme), small, f"vgemm N=3 {scheme}")


@needs_vnni
def test_vgemm_w8a8_int32_sums_near_the_limit(ctx):
    """w8a8 adds a whole row in int32 (one scale per channel): with K = 70000 codes of +127
    against +127 (and -127) the sums, ±1.13e9, are exact, though the biased products alone
    (x + 128) add up to 2.27e9."""
    K, N = 70000, 16
    x = torch.ones(2, K)
    x[1] = -1.0
    w = torch.ones(N, K)
    w[1] = -1.0
    wp, ws = quantize_weight(w, "w8a8")
    vals = {"x": x, "w_packed": wp, "w_scale": ws, "scheme": "w8a8", "bias": None}
    got = quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, "w8a8")
    _check(got, vals, "vgemm w8a8 K=70000")
    assert got[0, 0].item() == pytest.approx(K, rel=1e-6)


def test_vgemm_task_split_balances_threads():
    """Register tiles per task: within the scratch slot, at least one, and sized so that the
    busiest thread (each runs a contiguous share of the tasks, as the kernel splits them)
    gets at most one tile per task round more than an even share: 13 tasks of 80 tiles on 2
    threads gave one thread 544 of 1024 tiles; 14 of 74 give it 518."""
    def busiest(nblk: int, threads: int, n: int) -> int:
        tasks = -(-nblk // n)
        loads = []
        for th in range(threads):
            ks = range(th * tasks // threads, (th + 1) * tasks // threads)
            loads.append(sum(min(n, nblk - k * n) for k in ks))
        assert sum(loads) == nblk
        return max(loads)

    for nblk in (1, 3, 10, 37, 1024, 2048, 5000):
        for threads in (1, 2, 3, 16):
            for most in (1, 7, 80):
                n = quant_vgemm._tasks(nblk, threads, most)
                assert 1 <= n <= most, (nblk, threads, most, n)
                rounds = -(-(-(-nblk // n)) // threads)
                assert busiest(nblk, threads, n) <= -(-nblk // threads) + rounds, (
                    nblk, threads, most, n)
    assert busiest(1024, 2, quant_vgemm._tasks(1024, 2, 80)) == 518


@needs_vnni
def test_vgemm_w8a16_fp32_matches_oracle(ctx):
    """w8a16 on fp32 x (fp32 FMAs, any AVX-512 CPU) over the boundary shapes, within the op's
    tolerance."""
    assert _sweep(lambda x, wp, ws: quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, "w8a16"),
                  VGEMM_SHAPES, "w8a16", "vgemm", (F32,)) == len(VGEMM_SHAPES)


@needs_bf16
def test_vgemm_w8a16_bf16_matches_oracle(ctx):
    """w8a16 on bf16 x (vdpbf16ps) over the boundary shapes, within the op's tolerance."""
    assert _sweep(lambda x, wp, ws: quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, "w8a16"),
                  VGEMM_SHAPES, "w8a16", "vgemm", (BF16,)) == len(VGEMM_SHAPES)


@pytest.mark.parametrize("dtype, top", [
    pytest.param(BF16, 256, marks=needs_bf16), pytest.param(F32, 2**9, marks=needs_vnni)])
def test_vgemm_w8a16_is_exact_on_exact_products(ctx, dtype, top):
    """Integer-valued x and weights whose every partial sum is an integer below 2^24: each
    output is exact, so a dropped or repeated chunk, pair, step or K value shows as a wrong
    integer (bf16 x: 8-bit integers, one plane; fp32 x: 10-bit integers, FMAs)."""
    g = torch.Generator().manual_seed(6)
    M, K, N = 70, 200, 37
    x = torch.randint(-top, top, (M, K), generator=g).to(dtype)
    w = torch.randint(-127, 128, (N, K), generator=g).float()
    w[:, 0] = 127  # amax 127: the scale is exactly 1
    wp, ws = quantize_weight(w, "w8a16")
    assert torch.equal(ws, torch.ones(N))
    got = quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, "w8a16")
    want = x.double() @ w.double().T
    assert top * 127 * K < 2**24  # every partial sum is an integer fp32 holds exactly
    assert torch.equal(got.double(), want), dtype


def test_vgemm_w8a16_bf16_refused_without_bf16(ctx, monkeypatch):
    """Where the CPU lacks AVX-512 BF16 the GEMM refuses w8a16 on bf16 x naming what is
    missing, and the path table sends such calls to the VNNI GEMV (its fallback entry); fp32 x
    (FMAs) is still served."""
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (False, "CPU lacks avx512_bf16"))
    vals = _case(4, 64, 8, "w8a16", BF16)
    with pytest.raises(RuntimeError, match="vdpbf16ps: CPU lacks avx512_bf16"):
        quant_vgemm.gemm_vnni(lambda: ctx, vals["x"], vals["w_packed"], vals["w_scale"],
                              "w8a16")
    assert not quant.serves("vgemm", "w8a16", BF16) and quant.serves("vgemm", "w4a8", BF16)
    assert quant.serves("vgemm", "w8a16", F32) and quant.serves("vgemm", "w8a16")
    assert quant.path("w8a16", 512, "vnni", BF16) == "vnni"
    assert quant.path("w8a16", 512, "vnni", F32) == "vgemm"


def test_vgemm_serves_w8a16_above_the_gemv_rows(monkeypatch):
    """With AVX-512 BF16, w8a16 takes the GEMM above the GEMV's rows, for bf16 and fp32 x."""
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    assert quant.serves("vgemm", "w8a16", BF16) and quant.serves("vgemm", "w8a16", F32)
    for dtype in (BF16, F32):
        bound = {BF16: 16, F32: 32}[dtype]
        assert quant.path("w8a16", bound, "vnni", dtype) == "vnni"
        assert quant.path("w8a16", bound + 1, "vnni", dtype) == "vgemm"


# (M, K, N): K below one 64-code vector step, not a multiple of it (a scalar tail), whole
# steps; N of one row
ONEDNN_SHAPES = ((1, 64, 16), (3, 331, 37), (17, 7, 50), (40, 1000, 33), (130, 129, 1),
                 (64, 128, 70))


@needs_bf16
@pytest.mark.parametrize("block", [None, 3000])
def test_onednn_w8a16_matches_oracle(ctx, monkeypatch, block):
    """w8a16 on bf16 x through oneDNN (weight blocks dequantized to bf16 by TVM), over the
    boundary shapes: bf16 [M, N] within the op's tolerance, with all rows in one block and
    with blocks of 3000 codes (3 to 428 rows here: several blocks, a short last one)."""
    from glm5.kernels.tvm import quant_onednn

    if block:
        monkeypatch.setattr(quant_onednn, "BLOCK", block)
    fn = lambda x, wp, ws: quant_onednn.gemm(lambda: ctx, x, wp, ws)  # noqa: E731
    assert _sweep(fn, ONEDNN_SHAPES, "w8a16", "onednn", (BF16,), None) == len(ONEDNN_SHAPES)


@needs_bf16
def test_onednn_blocks_give_the_whole_product(ctx, monkeypatch):
    """Weight rows in blocks (here 3 rows, the last one short; one row) give the same bits as
    one block of all rows: each output column comes from its own row's block."""
    from glm5.kernels.tvm import quant_onednn

    vals = _case(9, 200, 11, "w8a16", BF16, seed=3)
    args = (vals["x"], vals["w_packed"], vals["w_scale"])
    whole = quant_onednn.gemm(lambda: ctx, *args)
    for rows in (3, 1):
        monkeypatch.setattr(quant_onednn, "BLOCK", rows * 200)
        assert torch.equal(quant_onednn.gemm(lambda: ctx, *args), whole), rows


@needs_bf16
def test_onednn_dequantized_rows_round_to_nearest_even(ctx):
    """The dequantization pass: ``bf16(code · scale)`` with the product in fp32 rounded to
    nearest even, bit for bit torch's own rounding, over whole 64-code steps and a scalar tail
    (K = 1000), rows of one step and shorter; scales that put products exactly halfway between
    two bf16 values (ties) and just above them."""
    from glm5.kernels.tvm import quant_onednn

    g = torch.Generator().manual_seed(9)
    for N, K in ((5, 1000), (3, 64), (4, 7)):
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = torch.rand(N, generator=g) * 0.02
        s[0] = 1.0 + 2.0**-8  # a power-of-two code 2^j times this is 2^j + half its ulp: a tie
        pw = torch.tensor([1, 2, 4, 8, 16, 32, 64], dtype=torch.int8)
        q[0, :min(K, 14)] = torch.cat((pw, -pw))[:K]
        if N > 3:
            s[1] = 1.0 + 2.0**-8 + 2.0**-20  # just above halfway: rounds up
        out = torch.empty(N, K, dtype=BF16)
        quant_onednn.dequantize_rows(lambda: ctx, q, s, out)
        assert torch.equal(out, (q.float() * s[:, None]).to(BF16)), (N, K)


def test_onednn_serves_bf16_w8a16_only(ctx, monkeypatch):
    """The oneDNN path serves w8a16 on bf16 x where the CPU has AVX-512 BF16; fp32 x is refused
    by name; the table sends bf16 x to it above the VNNI GEMM's rows (128)."""
    from glm5.kernels.tvm import quant_onednn

    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    assert quant.serves("onednn", "w8a16", BF16) and quant.serves("onednn", "w8a16")
    assert not quant.serves("onednn", "w8a16", F32)
    assert not any(quant.serves("onednn", s) for s in ("w8a8", "w4a8", "w6a12"))
    assert quant.path("w8a16", 128, "vnni", BF16) == "vgemm"
    assert quant.path("w8a16", 129, "vnni", BF16) == "onednn"
    assert quant.path("w8a16", 10**5, "vnni", F32) == "vgemm"
    vals = _case(3, 64, 8, "w8a16", F32)
    with pytest.raises(ValueError, match=r"onednn path\): argument 'x' expected bfloat16"):
        quant_onednn.gemm(lambda: ctx, vals["x"], vals["w_packed"], vals["w_scale"])
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (False, "t"))
    assert not quant.serves("onednn", "w8a16", BF16)


def test_dpbf16_rewrite():
    """The vdpbf16ps rewrite: each stand-in call becomes bitcasts around the intrinsic
    (operands of either form, constants too), its declaration is replaced, and a use it does
    not recognise is refused instead of linking the stand-in's integer semantics."""
    from glm5.kernels.tvm import tirlib

    ll = ("define void @f() {\n"
          "  %7 = tail call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> %a.x, "
          "<32 x i16> %1, <32 x i16> %2), !dbg !4\n"
          "  %8 = call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> zeroinitializer, "
          "<16 x i32> %3, <16 x i32> %4)\n"
          "  ret void\n}\n"
          "declare <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32>, <32 x i16>, "
          "<32 x i16>) #1\n")
    out = tirlib.dpbf16_ir(ll)
    assert "vpdpwssd" not in out
    assert out.count("call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(") == 2
    assert "bitcast <16 x i32> %a.x to <16 x float>" in out
    assert "bitcast <32 x i16> %1 to <32 x bfloat>" in out
    assert "bitcast <16 x i32> %4 to <32 x bfloat>" in out
    assert "bitcast <16 x i32> zeroinitializer to <16 x float>" in out
    assert "%7 = bitcast <16 x float>" in out and ", !dbg !4" in out
    assert out.count("declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, "
                     "<32 x bfloat>, <32 x bfloat>)") == 1
    old = tirlib.dpbf16_ir(ll, "<16 x i32>")
    assert "bitcast <32 x i16> %1 to <16 x i32>" in old
    with pytest.raises(RuntimeError, match="cannot rewrite"):
        tirlib.dpbf16_ir("  store ptr @llvm.x86.avx512.vpdpwssd.512, ptr %p\n")


def _amx_codes(xb: torch.Tensor, M: int, K: int, bits: int, unsigned: bool = False
               ) -> torch.Tensor:
    """Undo `quant_amx.activations`' tile layout: int32 codes [M, K] (planes combined;
    ``unsigned``: plane 0's bias of 128 taken off)."""
    P, Mt, NC = xb.shape[0], xb.shape[1], xb.shape[2]
    q = (xb.view(P, Mt, NC, 16, 16, 4).permute(0, 1, 4, 2, 3, 5).reshape(P, Mt * 16, NC * 64)
         .to(torch.int32))
    if unsigned:
        q[0] = q[0].view(torch.int32).bitwise_xor(-128)  # int8 byte XOR 0x80, sign-extended
    q = q[0] * 16 + q[1] if P == 2 else q[0]
    out = torch.empty_like(q)
    out[:, quant_amx.kpermutation(bits, NC * 64)] = q
    assert not out[M:].any() and not out[:, K:].any()  # the padding is zero (code 0)
    return out[:M, :K]


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w6a12"])
def test_tile_layout_activation_codes_are_the_oracles(ctx, scheme):
    """The TVM quantizer (portable: no AMX needed) gives quantize_per_token_ref's codes and
    scales bit for bit (ties included), in the tile layout the weight's unpacking expects;
    the unsigned form (the VNNI GEMM's) is the same codes with plane 0 + 128, padding
    included."""
    sc = SCHEMES[scheme]
    for unsigned in (False, True):
        for dtype in (F32, BF16):
            for M, K in ((3, 331), (17, 64), (33, 1000)):
                x = _case(M, K, 1, scheme, dtype, seed=K, halves=True)["x"]
                xb, sx = quant_amx.activations(lambda: ctx, x, scheme, unsigned=unsigned)
                want_q, want_s = quantize_per_token_ref(x, sc.act_bits)
                got = _amx_codes(xb, M, K, sc.weight_bits, unsigned)
                assert torch.equal(got, want_q.to(torch.int32)), (unsigned, dtype, M, K)
                assert torch.equal(sx[:M], want_s)
                assert torch.equal(sx[M:], torch.ones(len(sx) - M))


def test_amx_bf16_planes_are_exact(ctx):
    """w8a16's activation: rows scaled by 2^e, then hi + mid + lo == x·2^e exactly (fp32 x),
    one plane equal to x·2^e (bf16 x); sx = 2^-e undoes the scaling exactly."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 70, generator=g)
    x[1] *= 1e-30
    x[2] *= 1e30
    x[3] = 0.0
    x[4, :3] = torch.tensor([3.3e38, -1e-38, 1.0])
    x[5] = torch.randn(70, generator=g) * torch.logspace(-20, 20, 70)
    for dtype in (F32, BF16):
        xd = x.to(dtype)
        xb, sx = quant_amx.activations(lambda: ctx, xd, "w8a16")
        P, Mt, NC = xb.shape[:3]
        planes = (xb.view(torch.bfloat16).view(P, Mt, NC, 16, 16, 2).permute(0, 1, 4, 2, 3, 5)
                  .reshape(P, Mt * 16, NC * 32).to(torch.float64))[:, :6, :70]
        assert P == (3 if dtype == F32 else 1)
        scaled = xd.to(torch.float64) / sx[:6, None].to(torch.float64)
        # exact down to 2^-100 of the row's largest (then fp32 underflow: an error below
        # 2^-100 of it, which the tile unit would flush anyway)
        big = scaled.abs() >= 2.0**-100
        assert big.sum() > 250
        assert torch.equal(planes.sum(0)[big], scaled[big]), dtype
        assert ((planes.sum(0) - scaled)[~big].abs() <= 2.0**-100).all(), dtype
        assert ((sx[:6].log2() % 1) == 0).all()  # powers of two
        amax = scaled.abs().amax(1)
        # [1, 2); a row reaching 2^127 is scaled by 2^-126 at most (2^-127 is not normal)
        top = xd.to(torch.float64).abs().amax(1) >= 2.0**127
        assert (((amax >= 1) & (amax < 2)) | (top & (amax >= 2) & (amax < 4))
                | (amax == 0)).all(), amax


@needs_vnni
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w6a12"])
def test_vnni_activation_codes_and_corrections(ctx, scheme):
    """The GEMV's x layout holds the oracle's codes; corr[m, g, lane] is the weight bias times
    the sum of the codes that lane multiplies in group g."""
    sc = SCHEMES[scheme]
    M, K = 3, 331
    x = _case(M, K, 1, scheme, F32, seed=2, halves=True)["x"]
    VV = quant_vnni._vals_per_vec(sc.weight_bits)
    Kv = -(-K // VV) * VV
    P = 2 if sc.act_bits == 12 else 1
    G = -(-K // 128) if sc.grouped else 1
    xq = torch.empty(P, M, Kv, dtype=torch.int8)
    corr = torch.empty(M, G, 16, dtype=torch.int32)
    sx = torch.empty(M)
    quant_vnni._prep_fn(lambda: ctx, scheme, "float32")(x, xq, corr, sx, M, K)
    want_q, want_s = quantize_per_token_ref(x, sc.act_bits)
    q = xq[0].to(torch.int32) * 16 + xq[1].to(torch.int32) if P == 2 else xq[0].to(torch.int32)
    nat = torch.empty_like(q)
    nat[:, quant_vnni._x_permutation(sc.weight_bits, Kv)] = q
    assert torch.equal(nat[:, :K], want_q.to(torch.int32)) and not nat[:, K:].any()
    assert torch.equal(sx, want_s)
    lane = (torch.arange(Kv) % 64) // 4  # lane of each x position
    grp = (quant_vnni._x_permutation(sc.weight_bits, Kv) // 128 if sc.grouped
           else torch.zeros(Kv, dtype=torch.long))
    want = torch.zeros(M, G, 16, dtype=torch.int32)
    want.index_put_((torch.arange(M)[:, None], grp[None], lane[None]), q, accumulate=True)
    assert torch.equal(corr, quant_vnni.BIAS[sc.weight_bits] * want)


def test_kernels_write_inside_their_buffers(ctx, monkeypatch):
    """Every buffer the VNNI and AMX paths write (tiled x, scales, corrections, per-thread
    scratch, the output) gets 4 KiB of guard bytes on both sides: after the boundary shapes
    of every scheme ran, every guard byte is intact."""
    from glm5.kernels.tvm import tirlib

    GUARD, FILL = 4096, 0xA5
    bufs = []

    def guarded(shape, dtype, *_):
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        raw = torch.full((nbytes + 2 * GUARD,), FILL, dtype=torch.uint8)
        bufs.append((raw, nbytes, shape))
        return raw[GUARD:GUARD + nbytes].view(dtype).view(shape)

    monkeypatch.setattr(tirlib, "scratch", lambda name, shape, dtype: guarded(shape, dtype))
    monkeypatch.setattr(tirlib, "fresh", guarded)
    runs = []
    if VNNI:
        runs += [(lambda x, wp, ws, s, mb=mb: quant_vnni.gemv_vnni(lambda: ctx, x, wp, ws, s, mb),
                  GEMV_SHAPES) for mb in (1, 4)]
        runs += [(lambda x, wp, ws, s: quant_vgemm.gemm_vnni(lambda: ctx, x, wp, ws, s)
                  if quant.serves("vgemm", s, x.dtype) else None, VGEMM_SHAPES)]
    if BF16_DP:  # the dequantized weight blocks (a scratch) and the output
        from glm5.kernels.tvm import quant_onednn

        runs += [(lambda x, wp, ws, s: quant_onednn.gemm(lambda: ctx, x, wp, ws)
                  if quant.serves("onednn", s, x.dtype) else None, ONEDNN_SHAPES)]
    if AMX:
        runs += [(lambda x, wp, ws, s: quant_amx.gemm_amx(lambda: ctx, x, wp, ws, s),
                  AMX_SHAPES)]
    if not runs:
        pytest.skip("no VNNI / AMX on this CPU")
    for fn, shapes in runs:
        for scheme in SCHEMES:
            for dtype in (F32, BF16):
                for i, (M, K, N) in enumerate(shapes):
                    vals = _case(M, K, N, scheme, dtype, seed=i)
                    fn(vals["x"], vals["w_packed"], vals["w_scale"], scheme)
    assert bufs
    for raw, nbytes, shape in bufs:
        assert (raw[:GUARD] == FILL).all() and (raw[GUARD + nbytes:] == FILL).all(), shape


_OVERREAD = r"""
import ctypes, mmap, sys
import torch
from glm5.ir.quant_formats import SCHEMES, quantize_weight
from glm5.kernels.tvm import quant
from glm5.kernels.tvm.build import TVMContext

ctx = TVMContext(cache_dir=sys.argv[1])
libc = ctypes.CDLL(None)
PAGE = mmap.PAGESIZE
keep = []


def at_page_end(t):
    # a copy of t whose last byte ends a page, the next page unreadable (PROT_NONE)
    nbytes = t.numel() * t.element_size()
    npages = -(-nbytes // PAGE) + 1
    m = mmap.mmap(-1, npages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(ctypes.c_void_p(base + (npages - 1) * PAGE), PAGE, 0) == 0
    off = (npages - 1) * PAGE - nbytes
    out = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off)
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    keep.append(m)
    return out


g = torch.Generator().manual_seed(0)
for p in sys.argv[2].split(","):
    for scheme in SCHEMES:
        if not quant.serves(p, scheme):
            continue
        for M, K, N in ((1, 1000, 9), (5, 1000, 9), (70, 1000, 9), (3, 7, 5), (50, 129, 17)):
            wp, ws = quantize_weight(torch.randn(N, K, generator=g), scheme)
            x = torch.randn(M, K, generator=g)
            if not quant.serves(p, scheme, x.dtype):  # the oneDNN path: bf16 x only
                x = x.to(torch.bfloat16)
            want = quant.run_path(p, lambda: ctx, x, wp, ws, scheme)
            got = quant.run_path(p, lambda: ctx, at_page_end(x), at_page_end(wp), at_page_end(ws),
                             scheme)
            assert torch.equal(got, want), (p, scheme, M, K, N)
print("read inside")
"""


def test_kernels_read_inside_their_inputs(tmp_path):
    """x, the packed weight and its scales each end at an unreadable page: every path of this
    CPU reads none of them past their end (a read one byte over would kill the process: run in
    a subprocess), and gives what it gives on ordinary tensors. Shapes: int6 rows whose last
    64-byte load would leave the row (K = 1000), rows shorter than one load, odd K."""
    paths = [p for p in _paths_here() if p != "torch:gemm"]
    r = subprocess.run([sys.executable, "-c", _OVERREAD, str(tmp_path), ",".join(paths)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "read inside" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_scratch_buffers_are_reused_up_to_a_size(monkeypatch):
    """Per-thread scratch is reused across calls (no fresh pages each call), but a buffer above
    SCRATCH_KEEP bytes is allocated per call and not kept."""
    from glm5.kernels.tvm import tirlib

    a = tirlib.scratch("t_small", (4, 8), torch.int32)
    b = tirlib.scratch("t_small", (2, 8), torch.int32)
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 8)
    monkeypatch.setattr(tirlib, "SCRATCH_KEEP", 64)
    c = tirlib.scratch("t_big", (32,), torch.int32)  # 128 bytes
    d = tirlib.scratch("t_big", (32,), torch.int32)
    assert c.data_ptr() != d.data_ptr()
    assert ("t_big", torch.int32) not in tirlib._local.bufs


# --------------------------------------------------------------------------- the path table
def test_path_table_boundaries(monkeypatch):
    """`quant.path` picks, for every tier, scheme and x dtype, the entry of `PATHS` (those for
    that dtype and those for any) whose row bound is the first >= M: at each bound its own
    path, one row above it the next entry's. Entries after the first catch-all are
    fallbacks, served by a path that serves every call."""
    monkeypatch.setattr(quant_vgemm, "bf16_available", lambda: (True, "t"))
    for tier, table in quant.PATHS.items():
        assert set(table) == set(SCHEMES), tier
        for scheme, all_entries in table.items():
            assert all(len(e) == 2 or e[2] in ("float32", "bfloat16") for e in all_entries)
            for dtype in (None, F32, BF16):
                name = str(dtype).removeprefix("torch.")
                entries = [e[:2] for e in all_entries if len(e) == 2 or e[2] == name]
                first = [r for r, _ in entries].index(None)
                assert all(r is None for r, _ in entries[first:]), (tier, scheme)
                assert entries[-1][1] != "vgemm" or quant.SCHEMES[scheme].act_bits is not None
                entries = entries[:first + 1]
                bounds = [r for r, _ in entries[:-1]]
                assert bounds == sorted(set(bounds)) and all(b >= 1 for b in bounds)
                assert all(p in quant.LABELS for _, p in entries)
                assert quant.path(scheme, 1, tier, dtype) == entries[0][1]
                for (r, p), (_, nxt) in zip(entries, entries[1:]):
                    assert quant.path(scheme, r, tier, dtype) == p, (tier, scheme, r, dtype)
                    assert quant.path(scheme, r + 1, tier, dtype) == nxt, (tier, scheme, r + 1)
                assert quant.path(scheme, 10**7, tier, dtype) == entries[-1][1]
    # w8a16 on the VNNI tier: the GEMV to 16 rows of bf16 x, to 32 of fp32 x, the VNNI GEMM
    # to 128 rows of bf16 x, then oneDNN (measured)
    assert quant.path("w8a16", 17, "vnni", BF16) == "vgemm"
    assert quant.path("w8a16", 129, "vnni", BF16) == "onednn"
    assert quant.path("w8a16", 32, "vnni", F32) == "vnni"
    assert quant.path("w8a16", 33, "vnni", F32) == "vgemm"


def test_cpu_tier_from_features(monkeypatch):
    """amx needs AMX and VNNI; vnni needs VNNI; the tier is read once and kept."""
    for amx, vnni, want in ((True, True, "amx"), (False, True, "vnni"), (True, False, "portable"),
                            (False, False, "portable")):
        monkeypatch.setattr(quant, "_tier", [])
        monkeypatch.setattr(quant_amx, "amx_available", lambda a=amx: (a, "t"))
        monkeypatch.setattr(quant_vnni, "vnni_available", lambda v=vnni: (v, "t"))
        assert quant.cpu_tier() == want
        monkeypatch.setattr(quant_vnni, "vnni_available", lambda: (not vnni, "t"))
        assert quant.cpu_tier() == want  # cached


@pytest.mark.parametrize("tier", list(quant.PATHS))
def test_served_op_runs_and_reports_the_tables_path(monkeypatch, tier):
    """The cpu backend's quant_linear runs the path `PATHS` names for (tier, scheme, M, x's
    dtype) and reports its label; empty products run nothing."""
    entry = glm5.get_registry().get("cpu").kernels["quant_linear"]
    ran = []

    def fake(p, context, x, wp, ws, scheme):
        ran.append(p)
        return torch.zeros(x.shape[0], wp.shape[0])

    monkeypatch.setattr(quant, "_tier", [tier])
    monkeypatch.setattr(quant, "run_path", fake)
    for scheme in SCHEMES:
        wp, ws = quantize_weight(torch.randn(16, 64), scheme)
        bounds = [e[0] for e in quant.PATHS[tier][scheme] if e[0] is not None]
        for M in sorted({1, 2, 3, *bounds, *(b + 1 for b in bounds), 600}):
            for dtype in (F32, BF16):
                ran.clear()
                x = torch.randn(M, 64).to(dtype)
                y, labels = run_recorded(entry, (x, wp, ws, scheme, None))
                want = quant.path(scheme, M, tier, dtype)
                assert ran == [want] and labels == [quant.LABELS[want]], (scheme, M, dtype)
                assert y.shape == (M, 16)
        ran.clear()
        _, labels = run_recorded(entry, (torch.randn(0, 64), wp, ws, scheme, None))
        assert ran == [] and labels == [entry.impl]


def _paths_here() -> list[str]:
    return [p for p, ok in (("vnni", VNNI), ("vgemm", VNNI), ("amx", AMX), ("onednn", BF16_DP),
                            ("tvm", True), ("torch:gemm", True)) if ok]


def _x_dtype(p: str, scheme: str) -> torch.dtype:
    """fp32 where path ``p`` serves it, else bf16 (the oneDNN path's only dtype)."""
    return F32 if quant.serves(p, scheme, F32) else BF16


@pytest.fixture(scope="module")
def backend(ctx):
    b = glm5.Backend("cpu_quant_x86_test", vendor="t", device_type="cpu")
    for op, fn, dtypes, supports in quant.kernels(lambda: ctx):
        b.kernel(op, dtypes=dtypes, supports=supports)(fn)
    return b


@pytest.mark.parametrize("p", _paths_here())
def test_every_path_passes_parity(backend, monkeypatch, p):
    """quant_linear with every row count sent down one path: the kit's edge and tile cases
    (fp32 and bf16, biases, activations with exact ties) all within the op's tolerance."""
    monkeypatch.setitem(quant.PATHS, quant.cpu_tier(), {
        s: ((None, p), (None, "tvm")) for s in SCHEMES})  # tvm where p does not serve
    rows = run_parity(backend, ["quant_linear"], examples=4, seed=11, profile="smoke")
    assert rows and all(r.status == "pass" for r in rows), format_table(rows)


def _tiers_here() -> list[str]:
    return [t for t, ok in (("portable", True), ("vnni", VNNI), ("amx", AMX)) if ok]


@pytest.mark.parametrize("tier", _tiers_here())
def test_moe_experts_quant_on_every_tier(backend, monkeypatch, tier):
    """moe_experts_quant as each tier of this CPU runs it (portable: one grouped GEMV call
    over all experts; VNNI / AMX: each expert's rows on quant_linear's path for its row
    count): the kit's cases within the op's tolerance."""
    monkeypatch.setattr(quant, "_tier", [tier])
    rows = run_parity(backend, ["moe_experts_quant"], examples=6, seed=5, profile="smoke")
    assert rows and all(r.status == "pass" for r in rows), format_table(rows)


@pytest.mark.skipif(not VNNI, reason=quant_vnni.vnni_available()[1])
def test_moe_experts_quant_takes_each_experts_path(ctx, monkeypatch):
    """On a VNNI tier every expert with rows runs both projections on `quant.path` for its own
    row count and x's dtype (here 1 to 40 rows: the GEMV and the GEMM both serve), experts
    without rows run nothing, and the result matches the grouped portable kernel's within the
    op's tolerance."""
    monkeypatch.setattr(quant, "_tier", ["vnni"])
    g = torch.Generator().manual_seed(2)
    E, D, I, T, k = 6, 96, 64, 40, 2
    # w8a16 twice: fp32 x (the GEMV at every count), bf16 x (the bf16 GEMM above 16 rows)
    for scheme, dtype in [(s, F32) for s in SCHEMES] + [("w8a16", BF16)]:
        w13 = [quantize_weight(torch.randn(2 * I, D, generator=g), scheme) for _ in range(E)]
        w2 = [quantize_weight(torch.randn(D, I, generator=g), scheme) for _ in range(E)]
        args = (torch.stack([a for a, _ in w13]), torch.stack([b for _, b in w13]),
                torch.stack([a for a, _ in w2]), torch.stack([b for _, b in w2]))
        x = torch.randn(T, D, generator=g).to(dtype)
        # expert 0: every token; 1: one token; 2: none; the rest share the others
        ids = torch.zeros(T, k, dtype=torch.int32)
        ids[:, 1] = 3 + torch.arange(T) % 3
        ids[0, 1] = 1
        wts = torch.rand(T, k, generator=g)
        ran = []
        real = quant.run_path

        def spy(p, context, xe, *rest):
            ran.append((p, xe.shape[0]))
            return real(p, context, xe, *rest)

        monkeypatch.setattr(quant, "run_path", spy)
        got = quant.moe_experts_quant(lambda: ctx, x, ids, wts, *args, scheme)
        monkeypatch.setattr(quant, "run_path", real)
        counts = torch.bincount(ids.reshape(-1).long(), minlength=E).tolist()
        want_runs = [(quant.path(scheme, n, "vnni", x.dtype), n) for n in counts if n
                     for _ in (0, 1)]
        assert ran == want_runs, (scheme, ran)
        monkeypatch.setattr(quant, "_tier", ["portable"])
        grouped = quant.moe_experts_quant(lambda: ctx, x, ids, wts, *args, scheme)
        monkeypatch.setattr(quant, "_tier", ["vnni"])
        vals = {"x": x, "ids": ids, "weights": wts, "w13_packed": args[0], "w13_scale": args[1],
                "w2_packed": args[2], "w2_scale": args[3], "scheme": scheme}
        assert_matches("moe_experts_quant", got, vals, what=f"by expert {scheme}")
        assert_matches("moe_experts_quant", grouped, vals, what=f"grouped {scheme}")


@pytest.mark.parametrize("p", _paths_here())
def test_every_path_takes_strided_inputs(ctx, monkeypatch, p):
    """x (every other column), the packed weight and the scales (rows with gaps) as strided
    views: the same result as from contiguous copies."""
    g = torch.Generator().manual_seed(8)
    for scheme in [s for s in SCHEMES if quant.serves(p, s)]:
        for M in (1, 5, 33):
            vals = _case(M, 200, 40, scheme, _x_dtype(p, scheme), seed=M)
            wp, ws = vals["w_packed"], vals["w_scale"]
            x_s = torch.randn(M, 400, generator=g).to(vals["x"].dtype)[:, ::2]
            x_s.copy_(vals["x"])
            wp_s = torch.zeros(40, wp.shape[1] + 9, dtype=wp.dtype)[:, 5:5 + wp.shape[1]]
            wp_s.copy_(wp)
            ws_s = torch.zeros(*ws.shape[:-1], ws.shape[-1] + 3)[..., 1:1 + ws.shape[-1]] \
                if ws.dim() == 2 else torch.zeros(80)[::2]
            ws_s.copy_(ws)
            assert not (x_s.is_contiguous() or wp_s.is_contiguous() or ws_s.is_contiguous())
            got = quant.run_path(p, lambda: ctx, x_s, wp_s, ws_s, scheme)
            want = quant.run_path(p, lambda: ctx, vals["x"], wp, ws, scheme)
            assert torch.equal(got, want), (scheme, M)


def test_kernels_decline_what_int32_indexing_cannot_reach():
    """A call whose x (in any layout of any path: up to three planes of 16-row, 128-code
    padding) or y has 2^31 elements or more is declined (the op then passes to the next
    candidate), not silently wrapped around. Shapes only: the tensors are expanded views."""
    sup = [s for op, _, _, s in quant.kernels(lambda: None) if op == "quant_linear"][0]

    def x(M, K):
        return torch.empty(1, 1).expand(M, K)

    wp, ws = quantize_weight(torch.randn(16, 64), "w4a8")
    assert sup(x(4, 64), wp, ws, "w4a8") and sup(x(2**20, 64), wp, ws, "w4a8")
    wp1, ws1 = quantize_weight(torch.randn(1, 64), "w4a8")
    wide = (wp1.expand(2**20, wp1.shape[1]), ws1.expand(2**20, ws1.shape[1]))
    assert not sup(x(2**11, 64), *wide, "w4a8")  # y: 2^31 elements
    assert sup(x(2**11 - 1, 64), *wide, "w4a8")
    wk, sk = quantize_weight(torch.randn(2, 2**10), "w4a8")
    assert sup(x(2**19, 2**10), wk, sk, "w4a8")  # 3 planes: 1.6e9
    assert not sup(x(2**20, 2**10), wk, sk, "w4a8")  # 3.2e9


def test_new_kernels_build_once_and_load_from_disk(ctx, tmp_path):
    """New M, N, K reuse the built VNNI / AMX kernels (all three are runtime values); a fresh
    context on the same cache directory loads them instead of compiling (and they compute
    the same)."""
    todo = [p for p in ("vnni", "vgemm", "amx") if p in _paths_here()]
    if not todo:
        pytest.skip("no VNNI / AMX on this CPU")
    c1 = TVMContext(cache_dir=tmp_path)
    g = torch.Generator().manual_seed(4)

    def run(c, M, K, N):
        wp, ws = quantize_weight(torch.randn(N, K, generator=g), "w4a8")
        for p in todo:
            quant.run_path(p, lambda: c, torch.randn(M, K, generator=g), wp, ws, "w4a8")
        if BF16_DP:  # the bf16 GEMM: compiled from rewritten LLVM IR, cached like the rest
            wp, ws = quantize_weight(torch.randn(N, K, generator=g), "w8a16")
            x = torch.randn(M, K, generator=g).to(BF16)
            vals = {"x": x, "w_packed": wp, "w_scale": ws, "scheme": "w8a16", "bias": None}
            _check(quant.run_path("vgemm", lambda: c, x, wp, ws, "w8a16"), vals, "w8a16 cached")
            # the oneDNN path's dequantization pass: n and K are runtime values too
            _check(quant.run_path("onednn", lambda: c, x, wp, ws, "w8a16"), vals, "onednn cached",
                   BF16)

    run(c1, 3, 200, 40)
    built = [b["how"] for b in c1.builds]
    assert built and set(built) == {"built"}
    run(c1, 5, 300, 70)
    run(c1, 2, 64, 9)
    assert len(c1.builds) == len(built)
    c2 = TVMContext(cache_dir=tmp_path)
    run(c2, 3, 200, 40)
    assert [b["how"] for b in c2.builds] == ["loaded"] * len(built)


def test_choosing_a_path_imports_no_tvm():
    """The path table and the CPU tier need no compiler: `import tvm` stays lazy."""
    code = ("import sys, glm5.kernels.tvm.quant as q; q.path('w4a8', 1); q.path('w8a16', 999);"
            "assert 'tvm' not in sys.modules, 'tvm imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not VNNI, reason=quant_vnni.vnni_available()[1])
def test_moe_bench_script_writes_its_rows(tmp_path):
    """bench/cpu_moe_quant.py at a tiny shape: a row per (scheme, tokens) with both forms'
    times and their outputs' difference (small); the tier is left as it was."""
    spec = importlib.util.spec_from_file_location(
        "cpu_moe_quant_bench", Path(__file__).parents[1] / "bench" / "cpu_moe_quant.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tier = quant.cpu_tier()
    out = tmp_path / "m.json"
    assert bench.main(["--experts", "3", "--d", "64", "--i", "32", "--topk", "2", "--tokens",
                       "1,5", "--schemes", "w4a8,w8a16", "--rounds", "1", "--out",
                       str(out)]) == 0
    d = json.loads(out.read_text())
    assert {(r["scheme"], r["tokens"]) for r in d["rows"]} == {
        (s, t) for s in ("w4a8", "w8a16") for t in (1, 5)}
    assert all(r["grouped_ms"] > 0 and r["by_expert_ms"] > 0 and r["max_diff"] < 1e-3
               for r in d["rows"])
    assert quant.cpu_tier() == tier


def test_bench_script_writes_its_table(tmp_path, monkeypatch):
    """bench/cpu_quant_linear.py at a tiny shape: one row per (M, scheme, x dtype) naming the
    path `PATHS` chooses, the dense timings and ratios, GB/s at M = 1; --paths adds a row per
    (M, scheme, dtype) with every path of this CPU's tier timed."""
    monkeypatch.setenv("GLM5_STRICT", "1")
    spec = importlib.util.spec_from_file_location(
        "cpu_quant_linear_bench", Path(__file__).parents[1] / "bench" / "cpu_quant_linear.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--ms", "1,3", "--k", "64", "--n", "32", "--rounds", "1", "--budget",
                       "0", "--dtypes", "float32,bfloat16", "--paths", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    tier = quant.cpu_tier()
    assert d["tier"] == tier and d["features"]["flags"] and d["cpu"]
    assert {(r["M"], r["scheme"], r["dtype"]) for r in d["rows"]} == {
        (M, s, dt) for M in (1, 3) for s in SCHEMES for dt in ("float32", "bfloat16")}
    for r in d["rows"]:
        dt = getattr(torch, r["dtype"])
        assert r["path"] == quant.LABELS[quant.path(r["scheme"], r["M"], tier, dt)], r
        assert r["ms"] > 0 and set(r["dense_ms"]) >= {"fp32", "bf16"}
        assert r["x_fp32"] == pytest.approx(r["dense_ms"]["fp32"] / r["ms"])
        assert (r["gbps"] is not None) == (r["M"] == 1)
    assert len(d["paths"]) == len(d["rows"])
    assert all(set(p["ms"]) == set(bench._paths(tier, p["scheme"], getattr(torch, p["dtype"])))
               for p in d["paths"])
