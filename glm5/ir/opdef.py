"""`OpDef`: the one definition of an op (signature, reference, shape function, cost, error
model, selection rule, decomposition)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from glm5.ir.env import getenv
from glm5.ir.numerics import ErrorTerms, Selection
from glm5.ir.signature import (
    OpInputError,
    OutArg,
    ScalarArg,
    TensorArg,
    bind_arguments,
    bind_shapes,
    out_dtype,
    out_shape,
)

# `check(values, symbols)` hooks look at tensor *values* (index ranges) only where
# `value_checks` allows it: on CPU tensors, where reading them is free, or everywhere under
# GLM5_STRICT=1. On a device each read would stall the host until the queued kernels ran (a
# decode step made ~15 of them), so there they are skipped; tensors without data (meta / fake
# under tracing) are never read.

STRICT_ENV = "GLM5_STRICT"

# Tests flip this to make CPU tensors behave as device tensors (glm5.testing.syncs counts the
# host reads a device would make by running on CPU inside `checks_as_on_device`).
_as_on_device: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "glm5_checks_as_on_device", default=False)


# `frozen_strict`'s reading of GLM5_STRICT (None: read the environment on every call).
_frozen_strict: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "glm5_frozen_strict", default=None)


def strict_mode() -> bool:
    """``GLM5_STRICT`` is set (1/true/yes/on): a broken plugin or a reference fallback raises,
    and argument value checks run on every device."""
    frozen = _frozen_strict.get()
    if frozen is not None:
        return frozen
    return (getenv(STRICT_ENV) or "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def frozen_strict() -> Iterator[None]:
    """Inside, `strict_mode` answers what ``GLM5_STRICT`` said on entry without reading the
    environment again (every op call asks it: an engine step makes hundreds of calls)."""
    token = _frozen_strict.set(strict_mode())
    try:
        yield
    finally:
        _frozen_strict.reset(token)


def has_data(t: torch.Tensor) -> bool:
    """False for meta, fake and functional (tracing) tensors: their values cannot be read."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t.device.type != "meta"
    return False


def value_checks(*tensors: torch.Tensor | None) -> bool:
    """Whether validation may read the values of ``tensors`` (None entries are ignored): the one
    place that decides it. True when all carry data and either ``GLM5_STRICT`` is on or all
    are CPU tensors (outside `checks_as_on_device`); False on a device otherwise, where a read
    is a host synchronisation."""
    ts = [t for t in tensors if t is not None]
    if not all(has_data(t) for t in ts):
        return False
    ok = strict_mode() or (not _as_on_device.get() and all(t.device.type == "cpu" for t in ts))
    if ok:
        # A validation that may read values cannot be reused for another call with the same
        # signature (`OpDef.validate_cached`).
        _value_reads.n = getattr(_value_reads, "n", 0) + 1
    return ok


# How many times `value_checks` allowed a read, per thread.
_value_reads = threading.local()


def value_check_count() -> int:
    """How many times `value_checks` has answered True in this thread (a counter: a validation
    during which it moved may have read argument values)."""
    return getattr(_value_reads, "n", 0)


#: validated signatures an op remembers before it forgets them all and starts again (shapes
#: that change every call, e.g. a growing KV length, must not grow memory without bound)
VALIDATED_LIMIT = 4096
_UNCACHEABLE = object()


def _arg_key(v: Any) -> Any:
    t = type(v)
    if t is torch.Tensor or t is torch.nn.Parameter:
        if v.is_meta:
            return _UNCACHEABLE
        return (v.dtype, v.device, v.shape, v.stride(), v.requires_grad)
    if v is None or t in (bool, int, float, str):
        return (t, v)  # the type too: 1, 1.0 and True are equal keys but not equal arguments
    return _UNCACHEABLE


@contextlib.contextmanager
def checks_as_on_device() -> Iterator[None]:
    """Within the block (this thread / context), `value_checks` treats CPU tensors as device
    tensors: value checks are skipped unless ``GLM5_STRICT=1``. For counting the host reads a
    device would make (glm5.testing.syncs) on a machine without one."""
    token = _as_on_device.set(True)
    try:
        yield
    finally:
        _as_on_device.reset(token)


@dataclass
class OpDef:
    """One op of the contract (docs/ops.md).

    ``reference(**args)`` is plain torch, dtype-generic, and runs in float64. ``cost(args, syms)``
    returns ``(flops, bytes)``. ``check(args, syms)`` adds op-specific validation beyond the
    signature (value ranges, cross-argument rules). ``error(o, ref, work)`` is the op's error
    model (glm5.ir.numerics): for each floating output (and mutated argument) the ErrorTerms a
    correct kernel called with dtype ``work`` may show against the float64 reference ``ref``
    computed from the float64 inputs ``o``; its docstring is the derivation. ``selection``,
    for an op whose output is a selection of indices, says how such a result is judged.
    ``decompose(ops, *args)``, for a composite op, computes the op from other ops called
    through ``ops`` (the namespace of op entry points, i.e. ``glm5.ops``, handed in by the
    caller so that the IR imports no layer above it).
    """

    name: str
    summary: str
    params: tuple[TensorArg | ScalarArg, ...]
    outputs: tuple[OutArg, ...]
    reference: Callable[..., Any]
    cost: Callable[[dict[str, Any], dict[str, int]], tuple[float, float]]
    error: Callable[[dict[str, Any], tuple, torch.dtype], dict[str, ErrorTerms]] | None = None
    check: Callable[[dict[str, Any], dict[str, int]], None] | None = None
    decompose: Callable[..., Any] | None = None
    mutates: tuple[str, ...] = ()
    selection: Selection | None = None
    differentiable: bool = True
    category: str = ""
    # Names of tensor parameters whose dtype selects the kernel (first floating input by default).
    dispatch_arg: str | None = None
    _param_names: tuple[str, ...] = field(init=False, repr=False)
    _tensor_params: tuple[TensorArg, ...] = field(init=False, repr=False)
    # Signatures of calls validated with values read: their (shape symbols, normalised scalars)
    # (`validate_cached`).
    _bound: dict[tuple, tuple[dict, dict]] = field(init=False, repr=False, compare=False,
                                                   default_factory=dict)
    # Signatures of calls that passed `validate` without reading any value (`validate_cached`).
    _validated: dict[tuple, None] = field(init=False, repr=False, compare=False,
                                          default_factory=dict)

    def __post_init__(self) -> None:
        self._param_names = tuple(p.name for p in self.params)
        self._tensor_params = tuple(p for p in self.params if isinstance(p, TensorArg))
        if self.dispatch_arg is None:
            for p in self.params:
                if isinstance(p, TensorArg) and p.dtypes is not None and any(
                    d.is_floating_point for d in p.dtypes
                ):
                    self.dispatch_arg = p.name
                    break

    # ----------------------------------------------------------------- structure
    @property
    def is_composite(self) -> bool:
        return self.decompose is not None

    @property
    def tensor_params(self) -> tuple[TensorArg, ...]:
        return self._tensor_params

    @property
    def param_names(self) -> tuple[str, ...]:
        return self._param_names

    # ----------------------------------------------------------------- binding
    def bind(self, args: tuple = (), kwargs: dict | None = None) -> dict[str, Any]:
        return bind_arguments(self.name, self.params, args, kwargs or {})

    def validate(
        self, args: tuple = (), kwargs: dict | None = None
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """Bind and check a call; raise ``OpInputError``/``OpTypeError`` naming the argument."""
        values = self.bind(args, kwargs)
        syms = bind_shapes(self.name, self.params, values)
        if self.check is not None:
            self.check(values, syms)
        return values, syms

    def signature(self, args: tuple, kwargs: dict | None = None) -> tuple | None:
        """The key under which a call's validation is remembered: how the arguments were
        passed, each tensor's dtype, device, shape, strides and whether it requires grad, each
        scalar's type and value,
        and the two settings that decide value checks (``GLM5_STRICT``, `checks_as_on_device`).
        None when an argument is neither (a list, a tensor subclass, a meta tensor)."""
        key: list[Any] = [len(args), strict_mode(), _as_on_device.get()]
        for v in args:
            k = _arg_key(v)
            if k is _UNCACHEABLE:
                return None
            key.append(k)
        if kwargs:
            for name, v in kwargs.items():
                k = _arg_key(v)
                if k is _UNCACHEABLE:
                    return None
                key.append(name)
                key.append(k)
        return tuple(key)

    def validate_cached(self, args: tuple = (), kwargs: dict | None = None) -> dict[str, Any]:
        """`validate` once per signature: a call whose `signature` passed validation before,
        without any value being read, is only bound (its checks depend on nothing the
        signature does not fix); a call whose signature passed before with values read runs
        the op's checks again (they read the values) but not the shape binding (`bind_shapes`
        depends on the signature alone: its symbols and normalised scalars are reused); any
        other call is validated in full. Checks that read values (index ranges:
        `value_checks`) therefore run on every call where they run at all. Returns the bound
        values; raises as `validate` does."""
        if torch.compiler.is_compiling():  # traced: checks run once, at trace time
            return self.validate(args, kwargs)[0]
        key = self.signature(args, kwargs)
        if key is not None:
            if key in self._validated:
                return bind_arguments(self.name, self.params, args, kwargs or {})
            bound = self._bound.get(key)
            if bound is not None:
                values = bind_arguments(self.name, self.params, args, kwargs or {})
                values.update(bound[1])
                if self.check is not None:
                    self.check(values, dict(bound[0]))
                return values
        reads = value_check_count()
        values, syms = self.validate(args, kwargs)
        if key is not None:
            memo = self._validated if value_check_count() == reads else self._bound
            if len(memo) >= VALIDATED_LIMIT:
                memo.clear()
            memo[key] = None if memo is self._validated else (dict(syms), {
                p.name: values[p.name] for p in self.params if isinstance(p, ScalarArg)})
        return values

    def shape_only(self, signature: tuple) -> bool:
        """Whether a call of this `signature` passed validation without reading any value
        (`validate_cached` skips its checks): what may be served without validating."""
        return signature in self._validated

    def symbols(self, values: dict[str, Any]) -> dict[str, int]:
        return bind_shapes(self.name, self.params, dict(values))

    def acc_dtype(self, values: dict[str, Any]) -> torch.dtype:
        """float64 when any floating input is float64 (the oracle), else float32."""
        for p in self.tensor_params:
            v = values.get(p.name)
            if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
                return torch.float64
        return torch.float32

    def dispatch_dtype(self, values: dict[str, Any]) -> torch.dtype | None:
        if self.dispatch_arg is None:
            return None
        v = values.get(self.dispatch_arg)
        return v.dtype if isinstance(v, torch.Tensor) else None

    def device(self, values: dict[str, Any]) -> torch.device:
        for p in self.tensor_params:
            v = values.get(p.name)
            if isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    # ----------------------------------------------------------------- shape function
    def meta(self, *args: Any, **kwargs: Any) -> Any:
        """Empty outputs of the right shape and dtype (the torch ``register_fake``)."""
        values = self.bind(args, kwargs)
        syms = self.symbols(values)
        acc = self.acc_dtype(values)
        like = next(
            v for p in self.tensor_params if isinstance(v := values.get(p.name), torch.Tensor)
        )
        outs = [
            like.new_empty(out_shape(o.shape, syms, values), dtype=out_dtype(o.dtype, values, acc))
            for o in self.outputs
        ]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def output_specs(self, values: dict[str, Any]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        syms = self.symbols(values)
        acc = self.acc_dtype(values)
        return [
            (out_shape(o.shape, syms, values), out_dtype(o.dtype, values, acc))
            for o in self.outputs
        ]

    def flops_bytes(self, *args: Any, **kwargs: Any) -> tuple[float, float]:
        values = self.bind(args, kwargs)
        return self.cost(values, self.symbols(values))

    # ----------------------------------------------------------------- torch schema
    def schema(self) -> str:
        parts = []
        for p in self.params:
            if isinstance(p, TensorArg):
                t = "Tensor"
                if p.name in self.mutates:
                    t = "Tensor(a!)"
                if p.optional:
                    parts.append(f"{t}? {p.name}=None")
                else:
                    parts.append(f"{t} {p.name}")
            else:
                t = {int: "int", float: "float", bool: "bool", str: "str"}[p.type]
                if p.has_default:
                    dv = p.default
                    if p.type is str:
                        dv = f'"{dv}"'
                    elif p.type is bool:
                        dv = "True" if dv else "False"
                    elif dv is None:
                        t, dv = t + "?", "None"
                    parts.append(f"{t} {p.name}={dv}")
                else:
                    parts.append(f"{t} {p.name}")
        rets = ", ".join("Tensor" for _ in self.outputs)
        ret = rets if len(self.outputs) == 1 else f"({rets})"
        return f"({', '.join(parts)}) -> {ret}"


def require(cond: bool, op: str, arg: str, expected: str, got: Any) -> None:
    """Raise the house-style boundary error when ``cond`` is false."""
    if not cond:
        raise OpInputError(f"glm5.{op}: argument {arg!r} expected {expected}, got {got}")


def check_index_range(
    op: str, arg: str, idx: torch.Tensor, low: int, high: int, what: str = ""
) -> None:
    """Entries of ``idx`` must be −1 or in ``[low, high)`` (a value check: see `value_checks`)."""
    if idx.numel() == 0 or not value_checks(idx):
        return
    bad = (idx != -1) & ((idx < low) | (idx >= high))
    if bool(bad.any()):
        first = idx[bad].flatten()[0].item()
        raise OpInputError(
            f"glm5.{op}: argument {arg!r} expected entries in [{low}, {high}) or -1"
            f"{' ' + what if what else ''}, got {first}"
        )


def seq(x: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(x)
