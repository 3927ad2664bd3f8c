"""Compile-count check without a GPU: which compiled variants Triton would build for a set of
launches.

Triton's JIT compiles one binary per *specialization key* and caches it: the key is built from
every argument -- a ``tl.constexpr`` by its value, an int by whether it is 1 (then it becomes a
constant) or divisible by 16, a tensor by its dtype and whether its address is 16-byte aligned
-- plus the launch options (``num_warps`` ...). Arguments listed in ``do_not_specialize`` keep
only their type. Two launches with equal keys share one compilation; a new key is a new
compilation (seconds on a GPU). This module computes exactly that key with Triton's own binder
(``triton.runtime.jit.create_function_from_signature``, as ``JITFunction.run`` does) for a CUDA
target (``GPUTarget("cuda", 90, 32)``, an H100/H200), so it runs on a CPU-only machine, with or
without the interpreter: the kernels are not compiled or run, only their keys are computed.

``record_launches()`` replaces the entry kernels of glm5.kernels.triton (the public
``@triton.jit`` names of the ``_*_kernels`` modules) by recorders for the duration of a
``with`` block: a launcher then runs its host-side argument preparation as usual, and each
launch records ``(kernel name, key)`` instead of running (outputs stay uninitialised). The test
tests/test_triton_compile_count.py sweeps 50 sequence lengths through every op this way and
asserts one key per kernel and variant.

triton is imported lazily (on the first key), like the kernel modules.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

# The modules holding the @triton.jit kernels; their public jit names are the entry kernels.
KERNEL_MODULES: tuple[str, ...] = ("_attention_kernels", "_flash_kernels", "_indexer_kernels",
                                   "_logprobs_kernels", "_moe_kernels", "_norm_kernels",
                                   "_prolog_kernels", "_quant_kernels", "_splitkv_kernels")

# (backend name, arch, warp size) of the target whose specialization rules are applied.
DEFAULT_TARGET: tuple[str, int, int] = ("cuda", 90, 32)

_binders: dict[tuple[int, tuple[str, int, int]], Any] = {}


def _jit_parts(kernel: Any) -> tuple[Any, list, list]:
    """(python function, do_not_specialize, do_not_specialize_on_alignment) of a JITFunction
    or of the interpreter's InterpretedFunction (which keeps the decorator's kwargs)."""
    fn = getattr(kernel, "fn", None)
    if fn is None:
        raise TypeError(f"glm5 compile_check: expected a @triton.jit kernel, got "
                        f"{type(kernel).__name__}")
    if hasattr(kernel, "do_not_specialize"):  # JITFunction
        return fn, list(kernel.do_not_specialize), list(kernel.do_not_specialize_on_alignment)
    kw = getattr(kernel, "kwargs", {}) or {}  # InterpretedFunction
    return (fn, list(kw.get("do_not_specialize") or []),
            list(kw.get("do_not_specialize_on_alignment") or []))


def _binder(kernel: Any, target: tuple[str, int, int]) -> Any:
    key = (id(kernel), target)
    if key not in _binders:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        fn, dns, dnsa = _jit_parts(kernel)
        jf = JITFunction(fn, do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)
        backend = make_backend(GPUTarget(*target))
        _binders[key] = create_function_from_signature(jf.signature, jf.params, backend)
    return _binders[key]


def specialization_key(kernel: Any, args: tuple, kwargs: dict[str, Any],
                       target: tuple[str, int, int] = DEFAULT_TARGET) -> str:
    """The cache key Triton's JIT computes for ``kernel[grid](*args, **kwargs)`` on ``target``
    (the grid plays no part): equal keys share one compilation."""
    from triton.runtime.jit import compute_cache_key

    _, specialization, options = _binder(kernel, target)(*args, **kwargs)
    return compute_cache_key({}, specialization, options)


def entry_kernels() -> dict[str, tuple[Any, str]]:
    """{kernel name: (module, attribute)} of every public @triton.jit kernel in
    KERNEL_MODULES (imports them, and so triton)."""
    out: dict[str, tuple[Any, str]] = {}
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"glm5.kernels.triton.{name}")
        for attr, obj in vars(mod).items():
            if attr.startswith("_"):
                continue  # private jit helpers are device functions, never launched
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and \
                    getattr(obj.fn, "__module__", None) == mod.__name__:
                out[attr] = (mod, attr)
    return out


class _Recorder:
    """Stands in for a kernel: ``rec[grid](*args, **kw)`` records the specialization key."""

    def __init__(self, name: str, kernel: Any, log: list[tuple[str, str]],
                 target: tuple[str, int, int], calls: list | None = None) -> None:
        self.name, self.kernel, self.log, self.target = name, kernel, log, target
        self.calls = calls

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append((self.name,
                             specialization_key(self.kernel, args, kwargs, self.target)))
            if self.calls is not None:
                self.calls.append((self.name, self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def record_launches(target: tuple[str, int, int] = DEFAULT_TARGET, calls: list | None = None
                    ) -> Iterator[list[tuple[str, str]]]:
    """Within the block every entry kernel records ``(name, key)`` into the yielded list instead
    of running; the kernels are restored on exit. With ``calls``, each launch also appends
    ``(name, kernel, args, kwargs)`` there (glm5.kernels.triton.static_check compiles them)."""
    log: list[tuple[str, str]] = []
    saved = []
    try:
        for name, (mod, attr) in entry_kernels().items():
            kern = getattr(mod, attr)
            saved.append((mod, attr, kern))
            setattr(mod, attr, _Recorder(name, kern, log, target, calls))
        yield log
    finally:
        for mod, attr, kern in saved:
            setattr(mod, attr, kern)
