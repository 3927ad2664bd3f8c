"""Compare a kernel's outputs with the float64 oracle: one example at a time.

Dense outputs use the tolerance table; selection ops (topk_indices, indexer_topk, moe_route)
are compared by the oracle scores of what was selected, so a tie that a rounding flips passes
and a set that differs beyond ties fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from glm5.ir.opdef import OpDef
from glm5.ir.ops_dsa import lightning_indexer_ref
from glm5.ir.ops_moe import moe_route_scores, route_weights
from glm5.testing.tolerances import SELECTION_SCORE_CLASS, Tolerance, lookup

TINY = torch.finfo(torch.float64).tiny


@dataclass
class Verdict:
    ok: bool = True
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    tolerance: str = ""
    message: str = ""
    notes: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> "Verdict":
        if self.ok:
            self.ok, self.message = False, msg
        return self

    def absorb(self, abs_err: float, rel_err: float) -> None:
        self.max_abs_err = max(self.max_abs_err, abs_err)
        self.max_rel_err = max(self.max_rel_err, rel_err)


def upcast(values: dict[str, Any]) -> dict[str, Any]:
    """The oracle's inputs: floating tensors in float64 (a fresh copy), others cloned."""
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().to(torch.float64).clone() if v.is_floating_point() else v.clone()
        else:
            out[k] = v
    return out


def clone_inputs(values: dict[str, Any]) -> dict[str, Any]:
    """The kernel's inputs: same tensors, but fresh copies of those the op mutates."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in values.items()}


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def compare_dense(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance, n: int,
                  v: Verdict, int_slack: int = 0) -> None:
    if not got.is_floating_point():
        diff = (got.long() - ref.long()).abs()
        worst = int(diff.max()) if diff.numel() else 0
        v.absorb(float(worst), 0.0)
        if worst > int_slack:
            v.fail(f"{name}: integer output differs by {worst} (allowed {int_slack})")
        return
    g, r = got.to(torch.float64), ref.to(torch.float64)
    gf, rf = torch.isfinite(g), torch.isfinite(r)
    if not torch.equal(gf, rf) or not torch.equal(g[~gf].nan_to_num(0.0, 1.0, -1.0),
                                                  r[~rf].nan_to_num(0.0, 1.0, -1.0)):
        where = (gf != rf).nonzero()
        at = where[0].tolist() if len(where) else "?"
        v.fail(f"{name}: non-finite values differ from the oracle (first at {at})")
        return
    if not bool(gf.any()):
        return
    err = (g - r).abs()[gf]
    rabs = r.abs()[gf]
    bound = tol.bound(r[rf], n)
    v.absorb(float(err.max()), float((err / rabs.clamp(min=TINY)).max()))
    bad = err > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        v.fail(f"{name}: |err| {float(err[i]):.3g} > bound {float(bound[i]):.3g} "
               f"(got {float(g[gf][i]):.6g}, oracle {float(r[rf][i]):.6g})")


def _row_selection(sel_ids: torch.Tensor, scores: torch.Tensor, k: int, tie: float,
                   v: Verdict, what: str, row: int) -> None:
    """One row: sel_ids [k] (−1 tail), oracle scores [S] (non-finite = not selectable)."""
    S = scores.shape[0]
    finite = torch.isfinite(scores)
    n_valid = min(k, int(finite.sum()))
    ids = sel_ids.long()
    valid = ids >= 0
    nv = int(valid.sum())
    if nv != n_valid:
        v.fail(f"{what} row {row}: {nv} valid entries, expected {n_valid}")
        return
    if nv and not bool(valid[:nv].all()):
        v.fail(f"{what} row {row}: valid entries must come first, −1 after")
        return
    got = ids[:nv]
    if bool(((got >= S) | (got < 0)).any()):
        v.fail(f"{what} row {row}: index out of range [0, {S})")
        return
    if got.unique().numel() != nv:
        v.fail(f"{what} row {row}: repeated index")
        return
    gs = scores[got]
    if not bool(torch.isfinite(gs).all()):
        v.fail(f"{what} row {row}: selected an entry with no finite score")
        return
    want = torch.sort(scores.masked_fill(~finite, float("-inf")), descending=True).values[:nv]
    have = torch.sort(gs, descending=True).values
    worst = float((have - want).abs().max()) if nv else 0.0
    v.absorb(worst, worst / max(float(want.abs().max()) if nv else 1.0, TINY))
    if worst > tie:
        v.fail(f"{what} row {row}: selected scores differ from the oracle's top-{k} by "
               f"{worst:.3g} (> tie tolerance {tie:.3g})")
        return
    if nv > 1 and bool((gs[1:] > gs[:-1] + tie).any()):
        v.fail(f"{what} row {row}: entries not in descending score order")


def _tie_tol(tol: Tolerance, scores: torch.Tensor, n: int) -> float:
    f = scores[torch.isfinite(scores)]
    if f.numel() == 0:
        return 0.0
    m = float(f.abs().max())
    return tol.rtol * m + tol.atol * (max(n, 1) ** 0.5) * m


def compare_selection(op: OpDef, got: Any, values: dict[str, Any], dtype: torch.dtype,
                      v: Verdict) -> None:
    tol = lookup(SELECTION_SCORE_CLASS[op.name], dtype)
    v.tolerance = "selected scores within tie " + tol.text()
    o = upcast(values)
    if op.name == "moe_route":
        weights, ids = got
        s, sel = moe_route_scores(o["logits"], o["bias"], o["n_group"], o["topk_group"])
        k = o["top_k"]
        for t in range(ids.shape[0]):
            _row_selection(ids[t], sel[t], k, _tie_tol(tol, sel[t], 1), v, "ids", t)
        if v.ok:
            want = route_weights(s, ids.long(), o["norm_topk_prob"], o["routed_scaling"])
            compare_dense("weights", weights, want, lookup("elementwise", dtype), k, v)
        return
    if op.name == "topk_indices":
        scores, k, n = o["scores"], o["k"], 1
    else:
        scores = lightning_indexer_ref(o["q"], o["k"], o["w"], o["k_start"], o["k_end"])
        k, n = o["topk"], op.reduce_len(o, op.symbols(o))
    for t in range(got.shape[0]):
        _row_selection(got[t], scores[t], k, _tie_tol(tol, scores[t], n), v, "idx", t)


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def check_example(op: OpDef, kernel: Any, values: dict[str, Any], dtype: torch.dtype,
                  device: torch.device | str | None = None) -> Verdict:
    """Run ``kernel`` on ``values`` (moved to ``device`` when given: a device backend's real
    run) and judge it against the float64 oracle on the CPU."""
    v = Verdict()
    scheme = values.get("scheme")
    tol = lookup(op.tolerance, dtype, scheme) if not op.selection else None
    if tol is not None:
        v.tolerance = tol.text()
    kin = clone_inputs(values)
    if device is not None and torch.device(device).type != "cpu":
        kin = {k: _to(x, torch.device(device)) for k, x in kin.items()}
    args = tuple(kin[n] for n in op.param_names)
    try:
        got = kernel(*args)
    except Exception as e:  # a kernel crash is this op's failure, not the runner's
        return v.fail(f"kernel raised {type(e).__name__}: {e}")
    if device is not None:
        got = tuple(_to(o, torch.device("cpu")) for o in got) if isinstance(got, tuple) \
            else _to(got, torch.device("cpu"))
        kin = {k: _to(x, torch.device("cpu")) for k, x in kin.items()}
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
    if op.selection:
        compare_selection(op, got, values, dtype, v)
        return v
    o64 = upcast(values)
    ref = _as_tuple(op.reference(*(o64[n] for n in op.param_names)))
    n = op.reduce_len(values, op.symbols(values))
    slack = 1 if op.tolerance == "quant" else 0
    for o, r, spec in zip(outs, ref, op.outputs):
        compare_dense(spec.name, o, r, tol, n, v, slack)
    for name in op.mutates:  # in-place results (the kv cache of mla_prolog)
        compare_dense(name, kin[name], o64[name], tol, n, v)
    return v
