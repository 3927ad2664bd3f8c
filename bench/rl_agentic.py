"""Agentic RL on five environment types: per-type reward and the sampler's ratios over a run.

    python bench/rl_agentic.py RUN_DIR [--train CONFIG] [--plot OUT.png] [--json OUT.json]

With --train, runs `glm5 rl train CONFIG --out RUN_DIR` first (examples/rl/agentic.yaml: about
10 minutes on 2 cores). Reads RUN_DIR/metrics.csv and warm_start.json and reports, per
environment type, the mean reward over the first and last fifth of the steps in which the type
was in the batch (a batch's mean reward mixes types in the sampler's changing ratios, so only
the per-type rows say whether the policy got better at a type), plus the warm start.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path


def summarize(run: Path) -> dict:
    from glm5.rl.metrics import read_metrics

    rows = read_metrics(run / "metrics.csv")
    types = sorted(k[len("reward/"):] for k in rows[0] if k.startswith("reward/"))
    n = len(rows)
    fifth = max(n // 5, 1)
    per = {}
    for t in types:
        def mean(rs: list[dict]) -> float | None:
            v = [r[f"reward/{t}"] for r in rs if r.get(f"reward/{t}") == r.get(f"reward/{t}")
                 and r.get(f"reward/{t}") is not None]
            return round(sum(v) / len(v), 3) if v else None

        per[t] = {"first_fifth": mean(rows[:fifth]), "last_fifth": mean(rows[-fifth:]),
                  "final_ratio": round(rows[-1].get(f"ratio/{t}", float("nan")), 3)}
    ws = run / "warm_start.json"
    return {"steps": n, "wall_s": round(rows[-1]["time"], 1),
            "reward_first_fifth": round(sum(r["reward"] for r in rows[:fifth]) / fifth, 3),
            "reward_last_fifth": round(sum(r["reward"] for r in rows[-fifth:]) / fifth, 3),
            "exact_first_fifth": round(sum(r["exact"] for r in rows[:fifth]) / fifth, 3),
            "exact_last_fifth": round(sum(r["exact"] for r in rows[-fifth:]) / fifth, 3),
            "per_type": per,
            "warm_start": json.loads(ws.read_text()) if ws.is_file() else None}


def plot(run: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glm5.rl.metrics import read_metrics

    rows = read_metrics(run / "metrics.csv")
    types = sorted(k[len("reward/"):] for k in rows[0] if k.startswith("reward/"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for t in types:
        pts = [(r["step"], r[f"reward/{t}"]) for r in rows
               if r.get(f"reward/{t}") is not None and r[f"reward/{t}"] == r[f"reward/{t}"]]
        xs = [p[0] for p in pts]
        # mean of the last 10 batches that held the type
        ys = [sum(p[1] for p in pts[max(0, i - 9):i + 1]) / len(pts[max(0, i - 9):i + 1])
              for i in range(len(pts))]
        a.plot(xs, ys, label=t)
        b.plot([r["step"] for r in rows], [r.get(f"ratio/{t}", 0.0) for r in rows], label=t)
    a.set(xlabel="trainer step", ylabel="reward (mean of the type's last 10 batches)",
          ylim=(-0.02, 1.02), title="reward per environment type")
    b.set(xlabel="trainer step", ylabel="share of new groups", ylim=(0, 1),
          title="task-ratio sampler")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--train", type=Path, help="a config to run first with glm5 rl train")
    ap.add_argument("--plot", type=Path, help="write the per-type figure here")
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args()
    if args.train:
        subprocess.run([sys.executable, "-m", "glm5.cli", "rl", "train", str(args.train),
                        "--out", str(args.run)], check=True)
    s = summarize(args.run)
    s.update(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"),
             machine=platform.machine())
    try:
        from glm5.perf.measure import cpu_model

        s["cpu"] = cpu_model()
    except Exception:  # noqa: BLE001 - informative only
        pass
    print(json.dumps(s, indent=1))
    if args.json:
        args.json.write_text(json.dumps(s, indent=1) + "\n")
    if args.plot:
        plot(args.run, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
