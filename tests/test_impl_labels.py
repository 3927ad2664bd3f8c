"""Implementation labels: every kernel entry names the code that serves it (`KernelEntry.impl`),
kernels that choose per call report the choice (`report_impl` / `call_impl`), and
`run_recorded` / `recording_impls` collect what served a call (the parity runner's source for
"what ran")."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import glm5
from glm5.backends import api
from glm5.backends.api import (
    FALLBACK_REFERENCE,
    Backend,
    BackendError,
    KernelEntry,
    call_impl,
    default_impl,
    implemented_by,
    recording_impls,
    report_impl,
    run_recorded,
)
from glm5.ir.catalog import OPS
from glm5.testing.compare import assert_matches

I32 = torch.int32


def _fn_in(module: str):
    def kernel(x, weight, eps):
        return x

    kernel.__module__ = module
    return kernel


# --------------------------------------------------------------------------- static labels
def test_default_labels_come_from_the_function():
    b = Backend("lbl", vendor="T", device_type="cpu")
    assert default_impl(_fn_in("glm5.kernels.triton.norm"), "lbl") == "triton"
    assert default_impl(_fn_in("glm5.kernels.tvm.norm"), "lbl") == "tvm"
    assert default_impl(_fn_in("glm5.ir.ops_norm"), "lbl") == "reference"
    assert default_impl(_fn_in("acme_glm5.kernels"), "lbl") == "lbl"  # else the backend's name
    assert default_impl(_fn_in("glm5.kernels.tritonic"), "lbl") == "lbl"  # a package, not a prefix
    tagged = implemented_by("torch_npu.npu_rms_norm")(_fn_in("glm5.kernels.triton.norm"))
    assert default_impl(tagged, "lbl") == "torch_npu.npu_rms_norm"  # the attribute wins

    b.kernel("rms_norm")(_fn_in("acme_glm5.kernels"))
    b.kernel("silu_mul", impl="torch")(lambda x: x)
    b.kernel("rope")(tagged)
    assert b.kernels["rms_norm"].impl == "lbl"
    assert b.kernels["silu_mul"].impl == "torch"
    assert b.kernels["rope"].impl == "torch_npu.npu_rms_norm"


def test_kernel_entry_built_directly_gets_a_default_label():
    b = Backend("lbl2", vendor="T", device_type="cpu")
    e = KernelEntry("rms_norm", _fn_in("glm5.kernels.tvm.norm"), b)  # API 1.0 positional form
    assert e.impl == "tvm"


@pytest.mark.parametrize("bad", ["", "  ", 3, None])
def test_impl_must_be_a_non_empty_label(bad):
    b = Backend("lbl3", vendor="T", device_type="cpu")
    if bad is None:
        b.kernel("rms_norm", impl=None)(_fn_in("x"))  # None = derive it
        return
    with pytest.raises(BackendError, match="impl expected a short non-empty label"):
        b.kernel("rms_norm", impl=bad)
    with pytest.raises(BackendError, match="impl expected"):
        implemented_by(bad)


def test_builtin_backends_label_their_kernels():
    reg = glm5.get_registry()
    assert {e.impl for e in reg.get("reference").kernels.values()} == {"reference"}
    for name in ("cuda", "hygon", "cambricon", "mthreads"):
        assert {e.impl for e in reg.get(name).kernels.values()} == {"triton"}, name
    cpu = reg.get("cpu").kernels
    assert cpu["rms_norm"].impl == "tvm" and cpu["sparse_attention"].impl == "tvm"
    assert cpu["moe_experts"].impl == "tvm|torch:per-expert"
    assert cpu["quant_linear"].impl == "tvm|tvm:vnni|tvm:vgemm|tvm:amx|tvm+onednn|torch:gemm"
    assert cpu["moe_experts_quant"].impl == "tvm|tvm:per-expert"
    asc = reg.get("ascend").kernels
    assert asc["sparse_attention"].impl == "torch_npu.npu_sparse_flash_attention|triton"
    assert asc["indexer_topk"].impl == "torch_npu.npu_lightning_indexer|triton"
    assert asc["mla_prolog"].impl == "torch_npu.npu_mla_prolog_v3|triton"
    assert asc["moe_route"].impl == "torch_npu.npu_moe_gating_top_k"
    assert asc["rms_norm"].impl == "triton"


# --------------------------------------------------------------------------- run-time reports
def test_no_recorder_no_cost_no_error():
    assert api._recording == 0
    assert report_impl("triton") is None
    assert call_impl("x", lambda a, b=0: a + b, 1, b=2) == 3
    assert api._recorder.get() is None


def test_run_recorded_collects_reports_and_defaults_to_the_entry_label():
    b = Backend("lbl4", vendor="T", device_type="cpu")

    @b.kernel("silu_mul", impl="quiet")
    def quiet(x):
        return x * 2

    @b.kernel("rms_norm", impl="tvm|torch")
    def chooser(x, weight, eps):
        report_impl("torch" if x.shape[0] > 4 else "tvm")
        report_impl("tvm" if x.shape[0] > 4 else "torch")
        report_impl("torch" if x.shape[0] > 4 else "tvm")  # repeats are dropped
        return x

    x = torch.ones(3)
    out, labels = run_recorded(b.kernels["silu_mul"], (x,))
    assert torch.equal(out, x * 2) and labels == ["quiet"]
    _, labels = run_recorded(b.kernels["rms_norm"], (torch.ones(8, 2), None, 1e-6))
    assert labels == ["torch", "tvm"]
    assert api._recording == 0


def test_recorders_nest_and_close_on_errors():
    with recording_impls() as outer:
        report_impl("a")
        with recording_impls() as inner:
            report_impl("b")
        assert inner == ["b"]
        assert call_impl("c", lambda: None) is None  # nothing reported inside: "c" is recorded
        assert call_impl("d", lambda: report_impl("e")) is None  # the inner report wins
    assert outer == ["a", "b", "c", "e"]

    b = Backend("lbl5", vendor="T", device_type="cpu")

    @b.kernel("silu_mul")
    def broken(x):
        report_impl("half-way")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_recorded(b.kernels["silu_mul"], (torch.ones(2),))
    assert api._recording == 0 and api._recorder.get() is None
    with recording_impls() as labels:  # a caller wanting the labels of a failing call
        with pytest.raises(RuntimeError):
            call_impl("lbl5", broken, torch.ones(2))
    assert labels == ["half-way"]


def test_recorders_are_context_local():
    seen = []

    def other_thread():
        report_impl("from-thread")  # a recorder is open, but not in this thread's context
        with recording_impls() as mine:
            report_impl("mine")
        seen.append(list(mine))

    with recording_impls() as labels:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        report_impl("main")
    assert labels == ["main"] and seen == [["mine"]]


# --------------------------------------------------------------------------- ascend (emulated)
def _sfa_args(H: int, T: int = 2, S: int = 8):
    g = torch.Generator().manual_seed(H)
    k = torch.randn(S, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(S, generator=g)[:4] for _ in range(T)]).to(I32)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    return q, k, k[..., :512], idx, 576 ** -0.5


@pytest.fixture
def emulated_ascend(monkeypatch):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need TRITON_INTERPRET=1 (set by conftest without a GPU)")
    pytest.importorskip("triton")
    asc = glm5.get_registry().get("ascend")
    monkeypatch.setattr(asc, "_available", (False, "no NPU here"))  # contract emulators
    return asc


def test_ascend_combine_reports_binding_or_triton(emulated_ascend):
    entry = emulated_ascend.kernels["sparse_attention"]
    op = OPS["sparse_attention"]
    for H, want in ((4, "torch_npu.npu_sparse_flash_attention"), (3, "triton")):
        args = _sfa_args(H)
        (out, lse), labels = run_recorded(entry, args)
        assert labels == [want], H
        assert_matches(op, (out, lse), dict(zip(op.param_names, args)), what=want)


def test_ascend_combine_with_stand_in_rows_reports_their_labels():
    from glm5.backends import ascend

    vend = ("silu_mul", implemented_by("torch_npu.npu_swiglu")(lambda x: "npu"),
            (torch.bfloat16,), None)
    trit = ("silu_mul", _tagged("triton", lambda x: "tri"), None, None)
    _, fn, _, _ = ascend.combine("silu_mul", vend, trit)
    with recording_impls() as labels:
        assert fn(torch.zeros(2, dtype=torch.bfloat16)) == "npu"
        assert fn(torch.zeros(2)) == "tri"
    assert labels == ["torch_npu.npu_swiglu", "triton"]
    assert getattr(fn, api.IMPL_ATTR) == "torch_npu.npu_swiglu|triton"


def _tagged(label, fn):
    return implemented_by(label)(fn)


def test_ascend_quant_linear_binding_reports_the_vendor_op_it_calls():
    from glm5.backends.ascend import contract, npu_ops
    from glm5.ir.quant_formats import quantize_weight

    fn = {r[0]: r[1] for r in npu_ops.vendor_kernels(lambda: contract)}["quant_linear"]
    x = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.randn(16, 64)
    for scheme, want in (("w8a16", npu_ops.WQBMM_IMPL), ("w8a8", npu_ops.QMM_IMPL)):
        packed, scale = quantize_weight(w, scheme)
        with recording_impls() as labels:
            fn(x, packed, scale, scheme)
        assert labels == [want], scheme


def test_ascend_moe_experts_binding_reports_an_all_padding_call():
    from glm5.backends.ascend import contract, npu_ops

    fn = {r[0]: r[1] for r in npu_ops.vendor_kernels(lambda: contract)}["moe_experts"]
    x = torch.randn(2, 8).to(torch.bfloat16)
    w13 = torch.randn(3, 8, 8).to(torch.bfloat16)
    w2 = torch.randn(3, 8, 4).to(torch.bfloat16)
    weights = torch.ones(2, 2)
    label = default_impl(fn, "ascend")
    assert label == npu_ops.GMM_IMPL
    with recording_impls() as labels:
        call_impl(label, fn, x, torch.full((2, 2), -1, dtype=I32), weights, w13, w2)
        call_impl(label, fn, x, torch.tensor([[0, 2], [1, -1]], dtype=I32), weights, w13, w2)
    assert labels == [npu_ops.GMM_EMPTY_IMPL, npu_ops.GMM_IMPL]


def test_ascend_weight_bindings_take_strided_weights():
    """npu_grouped_matmul / npu_quant_matmul take a weight contiguous or as the transpose of a
    contiguous one: the bindings copy a strided view once instead of failing the call."""
    from glm5.backends.ascend import contract, npu_ops
    from glm5.ir.quant_formats import quantize_weight

    rows = {r[0]: r[1] for r in npu_ops.vendor_kernels(lambda: contract)}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g)
    w13 = torch.randn(2, 8, 16, generator=g)[..., ::2]  # [E, 2I=8, D=8], strided
    w2 = torch.randn(2, 8, 8, generator=g)[:, :, ::2]  # [E, D=8, I=4], strided
    ids = torch.tensor([[0, 1], [1, -1], [0, 0]], dtype=I32)
    weights = torch.rand(3, 2, generator=g)
    got = rows["moe_experts"](x, ids, weights, w13, w2)
    assert_matches("moe_experts", got, {"x": x, "ids": ids, "weights": weights, "w13": w13,
                                        "w2": w2})
    packed, scale = quantize_weight(torch.randn(16, 64, generator=g), "w8a8")
    strided = torch.cat((packed, packed), 1)[:, ::2]
    assert not strided.is_contiguous()
    xb = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    # the strided weight is copied once: the same kernel on the same values, bit for bit
    assert torch.equal(rows["quant_linear"](xb, strided, scale, "w8a8"),
                       rows["quant_linear"](xb, strided.contiguous(), scale, "w8a8"))


# --------------------------------------------------------------------------- cpu (TVM vs torch)
def _spy(monkeypatch, mod, name, result=None):
    calls = []
    real = getattr(mod, name)

    def spy(*a, **k):
        calls.append(name)
        return real(*a, **k) if result is None else result(*a, **k)

    monkeypatch.setattr(mod, name, spy)
    return calls


def test_cpu_moe_experts_reports_the_path_it_takes(monkeypatch):
    from glm5.kernels.tvm import moe

    entry = glm5.get_registry().get("cpu").kernels["moe_experts"]
    torch_calls = _spy(monkeypatch, moe, "_experts_torch")
    tvm_calls = []  # the TVM pipeline, stubbed: nothing is built
    monkeypatch.setattr(moe, "_fns", lambda context, dtype: (None, None))
    monkeypatch.setattr(moe, "_experts_chunk", lambda *a: tvm_calls.append("chunk"))
    E, D, I, k = 4, 8, 4, 2
    w13, w2 = torch.randn(E, 2 * I, D), torch.randn(E, D, I)
    for T in (1, 3, 6):
        for rows_tvm in (0, 5, 2**20):
            monkeypatch.setattr(moe, "ROWS_TVM", rows_tvm)
            torch_calls.clear()
            tvm_calls.clear()
            ids = torch.randint(0, E, (T, k), dtype=I32)
            _, labels = run_recorded(entry, (torch.randn(T, D), ids, torch.rand(T, k), w13, w2))
            ran = "torch:per-expert" if torch_calls else "tvm"
            assert bool(torch_calls) != bool(tvm_calls)
            assert labels == [ran], (T, rows_tvm)


def test_cpu_quant_linear_reports_the_path_it_takes(monkeypatch):
    from glm5.ir.quant_formats import quantize_weight
    from glm5.kernels.tvm import quant

    entry = glm5.get_registry().get("cpu").kernels["quant_linear"]
    torch_calls = _spy(monkeypatch, quant, "gemm_torch")
    gemv_calls = _spy(monkeypatch, quant, "gemv",
                      result=lambda ctx, x, wp, ws, scheme: torch.zeros(x.shape[0], wp.shape[0]))
    packed, scale = quantize_weight(torch.randn(16, 64), "w8a16")
    tier = quant.cpu_tier()
    for M in (1, 4, 9):
        for rows in (0, 4, 2**20):  # the table of this CPU's tier, with a crossover at `rows`
            monkeypatch.setitem(quant.PATHS[tier], "w8a16", ((rows, "tvm"), (None, "torch:gemm")))
            torch_calls.clear()
            gemv_calls.clear()
            _, labels = run_recorded(entry, (torch.randn(M, 64), packed, scale, "w8a16", None))
            assert bool(torch_calls) != bool(gemv_calls)
            assert labels == ["torch:gemm" if torch_calls else "tvm"], (M, rows)
            assert bool(gemv_calls) == (M <= rows)


def test_cpu_moe_experts_quant_reports_the_path_it_takes(monkeypatch):
    """Each expert on quant_linear's path on a VNNI / AMX tier ("tvm:per-expert"), one grouped
    TVM GEMV on the portable tier ("tvm"), nothing for an empty call; the kernels are stubbed
    (a tier this CPU lacks must not run its instructions)."""
    from glm5.ir.quant_formats import quantize_weight
    from glm5.kernels.tvm import quant

    entry = glm5.get_registry().get("cpu").kernels["moe_experts_quant"]
    E, D, I, k = 3, 64, 32, 2
    wp13, ws13 = zip(*(quantize_weight(torch.randn(2 * I, D), "w4a8") for _ in range(E)))
    wp2, ws2 = zip(*(quantize_weight(torch.randn(D, I), "w4a8") for _ in range(E)))
    w = (torch.stack(wp13), torch.stack(ws13), torch.stack(wp2), torch.stack(ws2))
    by_expert = _spy(monkeypatch, quant, "_moe_by_expert",
                     result=lambda context, x, tok, *a: torch.zeros(tok.shape[0], x.shape[1]))
    grouped = _spy(monkeypatch, quant, "_grouped",
                   result=lambda context, xv, sx, w3, s3, blocks, scheme, mb: torch.zeros(
                       xv.shape[0], w3.shape[1]))
    for tier in ("portable", "vnni", "amx"):
        monkeypatch.setattr(quant, "_tier", [tier])
        for T in (0, 1, 5):
            by_expert.clear()
            grouped.clear()
            ids = torch.randint(0, E, (T, k), dtype=I32)
            _, labels = run_recorded(entry, (torch.randn(T, D), ids, torch.rand(T, k), *w,
                                             "w4a8"))
            if T == 0:
                assert labels == [entry.impl] and not by_expert and not grouped
            elif tier == "portable":
                assert labels == ["tvm"] and grouped and not by_expert, (tier, T)
            else:
                assert labels == ["tvm:per-expert"] and by_expert and not grouped, (tier, T)


def test_plugin_api_exports():
    import glm5.backends as gb

    for name in ("report_impl", "recording_impls", "run_recorded", "call_impl", "implemented_by",
                 "REFERENCE", "strict_mode"):
        assert getattr(gb, name) is getattr(api, name)
    assert FALLBACK_REFERENCE == "fallback:reference"
    assert isinstance(api, types.ModuleType)
