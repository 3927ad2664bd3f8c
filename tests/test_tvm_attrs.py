"""The TVM kernels' function attributes are ones TVM 0.27 honours: its compiler knows
"tirx.noalias" only, and a kernel that set "tir.noalias" silently lost the no-alias promise on
its parameters (glm5/kernels/tvm/indexer.py's score_tile and decode, select.py's select_topk did)."""

from __future__ import annotations

from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "glm5" / "kernels" / "tvm"


def test_no_kernel_sets_the_attribute_tvm_ignores():
    bad = [p.name for p in sorted(KERNELS.glob("*.py")) if '"tir.noalias"' in p.read_text()]
    assert not bad, f'"tir.noalias" is ignored by TVM 0.27 ("tirx.noalias" is the key): {bad}'


def test_tirx_noalias_reaches_the_generated_code():
    tvm = pytest.importorskip("tvm")
    from glm5.kernels.tvm.indexer import build_decode

    f = build_decode()

    def params_noalias(g) -> bool:
        m = tvm.compile(tvm.IRModule({"decode": g}), target={"kind": "llvm"})
        src = m.inspect_source("ll") if hasattr(m, "inspect_source") else m.mod.inspect_source("ll")
        return any("noalias" in line for line in src.splitlines()
                   if line.startswith("define") and "decode" in line)

    assert params_noalias(f)
    # the attribute the three kernels used to set: no noalias in the code
    assert not params_noalias(f.with_attr("tirx.noalias", False).with_attr("tir.noalias", True))
