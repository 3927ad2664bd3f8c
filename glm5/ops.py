"""Python entry points: `glm5.ops.<name>(...)` for every op of the catalog.

Each call validates its arguments at the boundary (errors name the op, the argument and what was
expected) — in full the first time a signature is seen, afterwards only the checks that read
values (`OpDef.validate_cached`; an eager call whose signature a kernel already served goes
straight to that kernel) — then
- under tracing (`torch.compile`, `torch.export`, fake tensors) calls `torch.ops.glm5.<name>`
  so the graph holds one node per op; while dynamo traces (`torch.compile`) the Python
  validation is skipped (it would break the graph): the op's fake kernel checks the shapes at
  trace time and its real kernel validates every call at run time;
- when autograd needs the op, calls `torch.ops.glm5.<name>` (backward = that of the kernel
  that served the forward where it registered one, else the vjp of the reference); a mutating
  composite (`mla_prolog`) runs its decomposition instead, whose parts are differentiable;
- otherwise (eager inference) calls the selected kernel directly, skipping the torch.library
  dispatcher's overhead per call (docs/performance.md, "Dispatch overhead").
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from glm5.backends import api, selection
from glm5.ir import library
from glm5.ir.catalog import OPS
from glm5.ir.opdef import VALIDATED_LIMIT, OpDef, has_data

# This module is the namespace composite ops decompose over (``OpDef.decompose(ops, ...)``).
_NS = sys.modules[__name__]


class _Served:
    """An op's kernels by call signature: (signature, dispatch state) -> (plan generation,
    kernel entry) of eager calls that a kernel served natively after a validation that read
    no value. A later call with the same key, while the plans are of the same generation and
    the entry still accepts the arguments, goes straight to that kernel: no validation, no
    selection. Used by `glm5.ops.<name>` and by the `torch.ops.glm5.<name>` binding."""

    def __init__(self, op: OpDef) -> None:
        self.op, self.names = op, op.param_names
        self.table: dict[tuple, tuple[int, Any]] = {}

    def key(self, args: tuple, kwargs: dict | None = None) -> tuple | None:
        if api.recording():
            return None
        sig = self.op.signature(args, kwargs)
        return None if sig is None else (sig, selection.dispatch_state())

    def run(self, key: tuple | None, args: tuple, kwargs: dict | None = None) -> Any:
        """The kernel's output for a served ``key``, else library.MISS."""
        if key is None:
            return library.MISS
        hit = self.table.get(key)
        if hit is None or hit[0] != selection.generation():
            return library.MISS
        a = args if not kwargs and len(args) == len(self.names) else \
            tuple(self.op.bind(args, kwargs)[n] for n in self.names)
        return hit[1].fn(*a) if hit[1].accepts(a) else library.MISS

    def remember(self, key: tuple | None, values: dict[str, Any]) -> None:
        """After a validation: remember the kernel serving ``values`` natively when the
        validation read no value (`OpDef.validate_cached` cached the signature)."""
        if key is None or not self.op.shape_only(key[0]):
            return
        entry = selection.serving_entry(self.op, values)
        if entry is not None:
            if len(self.table) >= VALIDATED_LIMIT:
                self.table.clear()
            self.table[key] = (selection.generation(), entry)


# One table per path: the binding's kernel runs below autograd, so a call it served with
# tensors that require grad must not send an eager `glm5.ops` call (where autograd is needed)
# straight to the kernel.
_served = {name: _Served(op) for name, op in OPS.items()}
_served_binding = {name: _Served(op) for name, op in OPS.items()}


def _torch_call(op: OpDef, values: dict[str, Any]) -> Any:
    """The `torch.ops.glm5` binding's kernel call, after its validation."""
    served = _served_binding[op.name]
    served.remember(served.key(tuple(values[n] for n in op.param_names)), values)
    return selection.call(op, values, _NS)


def _torch_fast(op: OpDef, args: tuple) -> Any:
    served = _served_binding[op.name]
    return served.run(served.key(args), args)


_torch_ops = library.bind_all(_torch_call, backward_for=selection.backward_for,
                              fast=_torch_fast)


def _tracing(values: dict[str, Any], op: OpDef) -> bool:
    for p in op.tensor_params:
        v = values.get(p.name)
        if isinstance(v, torch.Tensor):
            return not has_data(v)
    return False


def _needs_grad(values: dict[str, Any], op: OpDef) -> bool:
    if not op.differentiable or not torch.is_grad_enabled():
        return False
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values.values())


def _make(op: OpDef) -> Callable[..., Any]:
    torch_op = getattr(torch.ops.glm5, op.name)
    names = op.param_names
    served = _served[op.name]

    def fn(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo traces this: no Python validation here (its evals, ContextVar reads,
            # .item() / .tolist() value checks and torch.unique each broke the graph, 33-45
            # breaks per decode step; bench/compile_decode.py). Bad input still gets its
            # error: the fake kernel (`op.meta`, run by the dispatcher on fake tensors, not
            # traced by dynamo) binds the shapes (`bind_shapes`) at trace time, and the real
            # kernel behind `torch.ops.glm5.<name>` (glm5/ir/library.py `_impl`) runs
            # `validate_cached` on every call at run time (value checks included).
            # tests/test_validation_cache.py checks both.
            if kwargs or len(args) != len(names):
                values = op.bind(args, kwargs)  # plain dict work: traceable
                return torch_op(*(values[n] for n in names))
            return torch_op(*args)
        key = served.key(args, kwargs)
        out = served.run(key, args, kwargs)
        if out is not library.MISS:
            return out
        values = op.validate_cached(args, kwargs)
        if _tracing(values, op):
            return torch_op(*(values[n] for n in names))
        if _needs_grad(values, op):
            if op.mutates:
                return op.decompose(_NS, *(values[n] for n in names))
            return torch_op(*(values[n] for n in names))
        served.remember(key, values)
        return selection.call(op, values, _NS)

    fn.__name__ = fn.__qualname__ = op.name
    sig = ", ".join(p.name for p in op.params)
    outs = ", ".join(o.name for o in op.outputs)
    fn.__doc__ = (f"glm5.ops.{op.name}({sig}) -> {outs}\n\n{op.summary}\n"
                  f"(contract: docs/ops.md#{op.name})")
    return fn


for _op in OPS.values():
    globals()[_op.name] = _make(_op)

__all__ = list(OPS)


def repack_weight(op_name: str, packed: torch.Tensor, scale: torch.Tensor, scheme: str,
                  activation_dtype: torch.dtype | None) -> str | None:
    """Load-time hook for quantized weights: offer the canonical ``packed`` codes and ``scale``
    of ``scheme`` to the backend that will serve ``op_name`` (``quant_linear`` /
    ``moe_experts_quant``) on the weight's device, so it can cache its own layout once. Calls
    still pass the canonical tensors. Returns that backend's name, or None when it has no
    repack hook. (Not an op: it is the model's one door to load-time preparation.)"""
    return selection.repack(op_name, packed.device.type, activation_dtype, packed, scale,
                            scheme)


# The model marks its runs (forward, generate) with this, so that the reference fallbacks of
# one run are logged in one line (the model reaches dispatch only through this module).
model_run = selection.model_run

# Layers above the model (engine, RL) scope a run to a backend with this, as users do with
# `glm5.use_backend`; they reach the plugin system only through this module.
use_backend = selection.use_backend

# A run of many op calls (an engine step) reads the dispatch environment once with this.
frozen_dispatch = selection.frozen_dispatch


def __getattr__(name: str) -> Any:
    raise AttributeError(f"glm5.ops has no op {name!r}; known ops: {', '.join(OPS)}")
