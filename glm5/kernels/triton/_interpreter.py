"""Make the Triton interpreter round like the devices it stands in for.

The interpreter (TRITON_INTERPRET=1; triton/runtime/interpreter.py) converts fp32 to bf16 by
truncating the mantissa (``_convert_float`` with no rounding mode), where every GPU and NPU
rounds to nearest even (``cvt.rn.bf16.f32``; Triton's own ``.to(tl.bfloat16)`` lowers to
``arith.truncf``, round-to-nearest-even). Emulated bf16 results were then up to one ulp off,
twice the error of the device. This replaces that one conversion with torch's
round-to-nearest-even cast; every other cast is left as the interpreter does it (numpy's
``astype`` already rounds fp32 -> fp16 to nearest even).
"""

from __future__ import annotations

from typing import Any

_done = False


def faithful_rounding() -> None:
    """Patch the interpreter's fp32 -> bf16 cast once (idempotent; a no-op without triton)."""
    global _done
    if _done:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    _done = True
