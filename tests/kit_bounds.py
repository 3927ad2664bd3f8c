"""The kit's bound on a quantity a test derives from an op's output (a row sum, one element):
the op's own error model (``OpDef.error``) through glm5.testing.tolerances.bound. Nothing here
is a tolerance of its own: tests that judge an op's outputs call glm5.testing.compare.judge /
assert_matches instead."""

from __future__ import annotations

from typing import Any

import torch

from glm5.ir.catalog import get_op
from glm5.ir.opdef import OpDef
from glm5.testing.compare import upcast
from glm5.testing.tolerances import bound


def output_bound(op: OpDef | str, values: dict[str, Any], output: str,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(oracle, bound): the float64 oracle of ``output`` of ``op`` on ``values`` (the op's
    arguments by name) and the kit's elementwise bound on |y - oracle| for a computation called
    with ``dtype`` (default: the op's dispatch dtype) whose output has the op's contract dtype."""
    op = get_op(op) if isinstance(op, str) else op
    values = op.bind((), values)
    work = dtype or op.dispatch_dtype(values) or torch.float32
    o64 = upcast(values)
    outs = op.reference(*(o64[n] for n in op.param_names))
    outs = outs if isinstance(outs, tuple) else (outs,)
    names = [o.name for o in op.outputs]
    terms = op.error(o64, outs, work)
    out_dtype = dict(zip(names, (dt for _, dt in op.output_specs(values))))[output]
    r = outs[names.index(output)]
    return r, bound(r, terms[output], out_dtype, work)
