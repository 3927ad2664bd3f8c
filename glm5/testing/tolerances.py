"""The one tolerance table of the conformance kit, keyed by (op, output dtype, quant scheme).

Nothing here is picked: every bound is derived from the op's error model (``OpDef.error``,
its docstring is the derivation) and the bound form of glm5.ir.numerics:

    |y - r| <= MARGIN * (u(out) |r| + u(work) mid) + LAMBDA u(fp32) acc + step + floor

where ``r`` is the oracle (the reference in float64 on the same inputs), ``out`` the output's
dtype, ``work`` the dtype the kernel was called with, ``mid`` / ``acc`` / ``step`` the op's
error terms computed by the oracle for these very inputs. An fp32 output computed from bf16
inputs is held to fp32 arithmetic; a rounding to the working dtype counts only where the op's
model allows one (between an expert's two GEMMs, P before P.V, ...). Tests and ``glm5 parity``
ask this module (``bound``, ``entry``); there are no per-test tolerances.

``table()`` lists every entry with its numbers and derivation; docs/conformance.md is generated
from it (``python -m glm5.testing.tolerances``), and a test keeps the two in step.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass

import torch

from glm5.ir import numerics
from glm5.ir.catalog import OPS
from glm5.ir.numerics import ErrorTerms
from glm5.ir.opdef import OpDef
from glm5.ir.quant_formats import SCHEMES
from glm5.ir.signature import dtype_name
from glm5.testing.cases import GENERATORS, RandomDraw

ANY_SCHEME = "*"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def bound(ref: torch.Tensor, terms: ErrorTerms, out: torch.dtype,
          work: torch.dtype) -> torch.Tensor:
    """The elementwise bound on |y - ref| (float64, shaped like ``ref``) for an output of dtype
    ``out`` of a kernel called with ``work``, given the op's error ``terms``."""
    return numerics.bound(ref, terms, out, work)


@dataclass(frozen=True)
class Entry:
    op: str
    output: str
    out: torch.dtype
    work: torch.dtype
    scheme: str
    numbers: str  # the bound form with this entry's unit roundoffs
    derivation: str  # the op's error model, in words

    @property
    def key(self) -> tuple[str, torch.dtype, str]:
        return (self.op, self.out, self.scheme)


def _out_dtypes(op: OpDef, work: torch.dtype) -> list[tuple[str, torch.dtype | None]]:
    """(output name, dtype) for a call in ``work`` (None for integer outputs), read off a
    generated example's output specs; mutated arguments keep their dtype."""
    values = GENERATORS[op.name](RandomDraw(0, tier="edge"), work)
    res: list[tuple[str, torch.dtype | None]] = []
    for o, (_, dt) in zip(op.outputs, op.output_specs(values)):
        res.append((o.name, dt if dt.is_floating_point else None))
    for name in op.mutates:
        res.append((name, values[name].dtype))
    return res


def _derivation(op: OpDef) -> str:
    parts = []
    if op.selection is not None:
        parts.append(f"{op.selection.index_output}: {op.selection.doc}.")
    if op.error is not None:
        parts.append(" ".join(inspect.getdoc(op.error).split()))
    return " ".join(parts)


def _works(op: OpDef) -> list[torch.dtype]:
    arg = next(p for p in op.tensor_params if p.name == op.dispatch_arg)
    allowed = arg.dtypes
    return [d for d in DTYPES if allowed is None or d in allowed]


def table() -> list[Entry]:
    """Every (op, output, output dtype, scheme) entry of the kit."""
    rows = []
    for op in OPS.values():
        schemes = [ANY_SCHEME]
        if any(p.name == "scheme" for p in op.params):
            schemes = list(SCHEMES)
        for work in _works(op):
            for scheme in schemes:
                for name, out in _out_dtypes(op, work):
                    if out is None:
                        text = "integers: exact where the rule says, else as the derivation"
                    else:
                        text = (f"{numerics.MARGIN:g}*({numerics.unit_roundoff(out):.3g}*abs(r) + "
                                f"{numerics.unit_roundoff(work):.3g}*mid) + {numerics.LAMBDA:g}*"
                                f"{numerics.unit_roundoff(numerics.acc_dtype(work)):.3g}*acc + "
                                f"step")
                    rows.append(Entry(op.name, name, out or torch.int32, work, scheme, text,
                                      _derivation(op)))
    return rows


def entry(op: str, output: str, work: torch.dtype, scheme: str | None = None) -> Entry:
    """The table entry of one output of ``op`` called with ``work`` (and ``scheme``)."""
    want = scheme if scheme is not None else ANY_SCHEME
    for e in table():
        if e.op == op and e.output == output and e.work == work and e.scheme == want:
            return e
    raise KeyError(f"glm5.testing: no tolerance entry for {op}.{output} called in "
                   f"{dtype_name(work)} (scheme {want}); ops: {', '.join(OPS)}")


def bound_form() -> dict[str, object]:
    """The bound's form and constants, for reports (``glm5 parity --json``)."""
    return {"form": "MARGIN*(u(out)*|r| + u(work)*mid) + LAMBDA*u(acc)*acc + step + floor",
            "MARGIN": numerics.MARGIN, "LAMBDA": numerics.LAMBDA,
            "unit_roundoff": {dtype_name(d): numerics.unit_roundoff(d) for d in DTYPES}}


def formula(op: OpDef, work: torch.dtype, scheme: str | None = None) -> str:
    """One line for a parity row: the bound form with the unit roundoffs of this call."""
    u = numerics.unit_roundoff
    return (f"{numerics.MARGIN:g}*(u_out*|r| + {u(work):.2g}*mid) + {numerics.LAMBDA:g}*"
            f"{u(numerics.acc_dtype(work)):.2g}*acc + step (error model of {op.name})")


BEGIN = "<!-- BEGIN GENERATED by `python -m glm5.testing.tolerances`: do not edit -->"
END = "<!-- END GENERATED -->"


def markdown() -> str:
    """docs/conformance.md's generated section: the table and each op's derivation."""
    lines = [BEGIN, "", "| op | output | called in | output dtype | scheme | bound |",
             "|---|---|---|---|---|---|"]
    for e in table():
        lines.append(f"| {e.op} | {e.output} | {dtype_name(e.work)} | {dtype_name(e.out)} | "
                     f"{e.scheme} | {e.numbers} |")
    lines.append("")
    lines.append("### Derivations (each op's error model)")
    lines.append("")
    for op in OPS.values():
        lines.append(f"**{op.name}**: " + textwrap.fill(_derivation(op), 96))
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - docs generator
    print(markdown())
