"""Curves of RL runs from their metrics.csv: reward and exact match, rollout throughput and the
trainer's idle fraction, against the trainer step or wall time — one line per run, so a sync
and an async run of the same config compare on one figure (`glm5 rl plot`).

matplotlib is imported lazily (with the Agg backend: no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from glm5.rl.metrics import METRICS_CSV, read_metrics

X_AXES = {"step": "trainer step", "time": "wall time (s)"}
# (metric, axis title); throughput is derived (see _series)
PANELS = (("reward", "mean reward"), ("exact", "exact match"),
          ("throughput", "rollout throughput (tokens/s, cumulative)"),
          ("trainer_idle_frac", "trainer idle fraction (cumulative)"))


def _series(rows: list[dict], x: str, key: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of one panel over the rows that have the values it needs."""
    xs, ys = [], []
    for r in rows:
        if x not in r:
            continue
        if key == "throughput":
            # rollout_tokens counts every token generated since the run began and time is the
            # run's wall time (both continue across a resume), so the ratio is the average
            # rate so far.
            if "rollout_tokens" not in r or "time" not in r or not r["time"] > 0:
                continue
            y = r["rollout_tokens"] / r["time"]
        elif key in r:
            y = r[key]
        else:
            continue
        if isinstance(y, float) and isinstance(r[x], float):
            xs.append(r[x])
            ys.append(y)
    return xs, ys


def _smooth(ys: list[float]) -> list[float]:
    """A trailing moving average over ~5% of the points (RL step rewards are noisy)."""
    w = max(1, len(ys) // 20)
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= w:
            acc -= ys[i - w]
        out.append(acc / min(i + 1, w))
    return out


def load_runs(run_dirs: Sequence[str | Path]) -> list[tuple[str, list[dict]]]:
    """(label, rows) of each run directory. A directory without metrics.csv is a
    FileNotFoundError; a metrics.csv without rows or without the reward column a ValueError."""
    if not run_dirs:
        raise ValueError("glm5 rl plot: expected at least one run directory")
    runs = []
    names = [Path(d).resolve().name for d in run_dirs]
    for d, name in zip(run_dirs, names):
        p = Path(d)
        if not p.is_dir():
            raise FileNotFoundError(2, "not a run directory (no such directory)", str(p))
        if not (p / METRICS_CSV).is_file():
            raise FileNotFoundError(2, "no metrics.csv in this directory (expected a run "
                                       "directory written by `glm5 rl train`)", str(p))
        rows = read_metrics(p / METRICS_CSV)
        if not rows:
            raise ValueError(f"glm5 rl plot: {p / METRICS_CSV} holds no steps yet")
        if not any("reward" in r for r in rows):
            raise ValueError(f"glm5 rl plot: {p / METRICS_CSV} has no reward column; expected "
                             f"the metrics of `glm5 rl train`")
        # two runs with the same directory name (a/run, b/run) are told apart by their path
        runs.append((name if names.count(name) == 1 else str(d), rows))
    return runs


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, x: str = "step",
              title: str | None = None) -> Path:
    """Draw the four panels for ``run_dirs`` into ``out`` (any format matplotlib writes:
    .png, .pdf, .svg); returns the path."""
    if x not in X_AXES:
        raise ValueError(f"glm5 rl plot: x expected one of {list(X_AXES)}, got {x!r}")
    runs = load_runs(run_dirs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, ylabel), ax in zip(PANELS, axes.flat):
        for i, (label, rows) in enumerate(runs):
            xs, ys = _series(rows, x, key)
            if not xs:
                continue
            c = colors[i % len(colors)]
            if key in ("reward", "exact") and len(xs) >= 20:
                ax.plot(xs, ys, color=c, alpha=0.25, linewidth=0.8)
                ax.plot(xs, _smooth(ys), color=c, label=label, linewidth=1.6)
            else:
                ax.plot(xs, ys, color=c, label=label, linewidth=1.4)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if key in ("reward", "exact", "trainer_idle_frac"):
            ax.set_ylim(-0.02, 1.02)
    for ax in axes[1]:
        ax.set_xlabel(X_AXES[x])
        if x == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.965),
                   ncol=min(len(labels), 4), frameon=False)
    fig.suptitle(title or "glm5 rl: " + ", ".join(label for label, _ in runs), y=0.995,
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.935))
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
