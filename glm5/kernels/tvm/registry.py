"""The TVM kernels the cpu backend serves: (op, fn, dtypes, supports) rows, and the backwards
of those that have one.

`fn` takes the op's arguments exactly as docs/ops.md lists them; `context` is a callable returning
the backend's TVMContext (resolved lazily, so nothing imports tvm before a kernel runs).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

# (module under glm5.kernels.tvm, the function building its rows)
MODULES = ("sparse_attention", "indexer", "topk", "norm", "moe", "route", "quant", "rl")


def _modules() -> list[Any]:
    mods = []
    for name in MODULES:
        try:
            mods.append(importlib.import_module(f"glm5.kernels.tvm.{name}"))
        except ModuleNotFoundError as e:
            if e.name == f"glm5.kernels.tvm.{name}":
                continue
            raise
    return mods


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    rows = []
    for mod in _modules():
        rows.extend(mod.kernels(context))
    return rows


def backwards(context: Callable[[], Any]) -> dict[str, Callable[..., tuple]]:
    """op -> the backward of its kernel, for the modules that define ``backwards(context)``
    (the contract of ``glm5.Backend.kernel``'s ``backward``)."""
    out: dict[str, Callable[..., tuple]] = {}
    for mod in _modules():
        if hasattr(mod, "backwards"):
            out.update(mod.backwards(context))
    return out

