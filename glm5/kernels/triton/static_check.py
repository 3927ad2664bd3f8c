"""Hopper static check without a GPU: compile every Triton kernel variant glm5 launches at GLM-5's
shapes for sm_90 (H100/H200) and read what the compiled binary needs.

Triton compiles for any target without a device: the NVIDIA backend ships ``ptxas`` and
``cuobjdump`` in the wheel, so ``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` produces
the same cubin a Hopper GPU would load. From it this module reads, per variant:

* ``regs`` (registers per thread; 255 is the hardware limit and above ~168 at 8 warps the SM
  holds a single block), ``local`` / ``stack`` bytes (register spills to local memory: on a
  kernel that is meant to stream HBM or feed tensor cores, any spill is a slowdown, often many
  times over);
* ``shared`` bytes (Triton's own count; an sm_90 block can use at most 227 KiB);
* whether the tensor-core dots lowered to Hopper's asynchronous warpgroup MMA (``wgmma`` in the
  PTX) or to the older ``mma.sync`` (a bf16 ``tl.dot`` whose tile is too small for a warpgroup
  falls back to it, at roughly half the peak), and whether TMA bulk copies are used.

These are necessary conditions for Hopper speed, not a measurement: a variant can pass and still
be slow. The speed itself is measured on a GPU by bench/gpu_suite.py.

Run it as ``python -m glm5.kernels.triton.static_check`` (prints a table; ``--json PATH``
writes it). It must run WITHOUT ``TRITON_INTERPRET=1``: under the interpreter the kernels'
``@triton.jit`` helpers are interpreter functions the compiler cannot lower, so tests call it in
a subprocess. The launchers' device check is bypassed for the duration (the arguments are CPU
tensors that are never launched: every entry kernel is replaced by a recorder, see
``compile_check.record_launches``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from glm5.ir.quant_formats import quantize_weight
from glm5.kernels.triton import compile_check, registry

# sm_90's per-block shared memory limit (cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200).
SM90_SHARED_LIMIT = 227 * 1024


@dataclass(frozen=True)
class Variant:
    """What one compiled variant of an entry kernel needs on the target."""

    op: str
    compute_bound: bool
    kernel: str
    constexprs: str
    num_warps: int
    num_stages: int
    regs: int
    local: int
    stack: int
    shared: int
    wgmma: bool
    mma_sync: bool
    tma: bool
    # local-memory loads/stores in the SASS (STL/LDL), those inside a loop and those inside an
    # innermost one: a stack frame can be a spill read once per launch or one reloaded every
    # tile (all 0: no frame)
    spill_ops: int = 0
    loop_spill_ops: int = 0
    inner_spill_ops: int = 0

    @property
    def spills(self) -> bool:
        return self.local > 0 or self.stack > 0

    @property
    def dots(self) -> bool:
        return self.wgmma or self.mma_sync


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise RuntimeError(f"glm5 static_check: {path} not found; this Triton wheel ships no "
                           f"NVIDIA {name}")
    return str(path)


_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def resources(cubin: bytes) -> dict[str, int]:
    """{regs, stack, shared_static, local} of the single function in ``cubin`` (cuobjdump
    -res-usage)."""
    out = _cuobjdump(cubin, "-res-usage")
    m = _RES.search(out)
    if m is None:
        raise RuntimeError(f"glm5 static_check: cuobjdump printed no resource line:\n{out}")
    regs, stack, shared, local = (int(g) for g in m.groups())
    return {"regs": regs, "stack": stack, "shared_static": shared, "local": local}


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def spill_ops(sass: str) -> tuple[int, int, int]:
    """(local-memory loads and stores, how many of them inside a loop, how many inside an
    innermost loop) in ``sass`` (cuobjdump -sass of one function). A loop is the address range
    from a backward branch's target to the branch; an innermost loop holds no other loop: in a
    kernel's tile loop a spill costs once per tile, in an outer loop once per pass over it."""
    ins = [(int(m.group(1), 16), m.group(2).split(".")[0], m.group(3))
           for m in _SASS.finditer(sass)]
    loops = []
    for addr, op, rest in ins:
        t = _TARGET.search(rest) if op == "BRA" else None
        if t is not None and int(t.group(1), 16) <= addr:
            loops.append((int(t.group(1), 16), addr))
    inner = [(lo, hi) for lo, hi in loops
             if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    spills = [addr for addr, op, _ in ins if op in ("STL", "LDL")]

    def within(ranges: list[tuple[int, int]]) -> int:
        return sum(any(lo <= a <= hi for lo, hi in ranges) for a in spills)

    return len(spills), within(loops), within(inner)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool("cuobjdump"), flag, f.name], capture_output=True,
                              text=True, check=True).stdout


def compile_variant(kernel: Any, args: tuple, kwargs: dict[str, Any],
                    target: tuple[str, int, int] = compile_check.DEFAULT_TARGET) -> Any:
    """The CompiledKernel Triton would build for ``kernel[grid](*args, **kwargs)`` on
    ``target`` (as ``JITFunction.run`` does on a cache miss), compiled here without a device."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn, dns, dnsa = compile_check._jit_parts(kernel)
    if type(kernel).__name__ != "JITFunction":
        raise RuntimeError("glm5 static_check: the kernels were defined under "
                           "TRITON_INTERPRET=1; run the static check in a process without it")
    jf = JITFunction(fn, do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)
    gpu = GPUTarget(*target)
    backend = make_backend(gpu)
    binder = create_function_from_signature(jf.signature, jf.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jf._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return triton.compile(ASTSource(jf, signature, constexprs, attrs), target=gpu,
                          options=options.__dict__)


def describe(op: str, compute_bound: bool, name: str, kernel: Any, args: tuple,
             kwargs: dict[str, Any]) -> Variant:
    """Compile one launch and read its needs."""
    ck = compile_variant(kernel, args, kwargs)
    ptx = ck.asm["ptx"]
    res = resources(ck.asm["cubin"])
    frame = res["local"] or res["stack"]
    ops = spill_ops(_cuobjdump(ck.asm["cubin"], "-sass")) if frame else (0, 0, 0)
    const = {k: v for k, v in kwargs.items()
             if k not in ("num_warps", "num_stages") and not isinstance(v, torch.Tensor)}
    return Variant(op=op, compute_bound=compute_bound, kernel=name,
                   constexprs=",".join(f"{k}={v}" for k, v in const.items()),
                   num_warps=int(ck.metadata.num_warps), num_stages=int(ck.metadata.num_stages),
                   regs=res["regs"], local=res["local"], stack=res["stack"],
                   shared=int(ck.metadata.shared), wgmma="wgmma.mma_async" in ptx,
                   mma_sync="mma.sync" in ptx, tma="cp.async.bulk.tensor" in ptx,
                   spill_ops=ops[0], loop_spill_ops=ops[1], inner_spill_ops=ops[2])


def _no_check(*tensors: Any, **named: Any) -> None:
    return None


def lift_device_checks(patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """The launchers refuse CPU tensors without the interpreter; recorded launches never run, so
    CPU tensors may stand in for GPU ones: replace each launcher module's ``check_device``
    through ``patch`` (``setattr``, or a test's ``monkeypatch.setattr``)."""
    import importlib

    for name in registry.MODULES:
        patch(importlib.import_module(f"glm5.kernels.triton.{name}"), "check_device", _no_check)


@contextlib.contextmanager
def _device_checks_off() -> Iterator[None]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(mod: Any, attr: str, value: Any) -> None:
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, value)

    try:
        lift_device_checks(patch)
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def record(op_fn: Callable[[], Any]) -> list[tuple[str, Any, tuple, dict[str, Any]]]:
    """(kernel name, kernel, args, kwargs) of every distinct launch ``op_fn()`` makes."""
    calls: list[tuple[str, Any, tuple, dict[str, Any]]] = []
    seen: set[tuple[str, str]] = set()
    with _device_checks_off(), compile_check.record_launches(calls=calls) as log:
        op_fn()
    out = []
    for (name, key), call in zip(log, calls):
        if (name, key) not in seen:
            seen.add((name, key))
            out.append(call)
    return out


# ---- GLM-5 shapes ---------------------------------------------------------------------------
# Only the dimensions that reach a tl.constexpr matter (lengths are runtime arguments), so the
# token counts below are small; the head and model dimensions are GLM-5's.
H, DQK, DV, HI, DI, TOPK = 64, 576, 512, 32, 128, 2048
D_MODEL, I_MOE, E, K_ACT = 6144, 2048, 8, 8
MHA_H, MHA_D, MHA_DN = 64, 256, 192


def _bf(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


def _ranges(T: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32)
    return torch.zeros_like(ke), ke


def scenarios() -> dict[str, tuple[bool, Callable[[dict[str, Callable[..., Any]]], None]]]:
    """{label: (compute bound, run(ops))}: one call of an op at GLM-5 shapes per label (prefill
    and decode where the launch differs). A compute-bound scenario's dots must lower to wgmma;
    a memory-bound one (decode, GEMV) is judged by the bytes it moves, on a GPU."""
    def lightning(ops):
        ks, ke = _ranges(64, 4096)
        ops["lightning_indexer"](_bf(64, HI, DI), _bf(4096, DI),
                                 torch.zeros(64, HI), ks, ke)

    def topk(ops):
        ks, ke = _ranges(64, 4096)
        ops["indexer_topk"](_bf(64, HI, DI), _bf(4096, DI), torch.zeros(64, HI), ks, ke, TOPK)

    def topk_decode(ops):  # one query over 64K keys: split top-k
        ks, ke = _ranges(1, 65536)
        ops["indexer_topk"](_bf(1, HI, DI), _bf(65536, DI), torch.zeros(1, HI), ks, ke, TOPK)

    def topk_fp8(T: int, S: int):  # e4m3 dots (sm_89+); decode: split top-k
        def run(ops):
            ks, ke = _ranges(T, S)
            ops["indexer_topk_fp8"](_bf(T, HI, DI), _bf(S, DI), torch.zeros(T, HI), ks, ke,
                                    TOPK)

        return run

    def pool(rows: int, fp8: bool) -> tuple[torch.Tensor, ...]:
        """The paged key pool: bf16 rows, or e4m3 codes and a scale per row."""
        if fp8:
            return (torch.zeros(rows, DI, dtype=torch.float8_e4m3fn), torch.ones(rows))
        return (_bf(rows, DI),)

    def paged_topk_decode(fp8: bool):  # a decode batch of 4 sequences of 64K keys, 64-row pages
        def run(ops):
            B, S, ps = 4, 65536, 64
            table = torch.arange(B * (S // ps), dtype=torch.int32).reshape(B, S // ps)
            op = "paged_indexer_topk_fp8" if fp8 else "paged_indexer_topk"
            ops[op](_bf(B, HI, DI), *pool(B * S, fp8), torch.zeros(B, HI), table,
                    torch.arange(B, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32),
                    ps, TOPK)

        return run

    def paged_topk(fp8: bool):  # a prefill chunk of one sequence through 64-row pages
        def run(ops):
            T, S, ps = 64, 4096, 64
            op = "paged_indexer_topk_fp8" if fp8 else "paged_indexer_topk"
            ops[op](_bf(T, HI, DI), *pool(S, fp8), torch.zeros(T, HI),
                    torch.arange(S // ps, dtype=torch.int32)[None],
                    torch.zeros(T, dtype=torch.int32),
                    torch.arange(S - T + 1, S + 1, dtype=torch.int32), ps, TOPK)

        return run

    def sparse_prefill(ops):  # enough queries that the keys are not split (decode's split-KV)
        k = _bf(4096, 1, DQK)
        ops["sparse_attention"](_bf(512, H, DQK), k, k[..., :DV],
                                torch.zeros(512, TOPK, dtype=torch.int32), 0.1)

    def sparse_decode(ops):
        k = _bf(4096, 1, DQK)
        ops["sparse_attention"](_bf(2, H, DQK), k, k[..., :DV],
                                torch.zeros(2, TOPK, dtype=torch.int32), 0.1)

    def attention_mha(T: int, S: int):
        # GLM-5's non-absorbed MLA prefill: k = [k_nope 192 | k_pe 64] per head, v the last
        # 256 columns of the up-projected kv rows [S, H, 192 + 256] (a strided view)
        def run(ops):
            ks, ke = _ranges(T, S)
            kvx = _bf(S, MHA_H, MHA_DN + MHA_D)
            ops["attention"](_bf(T, MHA_H, MHA_D), _bf(S, MHA_H, MHA_D), kvx[..., MHA_DN:],
                             ks, ke, 0.1)

        return run

    def attention_mqa(T: int, S: int):
        # absorbed MLA over a sequence shorter than index_topk (dense, not DSA)
        def run(ops):
            ks, ke = _ranges(T, S)
            k = _bf(S, 1, DQK)
            ops["attention"](_bf(T, H, DQK), k, k[..., :DV], ks, ke, 0.1)

        return run

    def attention_fp32(ops):
        # the parity suite's fp32 rows on a GPU (CUDA-core dots): they must fit and launch
        ks, ke = _ranges(2, 256)
        ops["attention"](torch.zeros(2, MHA_H, MHA_D), torch.zeros(256, MHA_H, MHA_D),
                         torch.zeros(256, MHA_H, MHA_D), ks, ke, 0.1)
        ks, ke = _ranges(4, 2048)
        k = torch.zeros(2048, 1, DQK)
        ops["attention"](torch.zeros(4, H, DQK), k, k[..., :DV], ks, ke, 0.1)

    def moe(T: int):
        def run(ops):
            ops["moe_experts"](_bf(T, D_MODEL), torch.zeros(T, K_ACT, dtype=torch.int32),
                               _bf(T, K_ACT), _bf(E, 2 * I_MOE, D_MODEL), _bf(E, D_MODEL, I_MOE))

        return run

    def quant(scheme: str, M: int):
        wp, ws = quantize_weight(torch.randn(256, D_MODEL), scheme)

        def run(ops):
            ops["quant_linear"](_bf(M, D_MODEL), wp, ws, scheme, None)

        return run

    out = {"lightning_indexer": (True, lightning), "indexer_topk": (True, topk),
           "paged_indexer_topk": (True, paged_topk(False)),
           "paged_indexer_topk_fp8": (True, paged_topk(True)),
           "indexer_topk decode": (False, topk_decode),
           "indexer_topk_fp8": (True, topk_fp8(64, 4096)),
           "indexer_topk_fp8 decode": (False, topk_fp8(1, 65536)),
           "paged_indexer_topk decode": (False, paged_topk_decode(False)),
           "paged_indexer_topk_fp8 decode": (False, paged_topk_decode(True)),
           "sparse_attention prefill": (True, sparse_prefill),
           "sparse_attention decode": (False, sparse_decode),
           # prefills big enough not to split their keys; decodes split them (split-KV)
           "attention MHA 256": (True, attention_mha(1024, 1024)),
           "attention MHA 256 decode": (False, attention_mha(2, 256)),
           "attention MQA 576/512": (True, attention_mqa(512, 1024)),
           "attention MQA 576/512 decode": (False, attention_mqa(1, 2048)),
           "attention fp32": (False, attention_fp32),
           # prefill: 256 rows per expert, wgmma tiles; decode (T k <= 16 E): 16-row tiles,
           # bound by reading each routed expert's weights once
           "moe_experts prefill": (True, moe(256)), "moe_experts decode": (False, moe(4))}
    for s in ("w8a16", "w8a8", "w4a8", "w6a12"):
        out[f"quant_linear {s} M=1"] = (False, quant(s, 1))
        out[f"quant_linear {s} M=512"] = (True, quant(s, 512))
    return out


def cuda_ops() -> dict[str, Callable[..., Any]]:
    """The Triton ops with the cuda backend's tuning (its table over the kernels' defaults)."""
    table = Path(__file__).parents[2] / "backends" / "cuda" / "tuning.json"
    return {row[0]: row[1] for row in registry.kernels(registry.load_table(table))}


def check(only: str | None = None) -> list[Variant]:
    """Every distinct variant the scenarios launch, compiled for sm_90."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("glm5 static_check: unset TRITON_INTERPRET (the kernels must be "
                           "real @triton.jit functions to compile)")
    ops = cuda_ops()
    out = []
    for label, (bound, run) in scenarios().items():
        if only and only not in label:
            continue
        for name, kernel, args, kwargs in record(lambda: run(ops)):
            out.append(describe(label, bound, name, kernel, args, kwargs))
    return out


def problems(v: Variant) -> list[str]:
    """What keeps a variant from Hopper speed (empty: none of the checked conditions)."""
    bad = []
    if v.spills:
        bad.append(f"spills (local {v.local} B, stack {v.stack} B; {v.spill_ops} ld/st, "
                   f"{v.loop_spill_ops} in loops, {v.inner_spill_ops} in innermost)")
    if v.shared > SM90_SHARED_LIMIT:
        bad.append(f"shared {v.shared} B > {SM90_SHARED_LIMIT}")
    if v.compute_bound and v.mma_sync and not v.wgmma:
        bad.append("mma.sync, not wgmma")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5.kernels.triton.static_check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="scenarios whose label contains this")
    ap.add_argument("--json", help="write the table as JSON here")
    a = ap.parse_args(argv)
    rows = check(a.only)
    print(f"{'scenario':30} {'kernel':28} {'warps':>5} {'stg':>3} {'regs':>4} {'spill B':>7} "
          f"{'smem KiB':>8} {'mma':>6}  problems")
    for v in rows:
        mma = "wgmma" if v.wgmma else ("sync" if v.mma_sync else "-")
        print(f"{v.op:30} {v.kernel:28} {v.num_warps:5d} {v.num_stages:3d} {v.regs:4d} "
              f"{v.local + v.stack:7d} {v.shared / 1024:8.1f} {mma:>6}  "
              f"{'; '.join(problems(v)) or 'ok'}")
    if a.json:
        Path(a.json).write_text(json.dumps([{**asdict(v), "problems": problems(v)}
                                            for v in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
