"""`glm5 rl train` and `glm5 rl plot` as a user runs them (in process, through
`glm5.cli.main`), and the MetricsLogger behind metrics.csv: the union header when keys appear
mid-run, truncation on resume, a line cut by a crash, TensorBoard scalars (or a warning and CSV
only without the package)."""

from __future__ import annotations

import csv
import logging
import shutil
import sys
from pathlib import Path

import pytest

from glm5 import cli
from glm5.rl.metrics import MetricsLogger, read_metrics

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "examples" / "rl" / "ci.yaml"
# what every trainer step reports (glm5/rl/loop.py), for the ci config's two task types
COLUMNS = {"step", "time", "version", "reward", "exact", "staleness", "trainer_idle_frac",
           "rollout_tokens", "reward/reverse", "reward/sort", "ratio/reverse", "ratio/sort",
           "loss", "entropy", "clip_frac"}


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _header(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f))


def _one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(("glm5 rl: ", "glm5 rl train: ")), err
    for n in needles:
        assert n in err, err
    return err


# --------------------------------------------------------------------------- glm5 rl train
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A two-step run of examples/rl/ci.yaml (sync mode, a checkpoint every step)."""
    out = tmp_path_factory.mktemp("rl") / "ci-run"
    assert cli.main(["rl", "train", str(CI), "--out", str(out), "--steps", "2"]) == 0
    return out


def test_train_writes_metrics_tensorboard_and_checkpoint(run_dir):
    rows = read_metrics(run_dir / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0]
    assert COLUMNS <= set(_header(run_dir / "metrics.csv"))
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["trainer_idle_frac"] <= 1.0
        assert r["time"] > 0
    assert rows[1]["rollout_tokens"] > rows[0]["rollout_tokens"] > 0  # cumulative
    assert (run_dir / "checkpoint.pt").is_file()
    # the resolved config beside the run: the file's values with --steps applied
    import yaml

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["steps"] == 2 and saved["run"]["mode"] == "sync"
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    events = acc.Scalars("reward")
    assert [e.step for e in events] == [1, 2]
    assert [e.value for e in events] == pytest.approx([r["reward"] for r in rows], rel=1e-6)


@pytest.mark.parametrize("terminal", [False, True])
def test_train_prints_a_summary(terminal, tmp_path, capsys, monkeypatch):
    from glm5 import progress

    monkeypatch.setattr(progress, "enabled", lambda: terminal)  # a bar as on a terminal
    out = tmp_path / "one"
    assert cli.main(["rl", "train", str(CI), "--out", str(out), "--steps", "1"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    if terminal:  # the bar (on stderr) shows the step's reward, exact match and idle time
        assert "step 1: reward" not in text
        assert "rl train: reward" in captured.err and "exact" in captured.err
        assert "1/1" in captured.err
    else:  # a log line per step where no bar is drawn
        assert "step 1: reward" in text and "rl train: reward" not in captured.err
    assert "1 step(s) in" in text and "final reward" in text and "trainer idle" in text
    assert f"metrics: {out / 'metrics.csv'}" in text
    assert f"checkpoint: {out / 'checkpoint.pt'}" in text


def test_train_resumes_and_recomputes_rows_past_the_checkpoint(run_dir, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(run_dir, out)
    # a crash after step 3 was logged but before its checkpoint: the row is stale
    with open(out / "metrics.csv", "a", newline="") as f:
        csv.writer(f).writerow(["3"] + ["99"] * (len(_header(out / "metrics.csv")) - 1))
    before = read_metrics(out / "metrics.csv")
    # already at step 2: nothing to train, but the file now matches the checkpoint
    assert cli.main(["rl", "train", str(CI), "--out", str(out), "--steps", "2"]) == 0
    assert read_metrics(out / "metrics.csv") == before[:2]
    assert cli.main(["rl", "train", str(CI), "--out", str(out), "--steps", "3"]) == 0
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert rows[:2] == before[:2]  # continued, not started over
    assert rows[2]["reward"] != 99.0 and rows[2]["time"] > rows[1]["time"]
    # --no-resume starts over: step 1 of a new run, the old rows gone
    assert cli.main(["rl", "train", str(CI), "--out", str(out), "--steps", "1",
                     "--no-resume"]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.csv")] == [1.0]


def test_config_overrides_from_the_command_line():
    args = cli.build_parser().parse_args(["rl", "train", str(CI), "--steps", "7", "--mode",
                                          "ASYNC", "--seed", "5", "--out", "x", "--ray"])
    cfg = cli._rl_config(args)
    assert (cfg.run.steps, cfg.run.mode, cfg.run.seed, cfg.run.out_dir, cfg.run.ray) == \
        (7, "async", 5, "x", True)
    plain = cli._rl_config(cli.build_parser().parse_args(["rl", "train", str(CI)]))
    assert (plain.run.steps, plain.run.mode, plain.run.seed, plain.run.ray) == \
        (3, "sync", 0, False)


def test_unknown_config_key_is_a_usage_error_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CI.read_text().replace("  group_size: 4", "  group_size: 4\n  gruop: 2"))
    assert cli.main(["rl", "train", str(bad), "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, str(bad), "unknown key", "rollout", "gruop")
    assert not (tmp_path / "o").exists()  # refused before anything is written


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "--steps expected a positive integer"),
    (["--mode", "fast"], "invalid choice"),
])
def test_bad_options_are_usage_errors(argv, needle, tmp_path, capsys):
    assert cli.main(["rl", "train", str(CI), "--out", str(tmp_path / "o"), *argv]) == 2
    _one_line_error(capsys, needle)


def test_missing_and_malformed_configs(tmp_path, capsys):
    assert cli.main(["rl", "train", str(tmp_path / "nope.yaml")]) == 2
    _one_line_error(capsys, "nope.yaml", "is not a file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: {steps: [1\n")
    assert cli.main(["rl", "train", str(broken)]) == 1
    _one_line_error(capsys, "broken.yaml is not valid YAML")


# --------------------------------------------------------------------------- glm5 rl plot
def test_plot_writes_a_png(run_dir, tmp_path, capsys):
    other = tmp_path / "other-run"
    shutil.copytree(run_dir, other)
    for x in ("step", "time"):
        png = tmp_path / f"curves-{x}.png"
        assert cli.main(["rl", "plot", str(run_dir), str(other), "-o", str(png), "--x", x]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "wrote" in capsys.readouterr().out


def test_plot_series_throughput_and_missing_values():
    from glm5.rl.plot import _series

    rows = [{"step": 1.0, "time": 2.0, "rollout_tokens": 100.0, "reward": 0.5},
            {"step": 2.0, "time": 4.0, "rollout_tokens": 300.0},  # no reward this row
            {"step": 3.0, "time": 5.0, "rollout_tokens": 500.0, "reward": 0.75}]
    assert _series(rows, "step", "throughput") == ([1.0, 2.0, 3.0], [50.0, 75.0, 100.0])
    assert _series(rows, "time", "reward") == ([2.0, 5.0], [0.5, 0.75])


def test_plot_errors(run_dir, tmp_path, capsys):
    png = str(tmp_path / "x.png")
    assert cli.main(["rl", "plot", str(tmp_path), "-o", png]) == 2
    _one_line_error(capsys, str(tmp_path), "no metrics.csv")
    assert cli.main(["rl", "plot", str(tmp_path / "missing"), "-o", png]) == 2
    _one_line_error(capsys, "missing", "no such directory")
    assert cli.main(["rl", "plot", str(run_dir), "-o", str(tmp_path / "x.unknown")]) == 2
    _one_line_error(capsys, "x.unknown", ".png")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.csv").write_text("step,reward\n")
    assert cli.main(["rl", "plot", str(empty), "-o", png]) == 1
    _one_line_error(capsys, "holds no steps")
    assert not Path(png).exists()


# --------------------------------------------------------------------------- MetricsLogger
def test_new_keys_mid_run_rewrite_the_header(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    m.log(1, {"reward": 0.5})
    m.log(2, {"reward": 0.25, "reward/sort": 0.125})
    m.log(3, {"reward": 1.0, "reward/sort": 0.5, "loss": -0.1})
    m.close()
    assert _header(tmp_path / "metrics.csv") == ["step", "reward", "reward/sort", "loss"]
    assert read_metrics(tmp_path) == [
        {"step": 1.0, "reward": 0.5},
        {"step": 2.0, "reward": 0.25, "reward/sort": 0.125},
        {"step": 3.0, "reward": 1.0, "reward/sort": 0.5, "loss": -0.1}]
    with open(tmp_path / "metrics.csv", newline="") as f:  # every row has every column
        assert {len(r) for r in csv.reader(f)} == {4}


def test_values_round_trip_exactly(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    vals = {"a": 0.1 + 0.2, "b": 1e-300, "c": 7, "d": True}
    m.log(1, vals)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert row == {"step": 1.0, "a": 0.1 + 0.2, "b": 1e-300, "c": 7.0, "d": 1.0}


def test_resume_continues_the_file_and_drops_rows_past_the_checkpoint(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    for s in range(1, 6):
        m.log(s, {"reward": s / 10})
    m.close()
    m = MetricsLogger(tmp_path, tensorboard=False)  # a new process, checkpoint at step 3
    m.truncate(3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    m.log(4, {"reward": 0.9, "extra": 1.0})
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path)] == \
        [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.9)]
    m.truncate(0)  # --no-resume: started over
    assert read_metrics(tmp_path) == []


def test_logging_a_step_again_replaces_it_and_what_follows(tmp_path):
    """Without an explicit truncate (a caller that never calls it), steps stay increasing."""
    m = MetricsLogger(tmp_path, tensorboard=False)
    for s in (1, 2, 3):
        m.log(s, {"reward": float(s)})
    m2 = MetricsLogger(tmp_path, tensorboard=False)
    m2.log(2, {"reward": 20.0})
    m2.log(3, {"reward": 30.0})
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path)] == \
        [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_a_line_cut_by_a_crash_is_dropped(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,reward\n1,0.5\n2,0.7\n3,0.12")  # no newline
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    m = MetricsLogger(tmp_path, tensorboard=False)
    m.log(3, {"reward": 0.125})
    assert (tmp_path / "metrics.csv").read_text() == "step,reward\n1,0.5\n2,0.7\n3,0.125\n"


def test_bad_inputs(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match=r"MetricsLogger.log: row\['step'\] = 2 but step = 1"):
        m.log(1, {"step": 2, "reward": 0.0})
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metrics.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        MetricsLogger(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no metrics CSV"):
        read_metrics(tmp_path / "nothing")


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(tmp_path)
    for s in (1, 2, 3):
        m.log(s, {"reward": s / 4, "reward/sort": 1.0, "note": "text"})
    m.close()
    m = MetricsLogger(tmp_path)  # resumed at step 1: steps 2 and 3 are recomputed
    m.truncate(1)
    m.log(2, {"reward": 0.0625, "reward/sort": 0.0})
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.25), (2, 0.0625)]
    assert [(e.step, e.value) for e in acc.Scalars("reward/sort")] == [(1, 1.0), (2, 0.0)]
    assert "note" not in acc.Tags()["scalars"] and "step" not in acc.Tags()["scalars"]


def test_without_tensorboard_a_warning_and_csv_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    m = MetricsLogger(tmp_path, tensorboard=True)
    with caplog.at_level(logging.WARNING, logger="glm5.rl"):
        m.log(1, {"reward": 0.5})
        m.log(2, {"reward": 0.5})
    m.close()
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert len(read_metrics(tmp_path)) == 2 and not (tmp_path / "tb").exists()


@pytest.mark.skipif(shutil.which("bwrap") is None and __import__("os").environ.get("CI") != "true",
                    reason="bubblewrap (bwrap) is not installed (CI installs it)")
def test_train_on_environments_reports_the_warm_start(tmp_path, capsys):
    """examples/rl/agentic_ci.yaml through the CLI: the warm start is announced and reported,
    the metrics have a reward column per environment type; a resumed run skips the warm start."""
    cfg = ROOT / "examples" / "rl" / "agentic_ci.yaml"
    out = tmp_path / "agentic"
    assert cli.main(["rl", "train", str(cfg), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "warm start on 2 demonstration(s) per environment type, 2 step(s)" in text
    assert "warm start done: 10 demonstrations, loss " in text
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    header = set(_header(out / "metrics.csv"))
    assert {f"reward/{n}" for n in ("countdown", "search", "codefix", "terminal",
                                    "data")} <= header
    assert cli.main(["rl", "train", str(cfg), "--out", str(out), "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "warm start" not in text and "resumed at step 2" in text
