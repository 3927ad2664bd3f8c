"""`glm5 doctor`: what this machine can do for glm5 (the report is `glm5.doctor`'s)."""

# lazy imports: `glm5 --help` must not load torch: the command imports what it runs in `run`

from __future__ import annotations

import argparse
import json

from glm5.cli.backends import backend_rows, plugin_rows
from glm5.cli.common import fmt


def add_parser(sub) -> argparse.ArgumentParser:
    dr = sub.add_parser("doctor", help="what this machine can do for glm5: Python, torch, CPU "
                        "features, backends, optional dependencies, the RL sandbox; warnings")
    dr.add_argument("--json", action="store_true", help="one JSON object instead of text")
    dr.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    dr.set_defaults(func=run)
    return dr


def run(args: argparse.Namespace) -> int:
    from glm5.doctor import doctor_report, format_report

    report = doctor_report(backend_rows(), plugin_rows(False))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, fmt))
    return 1 if args.strict and report["warnings"] else 0
