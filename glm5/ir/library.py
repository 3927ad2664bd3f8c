"""The torch.library binding: every op is `torch.ops.glm5.<name>`, with the OpDef shape
function as its fake (meta) kernel and, for differentiable ops, a backward: the backward of the
kernel that served the forward where it has one, else the vjp of the reference.

The IR does not know about backends: `bind_all(call, backward_for)` receives the dispatcher and
the backward lookup from glm5.ops.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from glm5.ir.catalog import OPS
from glm5.ir.opdef import OpDef, has_data

NAMESPACE = "glm5"
_bound: dict[str, Any] = {}


# fast(op, args) -> the kernel's output for a call whose signature a kernel already served
# (glm5.ops: no validation, no selection), or MISS; glm5.ops passes its served-kernel table.
Fast = Callable[[OpDef, tuple], Any]
MISS = object()


def _impl(op: OpDef, call: Callable[[OpDef, dict[str, Any]], Any],
          fast: Fast | None = None) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        out = MISS if fast is None else fast(op, args)
        if out is MISS:
            values = op.validate_cached(args)
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


# backward_for(op, args) -> the backward of the kernel that serves this call, or None (the
# reference's vjp); glm5.ops passes glm5.backends.selection.backward_for.
BackwardFor = Callable[[OpDef, tuple], Callable[..., Any] | None]


def _traced(inputs: tuple) -> bool:
    """Fake tensors or a compiler tracing: a kernel's backward cannot run there."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(v, torch.Tensor) and not has_data(v) for v in inputs)


def vjp_backward(op: OpDef, backward_for: BackwardFor | None = None
                 ) -> tuple[Callable, Callable]:
    """(setup_context, backward) computing input gradients by the backward of the kernel that
    served the call (``backward_for``; its outputs are saved for it), else by the vjp of
    op.reference (when tracing, always the vjp)."""
    tensor_pos = [i for i, p in enumerate(op.params) if p.is_tensor]
    diff_out = [i for i, o in enumerate(op.outputs) if o.differentiable]

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        kernel_bwd = None
        if backward_for is not None and not _traced(inputs):
            kernel_bwd = backward_for(op, tuple(inputs))
        ctx.kernel_bwd = kernel_bwd
        outs = (output if isinstance(output, tuple) else (output,)) if kernel_bwd else ()
        ctx.n_out = len(outs)
        ctx.save_for_backward(*[inputs[i] for i in tensor_pos], *outs)
        ctx.scalars = {i: v for i, v in enumerate(inputs) if i not in tensor_pos}
        ctx.n = len(inputs)

    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        inputs: list[Any] = [None] * ctx.n
        for i, t in zip(tensor_pos, saved):
            inputs[i] = t
        for i, v in ctx.scalars.items():
            inputs[i] = v
        if ctx.kernel_bwd is not None:
            return _kernel_backward(op, ctx, inputs, saved[len(tensor_pos):], grads)
        want = [
            i for i in tensor_pos
            if inputs[i] is not None and inputs[i].is_floating_point() and _needs_grad(ctx, i)
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


def _needs_grad(ctx: Any, i: int) -> bool:
    # torch.library's needs_input_grad stops at the last tensor argument (trailing scalars and
    # None tensors have no entry): an index past its end needs no gradient.
    n = ctx.needs_input_grad
    return i < len(n) and bool(n[i])


def _kernel_backward(op: OpDef, ctx: Any, inputs: list, outs: tuple, grads: tuple) -> tuple:
    """Input gradients from the serving kernel's backward (see `Backend.kernel`)."""
    g = tuple(gr if o.differentiable else None for o, gr in zip(op.outputs, grads))
    needs = tuple(
        _needs_grad(ctx, i) and isinstance(v, torch.Tensor) and v.is_floating_point()
        for i, v in enumerate(inputs))
    if not any(needs):
        return (None,) * ctx.n
    res = tuple(ctx.kernel_bwd(g, tuple(outs), needs, *inputs))
    if len(res) != ctx.n:
        raise RuntimeError(f"glm5.{op.name}: the kernel's backward returned {len(res)} "
                           f"gradients, expected {ctx.n} (one per argument)")
    return tuple(r if needs[i] else None for i, r in enumerate(res))


def bind_all(call: Callable[[OpDef, dict[str, Any]], Any],
             backward_for: BackwardFor | None = None, fast: Fast | None = None
             ) -> dict[str, Any]:
    """Define `torch.ops.glm5.<name>` for every op (idempotent). ``backward_for``: the
    backward of the kernel serving a call (None: always the vjp of the reference); ``fast``:
    tried before validation on every call (see `Fast`)."""
    for op in OPS.values():
        if op.name in _bound:
            continue
        cop = torch.library.custom_op(
            f"{NAMESPACE}::{op.name}",
            _impl(op, call, fast),
            mutates_args=op.mutates,
            schema=op.schema(),
        )
        cop.register_fake(op.meta)
        if op.differentiable and not op.mutates:
            setup, bwd = vjp_backward(op, backward_for)
            cop.register_autograd(bwd, setup_context=setup)
        _bound[op.name] = cop
    return _bound


def require_bound(where: str) -> None:
    """Raise unless `torch.ops.glm5.*` are bound (glm5.ops binds them with the backend
    dispatcher, a layer the IR does not import)."""
    if len(_bound) < len(OPS):
        raise RuntimeError(f"{where}: torch.ops.glm5.* are not bound yet; import glm5.ops "
                           f"first (it binds every op with the backend dispatcher)")
