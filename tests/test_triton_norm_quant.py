"""Triton rms_norm / rope / silu_mul / token_logprobs / quant_linear kernels: conformance through
glm5.testing.parity (emulated: the Triton interpreter on CPU tensors, TRITON_INTERPRET=1 set by
conftest.py) plus targeted checks: exact activation codes and integer group sums for K not a
multiple of 128 in every scheme, token_logprobs across many vocabulary chunks (and split over V),
rope with middle dims, the two-pass norm path, and the lazy-import structure."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

import glm5
from glm5.ir.ops_quant import quant_linear_ref
from glm5.ir.quant_formats import SCHEMES, pack, quantize_per_token_ref, quantize_weight, unpack
from glm5.testing.compare import assert_matches
from glm5.testing.parity import format_table, run_parity

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (set by conftest.py) or a CUDA device",
                allow_module_level=True)

MODULES = ("norm", "logprobs", "quant_linear")
OPS = ("rms_norm", "rope", "silu_mul", "token_logprobs", "quant_linear")
EXAMPLES = 10
DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _mods():
    return [importlib.import_module(f"glm5.kernels.triton.{m}") for m in MODULES]


def _defaults() -> dict:
    d: dict = {}
    for m in _mods():
        d.update(m.DEFAULTS)
    return d


def _fns(overrides: dict | None = None) -> dict:
    """op -> launcher, with launch parameters DEFAULTS merged with ``overrides[op]``."""
    d = _defaults()
    over = overrides or {}
    tuning = lambda op: {**d.get(op, {}), **over.get(op, {})}  # noqa: E731
    out = {}
    for m in _mods():
        for op, fn, _, _ in m.kernels(tuning):
            out[op] = fn
    return out


def _on_gpu(fn):
    """On a GPU machine: the parity cases are CPU tensors; run the kernel on copies of their
    storages on the GPU (strides and offsets kept) and return the outputs on the CPU."""
    if DEV == "cpu":
        return fn

    def call(*args):
        dev = []
        for a in args:
            if isinstance(a, torch.Tensor):
                n = a.untyped_storage().nbytes() // a.element_size()
                flat = torch.empty(0, dtype=a.dtype).set_(a.untyped_storage(), 0, (n,), (1,))
                a = flat.to(DEV).as_strided(a.shape, a.stride(), a.storage_offset())
            dev.append(a)
        out = fn(*dev)
        return tuple(o.cpu() for o in out) if isinstance(out, tuple) else out.cpu()

    return call


def _backend() -> glm5.Backend:
    b = glm5.Backend("triton_a_test", vendor="t", device_type="cuda")
    b.emulation(lambda: (True, "interp"))
    d = _defaults()
    for m in _mods():
        for op, fn, dtypes, supports in m.kernels(lambda op: d.get(op, {})):
            b.kernel(op, dtypes=dtypes, supports=supports)(_on_gpu(fn))
    return b


# --------------------------------------------------------------------------- structure
def test_rows_and_defaults():
    rows = {}
    for m in _mods():
        assert isinstance(m.DEFAULTS, dict)
        for op, fn, dtypes, supports in m.kernels(lambda op: m.DEFAULTS.get(op, {})):
            rows[op] = (fn, dtypes, supports)
    assert sorted(rows) == sorted(OPS)
    for op, (fn, dtypes, supports) in rows.items():
        assert callable(fn)
        assert set(dtypes) == {torch.float32, torch.bfloat16, torch.float16}, op


def test_public_modules_do_not_import_kernels():
    code = ("import sys\n"
            "import glm5.kernels.triton.norm, glm5.kernels.triton.logprobs, "
            "glm5.kernels.triton.quant_linear\n"
            "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.') "
            "or m.startswith('glm5.kernels.triton._')]\n"
            "print(bad)\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("op", OPS)
def test_parity(op):
    rows = run_parity(_backend(), [op], examples=EXAMPLES, seed=0, emulate=DEV == "cpu",
                      profile="smoke" if DEV == "cpu" else "default")
    assert len(rows) == 3, format_table(rows)  # float32, bfloat16, float16
    assert all(r.status == "pass" and r.examples == EXAMPLES for r in rows), format_table(rows)


# --------------------------------------------------------------------------- quant_linear
def _act_codes(bits, M, K, g):
    """x whose per-row amax is exactly qmax with integer values: s_x = 1 and codes = x."""
    qmax = {8: 127, 12: 2047}[bits]
    x = torch.randint(-qmax, qmax + 1, (M, K), generator=g).float()
    x[:, 0] = qmax
    return x


@pytest.mark.parametrize("regime", [{}, {"GEMV_M": 0}], ids=["gemv", "gemm"])
@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "w6a12"])
def test_quant_linear_integer_sums_exact_k200(scheme, regime):
    """Unit scales: y is the raw integer sum; full-range random packed bytes (sign extension).
    M = 5 runs the decode GEMV; GEMV_M = 0 sends it to the GEMM."""
    sc = SCHEMES[scheme]
    g = torch.Generator().manual_seed(1)
    M, N, K = 5, 19, 200
    x = _act_codes(sc.act_bits, M, K, g)
    if sc.weight_bits == 8:
        wp = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    else:
        wp = torch.randint(0, 256, (N, sc.packed_k(K)), generator=g).to(torch.uint8)
    wq = unpack(wp, sc, K)
    ws = torch.ones(sc.scale_shape(N, K))
    want = x.double() @ wq.double().T  # exact
    got = _fns({"quant_linear": regime})["quant_linear"](x.to(DEV), wp.to(DEV), ws.to(DEV),
                                                         scheme).cpu()
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("K", [200, 130, 7])
def test_quant_linear_matches_reference_k_not_multiple_of_128(scheme, K):
    g = torch.Generator().manual_seed(K)
    M, N = 3, 21
    w = torch.randn(N, K, generator=g) * K ** -0.5
    wp, ws = quantize_weight(w, scheme)
    x = torch.randn(M, K, generator=g) * 3
    x[1] = 0  # amax 0: scale 1, zero codes
    bias = torch.randn(N, generator=g)
    for b in (None, bias):
        got = _fns()["quant_linear"](x.to(DEV), wp.to(DEV), ws.to(DEV), scheme,
                                     None if b is None else b.to(DEV)).cpu()
        want = quant_linear_ref(x, wp, ws, scheme, b)
        assert_matches("quant_linear", got,
                       {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": b})
        if SCHEMES[scheme].act_bits is not None and K <= 256 and DEV == "cpu":
            # <= 2 groups: the same fp32 operations in the same order as the reference (a GPU
            # may contract the scale products into FMAs)
            assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quant_linear_many_groups_and_tiles(scheme):
    """Several K groups, N and M beyond one tile, bf16 input, small tiles via tuning."""
    g = torch.Generator().manual_seed(7)
    M, N, K = 37, 70, 3 * 128 + 50
    wp, ws = quantize_weight(torch.randn(N, K, generator=g), scheme)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    fn = _fns({"quant_linear": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}})["quant_linear"]
    got = fn(x.to(DEV), wp.to(DEV), ws.to(DEV), scheme).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    assert_matches("quant_linear", got,
                   {"x": x, "w_packed": wp, "w_scale": ws, "scheme": scheme, "bias": None})


@pytest.mark.parametrize("bits", [8, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_per_token_codes_exact(bits, dtype):
    from glm5.kernels.triton.quant_linear import quantize_per_token

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(6, 200, generator=g) * 5).to(dtype)
    x[2] = 0
    qmax = {8: 127, 12: 2047}[bits]
    # exact ties: amax = qmax -> s = 1, x/s = k + 0.5 rounds to even
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, float(qmax)])
    x[3, : ties.numel()] = ties.to(dtype)
    x[3, ties.numel():] = 0
    xs = x[:, ::2]  # non-contiguous, K = 100
    for inp in (x, xs):
        q, s = quantize_per_token(inp.to(DEV), bits)
        q_ref, s_ref = quantize_per_token_ref(inp, bits)
        assert q.dtype == q_ref.dtype and torch.equal(q.cpu(), q_ref)
        assert torch.equal(s.cpu(), s_ref)
    # the two-pass (long row) path
    q, s = quantize_per_token(x.to(DEV), bits, {"QUANT_BLOCK_K": 32})
    q_ref, s_ref = quantize_per_token_ref(x, bits)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)


def test_pack_roundtrip_used_by_tests():
    q = torch.randint(-31, 32, (3, 11), dtype=torch.int32)
    assert torch.equal(unpack(pack(q, SCHEMES["w6a12"]), SCHEMES["w6a12"], 11), q)


# --------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("split", [None, 3])
def test_token_logprobs_many_chunks(split):
    g = torch.Generator().manual_seed(3)
    T, D, V = 21, 40, 1000  # 8 chunks of 128; T crosses a 16-token block
    h = torch.randn(T, D, generator=g)
    w = torch.randn(V, D, generator=g) * D ** -0.5
    tgt = torch.randint(0, V, (T,), generator=g).to(torch.int64)
    tgt[0], tgt[1] = 0, V - 1
    over = {"BLOCK_T": 16, "BLOCK_V": 128, "BLOCK_D": 16}
    if split:
        over["SPLIT_V"] = split
    fn = _fns({"token_logprobs": over})["token_logprobs"]
    logp, ent = fn(h.to(DEV), w.to(DEV), tgt.to(DEV), 0.8)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and logp.shape == (T,)
    # the op's targets are int32 (the launcher also takes int64, as here)
    assert_matches("token_logprobs", (logp.cpu(), ent.cpu()),
                   {"h": h, "w_vocab": w, "targets": tgt.to(torch.int32), "temperature": 0.8})
    # int32 targets and non-contiguous h
    hn = torch.randn(T, 2 * D, generator=g)[:, ::2]
    t32 = tgt.to(torch.int32)
    logp, ent = fn(hn.to(DEV), w.to(DEV), t32.to(DEV), 1.0)
    assert_matches("token_logprobs", (logp.cpu(), ent.cpu()),
                   {"h": hn, "w_vocab": w, "targets": t32, "temperature": 1.0})


def test_token_logprobs_default_split_on_gpu_setting():
    """The GPU split policy (TARGET_PROGRAMS) run through the interpreter."""
    g = torch.Generator().manual_seed(4)
    T, D, V = 3, 16, 700
    h, w = torch.randn(T, D, generator=g), torch.randn(V, D, generator=g)
    tgt = torch.randint(0, V, (T,), generator=g)
    fn = _fns({"token_logprobs": {"TARGET_PROGRAMS_INTERPRETED": 4, "BLOCK_V": 64}})[
        "token_logprobs"]
    logp, ent = fn(h.to(DEV), w.to(DEV), tgt.to(DEV), 1.3)
    assert assert_matches("token_logprobs", (logp.cpu(), ent.cpu()),
                   {"h": h, "w_vocab": w, "targets": tgt.to(torch.int32), "temperature": 1.3}).ok


# --------------------------------------------------------------------------- norm / rope / silu
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_middle_dims(interleaved, dtype):
    g = torch.Generator().manual_seed(5)
    T, R = 5, 16
    base = torch.randn(T, 3, 2, 2 * R, generator=g).to(dtype)
    x = base[..., ::2]  # [T, 3, 2, R], non-contiguous
    th = torch.rand(T, R // 2, generator=g) * 6
    cos, sin = th.cos().to(dtype), th.sin().to(dtype)
    fn = _fns({"rope": {"BLOCK_M": 4}})["rope"]  # 6 middle rows -> 2 row blocks
    got = fn(x.to(DEV), cos.to(DEV), sin.to(DEV), interleaved).cpu()
    assert got.shape == x.shape and got.dtype == dtype
    assert_matches("rope", got, {"x": x, "cos": cos, "sin": sin, "interleaved": interleaved})
    # x[T, R] (no middle dims) and x[T, 1, R]
    for xs in (x[:, 0, 0], x[:, :1, 0]):
        got = fn(xs.to(DEV), cos.to(DEV), sin.to(DEV), interleaved).cpu()
        assert_matches("rope", got, {"x": xs, "cos": cos, "sin": sin, "interleaved": interleaved})


def test_rms_norm_two_pass_and_lead_dims():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 100, generator=g) * 4
    w = torch.randn(100, generator=g)
    fn = _fns({"rms_norm": {"BLOCK_D": 32}})["rms_norm"]  # 4 passes of 32 over D = 100
    got = fn(x.to(DEV), w.to(DEV), 1e-5).cpu()
    assert assert_matches("rms_norm", got, {"x": x, "weight": w, "eps": 1e-5}).ok
    x1 = torch.randn(100, generator=g)  # no leading dims
    got = _fns()["rms_norm"](x1.to(DEV), w.to(DEV), 1e-6).cpu()
    assert assert_matches("rms_norm", got, {"x": x1, "weight": w, "eps": 1e-6}).ok


def test_silu_mul_multiple_blocks():
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 2, 2 * 50, generator=g) * 6).to(torch.float16)
    fn = _fns({"silu_mul": {"BLOCK_I": 16}})["silu_mul"]
    got = fn(x.to(DEV)).cpu()
    assert got.shape == (3, 2, 50) and got.dtype == torch.float16
    assert_matches("silu_mul", got, {"x": x})


# --------------------------------------------------------------------------- the cuda backend
def test_cuda_backend_serves_these_rows():
    """The cuda backend registers these rows from the kernel registry (emulated here)."""
    b = glm5.get_registry().get("cuda")
    assert set(OPS) <= set(b.kernels)
    if DEV == "cpu":
        rows = run_parity(b, list(OPS), examples=2, seed=1, emulate=True, profile="smoke")
        assert all(r.status == "pass" for r in rows), format_table(rows)


# --------------------------------------------------------------------------- sm_90 compile check
# Without a GPU the interpreter is all that runs the kernels; this compiles, for an H100/H200
# (sm_90, Triton's bundled ptxas), every kernel variant the launchers pick for GPU tensors with
# their default tuning, so an interpreter-only construct or a bad launch signature fails here.
# Each launcher runs with the kernels replaced by recorders; nothing is launched.
def test_kernels_compile_for_sm90():
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's bundled ptxas is not installed")
    from triton_compile_check import run_in_subprocess

    r = run_in_subprocess([["defaults", "cuda", 90, 32, "gpu_shapes"]])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "compiled" in r.stdout
