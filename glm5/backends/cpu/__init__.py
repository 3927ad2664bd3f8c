"""The cpu backend: TVM-compiled TensorIR kernels for the host CPU (llvm target), the default
on a machine without accelerators. Registered through glm5's `glm5.backends` entry point.

Kernel sources live in glm5/kernels/tvm; this module owns the build context (cache directory,
target) and declares which ops and dtypes it serves.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from glm5.backends.api import API_VERSION, Backend, hookimpl

GLM5_API_VERSION = API_VERSION

_ctx = None


def context():
    """The backend's TVM build context (cache dir from settings / GLM5_TVM_CACHE)."""
    global _ctx
    if _ctx is None:
        # TVM sizes its pool as hardware_concurrency / 2 on x86 (assuming hyper-threads): on a
        # 2-vCPU machine that is one thread. Use every CPU unless the user said otherwise; this
        # must happen before TVM's runtime starts.
        os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))
                                                     if hasattr(os, "sched_getaffinity")
                                                     else os.cpu_count() or 1))
        # TVM's idle workers spin after each kernel and take the cores from torch's own
        # threads, which run the GEMMs between glm5's kernels: the 8K long-context forward was
        # ~15% faster without spinning (bench/long_context.py, 3 runs each, 2026-11-30).
        os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")
        from glm5.kernels.tvm.build import TVMContext, default_cache_dir

        cache = BACKEND.settings.get("compile_cache") or default_cache_dir()
        _ctx = TVMContext(cache_dir=Path(str(cache)).expanduser())
    return _ctx


BACKEND = Backend(
    "cpu",
    vendor="glm5",
    device_type="cpu",
    priority=10,
    description="TVM (llvm) compiled TensorIR kernels for the host CPU",
    settings={"quant_scheme": "w8a16", "collective": "gloo", "compile_cache": "",
              "tuning_table": ""},
)


@BACKEND.availability
def _available() -> tuple[bool, str]:
    if importlib.util.find_spec("tvm") is None:
        return False, "apache-tvm is not installed (pip install 'glm5[tvm]')"
    return True, "TVM llvm target on the host CPU"


def _register_kernels(b: Backend) -> None:
    """Each kernel module adds its kernels; a module not yet written is simply absent."""
    from glm5.kernels.tvm import registry

    for op, fn, dtypes, supports in registry.kernels(context):
        b.kernel(op, dtypes=dtypes, supports=supports)(fn)


@hookimpl
def glm5_register_backends(registry) -> None:
    if not BACKEND.kernels:
        _register_kernels(BACKEND)
    registry.register(BACKEND)
