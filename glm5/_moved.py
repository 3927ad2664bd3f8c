"""Old module paths that moved in the 0.2 re-layout keep importing, for one release, with a
DeprecationWarning naming the new path (the module object is the new one: patching or reading
either path touches the same module).

`MOVED` is the one table of moves; `install()` (called by ``import glm5``) puts the finder in
front of ``sys.meta_path``. Standard library only: ``import glm5`` stays light."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType

#: old module path -> new module path. A package entry also maps every submodule under it
#: (``glm5.dist.comm`` -> ``glm5.parallel.comm``) unless a longer entry names it.
MOVED: dict[str, str] = {
    "glm5.dist": "glm5.parallel",
    "glm5.dist.parallel": "glm5.parallel.layouts",
    "glm5.serve.tokenizer": "glm5.text.tokenizer",
    "glm5.serve.chat": "glm5.text.chat",
    "glm5.testing.assets": "glm5.text.bpe",
    "glm5.core.plan": "glm5.deploy.plan",
    "glm5.core.quantize": "glm5.deploy.quantize",
    "glm5.core.info": "glm5.deploy.info",
    "glm5.core.chips": "glm5.deploy.chips",
    "glm5.core.export": "glm5.deploy.export",
    "glm5.testing.bench": "glm5.perf.bench",
    "glm5.testing.tune": "glm5.perf.tune",
    "glm5.testing.tune_cpu": "glm5.perf.tune_cpu",
    "glm5.testing.device_shapes": "glm5.perf.device_shapes",
    "glm5.testing.measure": "glm5.perf.measure",
}


def new_name(old: str) -> str | None:
    """The module path that replaced ``old``, or None if ``old`` did not move."""
    if old in MOVED:
        return MOVED[old]
    parent = old.rpartition(".")[0]
    while parent:
        if parent in MOVED:
            return f"{MOVED[parent]}.{old[len(parent) + 1:]}"
        parent = parent.rpartition(".")[0]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path is deprecated and will be "
                      "removed in the next release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        # The new module ran when it was imported; the import system now files it under the
        # old name as well.
        pass


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("glm5.") else None
        if new is None:
            return None
        # Submodules of a moved package come back through this finder (it is first on
        # sys.meta_path), so the spec need not say whether the new module is a package.
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
