"""Synchronous vs asynchronous RL on the same task and step budget.

Runs `glm5 rl train`'s loop on one config in several modes — sync, async (rollout threads in
this process) and async-ray (Ray actors: trainer and rollout worker in their own processes) —
``--repeats`` times each, interleaved (sync, async, async-ray, sync, async, ...) so that a
machine whose load drifts hurts every mode alike. Per run: wall time, trainer idle fraction
(time the trainer waited for rollouts / wall time), the step and time at which the reward (mean
over a 10-step window) first reaches --target — counted from the first trainer step ("train")
and from the launch of the run's process ("with start-up": each run is its own `python`
process, as a user's `glm5 rl train` is, so it pays the imports, the model and engines, the TVM
kernel loads and, for async-ray, Ray's start) — the final reward
and the mean staleness. Per mode: the median and range (min-max) over the repeats, and the
ratio of medians over sync. The GLM-5 seed's numbers for the same comparison at scale:
accelerator use < 15% -> > 65%, 120 h -> 36 h to the same success rate.

    python bench/rl_sync_async.py examples/rl/digits.yaml --steps 300 --target 0.8 \
        --repeats 3 --out bench/results/rl_sync_async.json --plot docs/images/rl_sync_async.png
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import statistics
import subprocess
import sys
import time
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
        # the epoch time the trainer's clock started (history times count from it)
        t0_epoch = time.time() - (time.perf_counter() - run._t0)
    finally:
        run.close()
        metrics.close()
    step, t = first_reaching(s.history, target)
    tail = s.history[-WINDOW:]
    return {"mode": mode, "steps": s.steps, "wall_s": round(s.wall_s, 2),
            "t0_epoch": t0_epoch,
            "trainer_idle_fraction": round(s.idle_fraction, 4),
            "steps_to_target": step, "seconds_to_target": None if t is None else round(t, 2),
            "final_reward": round(sum(r["reward"] for r in tail) / len(tail), 4),
            "final_exact": round(sum(r["exact"] for r in tail) / len(tail), 4),
            "mean_staleness": round(sum(r["staleness"] for r in s.history) / len(s.history), 3),
            "dropped_stale": run.dropped_stale, "run_dir": str(out)}


def run_child(a: argparse.Namespace, mode: str, out: Path) -> dict:
    """One run in a fresh process; its start-up counts from the launch."""
    cmd = [sys.executable, __file__, a.config, "--steps", str(a.steps), "--target",
           str(a.target), "--threads", str(a.threads), "--child", mode, str(out)]
    launched = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"bench/rl_sync_async.py: the {mode} run failed:\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    r["startup_s"] = round(r.pop("t0_epoch") - launched, 2)
    t = r["seconds_to_target"]
    r["seconds_to_target_with_startup"] = None if t is None else round(t + r["startup_s"], 2)
    return r


STATS = ("seconds_to_target", "seconds_to_target_with_startup", "steps_to_target", "wall_s",
         "startup_s", "trainer_idle_fraction", "final_reward", "mean_staleness")


def _spread(xs: list[float]) -> dict | None:
    return None if not xs else {"median": round(statistics.median(xs), 3),
                                "min": round(min(xs), 3), "max": round(max(xs), 3), "n": len(xs)}


def summarize(rows: list[dict], modes: list[str]) -> dict[str, dict]:
    """Per mode: median and range of each of STATS over the runs that have it (a run that
    never reached the target has no time to it: `reached` says how many did), and the ratio of
    the medians over sync's."""
    out: dict[str, dict] = {}
    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        q = {k: _spread([r[k] for r in rs if r[k] is not None]) for k in STATS}
        q["reached"] = f"{sum(r['steps_to_target'] is not None for r in rs)}/{len(rs)}"
        out[m] = q
    base = out.get("sync")
    for m, q in out.items():
        if base is None or m == "sync":
            continue
        for k in ("seconds_to_target", "seconds_to_target_with_startup", "wall_s"):
            if q[k] and base[k]:
                q[f"{k}_ratio_over_sync"] = round(q[k]["median"] / base[k]["median"], 3)
    return out


def _fmt(q: dict | None) -> str:
    return "never" if q is None else f"{q['median']:.1f} ({q['min']:.1f}-{q['max']:.1f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the machine's cores are left to the two sides)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per mode, interleaved across modes (>= 3 for a median and range)")
    ap.add_argument("--runs", default="runs/rl_sync_async",
                    help="where the runs go (one directory per mode and repeat)")
    ap.add_argument("--modes", default="sync,async,async-ray",
                    help="comma-separated: sync, async, async-ray (sync first: the baseline)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--plot", default=None, help="PNG comparing the modes' first runs")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    logging.getLogger("glm5").setLevel(logging.ERROR)
    torch.set_num_threads(a.threads)
    cfg = RLConfig.from_yaml(a.config)
    if a.child:  # one run in this process: its row as the last stdout line
        print(json.dumps(run_mode(cfg, a.child[0], a.steps, Path(a.child[1]), a.target)))
        return 0
    modes = a.modes.split(",")
    if a.repeats < 1:
        ap.error(f"--repeats expected >= 1, got {a.repeats}")
    rows = []
    for i in range(a.repeats):  # interleaved: every mode sees the machine's drift alike
        for m in modes:
            r = run_child(a, m, Path(a.runs) / f"{m}-{i}")
            r["repeat"] = i
            rows.append(r)
            print(f"repeat {i} {m:9} wall {r['wall_s']:.1f} s, start-up {r['startup_s']:.1f} s, "
                  f"to target: step {r['steps_to_target']}, {r['seconds_to_target']} s",
                  flush=True)
    summary = summarize(rows, modes)
    result = {"config": a.config, "steps": a.steps, "target": a.target, "window": WINDOW,
              "repeats": a.repeats, "threads": a.threads,
              "machine": f"{platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} torch threads", "summary": summary, "runs": rows}
    print(f"{'mode':9} {'to target, train s':>26} {'with start-up s':>26} {'wall s':>8} "
          f"{'idle':>6} {'final r':>8} {'reached':>7}")
    for m, q in summary.items():
        print(f"{m:9} {_fmt(q['seconds_to_target']):>26} "
              f"{_fmt(q['seconds_to_target_with_startup']):>26} {q['wall_s']['median']:8.1f} "
              f"{q['trainer_idle_fraction']['median']:6.3f} {q['final_reward']['median']:8.3f} "
              f"{q['reached']:>7}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    if a.plot:
        from glm5.rl.plot import plot_runs

        plot_runs([Path(r["run_dir"]) for r in rows if r["repeat"] == 0], a.plot, x="time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
