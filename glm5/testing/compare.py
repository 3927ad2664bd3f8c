"""Compare a kernel's outputs with the float64 oracle: one example at a time.

Dense outputs are held to the op's error model (``OpDef.error``, bounds from
glm5.testing.tolerances); index outputs of selection ops are judged by the op's selection rule
(``OpDef.selection``): exactly where the rule says the order is determined, else by the oracle
scores of what was selected. Nothing here knows an op by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from glm5.backends.api import KernelEntry, recording_impls, run_recorded
from glm5.ir.catalog import get_op
from glm5.ir.numerics import ErrorTerms, SelectionRows
from glm5.ir.opdef import OpDef
from glm5.testing.tolerances import bound, formula

TINY = torch.finfo(torch.float64).tiny


@dataclass
class Verdict:
    ok: bool = True
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    ratio: float = 0.0  # the largest |error| / bound over the example's checked values
    tolerance: str = ""
    message: str = ""
    notes: list[str] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)  # implementation labels that ran

    def fail(self, msg: str) -> "Verdict":
        if self.ok:
            self.ok, self.message = False, msg
        return self

    def absorb(self, abs_err: float, rel_err: float, ratio: float = 0.0) -> None:
        self.max_abs_err = max(self.max_abs_err, abs_err)
        self.max_rel_err = max(self.max_rel_err, rel_err)
        self.ratio = max(self.ratio, ratio)


def upcast(values: dict[str, Any]) -> dict[str, Any]:
    """The oracle's inputs: floating tensors in float64, others cloned (fresh copies)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().to(torch.float64, copy=True) if v.is_floating_point() \
                else v.clone()
        else:
            out[k] = v
    return out


def clone_inputs(values: dict[str, Any], mutates: tuple[str, ...]) -> dict[str, Any]:
    """The kernel's inputs: the same tensors, fresh copies of those the op mutates."""
    return {k: (v.clone() if k in mutates and isinstance(v, torch.Tensor) else v)
            for k, v in values.items()}


def _untouched(op: OpDef, values: dict[str, Any], o64: dict[str, Any], v: Verdict) -> None:
    """A kernel must not write into the inputs the op does not mutate."""
    for p in op.tensor_params:
        x = values.get(p.name)
        if p.name in op.mutates or not isinstance(x, torch.Tensor):
            continue
        if x.is_floating_point():
            a, b = x.to(torch.float64), o64[p.name]
            same = bool(((a == b) | (a.isnan() & b.isnan())).all())
        else:
            same = torch.equal(x, o64[p.name])
        if not same:
            v.fail(f"{p.name}: the kernel wrote into an input the op does not mutate")
            return


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _first(mask: torch.Tensor) -> list[int] | str:
    where = mask.nonzero()
    return where[0].tolist() if len(where) else "?"


def compare_dense(name: str, got: torch.Tensor, ref: torch.Tensor, terms: ErrorTerms,
                  work: torch.dtype, v: Verdict) -> None:
    """``got`` against ``ref`` within the bound of ``terms`` (integer outputs: within
    ``terms.step`` code units)."""
    if not got.is_floating_point():
        diff = (got.long() - ref.long()).abs().to(torch.float64)
        allowed = torch.broadcast_to(torch.as_tensor(terms.step, dtype=torch.float64),
                                     diff.shape)
        worst = float(diff.max()) if diff.numel() else 0.0
        v.absorb(worst, 0.0, float((diff / allowed.clamp(min=1.0)).max()) if diff.numel()
                 else 0.0)
        bad = diff > allowed
        if bool(bad.any()):
            at = _first(bad)
            v.fail(f"{name}: integer output differs by {int(diff[bad].max())} at {at} "
                   f"(allowed {int(allowed[tuple(at)])} there: only codes within rounding of a "
                   f"half may move)")
        return
    g, r = got.to(torch.float64), ref.to(torch.float64)
    gf, rf = torch.isfinite(g), torch.isfinite(r)
    if not torch.equal(gf, rf) or not torch.equal(g[~gf].nan_to_num(0.0, 1.0, -1.0),
                                                  r[~rf].nan_to_num(0.0, 1.0, -1.0)):
        v.fail(f"{name}: non-finite values differ from the oracle (first at {_first(gf != rf)})")
        return
    if not bool(gf.any()):
        return
    b = bound(r, terms, got.dtype, work)
    err = (g - r).abs()[gf]
    bb = b[gf]
    rabs = r.abs()[gf]
    ratio = err / bb.clamp(min=TINY)
    v.absorb(float(err.max()), float((err / rabs.clamp(min=TINY)).max()), float(ratio.max()))
    bad = err > bb
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        at = gf.nonzero()[i].tolist()
        v.fail(f"{name}: |err| {float(err[i]):.3g} > bound {float(bb[i]):.3g} at {at} "
               f"(got {float(g[gf][i]):.6g}, oracle {float(r[rf][i]):.6g}; worst "
               f"error/bound {float(ratio.max()):.3g})")


def _row(got: torch.Tensor, want_ids: torch.Tensor, scores: torch.Tensor, b: torch.Tensor,
         k: int, exact: bool, v: Verdict, what: str, t: int) -> None:
    """One row of a selection: got/want_ids [k] (−1 tail), oracle scores [S] (−inf: not
    selectable) and their bounds [S]."""
    S = scores.shape[0]
    finite = torch.isfinite(scores)
    n_valid = min(k, int(finite.sum()))
    ids = got.long()
    valid = ids >= 0
    nv = int(valid.sum())
    if nv != n_valid:
        v.fail(f"{what} row {t}: {nv} valid entries, expected {n_valid}")
        return
    if nv and not bool(valid[:nv].all()):
        v.fail(f"{what} row {t}: valid entries must come first, −1 after")
        return
    sel = ids[:nv]
    if bool(((sel >= S) | (sel < 0)).any()):
        v.fail(f"{what} row {t}: index out of range [0, {S})")
        return
    if sel.unique().numel() != nv:
        v.fail(f"{what} row {t}: repeated index")
        return
    if exact:
        if not torch.equal(ids, want_ids.long()):
            j = int((ids != want_ids.long()).nonzero()[0, 0])
            v.fail(f"{what} row {t}: position {j} holds {int(ids[j])}, the order rule "
                   f"(descending score, ties to the smaller index, −1 tail) gives "
                   f"{int(want_ids[j])}")
        return
    gs = scores[sel]
    if not bool(torch.isfinite(gs).all()):
        v.fail(f"{what} row {t}: selected an entry that is not selectable (outside its range or "
               f"masked)")
        return
    want = torch.sort(scores.masked_fill(~finite, float("-inf")), descending=True)
    top = want.indices[:nv]
    # A perturbation of at most `tie` per score moves the j-th order statistic of the selected
    # scores by at most 2 tie (tie: the largest bound among the entries either side chose).
    tie = float(torch.cat((b[sel], b[top])).max()) if nv else 0.0
    have = torch.sort(gs, descending=True).values
    worst = float((have - want.values[:nv]).abs().max()) if nv else 0.0
    v.absorb(worst, worst / max(float(want.values[:nv].abs().max()) if nv else 1.0, TINY),
             worst / max(2 * tie, TINY) if nv else 0.0)
    if worst > 2 * tie:
        j = int((have - want.values[:nv]).abs().argmax())
        v.fail(f"{what} row {t}: the {j + 1}-th best selected score is {float(have[j]):.6g}, the "
               f"oracle's is {float(want.values[j]):.6g} (differ by {worst:.3g} > {2 * tie:.3g}, "
               f"twice the score bound)")
        return
    if nv > 1 and bool((gs[1:] > gs[:-1] + 2 * tie).any()):
        v.fail(f"{what} row {t}: entries not in descending score order")


def judge_selection(rows: SelectionRows, got: torch.Tensor, want: torch.Tensor,
                    work: torch.dtype, v: Verdict, what: str) -> None:
    finite = torch.isfinite(rows.scores)
    b = bound(rows.scores.masked_fill(~finite, 0.0), rows.terms, rows.score_dtype, work)
    for t in range(got.shape[0]):
        _row(got[t], want[t], rows.scores[t], b[t], rows.k, bool(rows.exact[t]), v, what, t)
        if not v.ok:
            return
    for t, msg in rows.problems:
        v.fail(f"{what} row {t}: {msg}")
        return


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def to_device(values: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``values`` with every tensor copied to ``device`` as the caller laid it out: each storage
    copied once (a copy even where ``device`` is the tensor's own) and every tensor rebuilt as
    the same view of the copy (shape, strides, offset). A per-tensor ``.to()`` would make
    ``v = k[..., :Dv]`` a second, contiguous tensor, and a kernel's path for that aliasing or
    layout would never run on the device."""
    dev = torch.device(device)
    copies: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, x in values.items():
        if not isinstance(x, torch.Tensor):
            out[name] = x
            continue
        st = x.untyped_storage()
        key = (st.data_ptr(), x.dtype)
        if key not in copies:
            flat = torch.empty(0, dtype=x.dtype, device=x.device).set_(
                st, 0, (st.nbytes() // x.element_size(),), (1,))
            copies[key] = flat.to(dev, copy=True)
        out[name] = copies[key].as_strided(x.shape, x.stride(), x.storage_offset())
    return out


def check_example(op: OpDef, kernel: Any, values: dict[str, Any], dtype: torch.dtype,
                  device: torch.device | str | None = None) -> Verdict:
    """Run ``kernel`` (a backend's KernelEntry, whose implementation labels are recorded in
    ``Verdict.served_by``, or a plain function) on ``values`` (moved to ``device`` when given:
    a device backend's real run) and judge it against the float64 oracle on the CPU; ``dtype``
    is the dtype the kernel was called with (the op's dispatch dtype)."""
    v = Verdict(tolerance=formula(op, dtype, values.get("scheme")))
    o64 = upcast(values)  # before the kernel runs: a kernel that writes its inputs is caught
    kin = clone_inputs(values, op.mutates)
    if device is not None and torch.device(device).type != "cpu":
        kin = to_device(kin, device)
    args = tuple(kin[n] for n in op.param_names)
    try:
        if isinstance(kernel, KernelEntry):
            with recording_impls() as partial:  # labels reported before an exception
                got, v.served_by = run_recorded(kernel, args)
        else:
            got = kernel(*args)
    except Exception as e:  # a kernel crash is this op's failure, not the runner's
        if isinstance(kernel, KernelEntry):
            v.served_by = list(dict.fromkeys(partial)) or [kernel.impl]
        return v.fail(f"kernel raised {type(e).__name__}: {e}")
    if device is not None:
        got = tuple(_to(o, torch.device("cpu")) for o in got) if isinstance(got, tuple) \
            else _to(got, torch.device("cpu"))
        kin = {k: _to(x, torch.device("cpu")) for k, x in kin.items()}
    return _judge(op, got, values, o64, kin, dtype, v)


def _judge(op: OpDef, got: Any, values: dict[str, Any], o64: dict[str, Any],
           after: dict[str, Any], dtype: torch.dtype, v: Verdict) -> Verdict:
    """Judge outputs ``got`` of ``op`` on ``values`` (``o64``: the float64 inputs taken before
    the call; ``after``: the arguments after it, for mutated and untouched inputs)."""
    # Shape and dtype contract.
    specs = op.output_specs(values)
    outs = _as_tuple(got)
    if len(outs) != len(specs):
        return v.fail(f"returned {len(outs)} outputs, expected {len(specs)}")
    for o, spec, (shape, dt) in zip(outs, op.outputs, specs):
        if not isinstance(o, torch.Tensor):
            return v.fail(f"{spec.name}: expected a tensor, got {type(o).__name__}")
        if tuple(o.shape) != tuple(shape) or o.dtype != dt:
            return v.fail(f"{spec.name}: got {o.dtype} {list(o.shape)}, expected {dt} "
                          f"{list(shape)}")
    _untouched(op, after, o64, v)
    if not v.ok:
        return v
    names = [s.name for s in op.outputs]
    got_by = dict(zip(names, outs))
    expected = dict(zip(names, _as_tuple(op.reference(*(o64[n] for n in op.param_names)))))
    skip: set[str] = set()
    if op.selection is not None:
        idx = op.selection.index_output
        rows = op.selection.rows(o64, got_by, dtype)
        judge_selection(rows, got_by[idx], expected[idx], dtype, v, idx)
        if not v.ok:
            return v
        expected.update(rows.expected)
        skip.add(idx)
    if op.error is None:
        return v
    terms = op.error(o64, tuple(expected[n] for n in names), dtype)
    for name in names:
        if name not in skip:
            compare_dense(name, got_by[name], expected[name], terms[name], dtype, v)
    for name in op.mutates:  # in-place results (the kv cache of mla_prolog)
        compare_dense(name, after[name], o64[name], terms[name], dtype, v)
    return v


def judge(op: OpDef | str, got: Any, values: dict[str, Any],
          before: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Verdict:
    """The kit's verdict on outputs ``got`` that something computed from ``values`` (the op's
    arguments by name, as they are after the call). For an op that mutates an argument pass
    ``before``: the arguments as they were before the call (the oracle starts from those).
    ``dtype``: the dtype the computation was called with (default: the op's dispatch dtype of
    ``values``). This is what tests use instead of their own tolerances."""
    op = get_op(op) if isinstance(op, str) else op
    values = op.bind((), values)
    before = values if before is None else op.bind((), before)
    dt = dtype or op.dispatch_dtype(values) or torch.float32
    v = Verdict(tolerance=formula(op, dt, values.get("scheme")))
    return _judge(op, got, before, upcast(before), values, dt, v)


def assert_matches(op: OpDef | str, got: Any, values: dict[str, Any],
                   before: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
                   what: str = "") -> Verdict:
    """``judge`` that raises AssertionError with the kit's message when the outputs fail."""
    v = judge(op, got, values, before, dtype)
    if not v.ok:
        name = op if isinstance(op, str) else op.name
        raise AssertionError(f"{what + ': ' if what else ''}{name}: {v.message}")
    return v
