"""The cpu backend: TVM-compiled TensorIR kernels for the host CPU (llvm target), the default
on a machine without accelerators. Registered through glm5's `glm5.backends` entry point.

Kernel sources live in glm5/kernels/tvm; this module owns the build context (cache directory,
target) and declares which ops and dtypes it serves: every op the model calls on CPU (norms,
rope, silu_mul, the DSA indexer and selection, attention, MoE routing and experts, quantized
linears) and the RL trainer's ops (token_logprobs and policy_loss with backward kernels of
their own, grpo_advantages), so a model run or an RL step makes no reference fallback. Four
kernels choose per call between
paths (`moe_experts` above ``moe.ROWS_TVM`` routed rows, `quant_linear` per CPU tier, scheme
and row count from ``quant.PATHS``, `moe_experts_quant` per CPU tier, `topk_indices` below
``topk.RADIX_MIN`` scores a row); they are registered with a wrapper that reports the path
taken (`glm5.backends.api.report_impl`): "tvm", "tvm:vnni", "tvm:vgemm", "tvm:amx",
"tvm:per-expert", "torch:per-expert", "torch:gemm" or "torch:topk". token_logprobs is labelled
"tvm+torch:mm" (torch.mm logits, TVM softmax passes).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from glm5 import cpu_threads
from glm5.backends import tuning_cache as tc
from glm5.backends.api import API_VERSION, Backend, hookimpl, report_impl
from glm5.kernels.tvm import moe, quant, topk
from glm5.kernels.tvm import registry as kreg
from glm5.kernels.tvm.build import TVMContext, default_cache_dir

GLM5_API_VERSION = API_VERSION

_ctx = None
log = logging.getLogger("glm5.backends.cpu")


def context():
    """The backend's TVM build context (cache dir from settings / GLM5_TVM_CACHE)."""
    global _ctx
    if _ctx is None:
        # Before TVM's runtime starts: its pool's size (TVM's own default is half the vCPUs on
        # x86), no pinning, no spinning; torch's pool no wider than the CPUs this process gets
        # (glm5/cpu_threads.py decides both; measurements: docs/performance.md, "CPU under
        # load").
        cpu_threads.apply()
        warning = cpu_threads.spinning_warning()
        if warning:
            log.warning("cpu backend: %s", warning)
        cache = BACKEND.settings.get("compile_cache") or default_cache_dir()
        _ctx = TVMContext(cache_dir=Path(str(cache)).expanduser())
        apply_tuning_cache()
    return _ctx


tuning_state = "not applied yet (the backend has not started)"


def apply_tuning_cache() -> str:
    """Put this CPU's measured `quant_linear` crossovers in force (`glm5 tune --backend cpu`,
    kept in the tuning cache under this CPU's model, tier and thread count), or `PATHS`' own
    where the cache has none for it; returns (and keeps in ``tuning_state``) what happened."""
    global tuning_state
    key, _ = tc.cpu_key(quant.cpu_tier(), torch.get_num_threads())
    ops, why = tc.entries("cpu", key)
    try:
        quant.use_crossovers(ops.get("quant_linear", {}))
    except ValueError as e:
        quant.use_crossovers({})
        why = f"ignored: {e}"
    log.info("cpu backend tuning cache: %s", why)
    tuning_state = why
    return why


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


def _moe_path(x, ids, weights, w13, w2) -> str | None:
    """The path `glm5.kernels.tvm.moe.moe_experts` takes for these arguments (None: an empty
    call, nothing runs)."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return None
    return "torch:per-expert" if x.shape[0] * ids.shape[1] > moe.ROWS_TVM else "tvm"


def _quant_linear_path(x, w_packed, w_scale, scheme, bias=None) -> str | None:
    """The path `glm5.kernels.tvm.quant.quant_linear` takes for these arguments (None: an
    empty product, nothing runs)."""
    M, K = x.shape
    if M == 0 or K == 0 or w_packed.shape[0] == 0:
        return None
    return quant.LABELS[quant.path(scheme, M, dtype=x.dtype)]


def _moe_quant_path(x, ids, weights, w13_packed, w13_scale, w2_packed, w2_scale,
                    scheme) -> str | None:
    """The path `glm5.kernels.tvm.quant.moe_experts_quant` takes (None: an empty call):
    each expert on quant_linear's path on a VNNI / AMX tier, else one grouped TVM GEMV."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return None
    routed = w13_packed.shape[1] >= 2 and bool((ids >= 0).any())
    return "tvm:per-expert" if routed and quant.cpu_tier() != "portable" else "tvm"


def _topk_path(scores, k) -> str | None:
    """The selection `glm5.kernels.tvm.topk.topk_indices` uses (None: nothing to select)."""
    if scores.shape[0] == 0 or min(k, scores.shape[1]) == 0:
        return None
    return topk.path(scores.shape[1])


# op -> (the path it takes per call, its static label)
_CHOOSERS: dict[str, tuple[Callable[..., str | None], str]] = {
    "moe_experts": (_moe_path, "tvm|torch:per-expert"),
    "quant_linear": (_quant_linear_path, "tvm|tvm:vnni|tvm:vgemm|tvm:amx|tvm+onednn|torch:gemm"),
    "moe_experts_quant": (_moe_quant_path, "tvm|tvm:per-expert"),
    "topk_indices": (_topk_path, "tvm|torch:topk"),
}


# op -> label, where the kernel is not TVM's alone: token_logprobs' logits are torch.mm (MKL /
# oneDNN) GEMMs, its softmax passes TVM.
_LABELS = {"token_logprobs": "tvm+torch:mm"}


def _reporting(fn: Callable[..., Any], path: Callable[..., str | None]) -> Callable[..., Any]:
    def kernel(*args: Any) -> Any:
        label = path(*args)
        if label is not None:
            report_impl(label)
        return fn(*args)

    kernel.__name__ = getattr(fn, "__name__", "kernel")
    return kernel


def _register_kernels(b: Backend) -> None:
    """Each kernel module adds its kernels; a module not yet written is simply absent."""
    backwards = kreg.backwards(context)
    for op, fn, dtypes, supports in kreg.kernels(context):
        impl = _LABELS.get(op)
        if op in _CHOOSERS:
            path, impl = _CHOOSERS[op]
            fn = _reporting(fn, path)
        b.kernel(op, dtypes=dtypes, supports=supports, impl=impl,
                 backward=backwards.get(op))(fn)


@hookimpl
def glm5_register_backends(registry) -> None:
    if not BACKEND.kernels:
        _register_kernels(BACKEND)
    registry.register(BACKEND)
