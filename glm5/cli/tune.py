"""`glm5 tune`: a backend's Triton tiles searched on this device (or, for the cpu backend,
where quant_linear's paths switch on this CPU); ``--show`` / ``--clear`` the tuning cache."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from glm5.cli.common import registry, split_ops
from glm5.cli.errors import UsageError


def add_parser(sub) -> argparse.ArgumentParser:
    tu = sub.add_parser("tune", help="search a backend's Triton tiles on this device, each "
                        "candidate checked against the float64 oracle; winners are cached per "
                        "device and used from then on")
    tu.add_argument("--backend",
                    help="a Triton-library backend (default cuda), or cpu: where "
                         "quant_linear's paths (GEMV, GEMM, oneDNN) switch on this CPU "
                         "(--show: every backend's files unless given)")
    tu.add_argument("--ops", default="", help="comma-separated ops (default: all with shapes)")
    tu.add_argument("--budget-s", type=float, default=600.0, help="time for the whole search")
    tu.add_argument("--per-measure-s", type=float, default=0.15,
                    help="time spent timing one candidate at one shape")
    tu.add_argument("--min-gain", type=float, default=0.05,
                    help="keep a winner only when this much faster (0.05: 5%%)")
    tu.add_argument("--tp", type=int, default=1,
                    help="tune at the shapes one of N tensor-parallel ranks runs (attention "
                         "heads, column-parallel linears and the vocabulary split N ways)")
    tu.add_argument("--fresh", action="store_true",
                    help="start from the backend's table, not from this device's cache")
    tu.add_argument("--no-cache", action="store_true", help="report only; write no cache")
    tu.add_argument("--table", metavar="TUNING.JSON",
                    help="also merge the winners into this tuning table (backend maintainers)")
    tu.add_argument("--out", metavar="FILE", help="write every trial as JSON")
    tu.add_argument("--emulate", action="store_true",
                    help="tiny shapes through the Triton interpreter on CPU: checks the "
                         "procedure only (CPU times say nothing about a device)")
    tu.add_argument("--show", action="store_true",
                    help="list the tuning cache's files and whether they apply; tune nothing")
    tu.add_argument("--clear", action="store_true",
                    help="remove this device's cache file for the backend; tune nothing")
    tu.set_defaults(func=run)
    return tu


def _show_tuning_cache(backend: str | None) -> int:
    from glm5.backends import tuning_cache as tc

    got = tc.listing(backend)
    if got["dir"] is None:
        print(f"{tc.ENV}=off: no tuning cache is read or written")
        return 0
    print(f"tuning cache: {got['dir']}")
    if not got["files"]:
        print("  (empty: `glm5 tune --backend NAME` fills it)")
    for row in got["files"]:
        print(f"  {tc.describe(row)}")
    return 0


def _clear_tuning(path: Path | None, what: str) -> int:
    if path is not None and path.exists():
        path.unlink()
        print(f"removed {path}")
    else:
        print(f"no tuning cache for {what} ({path})")
    return 0


def _tune_cpu(args: argparse.Namespace, b: Any) -> int:
    """`glm5 tune --backend cpu`: where quant_linear's paths switch on this CPU."""
    import torch

    from glm5.backends import tuning_cache as tc
    from glm5.backends.cpu import context
    from glm5.perf.tune_cpu import OP, run as tune

    for opt, given in (("--emulate", args.emulate), ("--table", args.table),
                       ("--fresh", args.fresh), ("--tp", args.tp != 1)):
        if given:
            raise UsageError(f"{opt} does not apply to the cpu backend (it tunes quant_linear's "
                             f"crossovers on this CPU, with no table)")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if any(o != OP for o in ops):
        raise UsageError(f"--ops: the cpu backend tunes {OP} only, got {args.ops!r}")
    ok, reason = b.is_available()
    if not ok:
        raise ValueError(f"backend 'cpu' cannot be tuned here: {reason}")
    context()  # the thread pools' sizes (the crossovers are measured and kept per thread count)
    from glm5.kernels.tvm.quant import cpu_tier

    if args.clear:
        return _clear_tuning(tc.path_for("cpu", tc.cpu_key(cpu_tier(), torch.get_num_threads())[0]),
                             "cpu on this CPU")
    report = tune(context, budget_s=args.budget_s, write_cache=not args.no_cache)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.show:
        return _show_tuning_cache(args.backend)
    if args.emulate:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    from glm5.backends import tuning_cache as tc
    from glm5.perf.tune import TP_CHOICES, merge_table, run as tune

    for opt in ("budget_s", "per_measure_s"):
        if getattr(args, opt) <= 0:
            raise UsageError(f"--{opt.replace('_', '-')} expected seconds > 0, got "
                             f"{getattr(args, opt)}")
    if args.min_gain < 0:
        raise UsageError(f"--min-gain expected a fraction >= 0, got {args.min_gain}")
    if args.tp not in TP_CHOICES:
        raise UsageError(f"--tp expected one of {', '.join(map(str, TP_CHOICES))} (a divisor "
                         f"of GLM-5's 64 attention heads), got {args.tp}")
    if args.tp != 1 and args.emulate:
        raise UsageError("--tp applies to the device shapes; --emulate runs tiny ones")
    from glm5.backends.vendor import DeviceTuned

    b = registry().get(args.backend or "cuda")
    if b.name == "cpu":
        return _tune_cpu(args, b)
    if not any(isinstance(e.fn, DeviceTuned) for e in b.kernels.values()):
        raise ValueError(f"backend {b.name!r} runs no kernel of the Triton library: glm5 tune "
                         f"searches Triton launch parameters (cuda, hygon, ascend, cambricon, "
                         f"mthreads, or a plugin built on glm5.backends.vendor)")
    ok, reason = b.can_emulate() if args.emulate else b.is_available()
    if not ok:
        hint = "" if args.emulate or not b.can_emulate()[0] else \
            " (--emulate checks the procedure on CPU through its emulator)"
        raise ValueError(f"backend {b.name!r} cannot be "
                         f"{'emulated' if args.emulate else 'tuned'} here: {reason}{hint}")
    device = torch.device("cpu" if args.emulate else b.device_type)
    if args.clear:
        return _clear_tuning(tc.path_for(b.name, tc.device_key(device)[0]),
                             f"{b.name} on this device")
    ops = split_ops(args.ops)
    report = tune(b, ops, device, emulate=args.emulate, budget_s=args.budget_s, tp=args.tp,
                  per_measure_s=args.per_measure_s, min_gain=args.min_gain, fresh=args.fresh,
                  write_cache=not args.no_cache)
    if args.table:
        path = Path(args.table)
        table = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(merge_table(table, report["kept"]), indent=1) + "\n")
        print(f"merged {', '.join(sorted(report['kept'])) or 'nothing'} into {path}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 0
