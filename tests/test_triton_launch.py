"""glm5.kernels.triton.launch, the one home of the Triton wrappers' host-side helpers: golden
values of next_pow2 / cdiv, launch options, the device rule of check_device, and every Triton
launcher driven end to end (interpreter off, kernels replaced by the recorders of
tests/triton_compile_check.py) with stand-ins for tensors on each vendor's device type.

torch cannot build an npu / mlu / musa tensor (or even ``torch.device("npu")``) without the
vendor's extension, and no kernel could read one here. The stand-ins: CPU tensors of a
``torch.Tensor`` subclass whose ``.device`` reports the vendor device, and a function mode that
gives what the wrappers allocate with ``device=x.device`` the same device. The device object
is a ``str`` equal to "cpu" (so torch's argument parser allocates on the CPU, where the data
really is) carrying ``.type`` / ``.index`` of the vendor device (what check_device reads).
"""

from __future__ import annotations

import importlib
import re
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from glm5.kernels.triton import launch as L

# Every device backend running the Triton library: (backend package, its torch device type).
# The device types are read from the packages; the table only says which packages to ask.
VENDOR_BACKENDS = ("cuda", "hygon", "ascend", "cambricon", "mthreads")
EXPECTED_TYPES = {"cuda": "cuda", "hygon": "cuda", "ascend": "npu", "cambricon": "mlu",
                  "mthreads": "musa"}


def _spec(backend: str):
    return importlib.import_module(f"glm5.backends.{backend}").SPEC


def _on(device_type: str, index: int | None = 0):
    """A bare object with a ``.device`` of that type (for check_device alone)."""
    return types.SimpleNamespace(device=types.SimpleNamespace(type=device_type, index=index))


# --------------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize("n,want", [(-7, 1), (0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8),
                                    (15, 16), (16, 16), (17, 32), (100, 128), (1000, 1024),
                                    (1024, 1024), (1025, 2048), (8192, 8192),
                                    (2**40 + 1, 2**41)])
def test_next_pow2_golden(n, want):
    assert L.next_pow2(n) == want


@pytest.mark.parametrize("a,b,want", [(0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2),
                                      (7, 2, 4), (8, 2, 4), (1000, 64, 16), (1025, 1024, 2),
                                      (-3, 2, -1), (2**40 + 1, 2**20, 2**20 + 1)])
def test_cdiv_golden(a, b, want):
    assert L.cdiv(a, b) == want


def test_cdiv_matches_triton():
    triton = pytest.importorskip("triton")
    for a in range(-20, 70):
        for b in range(1, 17):
            assert L.cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_interpreted_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert L.interpreted()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not L.interpreted()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not L.interpreted()


def test_launch_opts():
    assert L.launch_opts({}) == {}
    assert L.launch_opts({"num_warps": "4", "num_stages": 2, "BLOCK_M": 16, "grid": "tiles"}) \
        == {"num_warps": 4, "num_stages": 2}
    # a helper kernel's own setting (quant_linear's activation quantization)
    assert L.launch_opts({"num_warps": 4}, prefix="quant_", num_warps=8) == {"num_warps": 8}
    assert L.launch_opts({"quant_num_warps": 1, "num_stages": 3}, prefix="quant_",
                         num_warps=8) == {"num_warps": 1}


def test_launch_goes_through_the_grid_policy():
    calls = []

    class K:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    L.launch(K(), (2, 3), {}, "rope", "x", BLOCK=16)
    L.launch(K(), (2, 3), {"grid": "persistent", "programs": 4}, "rope", "x", BLOCK=16)
    assert calls == [((2, 3), ("x", 6, 6, 3), {"PERSISTENT": False, "BLOCK": 16}),
                     ((4,), ("x", 6, 4, 3), {"PERSISTENT": True, "BLOCK": 16})]


def test_dot_fp32(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not L.dot_fp32(torch.bfloat16, torch.bfloat16)
    assert L.dot_fp32(torch.float32, torch.float32)
    assert L.dot_fp32(torch.bfloat16, torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert L.dot_fp32(torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("blocks,chunks,target,split,want", [
    (384, 24, 1056, None, (3, 8)),   # cdiv(1056, 384) = 3 splits of 8 chunks
    (16, 24, 1056, None, (24, 1)),   # at most one split per chunk
    (5, 7, 12, None, (3, 3)),        # 3 splits would be 3 + 3 + 1: kept (none empty)
    (2, 7, 8, None, (4, 2)),         # 4 splits: 2 + 2 + 2 + 1
    (3, 10, 4, None, (2, 5)),
    (1000, 24, 1056, None, (2, 12)),
    (2000, 24, 1056, None, (1, 24)),  # the blocks alone reach the target
    (4, 24, 0, None, (1, 24)),       # target 0: never split
    (4, 7, 0, 3, (3, 3)),            # a forced split, trimmed the same way
    (4, 7, 0, 6, (4, 2)),            # 6 splits of 2 would leave empty ones: 4
])
def test_split_for_target(blocks, chunks, target, split, want):
    got = L.split_for_target(blocks, chunks, target, split)
    assert got == want
    s, per = got
    assert (s - 1) * per < chunks <= s * per


def test_one_definition_of_each_helper():
    """The wrappers hold no copies of their own: the names they use are the helper's."""
    from glm5.kernels.triton import registry as kreg

    for name in kreg.MODULES:
        mod = importlib.import_module(f"glm5.kernels.triton.{name}")
        for helper in ("_next_pow2", "_cdiv", "_launch_opts"):
            assert not hasattr(mod, helper), f"{name}.{helper}"
        for helper in ("next_pow2", "cdiv", "interpreted", "check_device", "launch_opts",
                       "launch", "dot_fp32", "FLOATS", "split_for_target"):
            if hasattr(mod, helper):
                assert getattr(mod, helper) is getattr(L, helper), f"{name}.{helper}"
        assert mod.check_device is L.check_device, name


# --------------------------------------------------------------------------- check_device
@pytest.mark.parametrize("backend", VENDOR_BACKENDS)
def test_every_vendor_device_type_is_accepted(backend):
    dt = _spec(backend).device_type
    assert dt == EXPECTED_TYPES[backend]
    assert dt in L.DEVICE_TYPES


@pytest.mark.parametrize("device_type", L.DEVICE_TYPES)
def test_check_device_without_interpreter(device_type, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    L.check_device("rope", _on(device_type), _on(device_type), bias=None)
    L.check_device("rope", x=_on(device_type), cos=_on(device_type))
    with pytest.raises(RuntimeError, match=r"^glm5 triton rope: 'cos' is a CPU tensor; "
                                           r"expected a tensor on a Triton device \(cuda, npu"):
        L.check_device("rope", x=_on(device_type), cos=torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"^glm5 triton rope: argument 0 is a CPU tensor"):
        L.check_device("rope", torch.zeros(2))
    with pytest.raises(RuntimeError, match=rf"glm5 triton moe_experts: 'w2' is on "
                                           rf"{device_type}:1 but 'x' is on {device_type}:0; "
                                           "expected all tensors of one call on one device"):
        L.check_device("moe_experts", x=_on(device_type, 0), w2=_on(device_type, 1))


def test_check_device_refuses_other_devices(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"glm5 triton attention: 'q' is a meta tensor"):
        L.check_device("attention", q=torch.empty(2, device="meta"))
    with pytest.raises(RuntimeError, match=r"glm5 triton attention: 'k' is on hpu:0, which no "
                                           r"Triton stack here serves; expected one of cuda"):
        L.check_device("attention", q=_on("npu"), k=_on("hpu"))
    with pytest.raises(RuntimeError, match=r"'k' is on mlu:0 but 'q' is on npu:0"):
        L.check_device("attention", q=_on("npu"), k=_on("mlu"))
    with pytest.raises(TypeError, match=r"glm5 triton attention: 'k' expected a tensor, got int"):
        L.check_device("attention", q=_on("npu"), k=3)


def test_check_device_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    L.check_device("rms_norm", x=torch.zeros(2), weight=torch.zeros(2))
    # the interpreter copies device storages to the host around a launch: a device works too
    L.check_device("rms_norm", x=_on("npu"), weight=_on("npu"))
    with pytest.raises(RuntimeError, match=r"'weight' is on cuda:0 but 'x' is on cpu"):
        L.check_device("rms_norm", x=torch.zeros(2), weight=_on("cuda"))
    with pytest.raises(RuntimeError, match=r"'x' is a meta tensor .* or the CPU \(interpreted\)"):
        L.check_device("rms_norm", x=torch.empty(2, device="meta"))


# --------------------------------------------------------------------------- the launchers
class _Device(str):
    """Stands in for ``torch.device(type, index)``: torch reads it as the string "cpu" (the
    data really is on the CPU), check_device reads ``.type`` / ``.index``."""

    def __new__(cls, type_: str, index: int = 0) -> _Device:
        d = super().__new__(cls, "cpu")
        d.type, d.index = type_, index
        return d


class _OnDevice(torch.Tensor):
    """A CPU tensor reporting ``fake`` as its device; torch ops on it return the same class."""

    fake: _Device

    @property
    def device(self):  # type: ignore[override]
        return self.fake


_CLASSES: dict[str, type] = {}


def _stand_in_class(device_type: str) -> type:
    if device_type not in _CLASSES:
        _CLASSES[device_type] = type(f"On_{device_type}", (_OnDevice,),
                                     {"fake": _Device(device_type)})
    return _CLASSES[device_type]


class _AllocateOnStandIn(TorchFunctionMode):
    """``torch.empty(..., device=x.device)`` with a stand-in device gives a stand-in tensor of
    that device, as the vendor's allocator would give a device tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dev = kwargs.get("device")
        if isinstance(dev, _Device) and isinstance(out, torch.Tensor):
            return out.as_subclass(_stand_in_class(dev.type))
        return out


def _wrap(value, device_type: str):
    if isinstance(value, torch.Tensor):
        return value.as_subclass(_stand_in_class(device_type))
    return value


def _cases() -> list[tuple[str, tuple]]:
    """(op, args): one bf16 case per Triton op from the conformance kit's generators, and
    quant_linear in every scheme (the activation schemes run quantize_per_token first)."""
    from glm5.ir.catalog import OPS
    from glm5.ir.quant_formats import quantize_weight
    from glm5.kernels.triton import registry as kreg
    from glm5.testing.cases import GENERATORS, RandomDraw

    rows = kreg.kernels(lambda op: {})
    out = []
    for op, *_ in rows:
        vals, _ = OPS[op].validate((), GENERATORS[op](RandomDraw(1, tier="tile"),
                                                        torch.bfloat16))
        out.append((op, tuple(vals[n] for n in OPS[op].param_names)))
    g = torch.Generator().manual_seed(0)
    for scheme in ("w8a16", "w8a8", "w4a8", "w6a12"):
        wp, ws = quantize_weight(torch.randn(32, 256, generator=g), scheme)
        x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
        bias = torch.randn(32, generator=g).to(torch.bfloat16)
        out.append(("quant_linear", (x, wp, ws, scheme, bias)))
    return out


@pytest.fixture
def recorded(monkeypatch):
    """Kernels replaced by recording Recorders (nothing compiled, nothing launched), then the
    interpreter flag off, so the launchers take their device paths. The kernel modules are
    imported (by install_recorders) before the flag goes: they stay interpreter kernels for
    the rest of the session."""
    pytest.importorskip("triton")
    from triton_compile_check import Recorder, install_recorders

    monkeypatch.setattr(Recorder, "target", None)
    monkeypatch.setattr(Recorder, "calls", [])
    install_recorders(monkeypatch.setattr)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return Recorder


def _launchers(backend: str) -> dict:
    from glm5.backends import vendor
    from glm5.kernels.triton import registry as kreg

    return {op: fn for op, fn, _, _ in kreg.kernels(vendor.tuning_for(_spec(backend).tuning))}


@pytest.mark.parametrize("backend", VENDOR_BACKENDS)
def test_every_launcher_runs_on_the_vendor_device(backend, recorded):
    """Each Triton op, under the backend's own tuning table (ascend: persistent grids), gets
    past the device check with tensors on the backend's device type and launches its kernels
    with every tensor argument on that device (outputs allocated there too)."""
    from glm5.kernels.triton import registry as kreg

    dt = _spec(backend).device_type
    fns = _launchers(backend)
    assert set(fns) == {op for op, *_ in kreg.kernels(lambda op: {})}
    launched: dict[str, set[str]] = {}
    for op, args in _cases():
        recorded.calls.clear()
        with _AllocateOnStandIn():
            fns[op](*[_wrap(a, dt) for a in args])
        assert recorded.calls, f"{op}: no kernel launched on {dt}"
        for kernel, grid, kargs, kw in recorded.calls:
            devs = {t.device.type for t in kargs if isinstance(t, torch.Tensor)}
            assert devs == {dt}, f"{op} {kernel}: tensor arguments on {devs}, expected {dt}"
            launched.setdefault(op, set()).add(kernel)
    assert set(launched) == set(fns)
    assert "quantize_rows_kernel" in launched["quant_linear"]


@pytest.mark.parametrize("backend", VENDOR_BACKENDS)
def test_every_launcher_refuses_cpu_tensors_uninterpreted(backend, recorded):
    fns = _launchers(backend)
    for op, args in _cases():
        with pytest.raises(RuntimeError, match=rf"^glm5 triton {op}: '\w+' is a CPU tensor; "
                                               rf"expected a tensor on a Triton device"):
            fns[op](*args)
        assert not recorded.calls, f"{op} launched a kernel on CPU tensors"


def test_quantize_per_token_on_a_vendor_device(recorded):
    from glm5.kernels.triton.quant_linear import quantize_per_token

    x = torch.randn(3, 300).to(torch.bfloat16)
    for dt in ("npu", "mlu", "musa"):
        with _AllocateOnStandIn():
            q, s = quantize_per_token(_wrap(x, dt), 8)
        assert (q.device.type, s.device.type) == (dt, dt)
    assert [c[0] for c in recorded.calls] == ["quantize_rows_kernel"] * 3
    assert all(c[3]["num_warps"] == 8 for c in recorded.calls)
    with pytest.raises(RuntimeError, match=re.escape("glm5 triton quant_linear: 'x' is a CPU")):
        quantize_per_token(x, 8)


def test_interpreter_rounds_fp32_to_bf16_to_nearest_even():
    """The interpreter truncates fp32 -> bf16 (up to one ulp off); devices round to nearest
    even, and emulated parity must see the device's rounding (glm5.kernels.triton._interpreter
    is applied on the first launch)."""
    import triton
    import triton.language as tl

    from glm5.kernels.triton.launch import launch

    @triton.jit
    def cast(x_ptr, y_ptr, N_TILES, NUM_PROGRAMS, N: tl.constexpr, PERSISTENT: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.bfloat16))

    # 1 + 2^-8 + 2^-10 rounds up to 1 + 2^-7; truncation gives 1.
    x = torch.cat((torch.tensor([1.0 + 2**-8 + 2**-10, -2.3906]), torch.randn(254) * 7))
    y = torch.empty(256, dtype=torch.bfloat16)
    launch(cast, (1,), {}, "cast", x, y, N=256)
    assert torch.equal(y, x.to(torch.bfloat16))
