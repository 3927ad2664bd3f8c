"""The parity runner behind `glm5 parity`: every op a backend claims, every dtype it claims,
N generated examples each, judged against the float64 oracle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from glm5.backends.api import Backend, KernelEntry
from glm5.ir.catalog import OPS
from glm5.ir.signature import dtype_name
from glm5.testing.cases import DEFAULT_PROFILE, case_dtypes, example, example_seed
from glm5.testing.compare import check_example


@dataclass
class Row:
    backend: str
    op: str
    status: str  # pass | fail | skip
    dtype: str
    max_abs_err: float
    max_rel_err: float
    tolerance: str
    examples: int  # examples actually checked
    message: str = ""
    emulated: bool = False  # kernels ran on CPU tensors through an emulator, not the device
    # How close the kernel sits to its bound: median and max over examples of the largest
    # |error| / bound of each example (1.0 = at the bound).
    ratio_median: float = 0.0
    ratio_max: float = 0.0
    # Which implementation served the examples: label -> examples (a vendor binding such as
    # "torch_npu.npu_sparse_flash_attention", "triton", "tvm", "torch:per-expert",
    # "fallback:reference"); an example served by two (a combined kernel) counts for both.
    served_by: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_op(entry: KernelEntry, dtype: torch.dtype, examples: int, seed: int,
             device: str | None = None, profile: str = DEFAULT_PROFILE) -> Row:
    """Judge one (kernel, dtype) over ``examples`` generated cases, example ``i`` from the
    profile's i-th size tier (inputs moved to ``device`` for a device backend's real run)."""
    op = OPS[entry.op]
    row = Row(entry.backend.name, op.name, "pass", dtype_name(dtype), 0.0, 0.0, "", 0)
    declined = 0
    ratios: list[float] = []
    for i in range(examples):
        s = example_seed(seed, op.name, dtype, i)
        values = example(op.name, dtype, seed, i, profile)
        values, _ = op.validate((), values)  # a generator bug shows here, not as a kernel fail
        args = tuple(values[n] for n in op.param_names)
        if not entry.accepts(args):
            declined += 1
            continue
        v = check_example(op, entry, values, dtype, device)
        for label in v.served_by:
            row.served_by[label] = row.served_by.get(label, 0) + 1
        row.examples += 1
        row.tolerance = v.tolerance or row.tolerance
        row.max_abs_err = max(row.max_abs_err, v.max_abs_err)
        row.max_rel_err = max(row.max_rel_err, v.max_rel_err)
        ratios.append(v.ratio)
        if not v.ok:
            row.status = "fail"
            row.message = f"example {i} (seed {s}): {v.message}"
            break
    if ratios:
        ratios.sort()
        row.ratio_median, row.ratio_max = ratios[len(ratios) // 2], ratios[-1]
    if row.examples == 0:
        row.status = "skip"
        row.message = f"supports() declined all {declined} examples"
    elif declined and row.status == "pass":
        row.message = f"{declined} examples declined by supports()"
    return row


def run_parity(backend: Backend, ops: Iterable[str] | None = None, examples: int = 20,
               seed: int = 0, emulate: bool = False,
               profile: str = DEFAULT_PROFILE) -> list[Row]:
    """Rows for every op ``backend`` claims (optionally only ``ops``), in catalog order.

    ``emulate``: run the kernels on CPU tensors through the backend's emulation mode (see
    ``Backend.emulation``) instead of requiring its device; rows are marked emulated."""
    wanted = list(OPS) if ops is None else list(ops)
    unknown = [o for o in wanted if o not in OPS]
    if unknown:
        raise KeyError(f"glm5 parity: unknown ops {unknown}; known ops: {', '.join(OPS)}")
    rows: list[Row] = []
    ok, reason = backend.can_emulate() if emulate else backend.is_available()
    if emulate and not ok:
        reason = f"cannot emulate: {reason}"
    for name in wanted:
        entry = backend.kernels.get(name)
        if entry is None:
            continue
        dts = case_dtypes(OPS[name], entry.dtypes)
        if not dts:
            rows.append(Row(backend.name, name, "skip", "-", 0.0, 0.0, "", 0,
                            "kernel claims no dtype the op accepts"))
            continue
        for dt in dts:
            if not ok:
                rows.append(Row(backend.name, name, "skip", dtype_name(dt), 0.0, 0.0, "", 0,
                                reason if emulate else f"backend unavailable: {reason}",
                                emulate))
                continue
            dev = None if emulate or backend.device_type in ("cpu", "any") else backend.device_type
            row = check_op(entry, dt, examples, seed, dev, profile)
            row.emulated = emulate
            rows.append(row)
    return rows


def served_text(served: dict[str, int]) -> str:
    """"triton", or "torch_npu.npu_sparse_flash_attention x3, triton x7" when several served."""
    if len(served) <= 1:
        return next(iter(served), "-")
    return ", ".join(f"{k} x{n}" for k, n in served.items())


def format_table(rows: list[Row]) -> str:
    head = ("backend", "op", "dtype", "status", "examples", "max_abs_err", "err/bound med",
            "max", "served by", "message")
    body = [
        (r.backend + (" (emulated)" if r.emulated else ""), r.op, r.dtype, r.status.upper(),
         str(r.examples), f"{r.max_abs_err:.2e}", f"{r.ratio_median:.3f}", f"{r.ratio_max:.3f}",
         served_text(r.served_by), r.message)
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(head)]
    widths[-1] = len(head[-1])
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))]
    out += [line(b) for b in body]
    n = {s: sum(r.status == s for r in rows) for s in ("pass", "fail", "skip")}
    out.append(f"\n{n['pass']} passed, {n['fail']} failed, {n['skip']} skipped")
    return "\n".join(out)
