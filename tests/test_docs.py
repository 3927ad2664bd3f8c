"""The documentation users read is the truth: docs/ops.md (the op contract) agrees with the
OpDefs, no doc or docstring points outside the repository, and README's Python examples run as
written."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import pytest
import torch

from glm5.ir import contract_doc
from glm5.ir.catalog import OPS
from glm5.ir.signature import ScalarArg, TensorArg

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPS_MD = ROOT / "docs" / "ops.md"

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.int8,
    torch.uint8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn)}


# --------------------------------------------------------------------------- an independent reader
def _block(text: str, name: str) -> str | None:
    m = re.search(rf"<!-- BEGIN GENERATED {re.escape(name)}:.*?<!-- END GENERATED "
                  rf"{re.escape(name)} -->", text, re.S)
    return m.group(0) if m else None


def _table(block: str, first: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with ``| first |``, as cells."""
    lines = block.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else cell


def doc_vs_opdefs(text: str) -> list[str]:
    """Read docs/ops.md the way a user does and compare every op's argument and output tables
    with its OpDef: names and order, tensor or scalar, shapes, dtypes, optionality, defaults.
    (Independent of the generator, so a generator bug cannot hide a difference.)"""
    bad: list[str] = []
    for name, op in OPS.items():
        block = _block(text, name)
        if block is None:
            bad.append(f"{name}: no generated block")
            continue
        args = _table(block, "argument")
        got_names = [_code(r[0]) for r in args]
        if got_names != list(op.param_names):
            bad.append(f"{name}: arguments {got_names}, OpDef has {list(op.param_names)}")
            continue
        for row, p in zip(args, op.params):
            kind, shape, dtypes = row[1], row[2], row[3]
            if isinstance(p, TensorArg):
                if not kind.startswith("tensor"):
                    bad.append(f"{name}.{p.name}: kind {kind!r}, OpDef: tensor")
                if ("optional" in kind) != p.optional:
                    bad.append(f"{name}.{p.name}: optional={'optional' in kind}, OpDef: "
                               f"{p.optional}")
                if p.shape is not None:
                    want = "[" + ", ".join(str(d) for d in p.shape) + "]"
                    if _code(shape) != want:
                        bad.append(f"{name}.{p.name}: shape {shape}, OpDef: {want}")
                listed = {d.strip() for d in dtypes.split(",")}
                if p.dtypes is None:
                    if listed != {"any"}:
                        bad.append(f"{name}.{p.name}: dtypes {dtypes}, OpDef: any")
                elif {_DTYPES.get(d) for d in listed} != set(p.dtypes):
                    bad.append(f"{name}.{p.name}: dtypes {dtypes}, OpDef: "
                               f"{sorted(str(d) for d in p.dtypes)}")
            else:
                assert isinstance(p, ScalarArg)
                if kind != p.type.__name__:
                    bad.append(f"{name}.{p.name}: kind {kind!r}, OpDef: {p.type.__name__}")
                if p.has_default and f"default `{p.default!r}`" not in row[4]:
                    bad.append(f"{name}.{p.name}: default not {p.default!r} in {row[4]!r}")
        outs = [_code(r[0]) for r in _table(block, "output")]
        if outs != [o.name for o in op.outputs]:
            bad.append(f"{name}: outputs {outs}, OpDef has {[o.name for o in op.outputs]}")
        if f"`glm5.ops.{name}(" not in block:
            bad.append(f"{name}: no call signature")
    return bad


# --------------------------------------------------------------------------- docs/ops.md
def test_ops_doc_is_generated_from_the_current_opdefs():
    text = OPS_MD.read_text()
    assert contract_doc.problems(text) == [], (
        "docs/ops.md is stale: python -m glm5.ir.contract_doc docs/ops.md")
    assert doc_vs_opdefs(text) == []
    for name in OPS:  # every op has its own section (the anchor docstrings link to)
        assert f"\n### `{name}`\n" in text


def test_ops_doc_drift_is_caught(monkeypatch):
    text = OPS_MD.read_text()
    block = _block(text, "sparse_attention")
    # a dtype edited by hand
    edited = text.replace(block, block.replace("| `idx` | tensor | `[T, K]` | int32 |",
                                               "| `idx` | tensor | `[T, K]` | int64 |"))
    assert edited != text
    assert "the generated block of sparse_attention is stale" in contract_doc.problems(edited)
    assert any("sparse_attention.idx: dtypes" in b for b in doc_vs_opdefs(edited))
    # a shape edited by hand
    edited = text.replace(block, block.replace("`[S, Hk, Dqk]`", "`[S, Hk, Dv]`", 1))
    assert any("sparse_attention.k: shape" in b for b in doc_vs_opdefs(edited))
    # an op's section removed
    i = text.index("### `policy_loss`")
    cut = text[:i]
    assert "no section '### `policy_loss`'" in contract_doc.problems(cut)
    assert "policy_loss: no generated block" in doc_vs_opdefs(cut)
    # the OpDef changes (an argument renamed) while the page does not
    op = OPS["rms_norm"]
    renamed = dataclasses.replace(
        op, params=(op.params[0], dataclasses.replace(op.params[1], name="gamma"), op.params[2]))
    monkeypatch.setitem(OPS, "rms_norm", renamed)
    assert "the generated block of rms_norm is stale" in contract_doc.problems(text)
    assert any(b.startswith("rms_norm: arguments") for b in doc_vs_opdefs(text))


def test_ops_doc_render_rewrites_stale_blocks_only():
    text = OPS_MD.read_text()
    block = _block(text, "rope")
    stale = text.replace(block, block.replace("`[T, R/2]`", "`[T, R]`"))
    assert contract_doc.render(stale) == text
    assert contract_doc.render(text) == text


@pytest.mark.parametrize("name", [n for n in OPS if any(
    (n, o) in contract_doc.COMPUTED_SHAPES or (n, o) in contract_doc.COMPUTED_DTYPES
    for o in [p.name for p in OPS[n].params] + [o.name for o in OPS[n].outputs])
    or any(k[0] == n for k in contract_doc.DERIVED_SYMBOLS)])
def test_ops_doc_computed_shapes_match_real_calls(name):
    """The shapes the page writes for computed outputs, scheme-dependent scales and derived
    symbols are what real calls (the kit's generators, every tier of the smoke profile and
    every scheme they rotate through) have and produce."""
    from glm5.testing.cases import example

    op = OPS[name]
    seen = 0
    for i in range(8):
        values, syms = op.validate((), example(name, torch.float32, 0, i, profile="smoke"))
        syms = contract_doc.derived_symbols(op, values, syms)
        for (n, sym) in contract_doc.DERIVED_SYMBOLS:
            if n == name:
                assert syms[sym] == contract_doc.symbol_value(op, sym, values, syms), (sym, i)
        for p in op.tensor_params:
            forms = contract_doc.COMPUTED_SHAPES.get((name, p.name))
            if forms is not None and values[p.name] is not None:
                want = contract_doc.evaluate_shape(forms, values, syms)
                assert tuple(values[p.name].shape) == want, (p.name, i)
                seen += 1
        outs = op.reference(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in values.items()})
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o, got in zip(op.outputs, outs):
            forms = contract_doc.COMPUTED_SHAPES.get((name, o.name))
            if forms is not None:
                want = contract_doc.evaluate_shape(forms, values, syms)
                if want and want[0] == "...":
                    lead = tuple(values[op.params[0].name].shape[:-1])
                    want = lead + want[1:]
                assert tuple(got.shape) == want, (o.name, i)
                seen += 1
            dforms = contract_doc.COMPUTED_DTYPES.get((name, o.name))
            if dforms is not None:
                assert str(got.dtype) == "torch." + contract_doc.select_form(
                    dforms, values, syms), (o.name, i)
                seen += 1
    assert seen or any(k[0] == name for k in contract_doc.DERIVED_SYMBOLS)


def test_computed_shapes_are_written_for_every_opdef_that_computes_one():
    for op in OPS.values():
        for p in op.tensor_params:
            if p.shape is None:
                assert (op.name, p.name) in contract_doc.COMPUTED_SHAPES, (op.name, p.name)
        for o in op.outputs:
            if callable(o.shape):
                assert (op.name, o.name) in contract_doc.COMPUTED_SHAPES, (op.name, o.name)
            if callable(o.dtype):
                assert (op.name, o.name) in contract_doc.COMPUTED_DTYPES, (op.name, o.name)


def test_op_docstrings_link_to_the_contract():
    import glm5.ops

    for name in OPS:
        doc = getattr(glm5.ops, name).__doc__
        assert f"docs/ops.md#{name}" in doc, doc


def test_no_doc_points_outside_the_repository():
    """README, docs and docstrings point to docs/ops.md, not to an OPS.md users never see."""
    hits = []
    for sub in ("README.md", "docs", "glm5", "examples", "tests"):
        base = ROOT / sub
        files = [base] if base.is_file() else [
            f for f in base.rglob("*") if f.suffix in (".md", ".py") and f.is_file()]
        for f in files:
            if f == pathlib.Path(__file__).resolve():
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"\bOPS\.md\b", line):
                    hits.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


# --------------------------------------------------------------------------- README examples
def _python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    text = path.read_text()
    for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        out.append((text[:m.start()].count("\n") + 1, m.group(1)))
    return out


@pytest.mark.parametrize("path,line,code", [
    pytest.param(p, ln, code, id=f"{p.name}:{ln}")
    for p in (ROOT / "README.md", OPS_MD, ROOT / "docs" / "serving.md")
    for ln, code in _python_blocks(p)])
def test_python_examples_run_as_written(path, line, code, tmp_path, monkeypatch):
    """Each ```python block runs on its own, in a fresh namespace (shell blocks are not run)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GLM5_BACKEND", raising=False)
    exec(compile(code, f"{path.name}:{line}", "exec"), {"__name__": "__readme__"})


def test_readme_has_python_examples():
    assert len(_python_blocks(ROOT / "README.md")) >= 2
    assert os.path.exists(OPS_MD)
