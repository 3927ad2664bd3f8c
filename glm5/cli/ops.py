"""`glm5 ops`: the op catalog and which backend serves each op on a device."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json
from typing import Any

from glm5.cli.common import fmt, registry


def add_parser(sub) -> argparse.ArgumentParser:
    o = sub.add_parser("ops", help="the op catalog and which backend serves each op")
    o.add_argument("--backend", help="show what serves each op with this backend preferred")
    o.add_argument("--device", default="cpu", help="torch device type (default cpu)")
    o.add_argument("--dtype", default="bfloat16", help="dispatch dtype (default bfloat16)")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=run)
    return o


def op_rows(backend: str | None, device: str, dtype_name: str) -> list[dict[str, Any]]:
    import torch

    from glm5.backends import selection
    from glm5.ir.catalog import OPS

    want = getattr(torch, dtype_name)
    rows = []
    ctx = selection.use_backend(backend) if backend else selection.use_backend(None)
    with ctx:
        for op in OPS.values():
            arg = next((p for p in op.tensor_params if p.name == op.dispatch_arg), None)
            allowed = arg.dtypes if arg is not None and arg.dtypes else None
            dt = want if allowed is None or want in allowed else sorted(allowed, key=str)[0]
            plan = selection.resolve(op, device, dt)
            rows.append({
                "op": op.name, "category": op.category,
                "kind": "composite" if op.is_composite else "primitive",
                "check": "selection" if op.selection is not None else "error model",
                "dtype": str(dt).replace("torch.", ""),
                "served_by": plan.served_by, "mode": plan.mode,
                "candidates": [c.backend.name for c in plan.candidates],
                "declined": {n: r for n, r in plan.declined},
                "summary": op.summary,
            })
    return rows


def run(args: argparse.Namespace) -> int:
    if args.backend:
        registry().get(args.backend)
    rows = op_rows(args.backend, args.device, args.dtype)
    if args.json:
        print(json.dumps({"device": args.device, "backend": args.backend, "ops": rows}, indent=2))
        return 0
    table = [("op", "kind", "checked by", "dtype", "served by", "mode", "candidates")]
    for r in rows:
        table.append((r["op"], r["kind"], r["check"], r["dtype"], r["served_by"],
                      r["mode"], ",".join(r["candidates"]) or "-"))
    print(fmt(table))
    fb = [r["op"] for r in rows if r["mode"] == "fallback"]
    if fb:
        print(f"\n{len(fb)} op(s) fall back to the reference on {args.device}: {', '.join(fb)}")
    return 0
