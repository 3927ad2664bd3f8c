"""The plugin API a backend is built against: `Backend`, kernel registration, API version and
the pluggy markers. This is a stable contract (see docs/plugins.md)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy
import torch

PROJECT = "glm5"
API_VERSION = "1.0"  # a plugin declares GLM5_API_VERSION; another major version is refused
ENTRY_POINT_GROUP = "glm5.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

DEVICE_ANY = "any"

# Ops whose weights come in a canonical packed format (OPS.md) that a backend may repack once at
# load time (`@backend.repack`).
REPACK_OPS = ("quant_linear", "moe_experts_quant")


class BackendError(RuntimeError):
    """A backend or plugin broke the API contract."""


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of a backend: serves ``op`` for ``dtypes`` (None = any) when ``supports``
    (None = always) accepts the call's arguments."""

    op: str
    fn: Callable[..., Any]
    backend: "Backend"
    dtypes: frozenset[torch.dtype] | None = None
    supports: Callable[..., bool] | None = None

    def accepts_dtype(self, dtype: torch.dtype | None) -> bool:
        return self.dtypes is None or dtype is None or dtype in self.dtypes

    def accepts(self, args: tuple) -> bool:
        return self.supports is None or bool(self.supports(*args))


@dataclass(eq=False)
class Backend:
    """A hardware backend: detection + kernels + settings.

    ``Backend(name, vendor, device_type, priority=0, description="")``; attach kernels with
    ``@backend.kernel("<op>", dtypes=(...), supports=None)`` and detection with
    ``@backend.availability`` (a function returning ``(bool, reason)``); optionally
    ``@backend.repack("quant_linear")`` to repack quantized weights once at load time.
    ``settings`` holds the
    backend's own defaults (``quant_scheme``, ``collective``, ``compile_cache``,
    ``tuning_table``); plugins.toml overrides them key by key.
    """

    name: str
    vendor: str
    device_type: str
    priority: int = 0
    description: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, KernelEntry] = field(default_factory=dict, init=False, repr=False)
    source: str = field(default="", init=False)
    _availability: Callable[[], tuple[bool, str]] | None = field(default=None, init=False)
    _available: tuple[bool, str] | None = field(default=None, init=False, repr=False)
    _emulation: Callable[[], tuple[bool, str]] | None = field(default=None, init=False)
    repackers: dict[str, Callable[..., Any]] = field(default_factory=dict, init=False,
                                                     repr=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise BackendError(f"glm5.Backend: name expected a short identifier, got {self.name!r}")
        if not isinstance(self.device_type, str) or not self.device_type:
            raise BackendError(
                f"glm5.Backend({self.name!r}): device_type expected a torch device type "
                f"such as 'cpu', 'cuda', 'npu' or 'any', got {self.device_type!r}"
            )

    # ------------------------------------------------------------------ registration
    def kernel(
        self,
        op: str,
        dtypes: Iterable[torch.dtype] | None = None,
        supports: Callable[..., bool] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register ``fn`` as this backend's kernel for ``op``.

        The kernel takes the op's arguments exactly as OPS.md lists them (positionally) and
        returns what the op's reference returns.
        """
        from glm5.ir.catalog import OPS

        if op not in OPS:
            raise BackendError(
                f"glm5.Backend({self.name!r}).kernel: unknown op {op!r}; known ops: "
                f"{', '.join(OPS)}"
            )
        dts = None
        if dtypes is not None:
            dts = frozenset(dtypes)
            bad = [d for d in dts if not isinstance(d, torch.dtype)]
            if bad:
                raise BackendError(
                    f"glm5.Backend({self.name!r}).kernel({op!r}): dtypes expected torch.dtype "
                    f"values, got {bad!r}"
                )

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if op in self.kernels:
                raise BackendError(
                    f"glm5.Backend({self.name!r}): a kernel for {op!r} is already registered"
                )
            self.kernels[op] = KernelEntry(op, fn, self, dts, supports)
            return fn

        return deco

    def repack(self, op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: ``fn(packed, scale, scheme) -> None``, called once per quantized weight
        at model load time (``glm5.load_model``) when this backend is the one selected for
        ``op`` ("quant_linear" or "moe_experts_quant") on the weight's device.

        The op contract does not change: kernels still receive the canonical tensors as
        arguments. A backend that wants its own layout computes it here and keeps it in a cache
        keyed by the canonical tensor (`RepackCache` holds it weakly), where its kernel looks it
        up. ``packed``/``scale`` are [N, P]/[N(, G)] for quant_linear and [E, N, P]/[E, N(, G)]
        (w13, then w2) for moe_experts_quant.
        """
        if op not in REPACK_OPS:
            raise BackendError(
                f"glm5.Backend({self.name!r}).repack: op expected one of {REPACK_OPS}, got {op!r}"
            )

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if op in self.repackers:
                raise BackendError(
                    f"glm5.Backend({self.name!r}): a repack for {op!r} is already registered"
                )
            self.repackers[op] = fn
            return fn

        return deco

    def availability(self, fn: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[bool, str]]:
        """Decorator: ``fn() -> (available, reason)``, called once, lazily."""
        self._availability = fn
        self._available = None
        return fn

    def emulation(self, fn: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[bool, str]]:
        """Decorator: ``fn() -> (possible, reason)`` — whether this backend's kernels can run on
        CPU tensors here (e.g. Triton kernels through the Triton interpreter), for
        ``glm5 parity --emulate``. The caller sets up the environment (TRITON_INTERPRET=1)
        before any kernel module is imported."""
        self._emulation = fn
        return fn

    def can_emulate(self) -> tuple[bool, str]:
        if self._emulation is None:
            return False, "the backend declares no emulation mode"
        try:
            ok, reason = self._emulation()
            return bool(ok), str(reason)
        except Exception as e:
            return False, f"emulation check raised {type(e).__name__}: {e}"

    # ------------------------------------------------------------------ queries
    def is_available(self) -> tuple[bool, str]:
        if self._available is None:
            if self._availability is None:
                self._available = (True, "no availability check")
            else:
                try:
                    ok, reason = self._availability()
                    self._available = (bool(ok), str(reason))
                except Exception as e:  # detection must never break selection
                    self._available = (False, f"availability check raised {type(e).__name__}: {e}")
        return self._available

    def serves_device(self, device_type: str) -> bool:
        return self.device_type == DEVICE_ANY or self.device_type == device_type

    def ops(self) -> list[str]:
        return list(self.kernels)


class RepackCache:
    """A backend's repacked weights keyed by the canonical tensor's identity, held weakly: an
    entry disappears when the canonical tensor is freed (so a reused id never returns a stale
    layout). ``cache.put(packed, value)`` in a ``@backend.repack`` function, ``cache.get(packed)``
    (None when absent) in the kernel."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def put(self, key: torch.Tensor, value: Any) -> None:
        k = id(key)
        ref = weakref.ref(key, lambda _r, k=k: self._entries.pop(k, None))
        self._entries[k] = (ref, value)

    def get(self, key: torch.Tensor) -> Any:
        e = self._entries.get(id(key))
        if e is None or e[0]() is not key:
            return None
        return e[1]

    def __len__(self) -> int:
        return len(self._entries)
