"""Build-and-cache for TVM kernels.

A kernel is built once per (op, variant key, target, TVM version, kernel source): the variant
key holds what the PrimFunc is specialised on (dtypes, static dims such as head sizes); sequence
lengths are symbolic, so a new length never recompiles. Built libraries are written to the cache directory
(atomic rename) and loaded from there by later processes; the first build is logged with its
time.

Loading a cached kernel does not import the ``tvm`` Python package: that import is slow (it
registers the compiler's ~400 FFI classes) and was most of the first forward of a process
(bench/cold_start.py; docs/performance.md, "Cold start"). A cached library only needs TVM's
C++ runtime (thread pool, workspace allocator), loaded with ctypes, and
``tvm_ffi.load_module``. The two strings the cache key needs
from the package (``str(target)`` of the host and ``tvm.__version__``) are kept in a small
``host-<fingerprint>.json`` beside the kernels, written the first time ``tvm`` is imported; the
fingerprint covers the TVM installation (files and ``TVM_LIBRARY_PATH``) and the CPU (model and
feature flags), so a new TVM or another machine sharing the cache reads no stale entry.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import platform
import sys
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


_hashes: dict[str, str] = {}


def _source_hash(fn: Callable[..., Any]) -> str:
    """Hash of the file defining the kernel builder, of the files of the other kernel modules
    it uses (a builder imported from another module of this package, e.g. moe's silu_mul from
    norm) and of the shared TIR helpers: an edited kernel is rebuilt, not reused. Once per
    module and process (the code that builds is the code imported, whatever the disk holds
    later)."""
    mod = inspect.getmodule(fn)
    path = getattr(mod, "__file__", None)
    if not path:
        return ""
    name = mod.__name__
    if name not in _hashes:
        package = __name__.rpartition(".")[0]
        files = {Path(path), _SHARED_SOURCE}
        for v in vars(mod).values():
            used = v if inspect.ismodule(v) else inspect.getmodule(v)
            f = getattr(used, "__file__", None)
            if f and getattr(used, "__name__", "").startswith(package + "."):
                files.add(Path(f))
        h = hashlib.sha256()
        for f in sorted(files):
            h.update(f.read_bytes())
        _hashes[name] = h.hexdigest()[:16]
    return _hashes[name]


@dataclass
class TVMContext:
    """Where and for what to build: the backend owns one."""

    cache_dir: Path = field(default_factory=default_cache_dir)
    target: Any = None  # a tvm Target; None = the host CPU
    builds: list[dict] = field(default_factory=list)  # what was built / loaded, for reports
    _mem: dict[str, Any] = field(default_factory=dict)
    _keys: tuple[str, str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def host_target(self) -> Any:
        import tvm

        if self.target is None:
            self.target = tvm.target.Target.from_device("cpu")
        return self.target

    def _key_strings(self) -> tuple[str, str]:
        """(str(target), tvm.__version__) for the cache key, without importing ``tvm`` when a
        host record for this installation and CPU exists (module docstring)."""
        if self._keys is None:
            self._keys = self._find_key_strings()
        return self._keys

    def _find_key_strings(self) -> tuple[str, str]:
        if self.target is not None:  # an explicit target: its creator imported tvm already
            import tvm

            return str(self.target), tvm.__version__
        fp = _host_fingerprint()
        rec = Path(self.cache_dir) / f"host-{fp}.json" if fp else None
        if rec is not None and "tvm" not in sys.modules:
            try:
                d = json.loads(rec.read_text())
                _load_runtime(d["runtime"])
                return d["target"], d["tvm"]
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no (or a damaged) record: import tvm and write it
        import tvm

        target, version = str(self.host_target()), tvm.__version__
        if rec is not None:
            data = json.dumps({"target": target, "tvm": version,
                               "runtime": _imported_runtime_path()}).encode()
            try:
                if not rec.exists() or rec.read_bytes() != data:
                    _write_atomic(rec, data)
            except OSError as e:  # a read-only cache still serves; only cold starts pay
                log.debug("glm5 tvm: could not write %s: %s", rec, e)
        return target, version

    def kernel(self, op: str, key: dict[str, Any], build: Callable[[], Any],
               symbol: str, mattr: tuple[str, ...] = (),
               ir_rewrite: Callable[[str], str] | None = None) -> Callable[..., Any]:
        """The compiled function ``symbol`` of the PrimFunc/IRModule that ``build()`` returns.
        ``mattr``: LLVM target features added to the host's (e.g. ``"+amx-int8"``) for a
        kernel whose caller has checked at run time that this CPU has them. ``ir_rewrite``:
        applied to the generated LLVM IR before it is compiled to machine code (what TIR
        cannot express, e.g. `tirlib.dpbf16_ir`); the LLVM module must be the only one."""
        with self._lock:
            target, version = self._key_strings()
            ident = {"op": op, "key": key, "target": target, "tvm": version,
                     "source": _source_hash(build)}
            if mattr:
                ident["mattr"] = list(mattr)
            ident = json.dumps(ident, sort_keys=True, default=str)
            h = hashlib.sha256(ident.encode()).hexdigest()[:20]
            if h in self._mem:
                return self._mem[h][symbol]
            path = Path(self.cache_dir) / f"{op}-{h}.so"
            t0 = time.perf_counter()
            if path.exists():
                mod = load_library(path)
                how = "loaded"
            else:
                import tvm

                tgt = self.host_target()
                if mattr:
                    d = dict(tgt.export())
                    d["mattr"] = list(d.get("mattr", ())) + list(mattr)
                    tgt = tvm.target.Target(d)
                ex = tvm.compile(build(), target=tgt)
                path.parent.mkdir(parents=True, exist_ok=True)
                if ir_rewrite is not None:
                    ex = _rewritten(ex, ir_rewrite, path.parent)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
                os.close(fd)
                ex.export_library(tmp)
                os.replace(tmp, path)
                mod = load_library(path)
                how = "built"
            dt = time.perf_counter() - t0
            self.builds.append({"op": op, "key": key, "how": how, "seconds": dt,
                                "path": str(path)})
            if how == "built":
                log.info("glm5 tvm: built %s %s in %.2fs -> %s", op, key, dt, path)
            self._mem[h] = mod
            return mod[symbol]


def _rewritten(ex: Any, ir_rewrite: Callable[[str], str], where: Path) -> Any:
    """The module of ``ex`` recompiled from its LLVM IR after ``ir_rewrite``."""
    import tvm

    mod = ex.mod
    if list(mod.imports):
        raise RuntimeError("glm5 tvm: an IR rewrite needs a kernel of one LLVM module, this "
                           f"one imports {len(list(mod.imports))}")
    fd, tmp = tempfile.mkstemp(suffix=".ll", dir=where)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ir_rewrite(mod.inspect_source("ll")))
        return tvm.runtime.load_module(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


# --------------------------------------------------------------------------- runtime loading
_runtime: ctypes.CDLL | None = None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _imported_runtime_path() -> str | None:
    """The libtvm_runtime the imported ``tvm`` package loaded (None if it cannot be told)."""
    import tvm.base

    lib = getattr(tvm.base, "_LOADED_LIBS", {}).get("tvm_runtime")
    return getattr(lib, "_name", None)


def _load_runtime(path: str | None) -> None:
    """Load TVM's C++ runtime RTLD_GLOBAL, as ``tvm.base`` does (a later ``import tvm`` dlopens
    the same file and gets the same handle), so compiled kernels find its symbols."""
    global _runtime
    if _runtime is None and "tvm" not in sys.modules:
        if not path:
            raise ValueError("no runtime library recorded")
        import tvm_ffi  # noqa: F401  loads libtvm_ffi, which the runtime links against

        _runtime = ctypes.CDLL(path, ctypes.RTLD_GLOBAL)


def load_library(path: Path | str) -> Any:
    """A compiled kernel library from the cache as a ``tvm_ffi.Module`` (``mod[symbol]`` is
    the function). Needs the runtime loaded: by ``import tvm`` or by ``_key_strings``."""
    if "tvm" in sys.modules:
        import tvm

        return tvm.runtime.load_module(str(path))
    import tvm_ffi

    return tvm_ffi.load_module(str(path))


def runtime_function(name: str) -> Callable[..., Any]:
    """A global function of TVM's runtime (e.g. ``"runtime.NumThreads"``), without importing
    the ``tvm`` package when the runtime is already loaded (by a cached kernel)."""
    if _runtime is None or "tvm" in sys.modules:
        import tvm

        return tvm.get_global_func(name)
    import tvm_ffi

    return tvm_ffi.get_global_func(name)


_fingerprint: list[str | None] = []


def _host_fingerprint() -> str | None:
    """A hash of what ``str(Target.from_device("cpu"))`` and ``tvm.__version__`` depend on: the
    TVM installation (where it is, the size and mtime of its version and library files,
    ``TVM_LIBRARY_PATH``) and the CPU (/proc/cpuinfo's model name and flags). None where the
    CPU cannot be read this way (then ``tvm`` is imported and nothing is recorded)."""
    if _fingerprint:
        return _fingerprint[0]
    fp = None
    try:
        spec = importlib.util.find_spec("tvm")
        cpu = _cpu_identity()
        if spec is not None and spec.submodule_search_locations and cpu:
            pkg = Path(list(spec.submodule_search_locations)[0])
            h = hashlib.sha256()
            h.update(f"{pkg}\0{os.environ.get('TVM_LIBRARY_PATH', '')}\0{platform.machine()}"
                     f"\0{cpu}".encode())
            for rel in ("__init__.py", "libinfo.py", "_version.py", "lib/libtvm_runtime.so",
                        "lib/libtvm_compiler.so"):
                try:
                    st = (pkg / rel).stat()
                    h.update(f"\0{rel}:{st.st_size}:{st.st_mtime_ns}".encode())
                except OSError:
                    h.update(f"\0{rel}:-".encode())
            fp = h.hexdigest()[:20]
    except (OSError, ValueError, ImportError):
        fp = None
    _fingerprint.append(fp)
    return fp


def _cpu_identity() -> str | None:
    """The first CPU's model name and feature flags from /proc/cpuinfo (None elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    want = ("model name", "flags", "features", "cpu model", "isa", "vendor_id")
    seen: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if seen:
                break  # the first processor's block is enough
            continue
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k in want:
            seen[k] = v.strip()
    return json.dumps(seen, sort_keys=True) if seen else None
