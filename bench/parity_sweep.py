"""Run `glm5 parity` over many seeds and summarise: for each backend, (op, dtype) row, the
number of passing seeds and the largest / median error-to-bound ratio over all of them.

    python bench/parity_sweep.py --backends reference,cpu --seeds 0-9 --examples 100 \
        [--profile default] [--out bench/results/parity_sweep_cpu.json]

Every seed's rows are kept in the output (``runs``); the process exits 1 if any row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _seeds(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def _write(a: argparse.Namespace, summary: dict, runs: list) -> None:
    rows = {k: {**{f: v for f, v in s.items() if f != "ratio_medians"},
                "ratio_median": statistics.median(s["ratio_medians"])}
            for k, s in summary.items()}
    doc = {"command": " ".join(sys.argv), "examples": a.examples, "profile": a.profile,
           "summary": rows, "runs": runs}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="reference,cpu")
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--profile", default="default")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--out", default="bench/results/parity_sweep_cpu.json")
    a = ap.parse_args()
    os.environ.setdefault("GLM5_STRICT", "1")
    if a.emulate:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import glm5
    from glm5.testing.parity import run_parity

    runs, summary = [], {}
    for name in a.backends.split(","):
        b = glm5.get_registry().get(name)
        for seed in _seeds(a.seeds):
            t0 = time.perf_counter()
            rows = run_parity(b, None, a.examples, seed, emulate=a.emulate and name != "reference",
                              profile=a.profile)
            dt = time.perf_counter() - t0
            runs.append({"backend": name, "seed": seed, "seconds": round(dt, 1),
                         "rows": [r.as_dict() for r in rows]})
            bad = [f"{r.op}/{r.dtype}: {r.message}" for r in rows if r.status != "pass"]
            print(f"{name} seed {seed}: {len(rows) - len(bad)}/{len(rows)} rows pass "
                  f"({dt:.0f} s){'; ' + ' | '.join(bad) if bad else ''}", flush=True)
            for r in rows:
                s = summary.setdefault(f"{name}/{r.op}/{r.dtype}", {
                    "passed_seeds": 0, "seeds": 0, "ratio_max": 0.0, "ratio_medians": [],
                    "served_by": {}})
                s["seeds"] += 1
                s["passed_seeds"] += r.status == "pass"
                s["ratio_max"] = max(s["ratio_max"], r.ratio_max)
                s["ratio_medians"].append(r.ratio_median)
                for k, n in r.served_by.items():
                    s["served_by"][k] = s["served_by"].get(k, 0) + n
            _write(a, summary, runs)  # after every seed: a long sweep cut short keeps its seeds
    failed = sum(s["seeds"] - s["passed_seeds"] for s in summary.values())
    print(f"{len(summary)} rows x seeds: {failed} failed -> {a.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
