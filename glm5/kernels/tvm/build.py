"""Build-and-cache for TVM kernels.

A kernel is built once per (op, variant key, target, TVM version, kernel source): the variant
key holds what the PrimFunc is specialised on (dtypes, static dims such as head sizes); sequence
lengths are symbolic, so a new length never recompiles. Built libraries are written to the cache directory
(atomic rename) and loaded from there by later processes; the first build is logged with its
time.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("glm5.tvm")


def default_cache_dir() -> Path:
    env = os.environ.get("GLM5_TVM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "glm5" / "tvm"


# The TIR helpers every kernel of this package is generated with: part of each kernel's source.
_SHARED_SOURCE = Path(__file__).with_name("tirlib.py")


def _source_hash(fn: Callable[..., Any]) -> str:
    """Hash of the file defining the kernel builder and of the shared TIR helpers: an edited
    kernel is rebuilt, not reused."""
    mod = inspect.getmodule(fn)
    path = getattr(mod, "__file__", None)
    if not path:
        return ""
    h = hashlib.sha256(Path(path).read_bytes())
    h.update(_SHARED_SOURCE.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class TVMContext:
    """Where and for what to build: the backend owns one."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    target: Any = None  # a tvm Target; None = the host CPU
    builds: list[dict] = field(default_factory=list)  # what was built / loaded, for reports
    _mem: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def host_target(self) -> Any:
        import tvm

        if self.target is None:
            self.target = tvm.target.Target.from_device("cpu")
        return self.target

    def kernel(self, op: str, key: dict[str, Any], build: Callable[[], Any],
               symbol: str) -> Callable[..., Any]:
        """The compiled function ``symbol`` of the PrimFunc/IRModule that ``build()`` returns."""
        import tvm

        target = self.host_target()
        ident = json.dumps({"op": op, "key": key, "target": str(target),
                            "tvm": tvm.__version__, "source": _source_hash(build)},
                           sort_keys=True, default=str)
        h = hashlib.sha256(ident.encode()).hexdigest()[:20]
        with self._lock:
            if h in self._mem:
                return self._mem[h][symbol]
            path = Path(self.cache_dir) / f"{op}-{h}.so"
            t0 = time.perf_counter()
            if path.exists():
                mod = tvm.runtime.load_module(str(path))
                how = "loaded"
            else:
                ex = tvm.compile(build(), target=target)
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
                os.close(fd)
                ex.export_library(tmp)
                os.replace(tmp, path)
                mod = tvm.runtime.load_module(str(path))
                how = "built"
            dt = time.perf_counter() - t0
            self.builds.append({"op": op, "key": key, "how": how, "seconds": dt,
                                "path": str(path)})
            if how == "built":
                log.info("glm5 tvm: built %s %s in %.2fs -> %s", op, key, dt, path)
            self._mem[h] = mod
            return mod[symbol]
