"""@triton.jit helpers shared by the kernel modules (imported with them, on first kernel call)."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import triton
import triton.language as tl

from glm5.kernels.triton._grid import GRID_ARGS


def entry_kernel(*lengths: str) -> Callable[[Callable[..., Any]], Any]:
    """``@triton.jit`` for a launched kernel, with ``do_not_specialize`` = ``lengths`` (its
    arguments that follow a sequence length: token / key counts, strides set by a length) plus
    the grid-policy arguments it has. Triton specializes an int argument on being 1 and on
    divisibility by 16, so without this every such value compiles a new variant; tile sizes and
    model dimensions stay ``tl.constexpr`` or specialized. Only names of the signature are
    passed (older Tritons reject unknown ones); a length name it lacks is a TypeError."""
    def deco(fn: Callable[..., Any]) -> Any:
        names = inspect.signature(fn).parameters
        missing = [n for n in lengths if n not in names]
        if missing:
            raise TypeError(f"glm5 triton entry_kernel: {fn.__name__} has no argument "
                            f"{', '.join(missing)}")
        return triton.jit(do_not_specialize=[*lengths, *(g for g in GRID_ARGS if g in names)])(fn)

    return deco


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns in tl.dot: upcast there (and for fp32 inputs,
    # which must not go through TF32 on a GPU).
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
