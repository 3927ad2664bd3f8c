"""`glm5 bench`: a backend's kernels timed against the reference and the roofline."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json
from pathlib import Path

from glm5.cli.common import registry, split_ops
from glm5.cli.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    bn = sub.add_parser("bench", help="time a backend's kernels vs the reference and roofline")
    bn.add_argument("--backend", help="backend (default: the one serving the CPU)")
    bn.add_argument("--ops", default="", help="comma-separated ops (default: all with shapes)")
    bn.add_argument("--repeat", type=int, default=3, help="timed rounds per row (median)")
    bn.add_argument("--quick", action="store_true", help="faster ceiling measurements")
    bn.add_argument("--no-reference", action="store_true", help="skip timing the reference")
    bn.add_argument("--json", action="store_true")
    bn.add_argument("--csv", metavar="FILE", help="also write the rows to a CSV file")
    bn.add_argument("--plot", metavar="FILE.png",
                    help="also draw %% of roofline per op and dtype (needs matplotlib)")
    bn.set_defaults(func=run)
    return bn


def run(args: argparse.Namespace) -> int:
    from glm5.backends.api import REFERENCE
    from glm5.perf.bench import SHAPES, format_rows, plot_rows, run_bench, write_csv

    from glm5.backends.selection import preferred_backend

    reg = registry()
    if args.backend:
        b = reg.get(args.backend)
    else:  # what the selection rule offers CPU calls first (the model's choice too)
        b = preferred_backend("cpu") or reg.get(REFERENCE)
    ok, reason = b.is_available()
    if not ok:
        raise ValueError(f"backend {b.name!r} is unavailable: {reason}")
    ops = split_ops(args.ops)
    unknown = [o for o in ops or [] if o not in SHAPES]
    if unknown:
        raise ValueError(f"no benchmark shapes for {unknown}; ops with shapes: "
                         f"{', '.join(SHAPES)}")
    if args.repeat < 1:
        raise UsageError(f"--repeat expected a count >= 1, got {args.repeat}")
    for opt, path, ext in (("--csv", args.csv, None), ("--plot", args.plot, ".png")):
        if path is None:
            continue
        if ext and Path(path).suffix.lower() != ext:
            raise UsageError(f"{opt} {path}: expected a {ext} file name")
        if not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{opt} {path}: no such directory {str(Path(path).parent)!r}")
    if args.plot:  # fail before the run, not after minutes of measuring
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    if not args.json:  # say what runs at once: the run takes minutes
        print(f"backend: {b.name}", flush=True)
    ceil, rows = run_bench(b, ops, with_reference=not args.no_reference, repeat=args.repeat,
                           quick=args.quick)
    if args.json:
        print(json.dumps({"backend": b.name, "ceilings": ceil,
                          "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(format_rows(ceil, rows))
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot_rows(args.plot, rows, title=f"glm5 bench: backend {b.name}")
    return 0
