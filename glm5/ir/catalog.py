"""The op catalog: every OpDef, by name, in the order of docs/ops.md."""

from __future__ import annotations

from glm5.ir import ops_dsa, ops_mla, ops_moe, ops_norm, ops_quant, ops_rl
from glm5.ir.opdef import OpDef

OPS: dict[str, OpDef] = {
    op.name: op
    for mod in (ops_norm, ops_dsa, ops_mla, ops_moe, ops_quant, ops_rl)
    for op in mod.OPS
}


def get_op(name: str) -> OpDef:
    """The OpDef called ``name``; a KeyError lists the known ops."""
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"glm5: unknown op {name!r}; known ops: {', '.join(OPS)}") from None


def op_names() -> list[str]:
    return list(OPS)
