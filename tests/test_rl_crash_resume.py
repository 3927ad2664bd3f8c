"""`glm5 rl train` killed anywhere (SIGKILL, a real process) resumes to the run it would have
been: it ends at its target step, metrics.csv has every step once, no trajectory is trained
twice, and in sync mode (one thread, deterministic) the final weights are bit for bit those
of a run never killed.

Each mode's run is killed at the loop's named crash points (`glm5.rl.crash_points`: during
rollout, between train and publish, after publish, mid-checkpoint, mid-journal line) and at
seeded random moments from outside, then resumed with the same command until it finishes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from glm5.rl.metrics import read_metrics

STEPS = 8
CFG = {
    "model": {"preset": "tiny", "overrides": {
        "vocab_size": 19, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "n_routed_experts": 4, "indexer_types": ["full", "shared"],
        "index_topk": 16, "num_nextn_predict_layers": 0}},
    "tasks": [{"name": "reverse", "params": {"length": 2, "base": 4}},
              {"name": "sort", "params": {"length": 2, "base": 4}}],
    "rollout": {"group_size": 4, "groups_per_step": 2, "max_tokens": 3, "max_num_seqs": 16,
                "in_flight_groups": 2},
    "trainer": {"optimizer": "adamw", "lr": 1.0e-3, "micro_batch_size": 8},
    "sync": {"interval": 1, "max_staleness": 2},
    "pool": {"min_task_types": 2},
    "run": {"steps": STEPS, "mode": "sync", "checkpoint_every": 2, "tensorboard": False},
}

# (crash point, visit) per kill; the visit counts within one process (each resume restarts
# the counts), so these land at different steps of the run. The first: step 4 trained, the
# checkpoint at step 2, while async workers have journaled tokens of version 3 (the kill that
# made a resumed run refuse its own journal before resume discarded them).
NAMED_KILLS = [("train", 4), ("rollout", 9), ("train", 2), ("checkpoint", 1), ("journal", 23),
               ("publish", 3), ("checkpoint", 1), ("journal", 3)]


def _config(tmp: Path, mode: str, ray: bool) -> Path:
    d = json.loads(json.dumps(CFG))
    d["run"]["mode"] = mode
    d["run"]["ray"] = ray
    if mode == "async":
        d["rollout"]["num_workers"] = 2
    p = tmp / f"{mode}{'-ray' if ray else ''}.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


def _env(crash: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLM5_RL_CRASH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if crash:
        env["GLM5_RL_CRASH"] = crash
    return env


def _train(cfg: Path, out: Path, crash: str | None = None, kill_after: float | None = None
           ) -> int:
    """One `glm5 rl train` process (its own process group, so Ray's processes die with it);
    its exit status (-9: killed)."""
    cmd = [sys.executable, "-m", "glm5.cli", "rl", "train", str(cfg), "--out", str(out)]
    p = subprocess.Popen(cmd, env=_env(crash), start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out_text, _ = p.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out_text, _ = p.communicate()
    finally:
        try:  # whatever the process left behind in its group (Ray's raylet, workers)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode in (0, -signal.SIGKILL), f"rc {p.returncode}:\n{out_text[-3000:]}"
    return p.returncode


def _lineage(out: Path) -> list[dict]:
    """The journal's train records, checked: steps 1..n in order, no trajectory consumed
    twice, every consumed trajectory journaled before it was trained, and none sampled by
    weights this run's lineage had not published yet (a resumed run must not keep tokens of
    weights made after its checkpoint by the run that crashed)."""
    finished: set[str] = set()
    consumed: set[str] = set()
    steps = []
    published = -1
    for line in (out / "journal.jsonl").read_text().splitlines():
        rec = json.loads(line)  # a resumed run leaves no cut line behind
        if rec["kind"] == "publish":
            assert rec["version"] > published, rec
            published = rec["version"]
        elif rec["kind"] == "traj":
            tid = rec["traj"]["traj_id"]
            assert tid not in finished, f"{tid} journaled twice"
            finished.add(tid)
            newest = max(rec["traj"]["versions"], default=0)
            assert newest <= published, f"{tid} sampled by version {newest} > {published}"
        elif rec["kind"] == "train":
            ids = rec["trained"] + rec["dropped"]
            assert not consumed & set(ids), f"step {rec['step']} trains {consumed & set(ids)} again"
            assert set(ids) <= finished, f"step {rec['step']} trains unjournaled trajectories"
            consumed |= set(ids)
            steps.append(rec)
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    return steps


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from glm5.rl.loop import policy_state

    return policy_state(out)


def _kill_and_resume(cfg: Path, out: Path, kills: list[tuple[str, int]], timed: int,
                     seed: int) -> int:
    """Run to the end through the named kills, then ``timed`` kills at seeded random moments;
    returns how many kills landed (a run may finish before its crash point comes)."""
    rng = random.Random(seed)
    landed = 0
    for point, n in kills:
        landed += _train(cfg, out, crash=f"{point}:{n}") != 0
    for _ in range(timed):
        landed += _train(cfg, out, kill_after=rng.uniform(1.0, 5.0)) != 0
    for _ in range(3):
        if _train(cfg, out) == 0:
            break
    return landed


def _check_finished(out: Path) -> list[dict]:
    rows = read_metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    steps = _lineage(out)
    assert len(steps) == STEPS
    return steps


def test_sync_killed_anywhere_equals_the_uninterrupted_run(tmp_path):
    cfg = _config(tmp_path, "sync", ray=False)
    ref, out = tmp_path / "uninterrupted", tmp_path / "killed"
    assert _train(cfg, ref) == 0
    landed = _kill_and_resume(cfg, out, NAMED_KILLS, timed=2, seed=0)
    assert landed >= len(NAMED_KILLS)
    ref_steps, steps = _check_finished(ref), _check_finished(out)
    # the same trajectories trained at the same steps, and the same weights, bit for bit
    assert [s["trained"] for s in steps] == [s["trained"] for s in ref_steps]
    a, b = _weights(ref), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["reward"] for r in read_metrics(out)] == [r["reward"] for r in read_metrics(ref)]


def test_async_killed_anywhere_resumes_to_its_target(tmp_path):
    cfg = _config(tmp_path, "async", ray=False)
    out = tmp_path / "run"
    landed = _kill_and_resume(cfg, out, NAMED_KILLS, timed=2, seed=1)
    assert landed >= 4
    _check_finished(out)


def test_ray_killed_anywhere_resumes_to_its_target(tmp_path):
    pytest.importorskip("ray")
    cfg = _config(tmp_path, "async", ray=True)
    out = tmp_path / "run"
    landed = _kill_and_resume(cfg, out, [("train", 3), ("journal", 30)], timed=1, seed=2)
    assert landed >= 2
    _check_finished(out)
