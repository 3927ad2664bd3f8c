"""The torch.library binding: every op is `torch.ops.glm5.<name>`, with the OpDef shape
function as its fake (meta) kernel and, for differentiable ops without a backward kernel, a
backward from the vjp of the reference.

The IR does not know about backends: `bind_all(call)` receives the dispatcher from glm5.ops.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.ir.catalog import OPS
from glm5.ir.opdef import OpDef

NAMESPACE = "glm5"
_bound: dict[str, Any] = {}


def _impl(op: OpDef, call: Callable[[OpDef, dict[str, Any]], Any]) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        values, _ = op.validate(args)
        out = call(op, values)
        # torch.library outputs may not alias inputs.
        if isinstance(out, tuple):
            return tuple(_fresh(o, args) for o in out)
        return _fresh(out, args)

    impl.__name__ = op.name
    return impl


def _fresh(t: torch.Tensor, args: tuple) -> torch.Tensor:
    for a in args:
        if isinstance(a, torch.Tensor) and t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and t.numel():
            return t.clone()
    return t


def vjp_backward(op: OpDef) -> tuple[Callable, Callable]:
    """(setup_context, backward) computing input gradients by the vjp of op.reference."""
    tensor_pos = [i for i, p in enumerate(op.params) if p.is_tensor]
    diff_out = [i for i, o in enumerate(op.outputs) if o.differentiable]

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.save_for_backward(*[inputs[i] for i in tensor_pos])
        ctx.scalars = {i: v for i, v in enumerate(inputs) if i not in tensor_pos}
        ctx.n = len(inputs)

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        inputs: list[Any] = [None] * ctx.n
        for i, t in zip(tensor_pos, saved):
            inputs[i] = t
        for i, v in ctx.scalars.items():
            inputs[i] = v
        want = [
            i for i in tensor_pos
            if inputs[i] is not None and inputs[i].is_floating_point() and ctx.needs_input_grad[i]
        ]
        with torch.enable_grad():
            leaves = list(inputs)
            for i in tensor_pos:
                if leaves[i] is not None:
                    leaves[i] = leaves[i].detach().requires_grad_(i in want)
            outs = op.reference(*leaves)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [
                (outs[j], grads[j]) for j in diff_out
                if grads[j] is not None and outs[j].requires_grad
            ]
            result: list[Any] = [None] * ctx.n
            if pairs and want:
                gs = torch.autograd.grad(
                    [o for o, _ in pairs], [leaves[i] for i in want],
                    [g.to(o.dtype) for o, g in pairs], allow_unused=True,
                )
                for i, g in zip(want, gs):
                    result[i] = g
        return tuple(result)

    return setup_context, backward


def bind_all(call: Callable[[OpDef, dict[str, Any]], Any]) -> dict[str, Any]:
    """Define `torch.ops.glm5.<name>` for every op (idempotent)."""
    for op in OPS.values():
        if op.name in _bound:
            continue
        cop = torch.library.custom_op(
            f"{NAMESPACE}::{op.name}",
            _impl(op, call),
            mutates_args=op.mutates,
            schema=op.schema(),
        )
        cop.register_fake(op.meta)
        if op.differentiable and not op.mutates:
            setup, bwd = vjp_backward(op)
            cop.register_autograd(bwd, setup_context=setup)
        _bound[op.name] = cop
    return _bound


def require_bound(where: str) -> None:
    """Raise unless `torch.ops.glm5.*` are bound (glm5.ops binds them with the backend
    dispatcher, a layer the IR does not import)."""
    if len(_bound) < len(OPS):
        raise RuntimeError(f"{where}: torch.ops.glm5.* are not bound yet; import glm5.ops "
                           f"first (it binds every op with the backend dispatcher)")
