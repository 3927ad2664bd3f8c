"""Kernel selection per (op, device type, dtype): override, then plugins.toml policy, then
priority; `dtypes`/`supports` that decline pass the call on; composite ops decompose; the
reference is the explicit, logged last resort (an error under GLM5_STRICT=1)."""

from __future__ import annotations

import contextvars
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from glm5.backends import api
from glm5.backends.api import REFERENCE, STRICT_ENV, Backend, KernelEntry, strict_mode
from glm5.ir.opdef import OpDef

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
            from glm5.backends.registry import get_registry

            reg = get_registry()
            for n in clean:
                reg.get(n)  # KeyError naming the known backends
        self.names = clean
        self._token = _override.set(clean)

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc: Any) -> None:
        _override.reset(self._token)


def current_override() -> tuple[str, ...]:
    o = _override.get()
    if o:
        return o
    env = os.environ.get("GLM5_BACKEND", "").strip()
    return tuple(n.strip() for n in env.split(",") if n.strip()) if env else ()


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


def clear_cache() -> None:
    _cache.clear()
    _fallback_logged.clear()


def _ordered_backends(op: str, override: tuple[str, ...]) -> tuple[list[Backend], set[str]]:
    from glm5.backends.policy import get_policy
    from glm5.backends.registry import get_registry

    reg = get_registry()
    pol = get_policy()
    names: list[str] = []
    for n in (*override, *pol.op_orders.get(op, ()), *pol.order):
        if n in reg.backends and n not in names:
            names.append(n)
    rest = sorted(
        (b for b in reg.backends.values() if b.name not in names and b.name != REFERENCE),
        key=lambda b: (-b.priority, b.name),
    )
    names += [b.name for b in rest]
    explicit = set(override) | set(pol.op_orders.get(op, ()))
    return [reg.backends[n] for n in names], explicit


def resolve(op: OpDef, device_type: str, dtype: torch.dtype | None) -> Plan:
    env = os.environ
    override = current_override()
    key = (op.name, device_type, dtype, override, env.get(STRICT_ENV), env.get("GLM5_PLUGINS"))
    plan = _cache.get(key)
    if plan is not None:
        return plan
    from glm5.backends.policy import get_policy
    from glm5.backends.registry import get_registry

    pol = get_policy()
    ordered, explicit = _ordered_backends(op.name, override)
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
            cands.append(b.kernels[op.name])
    ref_backend = get_registry().backends.get(REFERENCE)
    ref = ref_backend.kernels.get(op.name) if ref_backend is not None else None
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


def _fallback(plan: Plan, tried: list[str]) -> KernelEntry:
    strict = strict_mode()
    key = (plan.op.name, plan.device_type, plan.dtype)
    if strict or key not in _fallback_logged or plan.reference is None:
        why = "; ".join(f"{n}: {r}" for n, r in plan.declined) or "no other backend registered"
        if tried:
            why += "; declined by supports(): " + ", ".join(tried)
        dt = str(plan.dtype).replace("torch.", "")
        if strict:
            raise FallbackError(
                f"glm5.{plan.op.name}: no backend serves it on {plan.device_type} for {dt} "
                f"({why}); falling back to the reference is an error under GLM5_STRICT=1"
            )
        if plan.reference is None:
            raise FallbackError(f"glm5.{plan.op.name}: no reference backend is registered")
        _fallback_logged.add(key)
        log.warning("glm5.%s on %s/%s falls back to the reference (%s)",
                    plan.op.name, plan.device_type, dt, why)
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
    from glm5.backends.api import BackendError
    from glm5.ir.catalog import get_op

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
