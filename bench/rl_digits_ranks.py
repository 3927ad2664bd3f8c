"""The digits demonstration (examples/rl/digits.yaml) with the trainer on one process and on
`--nproc N` FSDP2 ranks, several seeds: does the sharded trainer learn as the single process
does? Each run is `glm5 rl train` in its own process; the reward curves (metrics.csv) are
compared step by step.

    python bench/rl_digits_ranks.py --seeds 0 1 2 --nproc 2 --out bench/results/rl_digits_ranks.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cfg: str, out: Path, seed: int, steps: int, nproc: int) -> dict:
    cmd = [sys.executable, "-m", "glm5.cli", "rl", "train", cfg, "--out", str(out), "--no-resume",
           "--seed", str(seed), "--steps", str(steps)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    reward = [float(r["reward"]) for r in rows]
    mean10 = [sum(reward[max(0, i - 9):i + 1]) / len(reward[max(0, i - 9):i + 1])
              for i in range(len(reward))]
    reach = next((i + 1 for i, m in enumerate(mean10) if m >= 0.8), None)
    last = reward[-30:]
    return {"wall_s": round(wall, 1), "reward": reward,
            "first10": round(sum(reward[:10]) / 10, 4), "step_to_0.8": reach,
            "last30": round(sum(last) / len(last), 4),
            "exact_last30": round(sum(float(r["exact"]) for r in rows[-30:]) / len(last), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples/rl/digits.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/rl_digits_ranks.json"))
    a = ap.parse_args()
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:
            one = _run(a.config, Path(tmp) / f"s{seed}-1", seed, a.steps, 1)
            many = _run(a.config, Path(tmp) / f"s{seed}-{a.nproc}", seed, a.steps, a.nproc)
            diverge = next((i + 1 for i, (x, y) in enumerate(zip(one["reward"], many["reward"]))
                            if x != y), None)
            res.append({"seed": seed, "one": one, f"nproc{a.nproc}": many,
                        "first_step_rewards_differ": diverge})
            print(f"seed {seed}: 1 proc: 0.8 at step {one['step_to_0.8']}, last-30 reward "
                  f"{one['last30']} ({one['wall_s']} s); {a.nproc} ranks: 0.8 at step "
                  f"{many['step_to_0.8']}, last-30 {many['last30']} ({many['wall_s']} s); "
                  f"curves identical up to step {(diverge or a.steps + 1) - 1}", flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    Path(a.out).write_text(json.dumps({
        "command": "python bench/rl_digits_ranks.py " + " ".join(sys.argv[1:]),
        "config": a.config, "steps": a.steps, "nproc": a.nproc, "cpu": cpu,
        "cores": os.cpu_count(), "runs": res}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
