"""`import glm5` pulls in no optional dependency and stays fast."""

from __future__ import annotations

import json
import subprocess
import sys

OPTIONAL = ("triton", "tvm", "onnx", "onnxruntime", "onnxscript", "transformers", "ray",
            "torch_npu", "torch_mlu", "torch_musa", "hypothesis")

PROBE = r"""
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import glm5; t2 = time.perf_counter()
glm5.ops; glm5.get_registry(); t3 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "glm5": t2 - t1, "ops_and_registry": t3 - t2,
                  "modules": sorted(m.split(".")[0] for m in sys.modules)}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_pulls_no_optional_dependency():
    r = _probe()
    loaded = set(r["modules"]) & set(OPTIONAL)
    assert not loaded, f"import glm5 / glm5.ops loaded optional modules: {sorted(loaded)}"


def test_import_is_fast():
    r = _probe()
    # `import glm5` itself is lazy; binding all ops and discovering plugins stays well under
    # the cost of importing torch (~1-2 s here).
    assert r["glm5"] < 0.2, r
    assert r["ops_and_registry"] < 1.5, r


def _glm5_imports(path) -> set[str]:
    """Every glm5 module a source file imports (top level or inside functions)."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "glm5"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "glm5":
                found |= {f"glm5.{a.name}" for a in node.names}
            elif node.module.startswith("glm5."):
                found.add(node.module)
    return found


def test_ir_is_the_ground_floor():
    """DESIGN: the IR imports no glm5 layer (composites decompose over an ops namespace that the
    caller hands in; the ONNX export needs the ops bound, it does not bind them)."""
    import pathlib

    import glm5.ir

    bad = {}
    for f in sorted(pathlib.Path(glm5.ir.__file__).parent.glob("*.py")):
        up = sorted(m for m in _glm5_imports(f) if not m.startswith("glm5.ir"))
        if up:
            bad[f.name] = up
    assert not bad, f"glm5/ir imports layers above it: {bad}"
