"""`glm5 parity`: a backend's kernels checked against the float64 oracle."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json
import os

from glm5.cli.common import fit, registry, split_ops


def add_parser(sub) -> argparse.ArgumentParser:
    q = sub.add_parser("parity", help="check a backend's kernels against the float64 oracle")
    q.add_argument("--backend", required=True, help="backend name, or 'all'")
    q.add_argument("--ops", default="", help="comma-separated ops (default: all it claims)")
    q.add_argument("--examples", type=int, default=None,
                   help="examples per (op, dtype) (default: 10 for the default profile, 6 "
                        "quick, 4 smoke, 100 full)")
    q.add_argument("--profile", choices=("smoke", "quick", "default", "full"), default="default",
                   help="size tiers the examples cycle through: smoke = edge, tile; quick = "
                        "edge, tile, model "
                        "(interpreters); default adds large and huge (thousands of keys, past "
                        "every kernel's tiles); full = the same tiers, 100 examples")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--emulate", action="store_true",
                   help="run device kernels on CPU tensors through the backend's emulator "
                        "(Triton interpreter, contract emulators); rows are marked emulated")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=run)
    return q


def run(args: argparse.Namespace) -> int:
    from glm5.backends.api import REFERENCE
    from glm5.testing.cases import PROFILE_EXAMPLES, PROFILES
    from glm5.testing.parity import Row, format_table, run_parity
    from glm5.testing.tolerances import bound_form

    examples = args.examples if args.examples is not None else PROFILE_EXAMPLES[args.profile]

    if args.emulate:
        # Triton reads this when a kernel module is imported: before any of them is.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    reg = registry()
    names = sorted(reg.backends) if args.backend == "all" else [args.backend]
    for n in names:
        reg.get(n)
    ops = split_ops(args.ops)
    rows: list[Row] = []
    for n in names:
        b = reg.backends[n]
        emulate = args.emulate and n != REFERENCE
        ok, reason = b.can_emulate() if emulate else b.is_available()
        if not ok and args.backend != "all":
            # A backend named alone that cannot run checked nothing: that is a failure, not a
            # table of skips that exits 0. (`--backend all` skips what cannot run here.)
            if emulate:
                msg = f"backend cannot be emulated here: {reason}"
            else:
                msg = f"backend unavailable here: {reason}"
                if b.can_emulate()[0]:
                    msg += " (--emulate runs its kernels on CPU through its emulator)"
            rows.append(Row(n, "*", "fail", "-", 0.0, 0.0, "", 0, msg, emulate))
            continue
        rows.extend(run_parity(b, ops, examples, args.seed, emulate=emulate,
                               profile=args.profile))
    if args.json:
        print(json.dumps({"backend": args.backend, "seed": args.seed, "examples": examples,
                          "profile": args.profile, "tiers": list(PROFILES[args.profile]),
                          "bound": bound_form(), "rows": [r.as_dict() for r in rows]},
                         indent=2))
    else:
        print(fit(format_table(rows)))
    return 1 if any(r.status == "fail" for r in rows) else 0
