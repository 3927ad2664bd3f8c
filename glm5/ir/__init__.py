"""The op IR: one OpDef per op (signature, reference, shape function, cost, error model,
decomposition), the torch.library binding and graph capture."""

from glm5.ir.catalog import OPS, get_op, op_names
from glm5.ir.opdef import OpDef
from glm5.ir.signature import OpInputError, OpTypeError, OutArg, ScalarArg, TensorArg

__all__ = [
    "OPS",
    "OpDef",
    "OpInputError",
    "OpTypeError",
    "OutArg",
    "ScalarArg",
    "TensorArg",
    "get_op",
    "op_names",
]
