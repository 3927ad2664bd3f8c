"""The RL orchestration: sync and async runs, weights in sync after a push, a rollout worker
killed mid-episode loses no finished trajectory and its unfinished ones are re-queued, a
crashed run resumes from its checkpoint + journal with nothing lost, and the Ray path gives the
embedded path's result for a fixed seed."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from glm5.rl.config import RLConfig
from glm5.rl.loop import CHECKPOINT, JOURNAL, RLRun
from glm5.rl.services import ServiceDied, WorkerService
from glm5.rl.trajectory import Trajectory

MODEL = {"preset": "tiny", "overrides": {"vocab_size": 19, "num_hidden_layers": 1,
                                         "indexer_types": ["full"], "index_topk": 16,
                                         "mlp_layer_types": ["dense"],
                                         "num_nextn_predict_layers": 0}}
TASKS = [{"name": n, "params": {"length": 2, "base": 5}}
         for n in ("copy", "reverse", "sort", "add1", "min")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _quiet():
    logging.getLogger("glm5").setLevel(logging.ERROR)


def _cfg(tmp_path, **run):
    d = {"model": MODEL, "tasks": TASKS,
         "rollout": {"group_size": 2, "groups_per_step": 5, "max_tokens": 3,
                     "in_flight_groups": 4, "num_workers": 2},
         "trainer": {"micro_batch_size": 10},
         "sync": {"interval": 1},
         "run": {"steps": 2, "mode": "sync", "checkpoint_every": 0,
                 "out_dir": str(tmp_path), **run}}
    return RLConfig.from_dict(d)


def _journal(path):
    groups, trajs = {}, {}
    for line in (path / JOURNAL).read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "group":
            groups[rec["group"]["group_id"]] = rec["group"]
        elif rec["kind"] == "traj":
            t = rec["traj"]
            assert t["traj_id"] not in trajs, "a trajectory was journaled twice"
            trajs[t["traj_id"]] = t
    return groups, trajs


def _accounted(run):
    """Every trajectory id the run holds: in the pool, or finished members of open groups."""
    pooled = {t.traj_id for t in run.pool.call("sample", 10**6)}
    open_ = {f"{g}/{m}" for g, ms in run._done.items() for m in ms}
    return pooled, open_


def _ray_if(request, use_ray):
    if use_ray:
        request.getfixturevalue("ray_local")
    return use_ray


@pytest.mark.parametrize("use_ray", [False, True], ids=["embedded", "ray"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_trains_and_workers_hold_the_trainers_weights(tmp_path, mode, use_ray, request):
    run = RLRun(_cfg(tmp_path, mode=mode), resume=False, use_ray=_ray_if(request, use_ray))
    try:
        s = run.train(3)
        assert s.steps == 3 and len(s.history) == 3
        rows = s.history
        assert [r["version"] for r in rows] == [1, 2, 3]  # a push every step (interval 1)
        assert all(r["batch"] == 10 for r in rows)
        if mode == "sync":  # five groups, one per type (the sampler), all in the batch
            assert all(r["task_types"] == 5 for r in rows)
        assert 0.0 <= s.idle_fraction <= 1.0
        if mode == "sync":
            assert all(r["staleness"] == 0 for r in rows)  # on-policy
        assert run.weights_in_sync()
        # one update per batch: the ratio is 1; some batch had a signal to learn from
        assert all(r["mean_ratio"] == 1.0 for r in rows)
        assert max(r["grad_norm"] for r in rows) > 0
    finally:
        run.close()


def test_weights_out_of_sync_are_detected(tmp_path):
    run = RLRun(_cfg(tmp_path, steps=1), resume=False)
    try:
        run.train(1)
        assert run.weights_in_sync()
        w = run.workers[0].obj.worker.engine.model
        with torch.no_grad():
            next(w.parameters()).view(-1)[0] += 1.0
        assert not run.weights_in_sync()
    finally:
        run.close()


def test_killed_worker_loses_no_finished_trajectory_and_requeues_the_rest(tmp_path,
                                                                         monkeypatch):
    run = RLRun(_cfg(tmp_path, steps=2), resume=False)
    calls = {"n": 0}
    orig = WorkerService.step

    def dying(self):
        out = orig(self)
        calls["n"] += 1
        if self.worker.worker_id == "w0" and calls["n"] == 3:
            # w0 dies mid-episode: it finished some members (delivered above) and holds others
            assert self.worker.num_open() > 0
            raise ServiceDied("killed by the test")
        return out

    monkeypatch.setattr(WorkerService, "step", dying)
    try:
        run.train(2)
        assert run.replaced_workers == 1
        groups, trajs = _journal(tmp_path)
        pooled, open_ = _accounted(run)
        trained = set(trajs) - pooled - open_
        # every journaled (finished) trajectory is trained, pooled or waiting for its group
        assert trained | pooled | open_ == set(trajs)
        # nothing lost: every member of every completed group was finished exactly once
        complete = {g for g in groups if g not in run._groups}
        for g in complete:
            for m in range(groups[g]["size"]):
                assert f"{g}/{m}" in trajs
        assert len(trained) == 20
    finally:
        run.close()


@pytest.mark.parametrize("pool,use_ray", [("memory", False), ("sqlite", False),
                                          ("memory", True)],
                         ids=["memory", "sqlite", "memory-ray"])
def test_crash_and_resume_loses_nothing(tmp_path, pool, use_ray, request):
    cfg = _cfg(tmp_path, steps=4, checkpoint_every=2, mode="async")
    cfg.pool.backend = pool
    if pool == "sqlite":
        cfg.pool.memory_capacity = 8  # most of the pool lives on disk
    use_ray = _ray_if(request, use_ray)
    run = RLRun(cfg, resume=False, use_ray=use_ray)
    run.train(3)  # checkpoint at step 2, one more step and rollouts after it
    hist = [r["reward"] for r in run.history]
    # a crash: no close, no final checkpoint; the journal holds everything finished
    groups, trajs = _journal(tmp_path)
    run._journal.flush()
    if use_ray:  # the crashed run's actors die with it
        for h in [*run.workers, run.pool, run.trainer]:
            h.kill()
    del run
    st = torch.load(tmp_path / CHECKPOINT, weights_only=False)
    assert st["step"] == 2
    tail = {tid for tid in trajs if _journal_offset_of(tmp_path, tid) >= st["journal_offset"]}

    def newest(d):  # the newest weights version that sampled one of its tokens
        t = Trajectory.from_dict(d)
        return max((t.versions[i] for i in t.sampled), default=t.min_version)

    # sampled by weights published after the checkpoint: the resumed trainer never made them
    newer = {tid for tid in tail if newest(trajs[tid]) > st["version"]}
    resumed = RLRun(cfg, resume=True, use_ray=use_ray)
    try:
        assert resumed.step == 2 and [r["reward"] for r in resumed.history] == hist[:2]
        groups2, trajs2 = _journal(tmp_path)
        # the journal holds every finished trajectory once, less the newer ones
        assert set(trajs2) == set(trajs) - newer
        pooled, open_ = _accounted(resumed)
        # everything else journaled after the checkpoint is back: pooled or in an open group
        lost = [tid for tid in tail - newer if tid not in pooled | open_]
        assert not lost, lost[:5]
        assert not newer & (pooled | open_)
        # unfinished members of open groups (the discarded newer ones too) are queued again
        queued = {(g.group_id, m) for g in resumed._queue for m in g.pending}
        for tid in newer:
            gid, m = tid.split("/")
            assert (gid, int(m)) in queued, tid
        for gid, g in resumed._groups.items():
            for m in range(g.size):
                assert m in resumed._done[gid] or (gid, m) in queued
        s = resumed.train(4)
        assert s.steps == 4 and resumed.weights_in_sync()
    finally:
        resumed.close()


def _journal_offset_of(path, traj_id):
    off = 0
    with open(path / JOURNAL, "rb") as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "traj" and rec["traj"]["traj_id"] == traj_id:
                return off
            off += len(line)
    raise AssertionError(traj_id)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    yield ray
    ray.shutdown()


def test_ray_path_equals_embedded_path(tmp_path, ray_local):
    results = []
    for use_ray in (False, True):
        run = RLRun(_cfg(tmp_path / str(use_ray), steps=2), resume=False, use_ray=use_ray)
        try:
            run.train(2)
            results.append(([(r["reward"], r["batch"]) for r in run.history],
                            run.trainer.call("checksums"), run.weights_in_sync()))
        finally:
            run.close()
    (h0, c0, ok0), (h1, c1, ok1) = results
    assert ok0 and ok1
    assert h0 == h1
    assert c0 == c1  # bit-identical trainer weights after two steps


def test_ray_worker_killed_is_replaced(tmp_path, ray_local):
    run = RLRun(_cfg(tmp_path, steps=2), resume=False, use_ray=True)
    try:
        run.train(1)
        run.workers[1].kill()
        run.train(2)
        assert run.replaced_workers == 1 and run.step == 2 and run.weights_in_sync()
    finally:
        run.close()


def test_http_transport_trains_against_an_engine_server(tmp_path):
    pytest.importorskip("fastapi")
    from serve_util import LiveServer

    from glm5.engine.async_engine import AsyncEngine
    from glm5.engine.engine import EngineConfig, LLMEngine
    from glm5.rl.services import build_policy
    from glm5.serve.app import build_app

    cfg = _cfg(tmp_path)
    # the server starts with other weights: the run's first full update replaces them
    engine = LLMEngine(build_policy(cfg.model.__class__(**{**cfg.model.__dict__,
                                                           "init_seed": 5})),
                       EngineConfig(num_pages=128, page_size=16, seed=0))
    live = LiveServer(build_app(AsyncEngine(engine), "rl", None, allow_weight_updates=True))
    try:
        d = cfg.to_dict()
        d["rollout"].update(transport="http", urls=[live.url], num_workers=1)
        run = RLRun(RLConfig.from_dict(d), resume=False)
        try:
            s = run.train(2)
            assert s.steps == 2 and all(r["task_types"] == 5 for r in s.history)
            assert run.weights_in_sync() and engine.weights_version == 2  # pushes applied
        finally:
            run.close()
    finally:
        live.stop()


def test_run_from_a_checkpoint_directory(tmp_path):
    from glm5.rl.services import build_policy

    cfg = _cfg(tmp_path / "run")
    ckpt = tmp_path / "ckpt"
    build_policy(cfg.model).save_pretrained(ckpt)
    d = cfg.to_dict()
    d["model"] = {"path": str(ckpt)}
    run = RLRun(RLConfig.from_dict(d), resume=False)
    try:
        first = run.trainer.call("checksums")
        assert first == run.workers[0].call("checksums")  # the workers start from the file
        run.train(1)
        assert run.weights_in_sync() and run.trainer.call("checksums") != first
    finally:
        run.close()
    with pytest.raises(Exception, match="model.overrides apply to a preset"):
        RLConfig.from_dict({**d, "model": {"path": str(ckpt), "overrides": {"vocab_size": 8}}})
