"""@triton.jit helpers shared by the kernel modules (imported with them, on first kernel call)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, DOT_FP32: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns in tl.dot: upcast there (and for fp32 inputs,
    # which must not go through TF32 on a GPU).
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
