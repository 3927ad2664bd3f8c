"""Compile-only check of the Triton kernel library for GPU targets (no GPU needed, nothing is
launched). Run as a script in a fresh process (TRITON_INTERPRET must be unset):

    python tests/triton_compile_check.py '[[TABLE, BACKEND, ARCH, WARP, CASES], ...]'

TABLE is a backend package name whose tuning.json is used (``"defaults"``: the kernels' own
DEFAULTS), BACKEND/ARCH/WARP the GPUTarget (``"cuda", 90, 32`` = sm_90; ``"hip", "gfx90a", 64``),
CASES ``"generators"`` (one bf16 case per op from the conformance kit's generators) or
``"gpu_shapes"`` (GLM-5-sized norm / rope / logprobs / quant_linear calls in fp32 and bf16).
Every @triton.jit kernel is replaced by a recorder that compiles each distinct variant the
launchers pick; the interpreter proves the arithmetic, this proves the constructs compile.
Exit 1 and a FAIL line per variant that does not.

In process, with ``Recorder.target = None``, the recorders only record each launch (kernel,
grid, arguments) into ``Recorder.calls``: tests/test_triton_launch.py drives the launchers that
way with stand-ins for npu / mlu / musa tensors, which no kernel could read.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

from glm5.kernels.triton import compile_check, static_check
from glm5.kernels.triton.compile_check import KERNEL_MODULES

class Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **constexprs)`` compiles the variant
    for the current target once instead of launching it; with no target (``None``) it appends
    ``(kernel name, grid, args, kw)`` to ``calls`` and compiles nothing."""

    target = None
    done: dict = {}
    failed: list = []
    calls: list = []

    def __init__(self, fn) -> None:
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if Recorder.target is None:
                Recorder.calls.append((self.fn.__name__, grid, args, dict(kw)))
                return
            t = Recorder.target
            target = (t.backend, t.arch, t.warp_size)
            key = (target, self.fn.__name__,
                   compile_check.specialization_key(self.fn, args, kw, target))
            if key in Recorder.done:
                return
            t0 = time.time()
            try:
                static_check.compile_variant(self.fn, args, kw, target)
                Recorder.done[key] = time.time() - t0
            except Exception as e:  # reported, not raised: every failing variant is listed
                Recorder.failed.append(f"{t.backend} {self.fn.__name__} "
                                       f"{ {k: v for k, v in kw.items()} }: "
                                       f"{type(e).__name__}: {str(e)[:1500]}")
                Recorder.done[key] = -1
        return launch


def install_recorders(patch=setattr) -> None:
    """Replace every kernel (``*_kernel``) of the kernel modules by a Recorder. ``patch`` is
    ``setattr`` here (a throw-away process); in a test, ``monkeypatch.setattr`` undoes it."""
    from triton.runtime.jit import KernelInterface  # JITFunction, or InterpretedFunction

    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"glm5.kernels.triton.{name}")
        for a in dir(mod):
            obj = getattr(mod, a)
            if isinstance(obj, KernelInterface) and a.endswith("_kernel"):
                patch(mod, a, Recorder(obj))


def skip_device_checks(patch=setattr) -> None:
    """CPU tensors stand in for GPU ones: turn off each launcher module's device check."""
    static_check.lift_device_checks(patch)


def launchers(table: str) -> dict:
    from glm5.backends import vendor
    from glm5.kernels.triton import registry as kreg

    if table == "defaults":
        d = kreg.default_table()
        tuning = lambda op: d.get(op, {})  # noqa: E731
    else:
        tuning = vendor.tuning_for(importlib.import_module(f"glm5.backends.{table}").SPEC.tuning)
    return {r[0]: r[1] for r in kreg.kernels(tuning)}


def run_generators(fns: dict) -> None:
    import torch

    from glm5.ir.catalog import OPS
    from glm5.testing.cases import GENERATORS, RandomDraw

    for op, fn in fns.items():
        draw = RandomDraw(1, tier="tile")  # past the first tiles: the looping variants
        vals, _ = OPS[op].validate((), GENERATORS[op](draw, torch.bfloat16))
        fn(*[vals[n] for n in OPS[op].param_names])


def run_gpu_shapes(fns: dict) -> None:
    import torch

    from glm5.ir.quant_formats import quantize_weight

    z = torch.zeros
    for dt in (torch.float32, torch.bfloat16):  # fp16 takes the bf16 code paths
        for Dm in (6144, 20000):
            fns["rms_norm"](z(2, Dm, dtype=dt), z(Dm, dtype=dt), 1e-5)
        fns["silu_mul"](z(2, 4096, dtype=dt))
        for il in (True, False):
            fns["rope"](z(3, 64, 64, dtype=dt), z(3, 32, dtype=dt), z(3, 32, dtype=dt), il)
        fns["token_logprobs"](z(300, 256, dtype=dt), z(1000, 256, dtype=dt),
                              z(300, dtype=torch.int32), 1.0)
        for scheme in ("w8a16", "w8a8", "w4a8", "w6a12"):
            wp, ws = quantize_weight(torch.randn(64, 384), scheme)
            for M in (1, 64):
                fns["quant_linear"](z(M, 384, dtype=dt), wp, ws, scheme,
                                    z(64, dtype=dt) if M == 1 else None)


def main(jobs: list) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget

    install_recorders()
    skip_device_checks()
    for table, backend, arch, warp, cases in jobs:
        Recorder.target = GPUTarget(backend, arch, warp)
        fns = launchers(table)
        {"generators": run_generators, "gpu_shapes": run_gpu_shapes}[cases](fns)
    ok = [v for v in Recorder.done.values() if v >= 0]
    print(f"compiled {len(ok)} kernel variants in {sum(ok):.0f} s")
    for f in Recorder.failed:
        print("FAIL", f)
    return 1 if Recorder.failed else 0


def run_in_subprocess(jobs: list, timeout: int = 600):
    """Run the check in a fresh interpreter without TRITON_INTERPRET; the CompletedProcess."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.abspath(__file__), json.dumps(jobs)],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=root)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
