"""Kernel selection per (op, device type, dtype): override, then plugins.toml policy, then
priority (`ranked`, the one rule that model dispatch, `glm5 ops`, `glm5 bench` and
`glm5 parity` share); `dtypes`/`supports` that decline pass the call on; composite ops
decompose; the reference is the explicit last resort, an error under GLM5_STRICT=1 and
otherwise logged once: in one line per model run (`model_run`), else one line per op."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch

from glm5.backends import api
from glm5.backends.api import (
    REFERENCE,
    STRICT_ENV,
    Backend,
    BackendError,
    KernelEntry,
    UnknownBackendError,
    strict_mode,
)
from glm5.backends.policy import get_policy
from glm5.backends.registry import get_registry, on_change
from glm5.ir.catalog import get_op
from glm5.ir.env import getenv
from glm5.ir.opdef import OpDef, frozen_strict

log = logging.getLogger("glm5")

_override: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "glm5_backend_override", default=()
)


class FallbackError(RuntimeError):
    """Under GLM5_STRICT=1, an op would have fallen back to the reference."""


class use_backend:
    """Prefer the named backend(s) for every op.

    As a function, ``glm5.use_backend("cpu")`` sets the preference for the current context
    (``glm5.use_backend(None)`` clears it); as a context manager, ``with
    glm5.use_backend("cpu"):`` it is restored on exit. Ops the named backends do not serve go
    to the next candidate by policy. Overrides ``GLM5_BACKEND``.
    """

    def __init__(self, *names: str | None) -> None:
        clean = tuple(n for n in names if n is not None)
        if clean:
            reg = get_registry()
            for n in clean:
                reg.get(n)  # KeyError naming the known backends
        self.names = clean
        self._token = _override.set(clean)

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc: Any) -> None:
        _override.reset(self._token)


BACKEND_ENV = "GLM5_BACKEND"


def current_override() -> tuple[str, ...]:
    """The backend names preferred in this context: `use_backend`'s, else ``GLM5_BACKEND``'s
    (comma-separated), else ()."""
    return _override.get() or _env_override()


def check_override() -> tuple[str, ...]:
    """`current_override`, with every name known to the registry: a ``GLM5_BACKEND`` naming a
    backend that is not loaded raises `UnknownBackendError` naming the variable, the value and
    the known backends (`use_backend` checks its names when called)."""
    names = current_override()
    if names and not _override.get():
        reg = get_registry()
        bad = [n for n in names if n not in reg.backends]
        if bad:
            value = os.environ.get(BACKEND_ENV, "")
            raise UnknownBackendError(
                f"glm5: {BACKEND_ENV}={value!r}: {reg.why_not_loaded(bad[0])} (set "
                f"{BACKEND_ENV} to known backend names, comma-separated, or unset it)")
    return names


@dataclass
class Plan:
    """How an (op, device type, dtype) is served."""

    op: OpDef
    device_type: str
    dtype: torch.dtype | None
    candidates: list[KernelEntry]
    reference: KernelEntry | None
    explicit_reference: bool
    declined: list[tuple[str, str]] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """native | decomposed | fallback (before any `supports` check)."""
        if self.candidates:
            return "native"
        if self.op.is_composite:
            return "decomposed"
        return "fallback"

    @property
    def served_by(self) -> str:
        if self.candidates:
            return self.candidates[0].backend.name
        return "(parts)" if self.op.is_composite else REFERENCE


_cache: dict[tuple, Plan] = {}
_fallback_logged: set[tuple] = set()
# A profiler's wrapper of every kernel that plans resolve (`wrapped_kernels`); None: none.
_kernel_wrap: Callable[[KernelEntry], Callable[..., Any]] | None = None


_generation = 0


@on_change  # a backend registered or the registry was reset: plans are stale
def clear_cache() -> None:
    global _generation
    _cache.clear()
    _fallback_logged.clear()
    _generation += 1


@contextlib.contextmanager
def wrapped_kernels(wrap: Callable[[KernelEntry], Callable[..., Any]]) -> Iterator[None]:
    """While active, every kernel a call reaches (native candidates and the reference
    fallback) is called through ``wrap(entry)`` — a profiler's timer around the kernel itself,
    after validation and selection; plans are resolved again on entry and on exit (the
    fast path of `glm5.ops` follows `generation`). Not reentrant."""
    global _kernel_wrap
    if _kernel_wrap is not None:
        raise RuntimeError("glm5 wrapped_kernels: already active (one profiler at a time)")
    _kernel_wrap = wrap
    clear_cache()
    try:
        yield
    finally:
        _kernel_wrap = None
        clear_cache()


def _wrapped(entry: KernelEntry | None) -> KernelEntry | None:
    if _kernel_wrap is None or entry is None:
        return entry
    return dataclasses.replace(entry, fn=_kernel_wrap(entry))


def generation() -> int:
    """A number that changes whenever cached plans go stale: what `glm5.ops` checks before it
    reuses the kernel a signature was served by."""
    return _generation


# `frozen_dispatch`'s reading of the environment: (GLM5_BACKEND's names, GLM5_PLUGINS); None:
# read on every call.
_frozen_env: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "glm5_frozen_dispatch_env", default=None)


def _env_override() -> tuple[str, ...]:
    frozen = _frozen_env.get()
    if frozen is not None:
        return frozen[0]
    env = (getenv(BACKEND_ENV) or "").strip()
    return tuple(n.strip() for n in env.split(",") if n.strip()) if env else ()


def dispatch_state() -> tuple:
    """Everything besides the call itself that `resolve` selects by: the backend override and
    the plugin file setting (``GLM5_STRICT`` is part of a call's signature)."""
    frozen = _frozen_env.get()
    return current_override(), (getenv("GLM5_PLUGINS") if frozen is None else frozen[1])


@contextlib.contextmanager
def frozen_dispatch() -> Iterator[None]:
    """Inside, the environment every op call consults — ``GLM5_BACKEND``, ``GLM5_PLUGINS``,
    ``GLM5_STRICT`` — is read once, on entry: an engine step or a forward makes hundreds of
    calls and would otherwise read it three times in each. `use_backend` still applies
    (a context variable, not the environment)."""
    token = _frozen_env.set((_env_override(), getenv("GLM5_PLUGINS")))
    try:
        with frozen_strict():
            yield
    finally:
        _frozen_env.reset(token)


def ranked(op: str | None = None, override: tuple[str, ...] | None = None
           ) -> tuple[list[Backend], set[str]]:
    """THE selection rule: every registered backend in the order it is offered a call of
    ``op`` (None: any op), and the names chosen explicitly (the reference is a candidate only
    when one of these names it).

    1. the override (``override``; default: `use_backend`'s, else ``GLM5_BACKEND``'s names);
    2. the names plugins.toml gives: ``[ops.<op>] order``, then ``[selection] order`` (the
       packaged file gives none; a user's ``GLM5_PLUGINS`` file may);
    3. every other backend by ``priority``, highest first, then by name: glm5's built-ins and
       third-party plugins alike, so a plugin with a higher priority than a built-in goes
       ahead of it.

    Model dispatch (`resolve`), ``glm5 ops`` and ``glm5 bench`` (`preferred_backend`) order
    backends with this function; ``glm5 parity`` checks the kernels of the backend it is
    given directly, and any ``glm5.ops`` call inside them is dispatched by this rule."""
    if override is None:
        override = check_override()
    reg = get_registry()
    pol = get_policy()
    op_order = pol.op_orders.get(op, ()) if op is not None else ()
    names: list[str] = []
    for n in (*override, *op_order, *pol.order):
        if n in reg.backends and n not in names:
            names.append(n)
    rest = sorted(
        (b for b in reg.backends.values() if b.name not in names and b.name != REFERENCE),
        key=lambda b: (-b.priority, b.name),
    )
    names += [b.name for b in rest]
    explicit = set(override) | set(op_order)
    return [reg.backends[n] for n in names], explicit


def preferred_backend(device_type: str) -> Backend | None:
    """The backend the selection rule (`ranked`, no particular op) offers calls on
    ``device_type`` first among those that are available and allowed by plugins.toml; None
    when only the reference is left. What ``glm5 bench`` times without ``--backend``."""
    pol = get_policy()
    ordered, _ = ranked()
    for b in ordered:
        if (b.name != REFERENCE and pol.allowed(b.name) and b.serves_device(device_type)
                and b.is_available()[0]):
            return b
    return None


def resolve(op: OpDef, device_type: str, dtype: torch.dtype | None) -> Plan:
    override = current_override()
    key = (op.name, device_type, dtype, override, getenv(STRICT_ENV), getenv("GLM5_PLUGINS"))
    plan = _cache.get(key)
    if plan is not None:
        return plan
    pol = get_policy()
    ordered, explicit = ranked(op.name, check_override())
    cands: list[KernelEntry] = []
    declined: list[tuple[str, str]] = []
    explicit_ref = REFERENCE in explicit
    for b in ordered:
        if b.name == REFERENCE and not explicit_ref:
            continue
        why = _decline_reason(b, op.name, device_type, dtype, pol.allowed(b.name))
        if why:
            declined.append((b.name, why))
        else:
            cands.append(_wrapped(b.kernels[op.name]))
    ref_backend = get_registry().backends.get(REFERENCE)
    ref = _wrapped(ref_backend.kernels.get(op.name)) if ref_backend is not None else None
    plan = Plan(op, device_type, dtype, cands, ref, explicit_ref, declined)
    _cache[key] = plan
    return plan


def _decline_reason(b: Backend, op: str, device_type: str, dtype, allowed: bool) -> str:
    if not allowed:
        return "denied by plugins.toml"
    if not b.serves_device(device_type):
        return f"serves {b.device_type}, not {device_type}"
    ok, reason = b.is_available()
    if not ok:
        return f"unavailable: {reason}"
    k = b.kernels.get(op)
    if k is None:
        return "no kernel"
    if not k.accepts_dtype(dtype):
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in k.dtypes or ()))
        return f"dtype {str(dtype).replace('torch.', '')} not in ({names})"
    return ""


# Reference fallbacks of the model run open in this context (see `model_run`):
# (op, device type, dtype name) -> short reason, in the order they happened.
_run: contextvars.ContextVar[dict[tuple[str, str, str], str] | None] = contextvars.ContextVar(
    "glm5_model_run", default=None)

_F = TypeVar("_F", bound=Callable[..., Any])


class _ModelRun:
    """One model run (see `model_run`). Only the outermost run in a context collects and
    logs: a forward inside ``generate`` is part of generate's run."""

    def __init__(self) -> None:
        self._token: contextvars.Token | None = None
        self._fallbacks: dict[tuple[str, str, str], str] = {}

    def __enter__(self) -> "_ModelRun":
        if _run.get() is None:
            self._fallbacks = {}
            self._token = _run.set(self._fallbacks)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is None:
            return
        _run.reset(self._token)
        self._token = None
        new = {k: r for k, r in self._fallbacks.items() if k not in _fallback_logged}
        if new:
            _fallback_logged.update(new)
            log.warning("%s", fallback_line(new))


def model_run(fn: _F | None = None) -> Any:
    """Mark a model run (a forward, a generate call): the reference fallbacks inside it are
    logged when the outermost run ends, in ONE warning line on the ``glm5`` logger naming each
    op with the reason of the backends for its device (``glm5 ops`` shows every candidate's);
    an op is named once per process. Under GLM5_STRICT=1 a fallback raises as always.

    ``with model_run(): ...`` or, as a decorator, ``@model_run`` (a new run per call).
    Costs one context-variable read and set per run."""
    if fn is None:
        return _ModelRun()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced: no kernel runs, nothing to log
            return fn(*args, **kwargs)
        with _ModelRun():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _short_reason(plan: Plan, tried: list[str]) -> str:
    """Why the backends for the call's device declined (those for other devices are noise
    here: ``glm5 ops`` lists them)."""
    backends = get_registry().backends
    parts = [f"{n}: {r}" for n, r in plan.declined
             if n in backends and n != REFERENCE and backends[n].serves_device(plan.device_type)]
    parts += [f"{n}: supports() declined the call" for n in tried]
    return "; ".join(parts) or f"no backend for {plan.device_type} is registered"


def fallback_line(fallbacks: dict[tuple[str, str, str], str]) -> str:
    """The one log line for reference fallbacks {(op, device type, dtype name): reason}: ops
    with the same reason share it ("rms_norm, rope (cpu: no kernel)"), in first-seen order."""
    where = {(d, t) for _, d, t in fallbacks}
    one_place = len(where) == 1
    groups: dict[str, list[str]] = {}
    for (op, d, t), reason in fallbacks.items():
        groups.setdefault(reason, []).append(op if one_place else f"{op} on {d}/{t}")
    items = ", ".join(f"{', '.join(ops)} ({reason})" for reason, ops in groups.items())
    if one_place:
        d, t = next(iter(where))
        head = f"glm5: reference fallback on {d}/{t} for: {items}"
    else:
        head = f"glm5: reference fallback for: {items}"
    return head + " (`glm5 ops` shows every backend's reason; GLM5_STRICT=1 makes it an error)"


def _fallback(plan: Plan, tried: list[str]) -> KernelEntry:
    dt = str(plan.dtype).replace("torch.", "")
    if strict_mode():
        why = "; ".join(f"{n}: {r}" for n, r in plan.declined) or "no other backend registered"
        if tried:
            why += "; declined by supports(): " + ", ".join(tried)
        raise FallbackError(
            f"glm5.{plan.op.name}: no backend serves it on {plan.device_type} for {dt} "
            f"({why}); falling back to the reference is an error under GLM5_STRICT=1"
        )
    if plan.reference is None:
        raise FallbackError(f"glm5.{plan.op.name}: no reference backend is registered")
    key = (plan.op.name, plan.device_type, dt)
    if key not in _fallback_logged:
        run = _run.get()
        if run is not None:
            if key not in run:
                run[key] = _short_reason(plan, tried)
        else:
            _fallback_logged.add(key)
            log.warning("%s", fallback_line({key: _short_reason(plan, tried)}))
    return plan.reference


def call(op: OpDef, values: dict[str, Any], ops: Any) -> Any:
    """Run ``op`` on validated arguments through the selected kernel; a composite op no kernel
    accepts runs its decomposition over ``ops`` (the ``glm5.ops`` namespace).

    Inside `glm5.backends.api.recording_impls` each call records its implementation label:
    what the kernel reported, else its ``impl``; "decomposed" (then the parts' labels) or
    "fallback:reference"."""
    args = tuple(values[n] for n in op.param_names)
    plan = resolve(op, op.device(values).type, op.dispatch_dtype(values))
    tried: list[str] = []
    for entry in plan.candidates:
        if entry.accepts(args):
            if api._recording:
                return api.call_impl(entry.impl, entry.fn, *args)
            return entry.fn(*args)
        tried.append(entry.backend.name)
    if op.is_composite:
        api.report_impl(api.DECOMPOSED)
        return op.decompose(ops, *args)
    return api.call_impl(api.FALLBACK_REFERENCE, _fallback(plan, tried).fn, *args)


def backward_for(op: OpDef, args: tuple) -> Callable[..., Any] | None:
    """The backward of the kernel that serves this call (``args``: the op's arguments,
    positionally), or None where that kernel has none, or the call falls back to the reference
    or decomposes (autograd then takes the vjp of the reference)."""
    values = dict(zip(op.param_names, args))
    plan = resolve(op, op.device(values).type, op.dispatch_dtype(values))
    for entry in plan.candidates:
        if entry.accepts(args):
            return entry.backward
    return None


def serving_entry(op: OpDef, values: dict[str, Any]) -> KernelEntry | None:
    """The kernel entry that serves this call natively, or None where it decomposes or falls
    back to the reference."""
    args = tuple(values[n] for n in op.param_names)
    plan = resolve(op, op.device(values).type, op.dispatch_dtype(values))
    for entry in plan.candidates:
        if entry.accepts(args):
            return entry
    return None


def kernel_for(op: OpDef, values: dict[str, Any]) -> tuple[str, str]:
    """(backend name, mode) that would serve this call: for diagnostics and tests."""
    args = tuple(values[n] for n in op.param_names)
    plan = resolve(op, op.device(values).type, op.dispatch_dtype(values))
    for entry in plan.candidates:
        if entry.accepts(args):
            return entry.backend.name, "native"
    if op.is_composite:
        return "(parts)", "decomposed"
    return REFERENCE, "fallback"


def repack(op_name: str, device_type: str, dtype: torch.dtype | None, packed: torch.Tensor,
           scale: torch.Tensor, scheme: str) -> str | None:
    """Call the repack hook (``@backend.repack(op_name)``) of the backend selected for
    ``op_name`` on ``device_type`` with activations of ``dtype``, once, at load time.

    Returns the backend's name, or None when the selected backend has no repack hook (or only
    the reference / a decomposition serves the op: they take the canonical tensors as they are).
    """
    plan = resolve(get_op(op_name), device_type, dtype)
    if not plan.candidates:
        return None
    b = plan.candidates[0].backend
    fn = b.repackers.get(op_name)
    if fn is None:
        return None
    try:
        fn(packed, scale, scheme)
    except Exception as e:
        raise BackendError(f"glm5: backend {b.name!r} repack for {op_name} ({scheme}) raised "
                           f"{type(e).__name__}: {e}") from e
    return b.name
