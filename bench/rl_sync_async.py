"""Synchronous vs asynchronous RL on the same task and step budget.

Runs `glm5 rl train`'s loop on one config in several modes, one after the other — sync, async
(rollout threads in this process) and async-ray (Ray actors: trainer and rollout worker in
their own processes) — and reports for each: wall time, trainer idle fraction (time the trainer
waited for rollouts / wall time), steps and wall time until the reward (mean over a 10-step
window) first reaches --target, the final reward, and the mean staleness of the trained tokens.
The GLM-5 seed's numbers for the same comparison at scale: accelerator use < 15% -> > 65%,
120 h -> 36 h to the same success rate.

    python bench/rl_sync_async.py examples/rl/digits.yaml --steps 300 --target 0.8 \
        --out bench/results/rl_sync_async.json --plot docs/images/rl_sync_async.png
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import sys
from pathlib import Path

import glm5  # noqa: F401,I001  (before torch: it sets OMP_WAIT_POLICY for torch's pool)

import torch

from glm5.rl.config import RLConfig
from glm5.rl.loop import RLRun
from glm5.rl.metrics import MetricsLogger

WINDOW = 10


def first_reaching(history: list[dict], target: float) -> tuple[int | None, float | None]:
    """(step, wall seconds) where the WINDOW-step mean reward first reaches target."""
    for i in range(WINDOW - 1, len(history)):
        w = history[i - WINDOW + 1:i + 1]
        if sum(r["reward"] for r in w) / WINDOW >= target:
            return history[i]["step"], history[i]["time"]
    return None, None


def run_mode(cfg: RLConfig, mode: str, steps: int, out: Path, target: float) -> dict:
    """mode: sync | async (threads in this process) | async-ray (Ray actors: the trainer and
    each rollout worker in their own process, so they really run side by side)."""
    d = cfg.to_dict()
    d["run"].update(mode=mode.split("-")[0], ray=mode.endswith("-ray"), steps=steps,
                    checkpoint_every=0, out_dir=str(out))
    c = RLConfig.from_dict(d)
    if out.exists():
        shutil.rmtree(out)
    metrics = MetricsLogger(out, tensorboard=False)
    run = RLRun(c, resume=False, metrics=metrics)
    try:
        s = run.train()
    finally:
        run.close()
        metrics.close()
    step, t = first_reaching(s.history, target)
    tail = s.history[-WINDOW:]
    return {"mode": mode, "steps": s.steps, "wall_s": round(s.wall_s, 2),
            "trainer_idle_fraction": round(s.idle_fraction, 4),
            "steps_to_target": step, "seconds_to_target": None if t is None else round(t, 2),
            "final_reward": round(sum(r["reward"] for r in tail) / len(tail), 4),
            "final_exact": round(sum(r["exact"] for r in tail) / len(tail), 4),
            "mean_staleness": round(sum(r["staleness"] for r in s.history) / len(s.history), 3),
            "dropped_stale": run.dropped_stale, "run_dir": str(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the machine's cores are left to the two sides)")
    ap.add_argument("--runs", default="runs/rl_sync_async", help="where the runs go (one directory per mode)")
    ap.add_argument("--modes", default="sync,async,async-ray",
                    help="comma-separated: sync, async, async-ray (sync first: the baseline)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--plot", default=None, help="PNG comparing the two runs")
    a = ap.parse_args(argv)
    logging.getLogger("glm5").setLevel(logging.ERROR)
    torch.set_num_threads(a.threads)
    cfg = RLConfig.from_yaml(a.config)
    modes = a.modes.split(",")
    rows = [run_mode(cfg, m, a.steps, Path(a.runs) / m, a.target) for m in modes]
    by = {r["mode"]: r for r in rows}
    result = {"config": a.config, "steps": a.steps, "target": a.target, "window": WINDOW,
              "threads": a.threads, "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} torch threads", "runs": rows}
    base = by.get("sync")
    for m, r in by.items():
        if base is None or m == "sync":
            continue
        r["wall_ratio_over_sync"] = round(r["wall_s"] / base["wall_s"], 3)
        if r["seconds_to_target"] and base["seconds_to_target"]:
            r["time_to_target_ratio_over_sync"] = round(
                r["seconds_to_target"] / base["seconds_to_target"], 3)
    print(f"{'mode':9} {'wall s':>8} {'idle':>6} {'steps->tgt':>10} {'s->tgt':>8} "
          f"{'final r':>8} {'exact':>6} {'stale':>6}")
    for r in rows:
        print(f"{r['mode']:9} {r['wall_s']:8.1f} {r['trainer_idle_fraction']:6.3f} "
              f"{str(r['steps_to_target']):>10} {str(r['seconds_to_target']):>8} "
              f"{r['final_reward']:8.3f} {r['final_exact']:6.3f} {r['mean_staleness']:6.2f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    if a.plot:
        from glm5.rl.plot import plot_runs

        plot_runs([Path(r["run_dir"]) for r in rows], a.plot, x="time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
