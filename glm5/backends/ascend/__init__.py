"""The ascend backend: Huawei Ascend NPUs through torch_npu (device ``npu``, collectives
``hccl``) and CANN.

Kernels, per op:
* torch_npu's fused ops (npu_lightning_indexer, npu_sparse_flash_attention, npu_mla_prolog_v3,
  npu_quant_matmul, npu_grouped_matmul, npu_moe_gating_top_k, ...) through the bindings of
  :mod:`glm5.backends.ascend.npu_ops`; they come first for their ops;
* the Triton kernel library compiled by triton-ascend for the other ops, launched with the
  persistent 1-D grid triton-ascend wants (one program per AI core, each looping over tiles;
  tuning.json beside this file).

``Backend.kernel`` holds one kernel per op and a kernel that declines a call (``supports`` ->
False) passes it to the *next backend* (usually the reference). For an op served both ways the
backend therefore registers one combined kernel: the vendor binding when its ``supports``
accepts the call (its documented shapes and dtypes), else the Triton kernel. A call that neither
accepts (e.g. an fp32 sparse_attention with a head dim npu_sparse_flash_attention does not take,
which the Triton kernel does serve) stays on the NPU instead of falling back to the host oracle.
The combined kernel reports which of the two ran (`glm5.backends.api.call_impl`): the binding's
label (``torch_npu.npu_sparse_flash_attention``, ...) or ``triton``.

Emulation (``glm5 parity --backend ascend --emulate``): the Triton kernels run in the Triton
interpreter with the persistent grid and the table's documented core counts; the vendor
bindings call :mod:`glm5.backends.ascend.contract`, CPU emulators of the documented torch_npu
contracts, through the same ``npu()`` namespace that is ``torch_npu`` on hardware.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Callable

import torch

from glm5.backends import vendor
from glm5.backends.api import API_VERSION, IMPL_ATTR, call_impl, default_impl, hookimpl
from glm5.ir.catalog import OPS

GLM5_API_VERSION = API_VERSION
NPU_OPS = "glm5.backends.ascend.npu_ops"
CONTRACT = "glm5.backends.ascend.contract"

SPEC = vendor.VendorSpec(
    name="ascend", vendor="Huawei", device_type="npu", collective="hccl", quant_scheme="w4a8",
    priority=22,
    description="torch_npu fused ops + triton-ascend kernels on Ascend NPUs (CANN)",
    tuning=Path(__file__).with_name("tuning.json"), aliases=("npu", "huawei"),
    extension="torch_npu", tools=("npu-smi",),
    triton_package="triton-ascend (pip install triton-ascend; it replaces community triton)",
    install="install glm5[ascend] and CANN (source /usr/local/Ascend/ascend-toolkit/set_env.sh)",
)
BACKEND = vendor.make_backend(SPEC)

# tuning.json's symbolic program counts -> triton-ascend's device properties
_DEVICE_KEYS = {"ai_cores": "num_aicore", "vector_cores": "num_vectorcore"}


def detect() -> tuple[bool, str]:
    return vendor.detect_extension_device(SPEC)


@BACKEND.availability
def _available() -> tuple[bool, str]:
    return detect()


@BACKEND.emulation
def _emulation() -> tuple[bool, str]:
    ok, reason = vendor.triton_emulation()
    if not ok:
        return ok, reason
    if not vendor.module_present(CONTRACT):
        return False, f"{CONTRACT} (the torch_npu contract emulators) is missing"
    return True, "Triton interpreter (persistent grid) + torch_npu contract emulators on CPU"


def npu() -> Any:
    """The namespace the vendor-op bindings call: torch_npu on an Ascend device, the contract
    emulators when emulating (TRITON_INTERPRET=1, as `glm5 parity --emulate` sets)."""
    ok, reason = BACKEND.is_available()
    if ok:
        mod, why = vendor.import_extension("torch_npu")
        if mod is not None:
            return mod
        reason = why
    if os.environ.get("TRITON_INTERPRET") == "1":
        return importlib.import_module(CONTRACT)
    raise RuntimeError(f"glm5 ascend: no NPU ({reason}) and not emulating "
                       f"(glm5 parity --backend ascend --emulate sets TRITON_INTERPRET=1)")


def device_count(key: str) -> int | None:
    """A tuning.json core count ("ai_cores", "vector_cores") from triton-ascend's driver on the
    device; None when there is no device (the table's documented count is used then)."""
    if key not in _DEVICE_KEYS or not BACKEND.is_available()[0]:
        return None
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
        import triton.runtime.driver as driver

        props = driver.active.utils.get_device_properties(torch.npu.current_device())
        return int(props[_DEVICE_KEYS[key]])
    except Exception:
        return None


def vendor_rows() -> list[tuple]:
    """npu_ops' rows, or none while that module is absent (only that module's absence is
    tolerated: an import error inside it propagates)."""
    try:
        npu_ops = importlib.import_module(NPU_OPS)
    except ModuleNotFoundError as e:
        if e.name != NPU_OPS:
            raise
        return []
    return list(npu_ops.vendor_kernels(npu))


def combine(op: str, first: tuple, second: tuple) -> tuple:
    """One row serving ``op`` by ``first`` (the vendor binding) when it accepts the call's
    dispatch dtype and ``supports``, else by ``second`` (the Triton kernel). Each call reports
    the implementation label of the one that ran (the binding's own report, if it makes one,
    is kept: it is the more precise)."""
    _, f1, d1, s1 = first
    _, f2, d2, s2 = second
    l1, l2 = default_impl(f1, BACKEND.name), default_impl(f2, BACKEND.name)
    spec = OPS[op]
    at = spec.param_names.index(spec.dispatch_arg) if spec.dispatch_arg else None
    set1 = None if d1 is None else frozenset(d1)
    set2 = None if d2 is None else frozenset(d2)

    def takes(dts: frozenset | None, sup: Callable[..., bool] | None, args: tuple) -> bool:
        v = args[at] if at is not None and at < len(args) else None
        dt = v.dtype if isinstance(v, torch.Tensor) else None
        return (dts is None or dt is None or dt in dts) and (sup is None or bool(sup(*args)))

    def pick(args: tuple) -> tuple[Callable[..., Any], str] | None:
        if takes(set1, s1, args):
            return f1, l1
        if takes(set2, s2, args):
            return f2, l2
        return None

    def kernel(*args: Any) -> Any:
        chosen = pick(args)
        if chosen is None:
            raise ValueError(f"glm5 ascend {op}: neither the torch_npu binding nor the Triton "
                             f"kernel accepts these arguments (supports() is False for both)")
        fn, label = chosen
        return call_impl(label, fn, *args)

    def supports(*args: Any) -> bool:
        return pick(args) is not None

    kernel.__name__ = f"{op}_npu_or_triton"
    setattr(kernel, IMPL_ATTR, f"{l1}|{l2}")
    dtypes = None if set1 is None or set2 is None else set1 | set2
    return op, kernel, dtypes, supports


def rows() -> list[tuple]:
    """The ascend kernel rows: vendor bindings first; an op also in the Triton library gets the
    combined vendor-then-Triton kernel; the remaining Triton ops follow."""
    triton_by_op = {r[0]: r for r in vendor.triton_rows(BACKEND, device_count)}
    out, seen = [], set()
    for r in vendor_rows():
        op = r[0]
        out.append(combine(op, r, triton_by_op[op]) if op in triton_by_op else r)
        seen.add(op)
    out.extend(r for op, r in triton_by_op.items() if op not in seen)
    return out


@hookimpl
def glm5_register_backends(registry) -> None:
    if not BACKEND.kernels:
        vendor.register_rows(BACKEND, rows())
    registry.register(BACKEND)
