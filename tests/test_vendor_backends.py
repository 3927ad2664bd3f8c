"""The vendor backends (ascend, cambricon, mthreads, hygon) and the shared machinery of
glm5.backends.vendor: detection with faked runtimes (GLM5_DEVICE, a missing or present torch
extension, Hygon DCU vs AMD vs NVIDIA on HIP), settings, registration without any vendor runtime,
the persistent-grid launch path of every Triton kernel against the default grid (interpreter),
the ascend vendor-then-Triton kernel choice, and emulated parity on a small op subset."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
import types

import pytest
import torch

import glm5
from glm5.backends import vendor
from glm5.ir.catalog import OPS

VENDORS = ("ascend", "cambricon", "mthreads", "hygon")
EXPECTED = {  # name: (device string, torch.distributed backend, default quant scheme, extension)
    "ascend": ("npu", "hccl", "w4a8", "torch_npu"),
    "cambricon": ("mlu", "cncl", "w8a16", "torch_mlu"),
    "mthreads": ("musa", "mccl", "w6a12", "torch_musa"),
    "hygon": ("cuda", "nccl", "w8a8", None),
    "cuda": ("cuda", "nccl", "w4a8", None),
}


def _mod(name: str):
    return importlib.import_module(f"glm5.backends.{name}")


@pytest.fixture
def no_device_env(monkeypatch):
    """No override and no vendor tool on PATH, whatever the machine has."""
    monkeypatch.delenv("GLM5_DEVICE", raising=False)
    monkeypatch.setattr(vendor, "which", lambda tool: None)
    monkeypatch.setattr(vendor, "tool_output", lambda cmd, timeout=10.0: "")


def _fake_extension(monkeypatch, module: str, device_type: str, count: int, name: str) -> None:
    """A fake vendor torch extension in sys.modules and a fake torch.<device_type> namespace."""
    ext = types.ModuleType(module)
    ext.__version__ = "0.0-test"
    monkeypatch.setitem(sys.modules, module, ext)
    dev = types.SimpleNamespace(is_available=lambda: count > 0, device_count=lambda: count,
                                get_device_name=lambda i=0: name)
    monkeypatch.setattr(torch, device_type, dev, raising=False)


def _fake_hip(monkeypatch, name: str, hip: str = "6.2.41133") -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)


# --------------------------------------------------------------------------- detection
@pytest.mark.parametrize("name", ["ascend", "cambricon", "mthreads"])
def test_missing_extension_is_unavailable_with_the_named_reason(name, no_device_env,
                                                                monkeypatch):
    ext = EXPECTED[name][3]
    monkeypatch.delitem(sys.modules, ext, raising=False)
    ok, reason = _mod(name).detect()
    assert not ok
    assert f"{ext} is not importable" in reason and "install" in reason, reason
    assert "device tool" in reason  # no tool on PATH either
    assert ext not in sys.modules  # a failed probe leaves nothing behind


def test_ascend_reason_names_glm5_extra_and_cann(no_device_env, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    ok, reason = _mod("ascend").detect()
    assert not ok and "glm5[ascend]" in reason and "CANN" in reason and "set_env.sh" in reason


def test_device_tool_on_path_sharpens_the_reason(no_device_env, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_mlu", raising=False)
    monkeypatch.setattr(vendor, "which", lambda t: "/usr/bin/cnmon" if t == "cnmon" else None)
    ok, reason = _mod("cambricon").detect()
    assert not ok and "cnmon is on PATH" in reason and "torch_mlu is not importable" in reason


def test_broken_extension_import_is_caught(no_device_env, monkeypatch):
    """torch_npu without CANN fails inside its import (libhccl.so): unavailable, not a crash."""
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find(name, *a):
        return object() if name == "torch_npu" else real_find(name, *a)

    def imp(name, *a):
        if name == "torch_npu":
            raise ImportError("libhccl.so: cannot open shared object file")
        return real_import(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find)
    monkeypatch.setattr(importlib, "import_module", imp)
    ok, reason = _mod("ascend").detect()
    assert not ok and "libhccl.so" in reason and "torch_npu is not importable" in reason


@pytest.mark.parametrize("name", ["ascend", "cambricon", "mthreads"])
def test_present_extension_with_a_device_is_available(name, no_device_env, monkeypatch):
    dev, _, _, ext = EXPECTED[name]
    _fake_extension(monkeypatch, ext, dev, 2, f"{name}-test-chip")
    ok, reason = _mod(name).detect()
    assert ok, reason
    assert f"{name}-test-chip" in reason and "2 x" in reason


def test_extension_without_a_visible_device(no_device_env, monkeypatch):
    _fake_extension(monkeypatch, "torch_musa", "musa", 0, "none")
    ok, reason = _mod("mthreads").detect()
    assert not ok and "no musa device is visible" in reason


def test_glm5_device_override(no_device_env, monkeypatch):
    _fake_extension(monkeypatch, "torch_npu", "npu", 1, "Ascend910B2")
    _fake_extension(monkeypatch, "torch_mlu", "mlu", 1, "MLU590")
    monkeypatch.setenv("GLM5_DEVICE", "npu")  # an alias of ascend
    ok, reason = _mod("ascend").detect()
    assert ok and "GLM5_DEVICE=npu" in reason
    for other in ("cambricon", "mthreads", "hygon", "cuda"):
        ok, reason = _mod(other).detect()
        assert not ok and reason == "GLM5_DEVICE=npu selects another device", (other, reason)
    monkeypatch.setenv("GLM5_DEVICE", "cambricon")
    assert _mod("cambricon").detect()[0]
    assert not _mod("ascend").detect()[0]


def test_hygon_dcu_by_device_name(no_device_env, monkeypatch):
    _fake_hip(monkeypatch, "K100_AI")
    assert vendor.rocm_vendor(torch)[0] == "hygon"
    ok, reason = _mod("hygon").detect()
    assert ok and "K100_AI" in reason
    ok, reason = _mod("cuda").detect()
    assert not ok and "ROCm build" in reason and "hygon backend" in reason


def test_amd_gpu_is_neither_hygon_nor_cuda(no_device_env, monkeypatch):
    _fake_hip(monkeypatch, "AMD Instinct MI300X")
    assert vendor.rocm_vendor(torch)[0] == "amd"
    ok, reason = _mod("hygon").detect()
    assert not ok and "not a Hygon DCU" in reason and "GLM5_DEVICE=hygon" in reason
    ok, reason = _mod("cuda").detect()
    assert not ok and "AMD" in reason
    monkeypatch.setenv("GLM5_DEVICE", "hygon")  # the override claims the HIP device
    assert _mod("hygon").detect()[0]


def test_hygon_by_hy_smi_or_rocminfo(no_device_env, monkeypatch):
    _fake_hip(monkeypatch, "")
    monkeypatch.setattr(vendor, "which", lambda t: "/opt/hyhal/bin/hy-smi" if t == "hy-smi"
                        else None)
    assert vendor.rocm_vendor(torch) == ("hygon", "HIP 6.2.41133 build, hy-smi on PATH")
    monkeypatch.setattr(vendor, "which", lambda t: None)
    monkeypatch.setattr(vendor, "tool_output",
                        lambda cmd, timeout=10.0: "  Marketing Name:  DCU K100\n"
                        if cmd[0] == "rocminfo" else "")
    assert vendor.rocm_vendor(torch)[0] == "hygon"


def test_nvidia_is_not_hygon(no_device_env, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert vendor.rocm_vendor(torch)[0] == "nvidia"
    ok, reason = _mod("hygon").detect()
    assert not ok and "CUDA build" in reason


# --------------------------------------------------------------------------- registration
def test_all_vendor_backends_registered_without_runtimes():
    reg = glm5.get_registry()
    triton_ops = {r[0] for r in vendor.triton_rows(reg.get("hygon"))}
    for name in VENDORS:
        b = reg.get(name)
        assert reg.plugins[name].status == "loaded", reg.plugins[name]
        dev, coll, quant, _ = EXPECTED[name]
        assert (b.device_type, b.settings["collective"], b.settings["quant_scheme"]) == \
            (dev, coll, quant)
        assert b.settings["tuning_table"].endswith(f"{name}/tuning.json")
        assert triton_ops <= set(b.kernels), name
        ok, reason = b.is_available()
        if not ok:
            assert reason
    assert "moe_route" in reg.get("ascend").kernels or "glm5.backends.ascend.npu_ops" not in \
        sys.modules
    for ext in ("torch_npu", "torch_mlu", "torch_musa"):
        assert ext not in sys.modules  # registering never imports a vendor extension


def test_cuda_settings_unchanged():
    b = glm5.get_registry().get("cuda")
    assert (b.device_type, b.settings["collective"], b.settings["quant_scheme"]) == \
        ("cuda", "nccl", "w4a8")


# --------------------------------------------------------------------------- grid policy
def test_grid_policy_validation():
    from glm5.kernels.triton import _grid

    calls = []

    class K:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    with pytest.raises(ValueError, match="rms_norm.*'grid' expected one of"):
        _grid.launch(K(), (4,), {"grid": "diagonal"}, "rms_norm")
    with pytest.raises(ValueError, match="rope.*needs 'programs'"):
        _grid.launch(K(), (4,), {"grid": "persistent"}, "rope")
    with pytest.raises(ValueError, match="positive int"):
        _grid.launch(K(), (4,), {"grid": "persistent", "programs": 0}, "rope")
    _grid.launch(K(), (2, 3, 5), {"grid": "persistent", "programs": lambda: 7}, "attention", "x")
    _grid.launch(K(), (2, 3, 5), {}, "attention", "x")
    _grid.launch(K(), (4, 0), {}, "attention", "x")  # nothing to launch
    assert calls == [((7,), ("x", 30, 7, 3, 5), {"PERSISTENT": True}),
                     ((2, 3, 5), ("x", 30, 30, 3, 5), {"PERSISTENT": False})]


def test_symbolic_programs_resolve_from_the_table_or_the_device():
    path = _mod("ascend").SPEC.tuning
    tun = vendor.tuning_for(path)
    assert tun("rms_norm")["programs"]() == 48 and tun("quant_linear")["programs"]() == 24
    assert "programs" not in vendor.tuning_for(_mod("hygon").SPEC.tuning)("rms_norm")
    live = vendor.tuning_for(path, lambda key: {"ai_cores": 20}.get(key))
    assert live("attention")["programs"]() == 20 and live("rope")["programs"]() == 48
    assert tun("attention")["BLOCK_DV"] == 128 and tun("attention")["grid"] == "persistent"


# Small tiles so that the tiny test shapes still make more tiles than programs (3).
SMALL = {"BLOCK_T": 16, "BLOCK_S": 16, "BLOCK_D": 16, "BLOCK_K": 16, "BLOCK_DV": 16,
         "BLOCK_H_MAX": 16, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_I": 16}


def _generated(op: str, seed: int, dtype: torch.dtype = torch.float32,
               tier: str = "tile") -> tuple:
    """A kit example of ``tier``: "tile" is past the first tile of every kernel (a persistent
    grid of 3 programs loops over tiles); the attention ops take "edge" (T queries, one tile
    each: they loop too, and their tile-tier key loops are slow interpreted)."""
    from glm5.testing.cases import GENERATORS, RandomDraw

    values, _ = OPS[op].validate((), GENERATORS[op](RandomDraw(seed, tier=tier), dtype))
    return tuple(values[n] for n in OPS[op].param_names)


def _indexer_args(dtype: torch.dtype, topk: int | None = None, T: int = 70,
                  width: int = 30) -> tuple:
    """T queries over S = 50 keys with sliding ranges of ``width`` keys (tiles of 16)."""
    g = torch.Generator().manual_seed(9)
    S, Hi, Di = 50, 2, 16
    q = torch.randn(T, Hi, Di, generator=g).to(dtype)
    k = torch.randn(S, Di, generator=g).to(dtype)
    w = torch.randn(T, Hi, generator=g).to(dtype)
    ke = torch.clamp(torch.arange(T, dtype=torch.int32) + 11, max=S)
    ks = torch.clamp(ke - width, min=0).to(torch.int32)
    return (q, k, w, ks, ke) if topk is None else (q, k, w, ks, ke, topk)


def _paged_args(dtype: torch.dtype, topk: int) -> tuple:
    """paged_indexer_topk: 70 queries of 4 sequences (interleaved, k_len up to 50) over a
    shuffled pool of 4-row pages (tiles of 16: blocks mixing sequences)."""
    g = torch.Generator().manual_seed(11)
    ps, lens = 4, [50, 23, 8, 41]
    used = [-(-n // ps) for n in lens]
    perm = torch.randperm(sum(used) + 2, generator=g).tolist()
    table = torch.full((4, max(used) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(used):
        table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    T, Hi, Di = 70, 2, 16
    seq = torch.randint(0, 4, (T,), generator=g)
    k_len = (torch.rand(T, generator=g) * (torch.tensor(lens)[seq] + 1)).long()
    return (torch.randn(T, Hi, Di, generator=g).to(dtype),
            torch.randn((sum(used) + 2) * ps, Di, generator=g).to(dtype),
            torch.randn(T, Hi, generator=g).to(dtype), table, seq.to(torch.int32),
            k_len.to(torch.int32), ps, topk)


def _logprobs_args() -> tuple:
    g = torch.Generator().manual_seed(10)
    T, D, V = 40, 16, 70
    return (torch.randn(T, D, generator=g), torch.randn(V, D, generator=g),
            torch.randint(0, V, (T,), generator=g, dtype=torch.int32), 0.7)


def _persistent_cases():
    """(name, op, args builder, extra tuning, extra tuning of the default-grid run only): every
    Triton kernel and its launch variants."""
    gen = [("rms_norm", 11, "tile"), ("rope", 1, "tile"), ("silu_mul", 4, "tile"),
           ("sparse_attention", 3, "edge"), ("attention", 3, "edge"), ("mla_prolog", 0, "tile"),
           ("moe_experts", 0, "tile")]
    cases = [(op, op, (lambda op=op, s=s, t=t: _generated(op, s, tier=t)), {}, {})
             for op, s, t in gen]
    cases += [
        ("rms_norm_two_pass", "rms_norm", lambda: _generated("rms_norm", 11, torch.float16),
         {"BLOCK_D": 16}, {}),
        ("lightning_indexer", "lightning_indexer", lambda: _indexer_args(torch.float32), {},
         {}),
        ("indexer_topk_rank", "indexer_topk", lambda: _indexer_args(torch.float32, 5),
         {"MERGE": "rank"}, {}),
        # tl.sort is slow interpreted: the persistent sort merge against the default-grid rank
        # merge (both exact: the same indices), on few short ranges
        ("indexer_topk_sort", "indexer_topk", lambda: _indexer_args(torch.bfloat16, 5, 49, 6),
         {"MERGE": "sort"}, {"MERGE": "rank"}),
        ("token_logprobs_split", "token_logprobs", _logprobs_args, {"SPLIT_V": 2}, {}),
        ("paged_indexer_topk_rank", "paged_indexer_topk",
         lambda: _paged_args(torch.float32, 5), {"MERGE": "rank"}, {}),
    ]
    return cases


def _quant_case_args(scheme: str):
    from glm5.ir.quant_formats import quantize_weight

    g = torch.Generator().manual_seed(7)
    w = torch.randn(40, 256, generator=g)
    wp, ws = quantize_weight(w, scheme)
    return (torch.randn(20, 256, generator=g), wp, ws, scheme, torch.randn(40, generator=g))


@pytest.fixture
def launches(monkeypatch):
    """Every grid-policy launch: (op, n_tiles, programs launched, persistent)."""
    pytest.importorskip("triton")
    from glm5.kernels.triton import _grid

    seen: list[tuple[str, int, int, bool]] = []
    real = _grid.launch

    def spy(kernel, grid, p, op, *args, **kw):
        n = 1
        for g in grid:
            n *= int(g)
        pers = _grid.policy(p, op) == "persistent"
        seen.append((op, n, min(n, _grid.programs(p, op)) if pers else n, pers))
        return real(kernel, grid, p, op, *args, **kw)

    monkeypatch.setattr(_grid, "launch", spy)
    return seen


def _run_both(op: str, args: tuple, extra: dict, tiles_extra: dict | None = None) -> None:
    from glm5.kernels.triton import registry as kreg

    base = kreg.load_table(None)
    tiles = {r[0]: r[1] for r in kreg.kernels(
        lambda o: {**base(o), **extra, **(tiles_extra or {})})}
    pers = {r[0]: r[1] for r in kreg.kernels(
        lambda o: {**base(o), **extra, "grid": "persistent", "programs": 3})}
    a1, a2 = copy.deepcopy(args), copy.deepcopy(args)
    r1, r2 = tiles[op](*a1), pers[op](*a2)
    r1 = r1 if isinstance(r1, tuple) else (r1,)
    r2 = r2 if isinstance(r2, tuple) else (r2,)
    for x, y in zip(r1, r2):
        assert torch.equal(x, y), op
    for x, y in zip(a1, a2):  # in-place outputs (mla_prolog's kv_cache) too
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), op


@pytest.mark.parametrize("name,op,build,extra,tiles_extra", _persistent_cases(),
                         ids=[c[0] for c in _persistent_cases()])
def test_persistent_grid_matches_default_grid(name, op, build, extra, tiles_extra, launches):
    _run_both(op, build(), {**SMALL, **extra}, tiles_extra)
    pers = [x for x in launches if x[0] == op and x[3]]
    assert pers and all(x[2] <= 3 for x in pers)
    assert any(n > progs for _, n, progs, _ in pers), f"{op}: no launch looped over tiles"


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w4a8", "w6a12"])
def test_persistent_grid_quant_linear(scheme, launches):
    _run_both("quant_linear", _quant_case_args(scheme), {"BLOCK_M": 16, "BLOCK_N": 16,
                                                          "GEMV_M": 0})
    kernels = [x for x in launches if x[0] == "quant_linear" and x[3]]
    assert any(n > progs for _, n, progs, _ in kernels)


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8", "w4a8", "w6a12"])
def test_persistent_grid_quant_linear_gemv(scheme, launches):
    """The decode GEMV (3 rows) split over K, and its reduction, walked by 3 programs."""
    x, wp, ws, _, bias = _quant_case_args(scheme)
    _run_both("quant_linear", (x[:3], wp, ws, scheme, bias),
              {"GEMV_BLOCK_N": 8, "GEMV_BLOCK_K": 128, "GEMV_TARGET_PROGRAMS": 10,
               "GEMV_REDUCE_BLOCK_N": 16})
    kernels = [x for x in launches if x[0] == "quant_linear" and x[3]]
    # 5 N-blocks x 2 K-splits; the reduction: 3 rows x 3 column blocks
    assert {n for _, n, _, _ in kernels} >= {10, 9}
    assert any(n > progs for _, n, progs, _ in kernels)


# --------------------------------------------------------------------------- GPU compile
# The interpreter proves the arithmetic, not that a construct compiles. This compiles (no
# launch: the kernels are replaced by recorders) every kernel variant the launchers pick under
# the hygon table for a wavefront-64 HIP target (gfx90a stands in: community Triton does not
# know Hygon's gfx9 variants) and under the ascend table (persistent grid everywhere) for sm_90.
# triton-ascend, Cambricon's and MUSA's compilers are not available here.
def test_vendor_launch_rules_compile_for_gpu_targets():
    import os

    triton = pytest.importorskip("triton")
    root = os.path.dirname(triton.__file__)
    if not (os.path.isdir(os.path.join(root, "backends", "amd")) and
            os.path.exists(os.path.join(root, "backends", "nvidia", "bin", "ptxas"))):
        pytest.skip("Triton's AMD backend or bundled ptxas is not installed")
    from triton_compile_check import run_in_subprocess

    r = run_in_subprocess([["hygon", "hip", "gfx90a", 64, "generators"],
                           ["ascend", "cuda", 90, 32, "generators"]])
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "compiled" in r.stdout


# --------------------------------------------------------------------------- ascend
def _row(op, tag, dtypes, ok=None):
    return (op, lambda *a: tag, dtypes, ok)


def test_ascend_combined_kernel_prefers_the_vendor_binding():
    asc = _mod("ascend")
    op = "quant_linear"
    vend = _row(op, "npu", (torch.bfloat16,), lambda x, *rest: x.shape[0] <= 4)
    trit = _row(op, "triton", (torch.float32, torch.bfloat16), None)
    _, fn, dtypes, supports = asc.combine(op, vend, trit)
    assert dtypes == frozenset({torch.float32, torch.bfloat16})
    small_bf16 = (torch.zeros(2, 8, dtype=torch.bfloat16), None, None, "w8a8", None)
    big_bf16 = (torch.zeros(9, 8, dtype=torch.bfloat16), None, None, "w8a8", None)
    f32 = (torch.zeros(2, 8), None, None, "w8a8", None)
    assert fn(*small_bf16) == "npu" and fn(*big_bf16) == "triton" and fn(*f32) == "triton"
    f16 = (torch.zeros(2, 8, dtype=torch.float16), None, None, "w8a8", None)
    assert not supports(*f16)
    with pytest.raises(ValueError, match="ascend quant_linear: neither"):
        fn(*f16)


def test_ascend_vendor_rows_guard_only_the_missing_module(monkeypatch):
    asc = _mod("ascend")
    real = importlib.import_module

    def missing(name, *a):
        if name == asc.NPU_OPS:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert asc.vendor_rows() == []

    def broken(name, *a):
        if name == asc.NPU_OPS:
            raise ModuleNotFoundError("No module named 'scipy'", name="scipy")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="scipy"):
        asc.vendor_rows()


def test_ascend_rows_put_vendor_ops_first():
    asc = _mod("ascend")
    vendor_ops = [r[0] for r in asc.vendor_rows()]
    rows = asc.rows()
    names = [r[0] for r in rows]
    assert len(names) == len(set(names))
    assert names[:len(vendor_ops)] == vendor_ops
    triton_ops = {r[0] for r in vendor.triton_rows(asc.BACKEND)}
    for op, fn, _, _ in rows[:len(vendor_ops)]:
        assert (fn.__name__ == f"{op}_npu_or_triton") == (op in triton_ops)


def test_ascend_npu_namespace(monkeypatch):
    asc = _mod("ascend")
    monkeypatch.setattr(asc.BACKEND, "_available", (False, "torch_npu is not importable"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if importlib.util.find_spec(asc.CONTRACT) is not None:
        assert asc.npu() is importlib.import_module(asc.CONTRACT)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="no NPU .*torch_npu is not importable"):
        asc.npu()
    assert asc.device_count("ai_cores") is None  # no device: the table's count applies


# --------------------------------------------------------------------------- emulated parity
@pytest.mark.parametrize("name,ops", [
    ("ascend", ["rms_norm", "quant_linear", "moe_route"]),
    ("cambricon", ["silu_mul", "quant_linear"]),
    ("mthreads", ["rope", "token_logprobs"]),
    ("hygon", ["rms_norm", "moe_experts"]),
])
def test_emulated_parity_subset(name, ops, monkeypatch):
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the kernels are not interpreted in this process")
    from glm5.testing.parity import format_table, run_parity

    b = glm5.get_registry().get(name)
    ok, why = b.can_emulate()
    assert ok, why
    vendor_calls: list[str] = []
    if name == "ascend" and importlib.util.find_spec(_mod("ascend").CONTRACT) is not None:
        contract = importlib.import_module(_mod("ascend").CONTRACT)
        for fn_name in contract.__all__:  # count the vendor ops the bindings reach
            real = getattr(contract, fn_name)
            monkeypatch.setattr(contract, fn_name,
                                lambda *a, _f=real, _n=fn_name, **k: (vendor_calls.append(_n),
                                                                        _f(*a, **k))[1])
    rows = run_parity(b, [o for o in ops if o in b.kernels], examples=2, seed=2, emulate=True,
                      profile="smoke")
    assert rows and all(r.emulated for r in rows)
    assert all(r.status == "pass" for r in rows), format_table(rows)
    if name == "ascend" and "moe_route" in b.kernels:
        assert vendor_calls, "no torch_npu binding ran: only the Triton kernels were checked"


def test_emulated_ascend_parity_reaches_every_torch_npu_binding():
    """The kit's model tier reaches the bindings whose supports() want real model shapes
    (GLM-5's MQA attention and indexer; DeepSeek-V3's MLA prolog sizes): the rows are served by
    the bindings, not quietly by the Triton fallback."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("a GPU is present: the kernels are not interpreted in this process")
    from glm5.testing.cases import PROFILES, example
    from glm5.testing.compare import check_example

    b = glm5.get_registry().get("ascend")
    model = PROFILES["quick"].index("model")
    want = {"indexer_topk": "torch_npu.npu_lightning_indexer",
            "sparse_attention": "torch_npu.npu_sparse_flash_attention",
            "mla_prolog": "torch_npu.npu_mla_prolog_v3"}
    for op, label in want.items():
        values, _ = OPS[op].validate((), example(op, torch.bfloat16, 0, model, "quick"))
        v = check_example(OPS[op], b.kernels[op], values, torch.bfloat16)
        assert v.ok, f"{op}: {v.message}"
        assert label in v.served_by, f"{op} served by {v.served_by}, not {label}"
