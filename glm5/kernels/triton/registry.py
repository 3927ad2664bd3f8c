"""The Triton kernels a backend can serve: (op, fn, dtypes, supports) rows.

Each kernel module defines `DEFAULTS: dict[op, dict]` (default launch parameters) and
`kernels(tuning) -> rows`, where `tuning(op) -> dict` returns the backend's launch parameters
for that op (its own table, falling back op by op to the modules' DEFAULTS). Modules are imported
only when a backend registers, and must not import triton at module top level (Triton reads
TRITON_INTERPRET when a @triton.jit function is defined: kernels live in submodules imported on
first call).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

MODULES = ("norm", "indexer", "sparse_attention", "attention", "mla_prolog", "moe",
           "quant_linear", "logprobs")


def _modules() -> list[Any]:
    out = []
    for name in MODULES:
        try:
            out.append(importlib.import_module(f"glm5.kernels.triton.{name}"))
        except ModuleNotFoundError as e:
            if e.name == f"glm5.kernels.triton.{name}":
                continue
            raise
    return out


def default_table() -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for m in _modules():
        table.update(getattr(m, "DEFAULTS", {}))
    return table


def load_table(path: str | Path | None) -> Callable[[str], dict[str, Any]]:
    """tuning(op): the backend's entry for op merged over the default entry."""
    default = default_table()
    own: dict[str, dict[str, Any]] = {}
    if path:
        p = Path(path)
        if p.exists():
            own = json.loads(p.read_text())

    def tuning(op: str) -> dict[str, Any]:
        return {**default.get(op, {}), **own.get(op, {})}

    return tuning


def kernels(tuning: Callable[[str], dict[str, Any]]) -> list[tuple]:
    rows = []
    for m in _modules():
        rows.extend(m.kernels(tuning))
    return rows
