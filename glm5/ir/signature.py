"""Typed op signatures: tensor arguments with dtype sets and symbolic shapes, scalar attributes.

A shape is a tuple of dimension specs. A spec is an int (fixed size), a symbol name (``"T"``),
an arithmetic expression over symbols (``"2*I"``, ``"R/2"``, ``"H*(Dn+Dr)"``) or ``"..."``
(any number of leading/middle dimensions). Binding walks the arguments, binds plain symbols, then
solves expressions that are linear in a single still-unknown symbol (``Rkv+Dr`` with ``Rkv``
known gives ``Dr``), then checks every expression. Errors name the op, the argument and what
was expected.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Callable, Mapping, Sequence

import torch

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
FP32_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64})
INDEX_DTYPES: frozenset[torch.dtype] = frozenset({torch.int32})
INT8: frozenset[torch.dtype] = frozenset({torch.int8})
UINT8: frozenset[torch.dtype] = frozenset({torch.uint8})

_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_SYMBOLS = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _dtypes_text(dts: frozenset[torch.dtype]) -> str:
    return "{" + ", ".join(sorted(dtype_name(d) for d in dts)) + "}"


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument. ``dtypes=None`` means any dtype (checked by the op's own ``check``)."""

    name: str
    shape: tuple[Any, ...] | None
    dtypes: frozenset[torch.dtype] | None = FLOAT_DTYPES
    optional: bool = False
    doc: str = ""

    @property
    def is_tensor(self) -> bool:
        return True


@dataclass(frozen=True)
class ScalarArg:
    """A scalar attribute: ``type`` is int, float, bool or str; ``choices`` restricts values."""

    name: str
    type: type
    default: Any = None
    has_default: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    exclusive_minimum: bool = False
    doc: str = ""

    @property
    def is_tensor(self) -> bool:
        return False


def scalar(
    name: str,
    type_: type,
    *,
    default: Any = ...,
    choices: Sequence[Any] | None = None,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    doc: str = "",
) -> ScalarArg:
    return ScalarArg(
        name,
        type_,
        None if default is ... else default,
        default is not ...,
        tuple(choices) if choices is not None else None,
        minimum,
        exclusive_minimum,
        doc,
    )


@dataclass(frozen=True)
class OutArg:
    """An output. ``shape`` is a spec tuple over the bound symbols, ``"like:<arg>"``, or a
    callable ``(symbols, args) -> shape``; ``dtype`` is ``"like:<arg>"``, ``"acc"`` (float32, or
    float64 when the op runs in float64), a ``torch.dtype`` or a callable ``(args) -> dtype``."""

    name: str
    shape: Any
    dtype: Any
    differentiable: bool = True
    doc: str = ""


class OpInputError(ValueError):
    """Raised for bad input at an op boundary (shape, rank, device, value)."""


class OpTypeError(TypeError):
    """Raised for a wrong argument type or dtype at an op boundary."""


def _fmt_shape(shape: Sequence[Any]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@functools.lru_cache(maxsize=None)
def _compiled(expr: str) -> CodeType:
    return compile(expr, "<glm5 shape expression>", "eval")


def evaluate(expr: str, names: Mapping[str, Any]) -> Any:
    """The value of a contract expression (a dim such as ``"H * D"``, a condition) over
    ``names`` (shape symbols, scalar arguments); compiled once per expression, since a call's
    validation evaluates several."""
    return eval(_compiled(expr), {"__builtins__": {}}, names)  # noqa: S307 - ours


@dataclass
class Binding:
    """The result of binding call arguments to a signature."""

    args: dict[str, Any]
    symbols: dict[str, int] = field(default_factory=dict)


def bind_arguments(
    op_name: str, params: Sequence[TensorArg | ScalarArg], args: tuple, kwargs: dict
) -> dict[str, Any]:
    """Map positional and keyword arguments onto parameter names, filling defaults."""
    if len(args) > len(params):
        raise OpTypeError(
            f"glm5.{op_name}: takes {len(params)} arguments "
            f"({', '.join(p.name for p in params)}), got {len(args)} positional"
        )
    out: dict[str, Any] = {}
    for p, a in zip(params, args):
        out[p.name] = a
    names = {p.name for p in params}
    for k, v in kwargs.items():
        if k not in names:
            raise OpTypeError(
                f"glm5.{op_name}: unexpected argument {k!r}; expected one of "
                f"{', '.join(p.name for p in params)}"
            )
        if k in out:
            raise OpTypeError(f"glm5.{op_name}: argument {k!r} given twice")
        out[k] = v
    for p in params:
        if p.name in out:
            continue
        if isinstance(p, TensorArg) and p.optional:
            out[p.name] = None
        elif isinstance(p, ScalarArg) and p.has_default:
            out[p.name] = p.default
        else:
            raise OpTypeError(f"glm5.{op_name}: missing required argument {p.name!r}")
    return out


def _check_scalar(op_name: str, p: ScalarArg, v: Any) -> Any:
    if p.type is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif p.type is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = isinstance(v, p.type)
    if not ok:
        if p.has_default and p.default is None and v is None:
            return v
        raise OpTypeError(
            f"glm5.{op_name}: argument {p.name!r} expected {p.type.__name__}, "
            f"got {type(v).__name__} ({v!r})"
        )
    if p.choices is not None and v not in p.choices:
        raise OpInputError(
            f"glm5.{op_name}: argument {p.name!r} expected one of {list(p.choices)}, got {v!r}"
        )
    if p.minimum is not None:
        bad = v <= p.minimum if p.exclusive_minimum else v < p.minimum
        if bad or v != v:
            rel = ">" if p.exclusive_minimum else ">="
            raise OpInputError(
                f"glm5.{op_name}: argument {p.name!r} expected {rel} {p.minimum}, got {v!r}"
            )
    return v


def bind_shapes(
    op_name: str, params: Sequence[TensorArg | ScalarArg], values: dict[str, Any]
) -> dict[str, int]:
    """Check types, dtypes, ranks and devices and return the symbol values."""
    syms: dict[str, int] = {}
    pending: list[tuple[str, int, str, tuple]] = []  # (arg, dim index, expr, shape)
    device = None
    device_arg = None
    for p in params:
        v = values[p.name]
        if isinstance(p, ScalarArg):
            values[p.name] = _check_scalar(op_name, p, v)
            continue
        if v is None:
            if p.optional:
                continue
            raise OpTypeError(f"glm5.{op_name}: argument {p.name!r} is required, got None")
        if not isinstance(v, torch.Tensor):
            raise OpTypeError(
                f"glm5.{op_name}: argument {p.name!r} expected a torch.Tensor, "
                f"got {type(v).__name__}"
            )
        if p.dtypes is not None and v.dtype not in p.dtypes:
            raise OpTypeError(
                f"glm5.{op_name}: argument {p.name!r} expected dtype in {_dtypes_text(p.dtypes)}, "
                f"got {dtype_name(v.dtype)}"
            )
        if device is None:
            device, device_arg = v.device, p.name
        elif v.device != device:
            raise OpInputError(
                f"glm5.{op_name}: argument {p.name!r} is on {v.device}, expected {device} "
                f"(the device of {device_arg!r})"
            )
        if p.shape is None:
            continue
        shape = tuple(v.shape)
        spec = p.shape
        if "..." in spec:
            i = spec.index("...")
            head, tail = spec[:i], spec[i + 1 :]
            if len(shape) < len(head) + len(tail):
                raise OpInputError(
                    f"glm5.{op_name}: argument {p.name!r} expected at least "
                    f"{len(head) + len(tail)} dims {_fmt_shape(spec)}, got {_fmt_shape(shape)}"
                )
            dims = list(zip(head, shape[: len(head)])) + list(
                zip(tail, shape[len(shape) - len(tail) :])
            )
        else:
            if len(shape) != len(spec):
                raise OpInputError(
                    f"glm5.{op_name}: argument {p.name!r} expected {len(spec)} dims "
                    f"{_fmt_shape(spec)}, got {len(shape)} dims {_fmt_shape(shape)}"
                )
            dims = list(zip(spec, shape))
        for d, (s, n) in enumerate(dims):
            if isinstance(s, int):
                if n != s:
                    raise OpInputError(
                        f"glm5.{op_name}: argument {p.name!r} expected shape {_fmt_shape(spec)}, "
                        f"got {_fmt_shape(shape)} (dim {d} must be {s})"
                    )
            elif _NAME.match(s):
                if s in syms and syms[s] != n:
                    raise OpInputError(
                        f"glm5.{op_name}: argument {p.name!r} expected shape {_fmt_shape(spec)} "
                        f"with {s}={syms[s]}, got {_fmt_shape(shape)}"
                    )
                syms.setdefault(s, n)
            else:
                pending.append((p.name, n, s, spec))
    # Solve expressions linear in one unknown, then check all of them.
    progress = True
    while progress:
        progress = False
        for name, n, expr, spec in pending:
            unknown = [s for s in set(_SYMBOLS.findall(expr)) if s not in syms]
            if len(unknown) != 1:
                continue
            u = unknown[0]
            f0 = evaluate(expr, {**syms, u: 0})
            a = evaluate(expr, {**syms, u: 1}) - f0
            if a == 0:
                continue
            x = (n - f0) / a
            if x != int(x) or x < 0:
                known = {k: v for k, v in syms.items() if k in _SYMBOLS.findall(expr)}
                given = f" with {', '.join(f'{k}={v}' for k, v in known.items())}" if known else ""
                raise OpInputError(
                    f"glm5.{op_name}: argument {name!r} expected shape {_fmt_shape(spec)}, got "
                    f"a dim of {n}, which is not {expr} for any whole {u} >= 0{given}"
                )
            syms[u] = int(x)
            progress = True
    for name, n, expr, spec in pending:
        unknown = [s for s in set(_SYMBOLS.findall(expr)) if s not in syms]
        if unknown:
            raise OpInputError(
                f"glm5.{op_name}: argument {name!r}: cannot determine {', '.join(unknown)} "
                f"from the shapes given"
            )
        want = evaluate(expr, syms)
        if want != n:
            raise OpInputError(
                f"glm5.{op_name}: argument {name!r} expected shape {_fmt_shape(spec)} where "
                f"{expr} = {want:g}, got a dim of {n}"
            )
    return syms


def out_dtype(spec: Any, values: dict[str, Any], acc: torch.dtype) -> torch.dtype:
    if isinstance(spec, torch.dtype):
        return spec
    if spec == "acc":
        return acc
    if isinstance(spec, str) and spec.startswith("like:"):
        return values[spec[5:]].dtype
    if callable(spec):
        return spec(values)
    raise ValueError(f"bad output dtype spec {spec!r}")


def out_shape(spec: Any, syms: dict[str, int], values: dict[str, Any]) -> tuple[int, ...]:
    if isinstance(spec, str) and spec.startswith("like:"):
        return tuple(values[spec[5:]].shape)
    if callable(spec):
        return tuple(spec(syms, values))
    return tuple(s if isinstance(s, int) else int(evaluate(s, syms)) for s in spec)


ShapeFn = Callable[[dict[str, int], dict[str, Any]], Sequence[int]]
