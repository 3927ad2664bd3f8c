"""Render `bench/parity_sweep.py` results as the markdown table docs/conformance.md quotes:
per (op, dtype), for each backend, the seeds that passed and the median / largest
error-to-bound ratio over all seeds and examples.

    python bench/sweep_table.py bench/results/parity_sweep_reference.json \
        bench/results/parity_sweep_cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys


def table(paths: list[str]) -> str:
    """Merge the runs of every file (seeds may be split over processes) into one table."""
    acc: dict[tuple[str, str, str], dict] = {}
    backends: list[str] = []
    meta = []
    seen: set[tuple[str, int]] = set()
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        meta.append(f"`{doc['command']}`")
        for run in doc["runs"]:
            if (run["backend"], run["seed"]) in seen:  # a seed run by two processes counts once
                continue
            seen.add((run["backend"], run["seed"]))
            if run["backend"] not in backends:
                backends.append(run["backend"])
            for r in run["rows"]:
                a = acc.setdefault((r["op"], r["dtype"], run["backend"]),
                                   {"pass": 0, "n": 0, "med": [], "max": 0.0})
                a["n"] += 1
                a["pass"] += r["status"] == "pass"
                a["med"].append(r["ratio_median"])
                a["max"] = max(a["max"], r["ratio_max"])
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for (op, dt, b), a in acc.items():
        cells.setdefault((op, dt), {})[b] = (
            f"{a['pass']}/{a['n']} · {statistics.median(a['med']):.3f} · {a['max']:.3f}")
    head = "| op | dtype | " + " | ".join(f"{b}: seeds passed · med · max" for b in backends) + " |"
    rule = "|---|---|" + "---|" * len(backends)
    rows = [f"| {op} | {dt} | " + " | ".join(c.get(b, "—") for b in backends) + " |"
            for (op, dt), c in sorted(cells.items())]
    return "\n".join([head, rule, *rows]) + "\n\nProduced by " + "; ".join(meta) + "."


if __name__ == "__main__":
    print(table(sys.argv[1:]))
