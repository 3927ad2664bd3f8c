"""Host-side launch helpers shared by every Triton wrapper in glm5.kernels.triton: tile
arithmetic (``next_pow2``, ``cdiv``), the interpreter flag, the device check, launch options
from a tuning entry, the grid-policy launch and the fp32-dot rule. One definition of each.

The accepted device types live here (``DEVICE_TYPES``) and nowhere else: kernels never import
backends (DESIGN.md), so the backends' device strings cannot be read from them; the test suite
checks that every vendor backend's ``device_type`` is in this set.

No triton import here (nor of the ``_*`` kernel modules): the public wrapper modules import this
one at their top level, and Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is
defined, so kernels must only be imported on the first call.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

# The floating dtypes every Triton kernel here takes (the rows' ``dtypes``).
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# torch device types whose Triton stacks run these same kernels:
#   cuda  NVIDIA (community Triton), and also Hygon DCUs / AMD GPUs, which ROCm and DTK builds
#         of torch expose as "cuda" (the hygon backend's device_type);
#   npu   Huawei Ascend, torch_npu + triton-ascend (the ascend backend);
#   mlu   Cambricon, torch_mlu + Cambricon's Triton (the cambricon backend);
#   musa  Moore Threads, torch_musa + MUSA Triton (the mthreads backend);
#   xpu   Intel GPUs (Intel's Triton XPU backend); no glm5 backend yet, nothing to refuse.
DEVICE_TYPES: tuple[str, ...] = ("cuda", "npu", "mlu", "musa", "xpu")

# Triton launch options (not kernel arguments) that tuning entries may set.
LAUNCH_OPTIONS: tuple[str, ...] = ("num_warps", "num_stages")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): tl.arange and block shapes need one."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0), as ``triton.cdiv``, without importing triton."""
    return -(-a // b)


def split_for_target(blocks: int, chunks: int, target: int,
                     split: int | None = None) -> tuple[int, int]:
    """(SPLIT, chunks per split) for a grid of ``blocks`` x SPLIT programs that share ``chunks``
    units of sequential work per block (token_logprobs' vocabulary chunks, the quant GEMV's K
    steps): SPLIT = cdiv(target, blocks) so that about ``target`` programs run (1 when the blocks
    alone reach it or target is 0), or ``split`` when given; at most one split per chunk, and
    trimmed so that no split is left empty."""
    s = max(1, int(split)) if split is not None else max(1, cdiv(int(target), max(1, blocks)))
    s = max(1, min(s, chunks))
    per = cdiv(chunks, s)
    return cdiv(chunks, per), per


def split_head_dim(d: int) -> tuple[int, int]:
    """(BLOCK_DA, BLOCK_DB): a head dim held on chip as a power-of-two head [.., BLOCK_DA] and a
    tail [.., BLOCK_DB] (0: none), both >= 16 wide (tl.dot's minimum K); Dqk = 576 = 512 + 64,
    256 = 256 + 0, 36 = 32 + 16 (masked past d)."""
    da = max(16, 1 << (max(d, 1).bit_length() - 1))
    db = 0 if d <= da else max(16, next_pow2(d - da))
    return da, db


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _where(dev: Any) -> str:
    # torch.device prints "cuda:0"; stand-ins for devices torch cannot name without the vendor
    # extension (tests) only carry .type and .index, so format from those.
    idx = getattr(dev, "index", None)
    return dev.type if idx is None else f"{dev.type}:{idx}"


def check_device(op: str, *tensors: Any, **named: Any) -> None:
    """Refuse tensors op's Triton kernels cannot run on, before anything is allocated.

    ``tensors`` are reported by position ("argument 0"), ``named`` by keyword (use the op's
    argument names); ``None`` (an optional tensor not given) is skipped. The rules:

    * without the interpreter, a tensor must be on an accelerator in ``DEVICE_TYPES``; CPU
      tensors are refused (they run only interpreted);
    * under the interpreter (``TRITON_INTERPRET=1``) CPU tensors are accepted, and so are
      accelerator tensors (the interpreter copies each argument's storage to host memory and
      back around a launch: triton/runtime/interpreter.py, ``_init_args_hst``);
    * meta tensors (no data) and other device types are refused in both modes;
    * all tensors of one call must be on one device (the wrappers allocate outputs on the first
      tensor's device and run torch ops across the arguments).

    Raises RuntimeError ``glm5 triton <op>: ...`` naming the argument and what was expected.
    """
    interp = interpreted()
    items = [(f"argument {i}", t) for i, t in enumerate(tensors)]
    items += [(repr(name), t) for name, t in named.items()]
    accel = ", ".join(DEVICE_TYPES)
    first: tuple[str, Any] | None = None
    for label, t in items:
        if t is None:
            continue
        dev = getattr(t, "device", None)
        if dev is None:
            raise TypeError(f"glm5 triton {op}: {label} expected a tensor, got {type(t).__name__}")
        kind = dev.type
        if kind == "cpu":
            if not interp:
                raise RuntimeError(
                    f"glm5 triton {op}: {label} is a CPU tensor; expected a tensor on a Triton "
                    f"device ({accel}), or set TRITON_INTERPRET=1 before glm5.kernels.triton "
                    "kernels are imported to run CPU tensors interpreted")
        elif kind == "meta":
            raise RuntimeError(
                f"glm5 triton {op}: {label} is a meta tensor (no data); expected a tensor on a "
                f"Triton device ({accel})" + (" or the CPU (interpreted)" if interp else ""))
        elif kind not in DEVICE_TYPES:
            raise RuntimeError(
                f"glm5 triton {op}: {label} is on {_where(dev)}, which no Triton stack here "
                f"serves; expected one of {accel}" + (" or cpu (interpreted)" if interp else ""))
        if first is None:
            first = (label, dev)
        elif (kind, getattr(dev, "index", None)) != (first[1].type,
                                                      getattr(first[1], "index", None)):
            raise RuntimeError(
                f"glm5 triton {op}: {label} is on {_where(dev)} but {first[0]} is on "
                f"{_where(first[1])}; expected all tensors of one call on one device")


def launch_opts(p: dict[str, Any], prefix: str = "", **defaults: int) -> dict[str, int]:
    """Triton launch options from tuning entry ``p``: each of ``LAUNCH_OPTIONS`` read from key
    ``prefix + name`` (e.g. ``quant_num_warps`` for a helper kernel with its own setting), else
    from ``defaults``; an option in neither is left out (Triton's own default applies)."""
    out: dict[str, int] = {}
    for name in LAUNCH_OPTIONS:
        key = prefix + name
        if key in p:
            out[name] = int(p[key])
        elif name in defaults:
            out[name] = int(defaults[name])
    return out


def launch(kernel: Any, grid: tuple[int, ...], p: dict[str, Any], op: str, *args: Any,
           **kw: Any) -> None:
    """Launch ``kernel`` over the logical ``grid`` under tuning entry ``p``'s grid policy
    (glm5.kernels.triton._grid; imported here on the first launch, like the kernels)."""
    # lazy: no ``_*`` module loads before the first launch (this module's contract, above)
    from glm5.kernels.triton._grid import launch as _launch

    if interpreted():
        # lazy: optional dependency: patches triton's interpreter, only when interpreted
        from glm5.kernels.triton._interpreter import faithful_rounding

        faithful_rounding()
    _launch(kernel, grid, p, op, *args, **kw)


def dot_fp32(*dtypes: torch.dtype) -> bool:
    """fp32 dots when interpreted (bf16 tl.dot is wrong there), for fp32 inputs (IEEE, no TF32)
    or mixed operand dtypes; otherwise bf16/fp16 tensor-core dots with fp32 accumulation."""
    return interpreted() or torch.float32 in dtypes or len(set(dtypes)) > 1


def resolve_programs(p: dict[str, Any],
                     counts: dict[str, Callable[[], int] | int]) -> dict[str, Any]:
    """A copy of tuning entry ``p`` with a symbolic ``programs`` (a key of ``counts``, e.g.
    "ai_cores") replaced by its count or count function."""
    v = p.get("programs")
    if isinstance(v, str):
        if v not in counts:
            raise ValueError(f"glm5 triton: tuning 'programs' {v!r} is not a known device count "
                             f"(known: {', '.join(sorted(counts)) or 'none'})")
        return {**p, "programs": counts[v]}
    return p
