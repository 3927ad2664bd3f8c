"""glm5: GLM-5 on an op IR with pluggable hardware backends.

Everything is imported lazily so that `import glm5` stays fast and pulls in no optional
dependency: `glm5.ops`, `glm5.Backend`, `glm5.hookimpl`, `glm5.use_backend` ... load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Before anything imports torch: its OpenMP pool reads its wait policy once, when it loads, and
# a spinning pool fights TVM's for the cores (glm5/cpu_threads.py).
from glm5 import cpu_threads as _cpu_threads  # noqa: E402  (standard library only)

_cpu_threads.quiet_openmp()

# Module paths that moved keep importing, with a DeprecationWarning (glm5/_moved.py).
from glm5 import _moved  # noqa: E402  (standard library only)

_moved.install()

_LAZY = {
    "ops": ("glm5.ops", None),
    "Backend": ("glm5.backends.api", "Backend"),
    "hookimpl": ("glm5.backends.api", "hookimpl"),
    "hookspec": ("glm5.backends.api", "hookspec"),
    "API_VERSION": ("glm5.backends.api", "API_VERSION"),
    "BackendError": ("glm5.backends.api", "BackendError"),
    "use_backend": ("glm5.backends.selection", "use_backend"),
    "FallbackError": ("glm5.backends.selection", "FallbackError"),
    "get_registry": ("glm5.backends.registry", "get_registry"),
    "reset_registry": ("glm5.backends.registry", "reset_registry"),
    "OpInputError": ("glm5.ir.signature", "OpInputError"),
    "OpTypeError": ("glm5.ir.signature", "OpTypeError"),
    "get_op": ("glm5.ir.catalog", "get_op"),
    "load_model": ("glm5.core.checkpoint", "load_model"),
    "GLM5Config": ("glm5.core.config", "GLM5Config"),
    "GLM5ForCausalLM": ("glm5.core.model", "GLM5ForCausalLM"),
    "LLM": ("glm5.engine.llm", "LLM"),
    "SamplingParams": ("glm5.engine.sampling", "SamplingParams"),
    "EngineConfig": ("glm5.engine.engine", "EngineConfig"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        mod, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'glm5' has no attribute {name!r}") from None
    m = importlib.import_module(mod)
    value = m if attr is None else getattr(m, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
