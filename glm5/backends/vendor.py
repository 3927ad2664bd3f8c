"""Shared machinery of glm5's device backends (cuda, hygon, ascend, cambricon, mthreads).

A backend package declares a :class:`VendorSpec` (name, vendor, torch device string,
``torch.distributed`` backend, default quant scheme, torch extension, device tools, install
hint) and builds its :class:`~glm5.backends.api.Backend` with :func:`make_backend`. This module
holds what they share:

* detection, in this order: an explicit ``GLM5_DEVICE`` override (selects one backend, or rules
  the others out); the vendor's torch extension (``torch_npu``, ``torch_mlu``, ``torch_musa``),
  imported lazily and guarded; the vendor's device tool on PATH (``npu-smi``, ``cnmon``,
  ``mthreads-gmi``, ``hy-smi``), which only sharpens the reason when the extension is missing.
  CUDA-under-HIP builds are told apart by :func:`rocm_vendor` (Hygon DCU vs AMD vs NVIDIA);
* the Triton kernel library registered with the backend's tuning table (its tuning.json merged
  over the kernels' DEFAULTS), with symbolic program counts (``"programs": "ai_cores"``)
  resolved from the device when it is present and from the table's ``_device`` entry otherwise;
* the emulation check (Triton interpreter) behind ``glm5 parity --backend NAME --emulate``.

Nothing here imports triton or a vendor extension at module level (``import glm5`` stays light).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

from glm5.backends import tuning_cache
from glm5.backends.api import IMPL_ATTR, Backend, default_impl, hookimpl
from glm5.kernels.triton import registry as kreg
from glm5.kernels.triton.launch import resolve_programs

ENV_DEVICE = "GLM5_DEVICE"

# (op, fn, dtypes, supports), as glm5/kernels/triton/registry.py returns; a row may add a fifth
# element, its implementation label (`Backend.kernel`'s ``impl``)
Rows = list[tuple]


@dataclass(frozen=True)
class VendorSpec:
    """What a device backend is: the fixed facts, in one place.

    ``aliases``: the ``GLM5_DEVICE`` values that select this backend (its name first).
    ``extension``: the torch extension module the runtime comes from (None: plain torch).
    ``tools``: device tools whose presence on PATH shows the vendor's devices are installed.
    ``install``: what to install when the runtime is missing (shown in the reason).
    ``tuning``: the backend's tuning table (tuning.json beside its package).
    """

    name: str
    vendor: str
    device_type: str
    collective: str
    quant_scheme: str
    priority: int
    description: str
    tuning: Path
    aliases: tuple[str, ...] = ()
    extension: str | None = None
    tools: tuple[str, ...] = ()
    install: str = ""
    triton_package: str = "triton"
    extra_settings: dict[str, Any] = field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        """The backend's own defaults; plugins.toml [backends.NAME] overrides them key by key."""
        return {"quant_scheme": self.quant_scheme, "collective": self.collective,
                "tuning_table": str(self.tuning), **self.extra_settings}


# --------------------------------------------------------------------------- probes
# Module-level so that tests can replace them (monkeypatch) without a device.
def which(tool: str) -> str | None:
    """The tool's path when it is on PATH."""
    return shutil.which(tool)


def tool_output(cmd: list[str], timeout: float = 10.0) -> str:
    """stdout of a device tool ("" when it is absent, fails or hangs)."""
    if which(cmd[0]) is None:
        return ""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout or ""


def forced_device() -> str:
    """The ``GLM5_DEVICE`` override, lower-cased ("" when unset)."""
    return os.environ.get(ENV_DEVICE, "").strip().lower()


def override(spec: VendorSpec) -> tuple[bool, str] | None:
    """None without an override; (True, why) when ``GLM5_DEVICE`` names this backend (or one of
    its aliases); (False, reason) when it names another one."""
    forced = forced_device()
    if not forced:
        return None
    if forced in (spec.name, *spec.aliases):
        return True, f"{ENV_DEVICE}={forced}"
    return False, f"{ENV_DEVICE}={forced} selects another device"


def import_extension(module: str) -> tuple[ModuleType | None, str]:
    """Import a vendor torch extension without letting its failure escape: (module, "") or
    (None, why). A module already in sys.modules (imported, or faked by a test) is used as is."""
    if module in sys.modules and sys.modules[module] is not None:
        return sys.modules[module], ""
    try:
        if importlib.util.find_spec(module) is None:
            return None, "not installed"
    except (ImportError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    try:
        return importlib.import_module(module), ""
    except Exception as e:  # a broken vendor runtime (e.g. libhccl.so missing) must not escape
        return None, f"import failed ({type(e).__name__}: {e})"


def module_present(module: str) -> bool:
    """Whether ``module`` can be imported (found), without importing it."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _tool_hint(spec: VendorSpec) -> str:
    found = [t for t in spec.tools if which(t)]
    if found:
        return f"; {found[0]} is on PATH, so a {spec.vendor} device appears to be installed"
    if spec.tools:
        return f"; no {spec.vendor} device tool ({', '.join(spec.tools)}) on PATH either"
    return ""


def detect_extension_device(spec: VendorSpec) -> tuple[bool, str]:
    """Detection of a backend whose runtime is a torch extension (torch_npu, torch_mlu,
    torch_musa) registering device type ``spec.device_type``: override, then the extension,
    then a visible device, then the Triton compiler the kernels need."""
    ov = override(spec)
    if ov is not None and not ov[0]:
        return ov
    assert spec.extension is not None
    mod, why = import_extension(spec.extension)
    if mod is None:
        return False, (f"{spec.extension} is not importable ({why}): {spec.install}"
                       f"{_tool_hint(spec)}")
    import torch

    dev = getattr(torch, spec.device_type, None)
    try:
        n = int(dev.device_count()) if dev is not None and dev.is_available() else 0
    except Exception as e:
        return False, (f"{spec.extension} imported but torch.{spec.device_type} failed "
                       f"({type(e).__name__}: {e}){_tool_hint(spec)}")
    if n == 0:
        return False, f"{spec.extension} imported but no {spec.device_type} device is visible" \
                      f"{_tool_hint(spec)}"
    if not module_present("triton"):
        return False, (f"{n} {spec.device_type} device(s), but {spec.triton_package} (the "
                       f"Triton compiler for {spec.vendor}) is not installed")
    try:
        name = str(dev.get_device_name(0))
    except Exception:
        name = spec.device_type
    forced = f"; {ov[1]}" if ov else ""
    return True, f"{n} x {name} ({spec.extension} {getattr(mod, '__version__', '?')}){forced}"


# --------------------------------------------------------------------------- CUDA vs HIP
# Hygon DCUs run a ROCm-style stack (DTK) and show up as torch "cuda" devices, like AMD GPUs.
# Evidence that a HIP device is a Hygon DCU (any one suffices):
#  * the device name: DTK reports DCU models (K100, K100_AI, Z100, BW1000; FlagTree's Hygon
#    "hcu" backend README targets K100/BW1000) or "DCU"/"Hygon" in the name;
#  * `hy-smi` on PATH (Hygon's device tool, GPUStack docs "Running Inference With Hygon DCUs");
#  * `rocminfo` listing an agent whose marketing name contains "DCU" (same source).
HYGON_NAME_MARKERS = ("DCU", "HYGON", "K100", "Z100", "BW1000", "BW100")


def _cuda_device_name(torch: Any) -> str:
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return str(torch.cuda.get_device_name(0))
    except Exception:
        pass
    return ""


def rocm_vendor(torch: Any = None) -> tuple[str, str]:
    """("nvidia" | "hygon" | "amd" | "none", evidence) for the torch build and devices here."""
    if torch is None:
        import torch
    hip = getattr(torch.version, "hip", None)
    if not hip:
        if getattr(torch.version, "cuda", None):
            return "nvidia", f"CUDA {torch.version.cuda} build"
        return "none", "CPU-only torch build"
    name = _cuda_device_name(torch)
    up = name.upper()
    hit = next((m for m in HYGON_NAME_MARKERS if m in up), None)
    if hit:
        return "hygon", f"HIP {hip} build, device {name!r}"
    if which("hy-smi"):
        return "hygon", f"HIP {hip} build, hy-smi on PATH"
    if "DCU" in tool_output(["rocminfo"]).upper():
        return "hygon", f"HIP {hip} build, rocminfo lists a DCU agent"
    return "amd", f"HIP {hip} build, device {name or 'unknown'!r}, no Hygon DCU marker"


# --------------------------------------------------------------------------- Triton kernels
def triton_emulation() -> tuple[bool, str]:
    """Whether the Triton kernels can run on CPU tensors here (the interpreter)."""
    if not module_present("triton"):
        return False, "triton is not installed (pip install 'glm5[cuda]' provides it)"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False, "TRITON_INTERPRET=1 must be set before the kernels are imported"
    return True, "Triton interpreter on CPU tensors"


def device_table(path: str | Path) -> dict[str, Any]:
    """The ``_device`` entry of a tuning table: documented device counts (e.g. ai_cores) used
    when the device itself cannot be asked (emulation)."""
    p = Path(path)
    if not p.exists():
        return {}
    return dict(json.loads(p.read_text()).get("_device", {}))


def counts_for(table: dict[str, Any],
               query: Callable[[str], int | None] | None) -> dict[str, Callable[[], int]]:
    """Count functions for the numeric keys of a ``_device`` table: ``query(key)`` (the live
    device, called once on the first launch) when it answers, else the table's value."""
    out: dict[str, Callable[[], int]] = {}
    memo: dict[str, int] = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue

        def count(key: str = key, value: int = value) -> int:
            if key not in memo:
                live = query(key) if query is not None else None
                memo[key] = int(live) if live else int(value)
            return memo[key]

        out[key] = count
    return out


def tuning_for(path: str | Path,
               query: Callable[[str], int | None] | None = None) -> Callable[[str], dict]:
    """``tuning(op)``: the backend's table merged over the kernels' DEFAULTS, with symbolic
    ``programs`` resolved (see glm5.kernels.triton.launch.resolve_programs)."""
    base = kreg.load_table(path)
    counts = counts_for(device_table(path), query)
    return lambda op: resolve_programs(base(op), counts)


def triton_rows(backend: Backend, query: Callable[[str], int | None] | None = None) -> Rows:
    """The Triton kernel library's rows under this backend's tuning table, each kernel applying
    the per-device tuning cache (`glm5.backends.tuning_cache`) from its first call on."""
    tuning = tuning_for(backend.settings.get("tuning_table") or "", query)
    rows = kreg.kernels(tuning)
    rebuild = _Rebuild(backend.name, tuning)
    return [(r[0], DeviceTuned(backend.name, r[0], r[1], rebuild), *r[2:]) for r in rows]


class _Rebuild:
    """The library's kernels under ``tuning`` with one device's cached entries over it, built
    once per device key (building makes no compilation: kernels compile on first launch)."""

    def __init__(self, backend: str, tuning: Callable[[str], dict]) -> None:
        self.backend, self.tuning = backend, tuning
        self.by_key: dict[str, tuple[dict[str, Callable[..., Any]], str]] = {}

    def fns(self, key: str) -> tuple[dict[str, Callable[..., Any]], str]:
        """({op: kernel} for the ops the cache tunes on device ``key``, why)."""
        if key not in self.by_key:
            ops, why = tuning_cache.entries(self.backend, key)
            fns: dict[str, Callable[..., Any]] = {}
            if ops:
                rows = kreg.kernels(lambda op: {**self.tuning(op), **ops.get(op, {})})
                fns = {r[0]: r[1] for r in rows if r[0] in ops}
            tuning_cache.log.info("glm5 %s tuning cache: %s", self.backend, why)
            self.by_key[key] = (fns, why)
        return self.by_key[key]


class DeviceTuned:
    """A Triton row's kernel that, on its first call, looks up the tuning cache for the device
    of that call's first tensor argument and from then on runs the kernel built with the cached
    launch parameters (the plain one when the cache has none for its op). The device is known
    only at a call: looking it up at registration would initialize the device runtime in every
    process that imports glm5."""

    def __init__(self, backend: str, op: str, fn: Callable[..., Any], rebuild: _Rebuild) -> None:
        self.op, self.plain, self.rebuild = op, fn, rebuild
        self.fn: Callable[..., Any] | None = None
        self.device_key: str | None = None
        self.__name__ = getattr(fn, "__name__", op)
        setattr(self, IMPL_ATTR, default_impl(fn, backend))

    def resolve(self, args: tuple) -> Callable[..., Any]:
        """The kernel for the device of the first tensor in ``args``."""
        import torch

        dev = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if dev is None:
            return self.plain
        self.device_key = tuning_cache.device_key(dev)[0]
        return self.rebuild.fns(self.device_key)[0].get(self.op, self.plain)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        if fn is None:
            fn = self.fn = self.resolve(args)
        return fn(*args, **kwargs)


def register_rows(backend: Backend, rows: Iterable[tuple]) -> None:
    """Register (op, fn, dtypes, supports[, impl]) rows; the first row of an op wins. Without
    an ``impl`` the label comes from the function (`glm5.backends.api.default_impl`): "triton"
    for the Triton library's kernels, a binding's own label, else the backend's name."""
    for row in rows:
        op, fn, dtypes, supports = row[:4]
        impl = row[4] if len(row) > 4 else None
        if op not in backend.kernels:
            backend.kernel(op, dtypes=dtypes, supports=supports, impl=impl)(fn)


def make_backend(spec: VendorSpec) -> Backend:
    """The Backend of ``spec`` (kernels are attached when the plugin registers)."""
    return Backend(spec.name, vendor=spec.vendor, device_type=spec.device_type,
                   priority=spec.priority, description=spec.description,
                   settings=spec.settings())


def triton_plugin(backend: Backend, detect: Callable[[], tuple[bool, str]]) -> Callable[..., None]:
    """Wire a Triton-library backend: ``detect`` as its availability check, the Triton
    interpreter as its emulation mode, and the ``glm5_register_backends`` hook implementation
    that attaches the library's kernels under the backend's tuning table and registers it.
    A backend module assigns the result to ``glm5_register_backends``."""
    backend.availability(detect)
    backend.emulation(triton_emulation)

    @hookimpl
    def glm5_register_backends(registry) -> None:
        if not backend.kernels:
            register_rows(backend, triton_rows(backend))
        registry.register(backend)

    return glm5_register_backends
