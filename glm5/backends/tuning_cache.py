"""Per-device tuning caches: the launch parameters `glm5 tune` found fastest on one device
model, kept on disk and applied over a backend's tuning table the first time one of its Triton
kernels runs on that device.

Layers of a Triton kernel's launch parameters, later ones winning key by key: the kernels'
DEFAULTS, the backend's tuning.json (shipped, one per backend), then this cache's entry for the
device the call runs on (vLLM keeps its fused-MoE configs per device name the same way). A
cache file is

    <dir>/<backend>/<device key>.json   {"_meta": {...}, "<op>": {<launch parameter>: value}}

where ``<dir>`` is ``$GLM5_TUNING_CACHE`` (``off``: no cache is read or written), else
``$XDG_CACHE_HOME/glm5/tuning`` (``~/.cache/glm5/tuning``), and the device key is the device's
name and compute capability (``NVIDIA-H200-sm90``) or ``interpreter`` for the Triton
interpreter on CPU tensors. ``_meta`` records what was measured (device, Triton and torch
versions, date, times before and after) and a hash of the Triton kernel sources: a file written
for other kernel sources is not applied (tiles chosen for one kernel say nothing about its
successor; run `glm5 tune` again), and `glm5 backends --diagnose` says so.

Nothing here imports triton; torch only inside `device_key`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from glm5.host_cpu import cpu_model

ENV = "GLM5_TUNING_CACHE"
META = "_meta"
INTERPRETER = "interpreter"

log = logging.getLogger("glm5.tuning")
_KERNELS = Path(__file__).resolve().parents[1] / "kernels"
# the sources whose change makes a cache stale: the Triton library; for the cpu backend's
# crossovers, the TVM quantized-linear kernels and their shared TIR helpers
_SOURCES = {"triton": ("triton/*.py",), "tvm": ("tvm/quant*.py", "tvm/tirlib.py")}
_hash: dict[str, str] = {}


def cache_dir() -> Path | None:
    """The cache directory, or None when ``GLM5_TUNING_CACHE=off``."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "glm5" / "tuning"


def kernels_hash(library: str = "triton") -> str:
    """sha256 (16 hex digits) of a kernel library's sources (`_SOURCES`), once per process."""
    if library not in _hash:
        h = hashlib.sha256()
        files = sorted({f for pattern in _SOURCES[library] for f in _KERNELS.glob(pattern)})
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        _hash[library] = h.hexdigest()[:16]
    return _hash[library]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-") or "device"


def device_key(device: Any) -> tuple[str, str]:
    """(key, name) of the device a tensor lives on: ``("NVIDIA-H200-sm90", "NVIDIA H200")``; a
    CPU tensor (the Triton interpreter) is ``("interpreter", "Triton interpreter")``."""
    import torch

    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        return INTERPRETER, "Triton interpreter"
    mod = getattr(torch, dev.type, None)
    index = dev.index if dev.index is not None else mod.current_device()
    name = str(mod.get_device_name(index))
    cap = ""
    if hasattr(mod, "get_device_capability"):
        try:
            major, minor = mod.get_device_capability(index)
            cap = f"-sm{major}{minor}"
        except Exception:  # a vendor runtime without capabilities: the name alone
            cap = ""
    return _slug(name) + cap, name


def cpu_key(tier: str, threads: int) -> tuple[str, str]:
    """(key, name) of this CPU for the cpu backend's crossovers: its model name, glm5's tier
    for it (``amx`` / ``vnni`` / ``portable``) and the thread count they were measured with
    (``AMD-EPYC-9B45-vnni-2t``)."""
    name = cpu_model()
    many = "s" if threads != 1 else ""
    return f"{_slug(name)}-{tier}-{threads}t", f"{name} ({tier}, {threads} thread{many})"


def path_for(backend: str, key: str, root: Path | None = None) -> Path | None:
    """The cache file of ``backend`` on the device ``key`` (None when the cache is off)."""
    root = cache_dir() if root is None else root
    return None if root is None else root / _slug(backend) / f"{_slug(key)}.json"


def read(path: Path) -> dict[str, Any]:
    """A cache file's contents ({} when absent); a file that is not a JSON object raises
    ValueError naming it."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"glm5 tuning cache {path}: unreadable ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"glm5 tuning cache {path}: expected an object of per-op objects")
    return data


def library_of(backend: str) -> str:
    """The kernel library a backend's cache entries tune: the cpu backend's TVM kernels (its
    quant_linear crossovers), every other backend's Triton kernels."""
    return "tvm" if backend == "cpu" else "triton"


def entries(backend: str, key: str) -> tuple[dict[str, dict[str, Any]], str]:
    """(per-op entries to apply, a line saying why) for ``backend`` on device ``key``: nothing
    when the cache is off, the file is absent or unreadable, or it was written for other sources
    of the backend's kernel library (`library_of`)."""
    library = library_of(backend)
    path = path_for(backend, key)
    if path is None:
        return {}, f"{ENV}=off"
    try:
        data = read(path)
    except ValueError as e:
        return {}, f"ignored: {e}"
    if not data:
        return {}, f"none for {key} ({path})"
    meta = data.get(META, {})
    if meta.get("kernels") != kernels_hash(library):
        return {}, (f"ignored: {path} was tuned for other {library} kernel sources (kernels "
                    f"{meta.get('kernels')}, now {kernels_hash(library)}); run `glm5 tune` "
                    f"again")
    ops = {op: e for op, e in data.items() if op != META}
    return ops, f"{path}: {', '.join(sorted(ops)) or 'no op'} (tuned {meta.get('date', '?')})"


def write(path: Path, ops: dict[str, dict[str, Any]], meta: dict[str, Any],
          drop: list[str] | tuple[str, ...] = ()) -> None:
    """Merge ``ops`` into the cache file at ``path`` (other ops' entries kept, those in ``drop``
    removed; a file written for other kernel sources starts over) with ``meta``, atomically."""
    old = read(path) if path.exists() else {}
    if old.get(META, {}).get("kernels") != meta.get("kernels"):
        old = {}
    data = {**{k: v for k, v in old.items() if k != META and k not in drop}, **ops}
    merged_meta = {**old.get(META, {}), **meta}
    merged_meta["results"] = {**old.get(META, {}).get("results", {}), **meta.get("results", {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({META: merged_meta, **dict(sorted(data.items()))}, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def listing(backend: str | None = None) -> dict[str, Any]:
    """What the cache holds (``backend``'s files, or every backend's): {"dir": str | None,
    "files": [{"backend", "key", "ops", "device", "triton", "date", "applied", "error"}]}."""
    root = cache_dir()
    if root is None:
        return {"dir": None, "files": []}
    files = sorted(root.glob(f"{_slug(backend) if backend else '*'}/*.json")) \
        if root.is_dir() else []
    rows = []
    for f in files:
        row: dict[str, Any] = {"backend": f.parent.name, "key": f.stem, "ops": [], "device": None,
                               "triton": None, "date": None, "tp": None, "applied": False,
                               "error": None}
        try:
            data = read(f)
        except ValueError as e:
            row["error"] = str(e)
        else:
            meta = data.get(META, {})
            row.update(ops=sorted(k for k in data if k != META), device=meta.get("device"),
                       triton=meta.get("triton"), date=meta.get("date"), tp=meta.get("tp"),
                       applied=meta.get("kernels") == kernels_hash(library_of(f.parent.name)))
        rows.append(row)
    return {"dir": str(root), "files": rows}


def describe(row: dict[str, Any]) -> str:
    """One line for a `listing` row."""
    name = f"{row['backend']}/{row['key']}"
    if row["error"]:
        return f"{name}: {row['error']}"
    state = "applied" if row["applied"] else "stale (other kernel sources: not applied)"
    triton = f", triton {row['triton']}" if row["triton"] else ""
    tp = f", tuned at tp {row['tp']}" if row.get("tp") not in (None, 1) else ""
    return (f"{name}: {', '.join(row['ops']) or 'no op'}; {row['device'] or '?'}{triton}{tp}, "
            f"{row['date'] or '?'}: {state}")
