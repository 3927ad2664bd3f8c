"""The layer contract (docs/layers.md) holds over every import in glm5, and the check can fail:
planted back-edges, cycles, private imports and unexplained in-function imports are caught. Old
module paths import with a DeprecationWarning; no source file grows past 800 lines unless it is
a kernel builder or a table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import layering
from glm5._moved import MOVED, new_name

ROOT = layering.ROOT
GLM5 = ROOT / "glm5"

#: files allowed past MAX_LINES, each with what it is (a kernel builder or a table)
LONG_FILES: dict[str, str] = {}
MAX_LINES = 800


def test_layer_contract_holds():
    findings = layering.check()
    assert not findings, "\n".join(findings)


def test_table_is_read_and_covers_every_unit():
    table = layering.read_table()
    units = {layering.unit(m) for m in layering.modules(GLM5)}
    assert units == set(table)
    # the rules the design states in words, as rows of the table
    assert table["ir"] <= {"glm5"}
    assert "backends" not in table["core"] and "kernels" not in table["core"]
    assert "core" not in table["backends"] and "backends" not in table["kernels"]
    assert not ({"parallel", "deploy"} & (table["core"] | table["engine"]))
    assert "text" in table["engine"] and "serve" not in table["engine"]
    assert not ({"core", "engine"} & table["testing"])


@pytest.fixture
def tree(tmp_path):
    """A copy of glm5's sources and the table, for planting faults."""
    shutil.copytree(GLM5, tmp_path / "glm5", ignore=shutil.ignore_patterns("__pycache__", "*.so",
                                                                           "*.json", "*.toml"))
    shutil.copy(layering.TABLE_DOC, tmp_path / "layers.md")
    return tmp_path


def _plant(path: Path, after: str, text: str) -> None:
    src = path.read_text()
    assert after in src, (path, after)
    path.write_text(src.replace(after, after + text, 1))


def _check(tree: Path) -> list[str]:
    return layering.check(tree / "glm5", tree / "layers.md")


def test_clean_copy_has_the_same_findings(tree):
    assert _check(tree) == layering.check()


def test_planted_back_edge_in_a_function_fails(tree):
    # the model reaching up into the HTTP server, hidden inside a function with a "reason"
    _plant(tree / "glm5/core/config.py", "from __future__ import annotations\n",
           "\n\ndef _planted():\n    from glm5.serve import app  # lazy: planted\n    return app\n")
    found = [f for f in _check(tree) if f.startswith("edge:")]
    assert any("glm5.core.config" in f and "glm5.serve.app" in f and "core -> serve" in f
               for f in found), found


def test_planted_module_level_back_edge_fails(tree):
    (tree / "glm5/kernels/planted.py").write_text("from glm5.backends import registry\n")
    found = _check(tree)
    assert any(f.startswith("edge: glm5.kernels.planted:1") and "kernels -> backends" in f
               for f in found), found


def test_planted_cycle_fails(tree):
    # text.chat <- text.bpe exists; the reverse arrow closes a loop inside one package
    (tree / "glm5/text/chat.py").write_text((tree / "glm5/text/chat.py").read_text()
                                            + "\n\ndef _planted():\n"
                                            "    from glm5.text import bpe  # lazy: planted\n"
                                            "    return bpe\n")
    found = [f for f in _check(tree) if f.startswith("cycle:")]
    assert any("glm5.text.bpe" in f and "glm5.text.chat" in f for f in found), found


def test_planted_private_import_fails(tree):
    (tree / "glm5/engine/planted.py").write_text("from glm5.core.config import _planted\n")
    found = _check(tree)
    assert any(f.startswith("private: glm5.engine.planted:1") and "_planted" in f
               for f in found), found


def test_planted_import_from_a_private_module_of_another_package_fails(tree):
    (tree / "glm5/backends/planted.py").write_text(
        "from glm5.kernels.triton._grid import launch\n")
    found = _check(tree)
    assert any(f.startswith("private: glm5.backends.planted:1") and "_grid" in f
               for f in found), found


def test_planted_unexplained_lazy_import_fails(tree):
    (tree / "glm5/engine/planted.py").write_text(
        "def f():\n    from glm5.core import config\n    return config\n\n\n"
        "def g():\n    from glm5.core import config  # lazy: a reason\n    return config\n")
    found = [f for f in _check(tree) if "planted.py" in f]
    assert len(found) == 1 and found[0].startswith("lazy: glm5/engine/planted.py:2"), found


def test_planted_table_cycle_fails(tree):
    doc = tree / "layers.md"
    doc.write_text(doc.read_text().replace("| `ir` | glm5 |", "| `ir` | glm5, ops |"))
    found = _check(tree)
    assert any(f.startswith("table:") and "cycle" in f for f in found), found


def test_old_paths_warn_and_are_the_new_modules():
    old = sorted(MOVED) + ["glm5.dist.comm", "glm5.dist.groups"]
    code = f"""
import importlib, json, warnings
out = {{}}
for name in {old!r}:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = importlib.import_module(name)
    out[name] = [m.__name__, [str(x.message) for x in w if x.category is DeprecationWarning]]
print(json.dumps(out))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for name in old:
        module, warned = out[name]
        assert module == new_name(name), (name, module)
        assert any(name in w and new_name(name) in w for w in warned), (name, warned)


def test_moved_table_points_at_real_modules_and_nothing_imports_old_paths():
    for old, new in MOVED.items():
        assert not (GLM5 / Path(*old.split(".")[1:])).with_suffix(".py").exists(), old
        assert (GLM5 / Path(*new.split(".")[1:])).with_suffix(".py").exists() or \
            (GLM5 / Path(*new.split(".")[1:]) / "__init__.py").exists(), new
    found = layering.imports(layering.modules(GLM5))[0]
    assert not [i for i in found if new_name(i.dst)]


def test_import_glm5_stays_light():
    code = ("import sys, glm5; heavy = [m for m in ('torch', 'numpy', 'glm5.parallel', "
            "'glm5.engine', 'glm5.text', 'glm5.deploy') if m in sys.modules]; print(heavy)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr)


def test_no_source_file_over_the_limit_but_builders_and_tables():
    long = {str(p.relative_to(ROOT)): n for p in GLM5.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= set(LONG_FILES), {k: v for k, v in long.items() if k not in LONG_FILES}
