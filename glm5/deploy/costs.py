"""The planner's costing primitives: one op as one device runs it (`OpCost`: flops, bytes, the
peak that applies, seconds on a chip by the roofline), the catalog op's own ``OpDef.cost`` on
meta tensors (`op_cost`), and the planner's error (`PlanError`, naming the argument)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glm5.deploy.chips import Chip
from glm5.ir.catalog import get_op


class PlanError(ValueError):
    """A planner input is invalid; the message names the argument."""


def plan_error(arg: str, expected: str, got: Any) -> PlanError:
    return PlanError(f"glm5.plan: argument {arg!r} expected {expected}, got {got!r}")


@dataclass
class OpCost:
    """One op as one device runs it, ``count`` times per phase."""

    label: str
    op: str  # OpDef name, or "matmul" / "bmm" for plain torch matmuls
    flops: float
    bytes: float
    dtype: str  # which peak applies: 'bf16', 'int8' or 'fp8'
    count: float = 1.0

    def seconds(self, chip: Chip) -> float:
        return self.count * max(self.flops / chip.peak_flops(self.dtype), self.bytes / (
            chip.hbm_gbs * 1e9))

    def bound(self, chip: Chip) -> str:
        return "compute" if self.flops / chip.peak_flops(self.dtype) > self.bytes / (
            chip.hbm_gbs * 1e9) else "memory"


def meta_tensor(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def op_cost(name: str, **kwargs: Any) -> tuple[float, float]:
    """``OpDef.cost`` of the catalog op ``name`` for these (meta) arguments, after the op's own
    signature and shape checks."""
    op = get_op(name)
    values, syms = op.validate((), kwargs)
    return op.cost(values, syms)
