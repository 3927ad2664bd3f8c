"""The TVM kernels the cpu backend serves: (op, fn, dtypes, supports) rows.

`fn` takes the op's arguments exactly as docs/ops.md lists them; `context` is a callable returning
the backend's TVMContext (resolved lazily, so nothing imports tvm before a kernel runs).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

# (module under glm5.kernels.tvm, the function building its rows)
MODULES = ("sparse_attention", "indexer", "topk", "norm", "moe", "route", "quant")


def kernels(context: Callable[[], Any]) -> list[tuple[str, Callable, tuple | None, Any]]:
    rows = []
    for name in MODULES:
        try:
            mod = importlib.import_module(f"glm5.kernels.tvm.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"glm5.kernels.tvm.{name}":
                continue
            raise
        rows.extend(mod.kernels(context))
    return rows

