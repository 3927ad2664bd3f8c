"""Helpers shared by the TVM (llvm, host CPU) kernels of this package: how a dtype is bound
(bf16 as its uint16 bits), widening to / rounding from fp32 in TIR, a vectorisable exp, a code
of the canonical packed weight layout in TIR, and the per-context memo of compiled kernels."""

from __future__ import annotations

import re
import threading
from typing import Any, Callable

import torch


def storage(dtype: str) -> str:
    """The dtype a buffer of ``dtype`` is bound as (bf16 as its uint16 bits)."""
    return "uint16" if dtype == "bfloat16" else dtype


def widen(T: Any, x: Any, dtype: str) -> Any:
    """A stored element as fp32 (bf16: its 16 bits are the high half of an fp32)."""
    if dtype == "bfloat16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", x), T.uint32(16)))
    return x if dtype == "float32" else T.Cast("float32", x)


def narrow(T: Any, x: Any, dtype: str) -> Any:
    """fp32 to the stored dtype; bf16 rounds to nearest even (NaN stays NaN)."""
    if dtype == "bfloat16":
        bits = T.reinterpret("uint32", x)
        rne = T.shift_right(
            bits + T.uint32(0x7FFF) + (T.shift_right(bits, T.uint32(16)) & T.uint32(1)),
            T.uint32(16))
        return T.Cast("uint16", T.Select(x != x, T.uint32(0x7FC0), rne))
    return x if dtype == "float32" else T.Cast(dtype, x)


def fexp(T: Any, x: Any) -> Any:
    """Vectorisable expf (Cephes polynomial, ~2 ulp); exp(-inf) = 0, large x saturate, NaN stays
    NaN."""
    xc = T.max(T.min(x, T.float32(88.3762626647949)), T.float32(-87.33654475))
    fx = T.floor(xc * T.float32(1.4426950408889634) + T.float32(0.5))
    r = xc - fx * T.float32(0.693359375) - fx * T.float32(-2.12194440e-4)
    y = (((((T.float32(1.9875691500e-4) * r + T.float32(1.3981999507e-3)) * r
            + T.float32(8.3334519073e-3)) * r + T.float32(4.1665795894e-2)) * r
          + T.float32(1.6666665459e-1)) * r + T.float32(5.0000001201e-1)) * (r * r) \
        + r + T.float32(1.0)
    e = T.reinterpret("float32", T.shift_left(T.Cast("int32", fx) + 127, 23))
    inf = T.float32(float("inf"))
    # The clamps above are min/max, which drop a NaN: pass it through explicitly, so a NaN score
    # reaches the softmax sum and the output as it does in the reference. Tested on the bits:
    # TVM's simplifier folds `x != x` to false.
    nan = (T.reinterpret("int32", x) & T.int32(0x7FFFFFFF)) > T.int32(0x7F800000)
    return T.Select(nan, x, T.Select(x > T.float32(88.3762626647949), inf,
                                        T.Select(x < T.float32(-87.33654475), T.float32(0.0),
                                                 y * e)))


# vdpbf16ps in TIR. TVM 0.27 cannot hand LLVM a bf16 vector: its lowering rewrites every
# bf16-typed expression to fp32 (BF16ComputeLegalize), and without that pass its code generator
# fails on bf16 types, while LLVM >= 17 declares the intrinsic on <32 x bfloat> operands. So a
# kernel calls a stand-in of the same shape that LLVM's optimiser knows has no side effects,
# ``vpdpwssd`` (int32 x 16 += pairs of int16 x 32: registers, loop-invariant motion and
# unrolling as for the real instruction), and `dpbf16_ir` rewrites every call of it in the
# optimised LLVM IR into bitcasts and ``vdpbf16ps``. A kernel using it has no other vpdpwssd.
STAND_IN = "@llvm.x86.avx512.vpdpwssd.512"
_VALUE = r"([^,\s()]+)"
_STAND_IN_CALL = re.compile(
    r"^(\s*)(%[-\w.]+) = (?:tail )?call <16 x i32> " + re.escape(STAND_IN) + r"\(<16 x i32> "
    + _VALUE + r", (<\d+ x i\d+>) " + _VALUE + r", (<\d+ x i\d+>) " + _VALUE + r"\)(.*)$")
WORD_OPERANDS = ("int16x32", "int32x16")  # the stand-in's operands: LLVM >= 20, older releases
BF16_OPERANDS = ("<32 x bfloat>", "<16 x i32>")  # vdpbf16ps's: LLVM >= 17, older releases


def dpbf16(T: Any, acc: Any, a: Any, b: Any, operand: str = WORD_OPERANDS[0]) -> Any:
    """``acc[i] += a[2i]·b[2i] + a[2i+1]·b[2i+1]`` (fp32 x 16; a, b: 32 bf16 as int32 x 16
    pairs) once `dpbf16_ir` has rewritten the kernel's IR; ``operand``: the stand-in's operand
    type that this LLVM accepts (`WORD_OPERANDS`)."""
    return T.reinterpret("float32x16", T.call_llvm_pure_intrin(
        "int32x16", STAND_IN[1:], T.reinterpret("int32x16", acc), T.reinterpret(operand, a),
        T.reinterpret(operand, b)))


def dpbf16_ir(ll: str, operand: str = BF16_OPERANDS[0]) -> str:
    """LLVM IR text with every `dpbf16` stand-in call replaced by ``vdpbf16ps`` on
    ``operand``-typed bitcasts of its operands. Raises if a use of the stand-in is left that
    the rewrite does not recognise."""
    intrinsic = "@llvm.x86.avx512bf16.dpbf16ps.512"
    out = []
    for i, line in enumerate(ll.splitlines()):
        m = _STAND_IN_CALL.match(line)
        if m:
            ind, r, acc, ta, a, tb, b, tail = m.groups()
            out += [f"{ind}%glm5.c{i} = bitcast <16 x i32> {acc} to <16 x float>",
                    f"{ind}%glm5.a{i} = bitcast {ta} {a} to {operand}",
                    f"{ind}%glm5.b{i} = bitcast {tb} {b} to {operand}",
                    f"{ind}%glm5.r{i} = call <16 x float> {intrinsic}(<16 x float> %glm5.c{i}, "
                    f"{operand} %glm5.a{i}, {operand} %glm5.b{i}){tail}",
                    f"{ind}{r} = bitcast <16 x float> %glm5.r{i} to <16 x i32>"]
        elif line.startswith("declare") and STAND_IN + "(" in line:
            continue
        elif STAND_IN in line:
            raise RuntimeError(f"glm5 tvm: cannot rewrite this use of the vdpbf16ps stand-in: "
                               f"{line.strip()!r}")
        else:
            out.append(line)
    out.append(f"declare <16 x float> {intrinsic}(<16 x float>, {operand}, {operand})")
    return "\n".join(out) + "\n"


def butterfly(T: Any, tb: Any, src: int, i: Any, d: int, n: int = 16) -> Any:
    """Row ``i`` after the transpose stage that swaps bit ``d`` of the row and column index
    of the n x n block ``tb[src]``: element (i, c) moves to (i ^ d, c ^ d) when those bits
    differ. One two-source shuffle per row (``i`` unrolled, so the branch folds). Stages
    d = n/2, ..., 2, 1 in turn transpose the block."""
    ramp = T.ramp(0, 1, n)
    lo = [c if c & d == 0 else n + c - d for c in range(n)]  # row i, bit d of i clear
    hi = [c + d if c & d == 0 else n + c for c in range(n)]  # bit d of i set
    mine, other = tb[src, i, ramp], tb[src, T.bitwise_xor(i, d), ramp]
    return T.if_then_else(T.bitwise_and(i, d) == 0, T.Shuffle([mine, other], lo),
                          T.Shuffle([other, mine], hi))


def bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 tensors go to a kernel as a uint16 view of the same memory (no copy)."""
    return x.view(torch.uint16) if x.dtype == torch.bfloat16 else x


# (bytes per unit, values per unit) of each weight width of the canonical packed layout
# (docs/ops.md): int8 1 byte = 1 value, int4 1 byte = 2 values, int6 3 bytes = 4 values
UNITS = {8: (1, 1), 4: (1, 2), 6: (3, 4)}


def unpack_code(T: Any, row: Callable[[Any], Any], u: Any, j: int, bits: int) -> Any:
    """Value j of packed unit u of a row (``row(i)`` = its byte i), as int32 (sign-extended)."""
    if bits == 8:
        return T.Cast("int32", row(u))
    if bits == 4:
        v = T.shift_right(T.Cast("int32", row(u)), 4 * j) & 15
        return (v ^ 8) - 8
    word = (T.Cast("int32", row(3 * u)) | T.shift_left(T.Cast("int32", row(3 * u + 1)), 8)
            | T.shift_left(T.Cast("int32", row(3 * u + 2)), 16))
    v = T.shift_right(word, 6 * j) & 63
    return (v ^ 32) - 32


# Input elements (rows × row length) below which a call takes the serial build of its kernel
# (row / token loop `T.serial`: no thread-pool launch); the measured crossovers at 2 threads are
# in docs/performance.md, "cpu backend: serial row kernels for small batches".
SERIAL_MAX = {"rms_norm": 2**19, "layer_norm": 2**19, "rope": 2**19, "silu_mul": 2**17,
              "moe_route": 4096}


def serial(op: str, work: int) -> bool:
    """Whether a call of ``op`` on ``work`` input elements (rows × row length) takes the serial
    build of its kernel: below `SERIAL_MAX`, waking TVM's thread pool costs more than the
    rows' work. Same TIR but the row loop, so both builds give the same bits."""
    return work < SERIAL_MAX[op]


def cached(ctx: Any, key: tuple, get: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """``get()`` once per (context, key), memoised on the context: `TVMContext.kernel` hashes
    the kernel's source file on every lookup, which costs more than a small kernel call."""
    fns = ctx.__dict__.setdefault("_glm5_fns", {})
    fn = fns.get(key)
    if fn is None:
        fn = fns[key] = get()
    return fn


_local = threading.local()


SCRATCH_KEEP = 32 * 2**20  # bytes: larger scratch buffers are allocated per call, not kept


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-thread buffer reused across calls (contents undefined) for a kernel's inputs and
    scratch: a fresh allocation of a few MiB is a fresh ``mmap`` whose pages fault on first
    touch, every call. Buffers above ``SCRATCH_KEEP`` bytes are not kept (a long prefill
    must not pin its activations' memory; its own run time dwarfs the page faults)."""
    n = 1
    for d in shape:
        n *= d
    with torch.inference_mode(False):  # an inference tensor could not be written outside
        if n * dtype.itemsize > SCRATCH_KEEP:
            return torch.empty(shape, dtype=dtype)
        bufs = _local.__dict__.setdefault("bufs", {})
        b = bufs.get((name, dtype))
        if b is None or b.numel() < n:
            b = bufs[(name, dtype)] = torch.empty(n, dtype=dtype)
    return b[:n].view(shape)


def fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor a kernel writes its result into (the caller keeps it). One place, so that
    a test can hand out buffers with guard bytes around them."""
    return torch.empty(shape, dtype=dtype)

