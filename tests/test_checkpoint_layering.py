"""glm5/core/checkpoint.py (reads checkpoints) and glm5/deploy/quantize.py (writes quantized ones)
depend one way: quantize imports checkpoint, never the reverse; the format's names stay
importable from both."""

from __future__ import annotations

import ast
from pathlib import Path

import glm5.core.checkpoint as checkpoint

ROOT = Path(checkpoint.__file__).resolve().parent


def _imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
    return mods


def test_checkpoint_does_not_import_quantize():
    mods = _imported_modules(ROOT / "checkpoint.py")
    assert not any(m == "glm5.deploy.quantize" or m.startswith("glm5.deploy.quantize.")
                   for m in mods), sorted(mods)
    assert "glm5.core.checkpoint" in _imported_modules(ROOT / "quantize.py")


def test_format_names_are_defined_once_and_importable_from_quantize():
    from glm5.deploy import quantize

    for name in ("INDEX", "SINGLE", "DESCRIPTION", "METHOD", "FORMAT_VERSION", "FLOAT",
                 "MSMODELSLIM_DESCRIPTION", "CheckpointError", "read_description",
                 "repack_model", "load_model"):
        assert getattr(quantize, name) is getattr(checkpoint, name), name
    src = (ROOT / "quantize.py").read_text()
    for name in ("DESCRIPTION", "METHOD", "FORMAT_VERSION", "FLOAT", "MSMODELSLIM_DESCRIPTION"):
        assert f"\n{name} = " not in src, name
    assert "def read_description" not in src and "def repack_model" not in src
