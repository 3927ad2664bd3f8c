"""The RL trainer on N data-parallel ranks (issue 37): weight sync from the sharded trainer to a
rollout engine (both routes), uneven batches, `glm5 rl train --nproc 2` against the single
process, a trainer rank killed mid-run resumed at another rank count, and Ray's placement
group."""

from __future__ import annotations

import json
import os
from dataclasses import replace
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from glm5.rl.metrics import read_metrics
from glm5.testing.dist import DistPool, values
from glm5.testing.serve_process import rank_pids
from test_rl_crash_resume import CFG as CRASH_CFG

# the crash-resume test's run (tiny model, two digit tasks, sync mode), 4 steps, micro-batches
# of 3 (so two ranks group a batch of 8 otherwise than one process does)
CFG = json.loads(json.dumps(CRASH_CFG))
CFG["trainer"]["micro_batch_size"] = 3
CFG["run"]["steps"] = 4


def _cfg(**changes) -> dict:
    d = json.loads(json.dumps(CFG))
    for key, v in changes.items():
        sec, k = key.split("__")
        d[sec][k] = v
    return d


def test_dp_slice_covers_the_batch_evenly():
    from glm5.rl.trainer_ranks import dp_slice

    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            parts = [list(range(n))[dp_slice(n, r, world)] for r in range(world)]
            assert sum(parts, []) == list(range(n))
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1


def test_config_checks_nproc_and_publish_route():
    from glm5.rl.config import RLConfig, RLConfigError

    with pytest.raises(RLConfigError, match="trainer.nproc expected a value > 0"):
        RLConfig.from_dict(_cfg(trainer__nproc=0))
    with pytest.raises(RLConfigError, match="sync.publish expected one of"):
        RLConfig.from_dict(_cfg(sync__publish="scatter"))


# ---------------------------------------------------------------- in-process worlds (gloo)
@pytest.fixture(scope="module")
def world2():
    with DistPool(2, comm_timeout_s=60) as pool:
        yield pool


def _trajs(n: int, version: int = 0):
    from glm5.rl.trajectory import Trajectory

    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        p = torch.randint(1, 19, (2 + i % 3,), generator=g).tolist()
        c = torch.randint(1, 19, (1 + i % 4,), generator=g).tolist()
        out.append(Trajectory(f"t{i}", f"g{i // 4}", "sort", p, c, [-1.0] * len(c),
                              [version] * len(c), advantage=(-1.0) ** i * (0.5 + i / 10),
                              temperature=1.0))
    return out


def _sync(ctx, route: str, optimizer: str) -> dict | None:
    """Two trainer ranks train two steps and publish by ``route`` to a rollout worker on rank 0
    (built from the sharded trainer's full update); returns what rank 0 saw."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from glm5.engine.weight_sync import (ChecksumMismatchError, WeightUpdate, state_checksums)
    from glm5.rl.config import RLConfig
    from glm5.rl.rollout import PromptGroup
    from glm5.rl.services import TrainerService, WorkerService

    torch.set_num_threads(1)
    d = RLConfig.from_dict(_cfg(trainer__nproc=2, trainer__optimizer=optimizer,
                                sync__publish=route, sync__mode="sub")).to_dict()
    svc = TrainerService(d, mesh=init_device_mesh("cpu", (2,)))
    full = svc.full_update()
    worker = WorkerService(d, full, "w0") if ctx.rank == 0 else None
    kinds, nbytes = set(), []
    for step in (1, 2):
        svc.train_step(_trajs(7, version=step - 1))  # 7: ranks hold 4 and 3
        version, data = svc.publish()
        if worker is not None:
            up = WeightUpdate.from_bytes(data)
            kinds |= {type(c).__name__ for c in up.checksums.values()}
            nbytes.append(up.nbytes)
            assert worker.apply_update(data) == version == step
    trained = get_model_state_dict(svc.trainer.model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    sums = svc.checksums()
    if worker is None:
        return None
    out = {"kinds": sorted(kinds), "nbytes": nbytes, "version": worker.version(),
           "synced": worker.checksums() == sums == state_checksums(trained)}
    # a corrupted delta is refused whole: the version and every tensor stay
    up = WeightUpdate.from_bytes(data)
    name = next(iter(up.tensors))
    bad = up.tensors[name].clone()
    bad.view(torch.uint8)[0] ^= 1
    up.tensors[name] = bad
    up.base_version, up.version = 2, 3
    before = worker.checksums()
    try:
        worker.apply_update(up.to_bytes())
        out["corrupt"] = "applied"
    except ChecksumMismatchError as e:
        out["corrupt"] = str(e)
    out["unchanged"] = worker.checksums() == before and worker.version() == 2
    # the engine's tokens carry the version of the weights that sampled them
    worker.submit(PromptGroup("g", "sort", [1, 2, 3], 2, max_tokens=3, seed=1))
    done: list = []
    for _ in range(50):
        done += worker.step()[0]
        if len(done) == 2:
            break
    out["token_versions"] = sorted({v for t in done for v in t.versions})
    return out


@pytest.mark.parametrize("route", ["shards", "gathered"])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_weight_sync_from_two_trainer_ranks(world2, route, optimizer):
    r = values(world2.run(_sync, route, optimizer, timeout_s=180))[0]
    assert r["synced"], r  # worker == trainer's published == the trained policy, whole tensors
    assert r["version"] == 2 and r["token_versions"] == [2], r
    # shards: each changed tensor's checksum is its ranks' row ranges; gathered: one sha256
    assert r["kinds"] == (["list"] if route == "shards" else ["str"]), r
    assert "computed from the update" in r["corrupt"] and r["unchanged"], r


def _uneven(ctx, n: int, mbs: int) -> dict:
    """``n`` trajectories over 2 ranks with micro-batches of ``mbs``: the ranks' micro-batch
    counts differ (or a rank has none); the step is still the single process's."""
    from torch.distributed.device_mesh import init_device_mesh

    from glm5.core.config import preset
    from glm5.core.model import GLM5ForCausalLM
    from glm5.rl.config import DistillConfig, TrainerConfig
    from glm5.rl.trainer import GRPOTrainer
    from glm5.rl.trainer_ranks import dp_slice

    torch.set_num_threads(1)

    def model():
        torch.manual_seed(0)
        return GLM5ForCausalLM(preset("tiny").replace(vocab_size=19,
                                                      num_nextn_predict_layers=0)).train()

    # distillation from another model: an empty micro-batch's loss would not be zero there
    cfg = TrainerConfig(optimizer="adamw", lr=1e-2, micro_batch_size=mbs, ppo_epochs=2,
                        distill=DistillConfig(enabled=True, weight=0.5))

    def teacher():
        torch.manual_seed(7)
        return GLM5ForCausalLM(preset("tiny").replace(vocab_size=19,
                                                      num_nextn_predict_layers=0))

    trajs = _trajs(n)
    ref = GRPOTrainer(model(), cfg, teacher=teacher())
    mr = ref.train_step(trajs)
    want = dict(ref.model.named_parameters())
    # the single process's own sensitivity: the same batch in one micro-batch (AdamW's first
    # steps move a weight by ~lr whatever its gradient's size, so a gradient's last bits,
    # summed in another order, show at ~lr x 1e-3)
    one = GRPOTrainer(model(), replace(cfg, micro_batch_size=n), teacher=teacher())
    one.train_step(trajs)
    sens = max(float((p - want[k]).detach().abs().max()) for k, p in one.model.named_parameters())
    tr = GRPOTrainer(model(), cfg, teacher=teacher(), mesh=init_device_mesh("cpu", (2,)))
    m = tr.train_step(trajs[dp_slice(n, ctx.rank, 2)])
    err = max(float((p.full_tensor() - want[k]).detach().abs().max())
              for k, p in tr.model.named_parameters())
    return {"err": err, "sens": sens, "loss": (m["loss"], mr["loss"]),
            "tokens": (m["tokens"], mr["tokens"]), "trajectories": m["trajectories"]}


@pytest.mark.parametrize("n, mbs", [(5, 2), (1, 2)])
def test_uneven_batches_pad_with_empty_micro_batches(world2, n, mbs):
    for r in values(world2.run(_uneven, n, mbs, timeout_s=120)):
        assert r["err"] <= max(1e-6, 2 * r["sens"]), r
        assert r["loss"][0] == pytest.approx(r["loss"][1], rel=1e-5, abs=1e-6), r
        assert r["tokens"][0] == r["tokens"][1] and r["trajectories"] == n, r


# ---------------------------------------------------------------- the command (torchrun)
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLM5_RL_CRASH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _cmd(cfg: Path, out: Path, nproc: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "glm5.cli", "rl", "train", str(cfg), "--out", str(out)]
    return cmd + (["--nproc", str(nproc)] if nproc else [])


def _train(cfg: Path, out: Path, nproc: int | None = None, timeout: float = 300) -> str:
    p = subprocess.run(_cmd(cfg, out, nproc), env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _write(tmp: Path, name: str, d: dict) -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump(d))
    return p


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_nproc2_run_is_the_single_process_run(tmp_path, optimizer):
    """Sync mode: the same trajectories, the same rewards step by step, the same final policy
    (within fp32 rounding: the ranks sum the gradients in another order)."""
    from glm5.rl.loop import policy_state

    cfg = _write(tmp_path, "c.yaml", _cfg(trainer__optimizer=optimizer))
    _train(cfg, tmp_path / "one")
    # the single process's own sensitivity to the order its gradients are summed in: the same
    # run with the batch in one micro-batch (Muon's bf16 Newton-Schulz amplifies the last bits)
    _train(_write(tmp_path, "m.yaml", _cfg(trainer__optimizer=optimizer,
                                           trainer__micro_batch_size=8)), tmp_path / "one-mb")
    sens = _max_diff(policy_state(tmp_path / "one"), policy_state(tmp_path / "one-mb"))
    text = _train(cfg, tmp_path / "two", nproc=2)
    assert "steps 1..4" in text
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert [r["trajectories"] for r in b] == [8.0] * 4  # the whole batch, counted over ranks
    # Muon's Newton-Schulz runs in bf16: a gradient's last fp32 bits (summed in another order
    # on two ranks) can round differently there, and the difference carries into later steps
    rel = 1e-4 if optimizer == "adamw" else 1e-3
    for x, y in zip(a, b):
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=rel)
    err = _max_diff(policy_state(tmp_path / "one"), policy_state(tmp_path / "two"))
    assert err <= max(1e-6, 3 * sens), (err, sens)
    saved = yaml.safe_load((tmp_path / "two" / "config.yaml").read_text())
    assert saved["trainer"]["nproc"] == 2


def test_a_killed_trainer_rank_resumes_at_another_rank_count(tmp_path):
    """SIGKILL trainer rank 1 of a --nproc 2 run once a sharded checkpoint exists: the command
    fails; the same command at --nproc 1 resumes from that checkpoint (written by 2 ranks) and
    finishes; the run is the uninterrupted one's (sync mode: same rewards and trajectories)."""
    from glm5.rl.loop import policy_state

    d = _cfg(run__steps=6)
    cfg = _write(tmp_path, "c.yaml", d)
    ref = tmp_path / "ref"
    _train(cfg, ref)
    out = tmp_path / "run"
    env = _env()
    env["GLM5_TEST_ROOT"] = tag = f"{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen(_cmd(cfg, out, 2), env=env, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = False
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            rows = read_metrics(out) if (out / "metrics.csv").exists() else []
            if (out / "checkpoint.pt").exists() and len(rows) >= 3:
                ranks = rank_pids({f"GLM5_TEST_ROOT={tag}".encode()})
                if 1 in ranks:
                    os.kill(ranks[1], signal.SIGKILL)
                    killed = True
                    break
            time.sleep(0.05)
        text, _ = p.communicate(timeout=120)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert killed, "the run finished before rank 1 could be killed"
    assert p.returncode != 0, text[-2000:]
    st = torch.load(out / "checkpoint.pt", weights_only=False)
    assert 2 <= st["step"] < 6
    _train(cfg, out, nproc=1)  # resumes at 1 rank from the 2 ranks' checkpoint
    rows = read_metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert [r["reward"] for r in rows] == [r["reward"] for r in read_metrics(ref)]
    assert _max_diff(policy_state(ref), policy_state(out)) <= 1e-5


def test_one_process_checkpoint_resumes_on_two_ranks(tmp_path):
    from glm5.rl.loop import policy_state

    cfg = _write(tmp_path, "c.yaml", _cfg(run__steps=4))
    ref = tmp_path / "ref"
    _train(cfg, ref)
    out = tmp_path / "run"
    short = _write(tmp_path, "short.yaml", _cfg(run__steps=2))
    _train(short, out)  # 2 steps, checkpoint at 2, one process
    text = _train(cfg, out, nproc=2)  # the same run to step 4 on two ranks
    assert "resumed at step 2" in text
    rows = read_metrics(out)
    assert [r["reward"] for r in rows] == [r["reward"] for r in read_metrics(ref)]
    assert _max_diff(policy_state(ref), policy_state(out)) <= 1e-5


def test_the_ranks_command_line():
    from glm5.cli import build_parser
    from glm5.cli.rl import ranks_command

    argv = ["rl", "train", "c.yaml", "--nproc", "4", "--out", "o"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    cmd = ranks_command(args, 4)
    i = cmd.index("--module")
    assert cmd[i + 1:] == ["glm5.cli", "rl", "train", "c.yaml", "--trainer-nproc", "4", "--out",
                           "o"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    argv = ["rl", "train", "c.yaml", "--nproc=4", "--nnodes", "2", "--rdzv-endpoint", "h:29500"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    cmd = ranks_command(args, 4)
    assert "--nproc-per-node=2" in cmd and "--nnodes=2" in cmd and "--trainer-nproc=4" in cmd
    assert "--rdzv-endpoint=h:29500" in cmd and "--standalone" not in cmd


def test_nproc_errors_are_usage_errors(tmp_path):
    cfg = _write(tmp_path, "c.yaml", _cfg())
    for extra, want in ((["--nproc", "0"], "--nproc expected a positive integer"),
                        (["--nnodes", "2"], "--nnodes expected with --nproc")):
        p = subprocess.run([sys.executable, "-m", "glm5.cli", "rl", "train", str(cfg), "--out",
                            str(tmp_path / "x"), *extra], env=_env(), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and want in p.stderr, p.stderr


def test_ray_places_trainer_ranks_in_a_placement_group(tmp_path):
    """run.ray with trainer.nproc 2: two trainer actors in a placement group, the same run as
    one process (sync mode)."""
    pytest.importorskip("ray")
    from glm5.rl.loop import RLRun
    from glm5.rl.config import RLConfig

    ref = RLRun(RLConfig.from_dict(_cfg(run__steps=2)), out_dir=tmp_path / "ref",
                use_ray=False)
    try:
        want = [h["reward"] for h in [ref.train().history][0]]
    finally:
        ref.close()
    run = RLRun(RLConfig.from_dict(_cfg(run__steps=2, trainer__nproc=2)),
                out_dir=tmp_path / "ray", use_ray=True)
    try:
        import ray
        from ray.util.placement_group import placement_group_table

        table = placement_group_table()
        assert any(len(pg["bundles"]) == 2 and pg["state"] == "CREATED"
                   for pg in table.values()), table
        got = [h["reward"] for h in run.train().history]
        assert run.weights_in_sync()
    finally:
        run.close()
        ray.shutdown()
    assert got == want


def test_two_trainer_ranks_feed_a_tp2_server(tmp_path):
    """`glm5 rl train --nproc 2` whose rollout worker is a `glm5 serve --tp 2
    --allow-weight-updates` server: the sharded trainer's updates (row-range checksums) reach
    the split server, which then holds the trained policy (whole tensors' checksums equal) and
    tags its tokens with that version."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from glm5.core.checkpoint import save_pretrained
    from glm5.engine.weight_sync import state_checksums
    from glm5.rl.config import RLConfig
    from glm5.rl.loop import policy_state
    from glm5.rl.services import build_policy
    from glm5.testing.serve_process import ServeProcess

    d = _cfg(run__steps=3)
    save_pretrained(build_policy(RLConfig.from_dict(d).model), tmp_path / "ckpt")
    srv = ServeProcess([str(tmp_path / "ckpt"), "--tp", "2", "--allow-weight-updates",
                        "--page-size", "16", "--num-pages", "256"])
    try:
        d["rollout"].update(transport="http", urls=[srv.url], num_workers=1)
        d["run"]["checkpoint_every"] = 2
        out = tmp_path / "run"
        _train(_write(tmp_path, "c.yaml", d), out, nproc=2)
        journal = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
        published = [r["version"] for r in journal if r["kind"] == "publish"]
        # step 1's batch has no reward: no weight changes, no version; steps 2 and 3 publish
        assert published == [0, 1, 2], published
        # an update reaches a worker before its next rollout: the run ends with version 2
        # pushed but not yet applied; the server holds version 1, what step 2 trained (the
        # checkpoint at step 2), and sampled step 3's batch with it
        got = httpx.get(srv.url + "/glm5/v1/weights", timeout=60).json()
        assert got["version"] == 1
        assert got["checksums"] == state_checksums(policy_state(out))
        step3 = [r["traj"] for r in journal if r["kind"] == "traj"][-8:]
        assert {v for t in step3 for v in t["versions"]} == {1}
    finally:
        assert srv.stop() in (0, -signal.SIGTERM), srv.output


class _Fake:
    """A trainer service stand-in: train_step fails on rank 1; version answers the rank."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def train_step(self, trajs, weights=None):
        self.calls += 1
        if self.rank == 1:
            raise ValueError("boom on rank 1")
        return {"loss": 0.0}

    def version(self) -> int:
        self.calls += 1
        return self.rank


def _front(ctx, idle_s: float) -> dict:
    from glm5.rl.trainer_ranks import TrainerFront, TrainerRankError, follow

    svc = _Fake(ctx.rank)
    if ctx.rank != 0:
        follow(svc)
        return {"calls": svc.calls}
    front = TrainerFront(svc)
    out = {}
    try:
        front.train_step([])
        out["error"] = None
    except TrainerRankError as e:
        out["error"] = str(e)
    time.sleep(idle_s)  # rank 0 rolls out: the others wait inside a collective
    out["version"] = front.version()
    front.stop()
    out["calls"] = svc.calls
    return out


def test_front_raises_a_rank_error_and_keeps_idle_ranks_alive():
    """A follower's failure is raised on rank 0 naming the rank; an idle front's heartbeat keeps
    the followers' collectives (timeout 3 s here) alive through 8 s without a call."""
    with DistPool(2, comm_timeout_s=3) as pool:
        r0, r1 = values(pool.run(_front, 8.0, timeout_s=60))
    assert "trainer rank 1 of 2 failed train_step: ValueError: boom on rank 1" in r0["error"]
    assert r0["version"] == 0 and r0["calls"] == 2 and r1["calls"] == 2
