"""The plugin API a backend is built against: `Backend`, kernel registration, API version, the
pluggy markers and hook specification, the reserved name of the reference backend, strict mode,
and the implementation labels a kernel reports (which code served a call). This is a stable
contract (see docs/plugins.md)."""

from __future__ import annotations

import contextvars
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import pluggy
import torch

from glm5.ir.catalog import OPS, get_op

# GLM5_STRICT is defined once, in the IR (the ground floor: argument value checks read it too);
# re-exported here, where plugins and selection use it.
from glm5.ir.opdef import STRICT_ENV, strict_mode  # noqa: F401

PROJECT = "glm5"
API_VERSION = "1.0"  # a plugin declares GLM5_API_VERSION; another major version is refused
ENTRY_POINT_GROUP = "glm5.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class BackendRegistry(Protocol):
    """What a plugin's ``glm5_register_backends`` hook is given: glm5's registry
    (`glm5.backends.registry.Registry`), of which a plugin calls ``register`` only."""

    def register(self, backend: "Backend") -> None: ...


class HookSpecs:
    """The hooks a glm5 plugin implements (API version 1)."""

    @hookspec
    def glm5_register_backends(self, registry: BackendRegistry) -> None:
        """Call ``registry.register(backend)`` for each backend the plugin ships."""


DEVICE_ANY = "any"

# The name of glm5's own float64 oracle backend: reserved (no plugin may register it), the
# explicit last resort of selection.
REFERENCE = "reference"

# Ops whose weights come in a canonical packed format (docs/ops.md) that a backend may repack once at
# load time (`@backend.repack`).
REPACK_OPS = ("quant_linear", "moe_experts_quant")


class BackendError(RuntimeError):
    """A backend or plugin broke the API contract."""


class UnknownBackendError(BackendError, KeyError):
    """A backend name (``glm5.use_backend``, ``GLM5_BACKEND``, ``--backend``) that no loaded
    plugin registered. The message names the known backends and, where a plugin of that name
    was refused, failed or is disabled, why. A `KeyError` (what ``use_backend`` always raised)
    whose text prints without KeyError's quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- implementation labels
# A label names the code that served a call: "triton", "tvm", "torch:per-expert", a vendor
# binding such as "torch_npu.npu_sparse_flash_attention", "reference", "fallback:reference".
# A kernel's static label is ``KernelEntry.impl``; a kernel that chooses among implementations
# at call time reports the one it ran with `report_impl` (or runs it through `call_impl`).
IMPL_ATTR = "glm5_impl"  # a function attribute carrying its label (see `implemented_by`)
FALLBACK_REFERENCE = "fallback:reference"
DECOMPOSED = "decomposed"
_IMPL_BY_PACKAGE = (("glm5.kernels.triton", "triton"), ("glm5.kernels.tvm", "tvm"),
                    ("glm5.ir", REFERENCE))

# Open recorders in any context: `report_impl` reads this one global when none is open.
_recording = 0
_recording_lock = threading.Lock()
_recorder: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "glm5_impl_recorder", default=None)


def implemented_by(label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: attach the implementation label ``label`` to a kernel function; it becomes
    the default ``impl`` of ``@backend.kernel`` (and of `default_impl`)."""
    _check_label(label, "implemented_by")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, IMPL_ATTR, label)
        return fn

    return deco


def default_impl(fn: Callable[..., Any], backend: str) -> str:
    """The label of a kernel function that was given none: its ``glm5_impl`` attribute (see
    `implemented_by`), else from its module (``glm5.kernels.triton.*`` -> "triton",
    ``glm5.kernels.tvm.*`` -> "tvm", ``glm5.ir.*`` (an op's reference) -> "reference"), else the
    backend's name."""
    label = getattr(fn, IMPL_ATTR, None)
    if isinstance(label, str) and label:
        return label
    mod = getattr(fn, "__module__", None) or ""
    for package, name in _IMPL_BY_PACKAGE:
        if mod == package or mod.startswith(package + "."):
            return name
    return backend


def recording() -> bool:
    """Whether a `recording_impls` block is open anywhere (then every call goes through the
    recording path)."""
    return _recording > 0


def report_impl(label: str) -> None:
    """Called by a kernel that chooses among implementations at call time: record that
    ``label`` served (part of) this call. A no-op costing one global read when no
    `recording_impls` is open."""
    if _recording:
        rec = _recorder.get()
        if rec is not None:
            rec.append(label)


def call_impl(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, recording ``label`` unless ``fn`` reported labels itself (a
    choice nested inside it is the more precise answer). Without an open recorder this is just
    the call."""
    if not _recording:
        return fn(*args, **kwargs)
    rec = _recorder.get()
    if rec is None:
        return fn(*args, **kwargs)
    n = len(rec)
    out = fn(*args, **kwargs)
    if len(rec) == n:
        rec.append(label)
    return out


class recording_impls:
    """Context manager collecting the labels reported (`report_impl`, `call_impl`) in this
    context (thread / task) while it is open: ``with recording_impls() as labels: ...``;
    ``labels`` is a list, in report order. A recorder opened inside another passes its labels
    on to the outer one when it closes."""

    def __init__(self) -> None:
        self.labels: list[str] = []
        self._token: contextvars.Token | None = None

    def __enter__(self) -> list[str]:
        global _recording
        self._token = _recorder.set(self.labels)
        with _recording_lock:
            _recording += 1
        return self.labels

    def __exit__(self, *exc: Any) -> None:
        global _recording
        assert self._token is not None
        _recorder.reset(self._token)
        self._token = None
        with _recording_lock:
            _recording -= 1
        outer = _recorder.get()
        if outer is not None:
            outer.extend(self.labels)


def run_recorded(entry: "KernelEntry", args: tuple) -> tuple[Any, list[str]]:
    """Run ``entry``'s kernel on ``args`` (positional, as the op lists them) and return
    ``(result, labels)``: the implementation labels that served the call, distinct, in report
    order; ``[entry.impl]`` when the kernel reported none. Exceptions propagate (wrap the call
    in `recording_impls` to keep the labels reported before one)."""
    with recording_impls() as labels:
        result = call_impl(entry.impl, entry.fn, *args)
    return result, list(dict.fromkeys(labels))


def _check_label(label: Any, where: str) -> None:
    if not isinstance(label, str) or not label.strip():
        raise BackendError(f"glm5 {where}: impl expected a short non-empty label such as "
                           f"'triton', 'tvm' or 'torch_npu.npu_lightning_indexer', got {label!r}")


@dataclass(frozen=True)
class KernelEntry:
    """One kernel of a backend: serves ``op`` for ``dtypes`` (None = any) when ``supports``
    (None = always) accepts the call's arguments. ``impl`` labels the implementation (default:
    `default_impl` of ``fn``); ``backward`` is the kernel's own backward, if it has one."""

    op: str
    fn: Callable[..., Any]
    backend: "Backend"
    dtypes: frozenset[torch.dtype] | None = None
    supports: Callable[..., bool] | None = None
    impl: str = ""
    # The kernel's own backward (see `Backend.kernel`); None: the vjp of the op's reference.
    backward: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not self.impl:
            object.__setattr__(self, "impl", default_impl(self.fn, self.backend.name))

    def accepts_dtype(self, dtype: torch.dtype | None) -> bool:
        return self.dtypes is None or dtype is None or dtype in self.dtypes

    def accepts(self, args: tuple) -> bool:
        return self.supports is None or bool(self.supports(*args))


@dataclass(eq=False)
class Backend:
    """A hardware backend: detection + kernels + settings.

    ``Backend(name, vendor, device_type, priority=0, description="")``; attach kernels with
    ``@backend.kernel("<op>", dtypes=(...), supports=None, impl=None)`` and detection with
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
        impl: str | None = None,
        backward: Callable[..., Any] | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register ``fn`` as this backend's kernel for ``op``.

        The kernel takes the op's arguments exactly as docs/ops.md lists them (positionally) and
        returns what the op's reference returns. ``impl`` labels its implementation ("triton",
        "tvm", "torch", "torch_npu.npu_lightning_indexer", ...); None derives it from ``fn``
        (`default_impl`). A kernel that chooses among implementations per call reports the
        one it ran with `report_impl`.

        ``backward`` (optional, API 1.x): the gradient of the op for calls this kernel serves,
        ``backward(grads, outputs, needs, *args) -> tuple``: ``grads`` one gradient per op
        output (None for an output marked not differentiable), ``outputs`` what the kernel
        returned, ``needs`` one bool per op argument (its gradient is wanted), ``args`` the
        op's arguments as the kernel got them; it returns one entry per op argument, a
        gradient shaped like the argument (cast to its dtype) or None. Without it, autograd
        takes the vjp of the op's reference.
        """
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

        if impl is not None:
            _check_label(impl, f"Backend({self.name!r}).kernel({op!r})")
        if backward is not None and not callable(backward):
            raise BackendError(f"glm5.Backend({self.name!r}).kernel({op!r}): backward expected "
                               f"a callable or None, got {backward!r}")
        if backward is not None and not get_op(op).differentiable:
            raise BackendError(f"glm5.Backend({self.name!r}).kernel({op!r}): backward given "
                               f"for an op that is not differentiable")

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if op in self.kernels:
                raise BackendError(
                    f"glm5.Backend({self.name!r}): a kernel for {op!r} is already registered"
                )
            label = impl if impl is not None else default_impl(fn, self.name)
            self.kernels[op] = KernelEntry(op, fn, self, dts, supports, label, backward)
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
