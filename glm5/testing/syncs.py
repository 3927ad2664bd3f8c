"""Count the host reads ("synchronisations") a piece of code makes, on any device, CPU included.

A host read is anything that makes the host wait for tensor *values*: on a GPU each one stalls
the CPU until the queued kernels have run, so a decode step should make as few as possible
(ideally one: the sampled tokens). `HostReadCounter` is a `TorchDispatchMode` that records, with
the Python frame that caused it:

- ``item``: ``aten._local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``),
  ``aten.is_nonzero``;
- ``equal``: ``aten.equal`` (``torch.equal`` answers a Python bool);
- ``shape-from-values``: ops whose output *shape* depends on values (``nonzero``,
  ``masked_select``, ``unique``, boolean-mask indexing and index_put, ``repeat_interleave``
  without ``output_size``, ``bincount``);
- ``to-host``: a copy from a non-CPU tensor to the CPU (``.cpu()``, ``.to("cpu")``,
  ``.tolist()`` / ``.numpy()`` of a device tensor);
- ``tolist`` / ``numpy``: those calls on a CPU tensor (torch serves them without a dispatched
  op, so the counter wraps the two methods while it is active).

On a CPU every tensor is a host tensor, so the count is what a device *would* do only if the
code under test behaves as on a device: value checks (index ranges) run there on CPU tensors and
are skipped on devices, so count inside ``glm5.ir.opdef.checks_as_on_device()`` (or use
`count_host_reads`, which enters it).

Usage::

    from glm5.testing.syncs import count_host_reads
    with count_host_reads() as reads:
        engine.step()
    assert reads.count <= 1, reads.report()
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5.ir.opdef import checks_as_on_device

_aten = torch.ops.aten

# Ops whose result is a host value.
_SCALAR = {_aten._local_scalar_dense.default: "item", _aten.is_nonzero.default: "item",
           _aten.equal.default: "equal"}

# Ops whose output shape depends on the input values (the host must learn the size).
_SHAPE_FROM_VALUES = {
    _aten.nonzero.default, _aten.nonzero.out, _aten.argwhere.default,
    _aten.masked_select.default, _aten.masked_select.out,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default,
    _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default,
}

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclass(frozen=True)
class HostRead:
    """One host read: its ``kind`` (see the module docstring), the aten op (or method) that made
    it, ``where`` (``file:line in function``, the innermost frame outside torch and this module)
    and the frames leading there, innermost last."""

    kind: str
    op: str
    where: str
    stack: tuple[str, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        return f"{self.kind} ({self.op}) at {self.where}"


def _frames() -> tuple[str, ...]:
    out = []
    for fs in traceback.extract_stack()[:-3]:
        path = os.path.abspath(fs.filename)
        if path == _HERE or path.startswith(_TORCH_DIR):
            continue
        out.append(f"{fs.filename}:{fs.lineno} in {fs.name}")
    return tuple(out)


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _classify(func: Any, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(kind, op name) when ``func(*args, **kwargs)`` reads values to the host, else None."""
    name = str(func)
    if func in _SCALAR:
        return _SCALAR[func], name
    if func in _SHAPE_FROM_VALUES:
        return "shape-from-values", name
    packet = func.overloadpacket
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        if len(args) > 1 and _has_bool_index(args[1]):
            return "shape-from-values", f"{name} with a boolean mask"
        return None
    if packet is _aten.repeat_interleave:
        if func is not _aten.repeat_interleave.self_int and kwargs.get("output_size") is None:
            return "shape-from-values", f"{name} without output_size"
        return None
    if packet is _aten.bincount:  # the length is max(minlength, max(input) + 1): a read
        return "shape-from-values", name
    if packet is _aten._to_copy:
        src, dev = args[0], kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None \
                and torch.device(dev).type == "cpu":
            return "to-host", name
        return None
    if packet is _aten.copy_:
        dst, src = args[0], args[1]
        if isinstance(src, torch.Tensor) and src.device.type != "cpu" \
                and dst.device.type == "cpu":
            return "to-host", name
    return None


class HostReadCounter(TorchDispatchMode):
    """Records every host read made while active (see the module docstring); ``count`` and
    ``reads`` give them, ``report()`` lists them with their frames."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[HostRead] = []
        self._saved: dict[str, Any] = {}

    @property
    def count(self) -> int:
        return len(self.reads)

    def record(self, kind: str, op: str) -> None:
        stack = _frames()
        self.reads.append(HostRead(kind, op, stack[-1] if stack else "<unknown>", stack))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        hit = _classify(func, args, kwargs)
        if hit is not None:
            self.record(*hit)
        return func(*args, **kwargs)

    def _wrap(self, method: str) -> None:
        orig = getattr(torch.Tensor, method)
        counter = self

        def wrapped(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            # A device tensor's read shows up as its copy to the CPU (counted above).
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":
                counter.record(method, f"Tensor.{method}")
            return orig(t, *a, **k)

        self._saved[method] = orig
        setattr(torch.Tensor, method, wrapped)

    def __enter__(self) -> "HostReadCounter":
        for m in ("tolist", "numpy"):
            self._wrap(m)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for m, orig in self._saved.items():
                setattr(torch.Tensor, m, orig)
            self._saved.clear()

    def report(self, frames: int = 4) -> str:
        """The reads, one per line, each with its last ``frames`` frames."""
        lines = [f"{self.count} host read(s):"]
        for r in self.reads:
            lines.append(f"  {r}")
            lines += [f"      {f}" for f in r.stack[-frames:-1]]
        return "\n".join(lines)


# The name bench/gpu_model.py looks for (``with SyncCounter() as c: ...; c.count``).
SyncCounter = HostReadCounter


@contextlib.contextmanager
def count_host_reads(as_on_device: bool = True) -> Iterator[HostReadCounter]:
    """Count host reads in the block. ``as_on_device`` (default): value checks behave as on a
    device (skipped unless ``GLM5_STRICT=1``) even on CPU tensors, so the count is a device's."""
    with contextlib.ExitStack() as stack:
        if as_on_device:
            stack.enter_context(checks_as_on_device())
        counter = stack.enter_context(HostReadCounter())
        yield counter
