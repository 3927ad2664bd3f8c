"""The RL run: rollout workers, the experience pool and the trainer, synchronous or
asynchronous, in one process or on Ray — the same orchestration code either way.

Flow. Prompt groups (the task-ratio sampler picks their task types) go to rollout workers;
each finished trajectory is journaled at once (`journal.jsonl`) and held until its group is
complete; a complete group gets rewards (the composite reward over the task's checker) and
GRPO advantages, feeds the sampler's success statistics and enters the pool. The trainer takes
a batch from the pool (priority, decay, task-type floor), weights it by staleness, trains, and
every `sync.interval` steps publishes the changed weights to every worker.

- sync: each step generates exactly one batch, then trains (rollouts and training alternate).
- async: one thread per worker keeps ``in_flight_groups`` groups in flight and applies weight
  updates between engine steps; the trainer trains whenever the pool holds a batch. The
  trainer's idle fraction (time waiting for data / wall time) is measured in both modes.

Checkpoints every `run.checkpoint_every` steps hold the trainer (policy, optimizers, published
snapshot), the pool, the sampler, the orchestrator's groups in flight and the journal offset;
a resumed run reads the journal past that offset: in sync mode every later step is re-run
whole (its groups re-queued: the same steps, bit for bit, as without the crash); in async mode a
trajectory sampled with weights no newer than the checkpoint's version is replayed into the
pool, a newer one (weights the restored trainer never made) discarded and its member re-queued.
Each step's `train` journal record names what it trained, so no trajectory is trained twice. A worker that dies mid-episode is
replaced; its finished trajectories were already delivered, its unfinished members re-queued.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from glm5 import ops
from glm5.rl import crash_points
from glm5.rl.config import (DEFAULT_MAX_TOKENS, DROP_WARN_FRACTION, DROP_WARN_WINDOW, RLConfig,
                             sync_warnings)
from glm5.rl.episodes import (EnvTask, env_task_names, episode_limits, load_dialogue,
                              resolve_tokenizer)
from glm5.rl.pool import DuplicateTrajectoryError, ExperiencePool
from glm5.rl.remote import HTTPWorkerService
from glm5.rl.reward import CompositeReward, RewardContext
from glm5.rl.rollout import PromptGroup
from glm5.rl.sampler import DynamicRatioSampler
from glm5.rl.services import (LocalHandle, RayHandle, ServiceDied, TrainerService, WorkerService,
                              copy_config)
from glm5.rl.tasks import answer_limit, make_task
from glm5.rl.trajectory import Trajectory
from glm5.rl.weight_sync import staleness_weights

log = logging.getLogger("glm5.rl")

CHECKPOINT = "checkpoint.pt"
JOURNAL = "journal.jsonl"
TRAINER_DIR = "trainer"


def policy_state(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The trained policy's weights (a state dict of whole tensors) at a run's last checkpoint,
    whatever number of trainer ranks wrote it."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    st = torch.load(Path(run_dir) / CHECKPOINT, weights_only=False)["trainer"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(Path(run_dir) / st["path"], os.path.join(tmp, "t.pt"))
        return torch.load(os.path.join(tmp, "t.pt"), weights_only=False)["model"]


@dataclass
class RunSummary:
    steps: int
    wall_s: float
    trainer_idle_s: float
    final_reward: float  # mean reward of the last 10% of steps (at least one)
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        return self.trainer_idle_s / self.wall_s if self.wall_s > 0 else 0.0


class RLRun:
    """One RL run from its config. ``use_ray`` (default: cfg.run.ray) runs the workers, the pool
    and the trainer as Ray actors (``ray.init`` must have been called or is called here with the
    local machine). ``resume`` continues from ``out_dir/checkpoint.pt`` when present."""

    def __init__(self, cfg: RLConfig, out_dir: str | Path | None = None, resume: bool = True,
                 use_ray: bool | None = None, metrics: Any = None) -> None:
        self.cfg = cfg
        self.out = Path(out_dir or cfg.run.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.use_ray = cfg.run.ray if use_ray is None else use_ray
        for msg in sync_warnings(cfg):
            log.warning("glm5 rl: %s", msg)
        envs = env_task_names(cfg)
        if envs:
            cfg = self.cfg = RLConfig.from_dict(copy_config(cfg))  # the caller's stays as given
            resolve_tokenizer(cfg, self.out)
            dialogue, limits = load_dialogue(cfg), episode_limits(cfg)
        self.tasks = {t.name: EnvTask(t.name, t.params, dialogue, limits) if t.name in envs
                      else make_task(t.name, t.params) for t in cfg.tasks}
        if len(self.tasks) != len(cfg.tasks):
            raise ValueError("glm5 rl: tasks lists a task type twice")
        if cfg.rollout.max_tokens is None:  # the tasks' own answer length (config.py)
            cfg = self.cfg = RLConfig.from_dict(copy_config(cfg))  # the caller's stays as given
            cfg.rollout.max_tokens = answer_limit(self.tasks.values()) or DEFAULT_MAX_TOKENS
        self.reward = CompositeReward(cfg.reward.components)
        self.sampler = DynamicRatioSampler([t.name for t in cfg.tasks],
                                           {t.name: t.weight for t in cfg.tasks}, cfg.sampler,
                                           seed=cfg.run.seed)
        self.metrics = metrics
        self._rng = random.Random(cfg.run.seed)
        self._lock = threading.RLock()  # orchestrator state, journal, pool adds
        self._groups: dict[str, PromptGroup] = {}  # groups not yet complete
        self._done: dict[str, dict[int, Trajectory]] = {}  # their finished members
        self._where: dict[str, int] = {}  # group id -> worker index holding it
        self._queue: list[PromptGroup] = []  # groups (or missing members) waiting for a worker
        self._next_group = 0
        self.step = 0
        self.version = 0
        self.history: list[dict[str, float]] = []
        self.trainer_idle_s = 0.0
        self.replaced_workers = 0
        self.dropped_stale = 0
        self._dropped_now = 0  # this step's stale drops (pool evictions and batch weights 0)
        self._drop_window: list[tuple[int, int]] = []  # (dropped, trained) of recent steps
        self._drop_warned = False
        self._tokens = 0
        self._errors: list[BaseException] = []
        self._replaying = False

        cfg_dict = copy_config(cfg)
        handle = self._handle
        # As actors, one torch thread each: the trainer and the workers share the machine's cores
        ckpt = self.out / CHECKPOINT
        state = torch.load(ckpt, weights_only=False) if resume and ckpt.exists() else None
        self.trainer = self._trainer_handle(cfg_dict, warm_start=state is None)
        self.warm_start = self.trainer.call("warm_start_report")
        if self.warm_start:
            (self.out / "warm_start.json").write_text(json.dumps(self.warm_start, indent=1))
        pool_path = cfg.pool.path or str(self.out / "pool.sqlite")
        self.pool = handle(ExperiencePool, cfg.pool, pool_path, seed=cfg.run.seed, name="pool")
        if state is not None:
            self.trainer.call("restore", {**state["trainer"], "path": str(
                (self.out / state["trainer"]["path"]).resolve())})
        self._full = self.trainer.call("full_update")
        self.version = self.trainer.call("version")
        self.workers = [self._new_worker(i) for i in range(cfg.rollout.num_workers)]
        self._updates: list[list[bytes]] = [[] for _ in self.workers]
        # a fresh run starts a fresh journal (an old one would be replayed by a later resume)
        self._journal = open(self.out / JOURNAL, "a+b" if state is not None else "w+b")
        if state is not None:
            self._restore(state)
        else:  # the weights every trajectory until the first publish is sampled with
            self._write({"kind": "publish", "version": self.version})

    # ------------------------------------------------------------------ services
    def _handle(self, factory: Callable, *args: Any, name: str = "", **kwargs: Any) -> Any:
        if self.use_ray:
            self._ray_init()
            return RayHandle(factory, *args, **kwargs)
        return LocalHandle(factory(*args, **kwargs))

    def _ray_init(self) -> None:
        import ray

        if not ray.is_initialized():  # the trainer's ranks take a CPU each (a placement group)
            ray.init(num_cpus=max(os.cpu_count() or 1, 2, self.cfg.trainer.nproc),
                     include_dashboard=False, log_to_driver=False)

    def _trainer_handle(self, cfg_dict: dict[str, Any], warm_start: bool) -> Any:
        """The trainer: one service, or ``trainer.nproc`` ranks (`glm5.rl.trainer_ranks`): Ray
        actors in a placement group, or — in a torchrun world this process is rank 0 of —
        the front that drives the other ranks (they run `trainer_ranks.follow`)."""
        n = self.cfg.trainer.nproc
        if n == 1:
            return self._handle(TrainerService, cfg_dict, threads=1 if self.use_ray else None,
                                warm_start=warm_start, name="trainer")
        from glm5.rl import trainer_ranks  # lazy: torch.distributed's FSDP and Ray

        if self.use_ray:
            self._ray_init()
            return trainer_ranks.RayTrainerGroup(cfg_dict, n, warm_start)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() != 0:
            raise ValueError(f"glm5 rl: trainer.nproc is {n}: run `glm5 rl train --nproc {n}` "
                             f"(the trainer's ranks under torchrun) or with run.ray")
        self._front = trainer_ranks.start_front(cfg_dict, warm_start)
        return LocalHandle(self._front)

    def _new_worker(self, i: int) -> Any:
        rc = self.cfg.rollout
        if rc.transport == "http":
            # an engine server per worker (urls[i]), brought to the
            # published weights with a full update
            w = LocalHandle(HTTPWorkerService(rc.urls[i], f"w{i}"))
            w.call("apply_update", self._full)
            return w
        threads = 1 if self.use_ray else None
        return self._handle(WorkerService, copy_config(self.cfg), self._full, f"w{i}",
                            threads=threads, name=f"rollout-{i}-{time.monotonic_ns()}")

    # ------------------------------------------------------------------ groups
    def _make_group(self, task_type: str) -> PromptGroup:
        task = self.tasks[task_type]
        inst = task.sample(self._rng)
        rc = self.cfg.rollout
        g = PromptGroup(f"g{self._next_group}", task_type, inst.prompt_ids, rc.group_size,
                        temperature=rc.temperature, top_p=rc.top_p, max_tokens=rc.max_tokens,
                        stop_token_ids=list(task.stop_token_ids),
                        seed=self.cfg.run.seed, meta=inst.meta)
        self._next_group += 1
        self._groups[g.group_id] = g
        self._done[g.group_id] = {}
        self._write({"kind": "group", "group": g.to_dict()})
        return g

    def _new_groups(self, n: int) -> list[PromptGroup]:
        with self._lock:
            return [self._make_group(t) for t in self.sampler.choose(n)]

    def _write(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec) + "\n").encode()
        self._journal.seek(0, os.SEEK_END)
        if crash_points.armed("journal"):
            self._journal.write(line[: len(line) // 2])
            self._journal.flush()
            crash_points.die()
        self._journal.write(line)
        self._journal.flush()

    def _deliver(self, trajs: list[Trajectory]) -> None:
        """Journal finished trajectories; complete groups get rewards and enter the pool."""
        with self._lock:
            ready = []
            for t in trajs:
                member = int(t.traj_id.rsplit("/", 1)[1])
                if t.group_id not in self._done or member in self._done[t.group_id]:
                    continue  # a re-queued member finished twice: keep the first
                self._write({"kind": "traj", "traj": t.to_dict()})
                self._done[t.group_id][member] = t
                self._tokens += len(t.completion_ids)
                if len(self._done[t.group_id]) == self._groups[t.group_id].size:
                    ready.append(t.group_id)
            for gid in ready:
                self._complete(gid)

    def _complete(self, gid: str) -> None:
        g = self._groups.pop(gid)
        members = self._done.pop(gid)
        self._where.pop(gid, None)
        trajs = [members[i] for i in range(g.size)]
        task = self.tasks[g.task_type]
        successes = []
        for t in trajs:
            score = task.score(t.meta, t.completion_ids)
            # the decoded text and turns when the task has text (glm5.rl.reward)
            ctx = RewardContext.from_trajectory(t, score, task=task)
            t.reward, t.reward_components = self.reward(ctx)
            t.reward_components = {**score, **t.reward_components}
            successes.append(score.get("exact", t.reward))
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
        adv = ops.grpo_advantages(rewards, g.size, self.cfg.trainer.std_normalize).tolist()
        for t, a, s in zip(trajs, adv, successes):
            t.advantage = float(a)
            self.sampler.record(t.task_type, float(s))
        if not self._replaying:
            self.pool.call("add", trajs)
            return
        for t in trajs:  # a persistent tier (SQLite, Redis) may still hold some of them
            try:
                self.pool.call("add", [t])
            except DuplicateTrajectoryError:
                pass

    # ------------------------------------------------------------------ workers
    def _assign(self, i: int, g: PromptGroup) -> None:
        with self._lock:
            self._where[g.group_id] = i
        try:
            self.workers[i].call("submit", g)
        except ServiceDied as e:
            self._worker_failed(i, e)  # g goes back to the queue with the worker's others

    def _worker_failed(self, i: int, err: BaseException) -> None:
        """Replace worker i; its groups' unfinished members go back to the queue."""
        log.warning("glm5 rl: rollout worker %d failed (%s); replacing it and re-queueing its "
                    "unfinished trajectories", i, err)
        with self._lock:
            lost = [gid for gid, w in self._where.items() if w == i]
            for gid in lost:
                del self._where[gid]
                g = self._groups[gid]
                missing = [m for m in range(g.size) if m not in self._done[gid]]
                self._queue.append(PromptGroup(**{**g.to_dict(), "pending": missing}))
            self.replaced_workers += 1
            self._full = self.trainer.call("full_update")
            self._updates[i] = []
        try:
            self.workers[i].call("close")  # an HTTP client's thread and connections
        except Exception:  # noqa: BLE001 - dead, or a service without close
            pass
        self.workers[i] = self._new_worker(i)

    def _requeue_failed(self, failed: list) -> None:
        with self._lock:
            for group, member, err in failed:
                log.warning("glm5 rl: trajectory %s failed in the engine (%s); re-queued",
                            group.traj_id(member), err)
                self._where.pop(group.group_id, None)
                self._queue.append(PromptGroup(**{**group.to_dict(), "pending": [member]}))

    def _pump(self, i: int) -> int:
        """One engine step of worker i (updates applied first); returns its open requests."""
        w = self.workers[i]
        with self._lock:
            updates, self._updates[i] = self._updates[i], []
        for u in updates:
            w.call("apply_update", u)
        done, failed = w.call("step")
        self._deliver(done)
        if failed:
            self._requeue_failed(failed)
        crash_points.reached("rollout")
        return w.call("num_open")

    def _push_update(self, data: bytes) -> None:
        with self._lock:
            for q in self._updates:
                q.append(data)

    def _take_queued(self, limit: int) -> list[PromptGroup]:
        with self._lock:
            out, self._queue = self._queue[:limit], self._queue[limit:]
            return out

    # ------------------------------------------------------------------ training
    @property
    def batch_size(self) -> int:
        return self.cfg.rollout.groups_per_step * self.cfg.rollout.group_size

    def _train(self, trajs: list[Trajectory], t_wait: float) -> dict[str, float]:
        sc = self.cfg.sync
        w = staleness_weights(trajs, self.version, sc.max_staleness, sc.stale_policy)
        stale = [self.version - t.min_version for t in trajs]  # versions behind the trainer
        keep = [(t, x) for t, x in zip(trajs, w) if x > 0]
        self.dropped_stale += len(trajs) - len(keep)
        self._dropped_now += len(trajs) - len(keep)
        self._watch_drops(len(keep))
        m: dict[str, float] = {}
        if keep:
            m = self.trainer.call("train_step", [t for t, _ in keep], [x for _, x in keep])
        self.step += 1
        with self._lock:  # which trajectories this step consumed: at most once, checkable
            self._write({"kind": "train", "step": self.step,
                         "trained": [t.traj_id for t, _ in keep],
                         "dropped": [t.traj_id for t, x in zip(trajs, w) if x <= 0]})
        crash_points.reached("train")
        if self.step % sc.interval == 0:
            self.version, data = self.trainer.call("publish")
            if data is not None:  # a new version (None: no weight changed, the same version)
                with self._lock:  # before any worker samples with it: the journal's order
                    self._write({"kind": "publish", "version": self.version})
                self._push_update(data)
            crash_points.reached("publish")
        self.sampler.step()  # every sampler.update_every steps: ratios from recent success
        rewards = [t.reward for t in trajs]
        exact = [t.reward_components.get("exact", t.reward) for t in trajs]
        row = {"step": self.step, "time": time.perf_counter() - self._t0,
               "version": self.version, "reward": sum(rewards) / len(rewards),
               "exact": sum(exact) / len(exact), "batch": len(trajs), "trained": len(keep),
               "staleness": sum(stale) / len(stale), "dropped_stale": self._dropped_now,
               "trainer_wait_s": t_wait,
               "trainer_idle_frac": self.trainer_idle_s / max(time.perf_counter() - self._t0,
                                                              1e-9),
               "rollout_tokens": self._tokens, "task_types": len({t.task_type for t in trajs})}
        for name in self.tasks:
            rs = [t.reward for t in trajs if t.task_type == name]
            if rs:
                row[f"reward/{name}"] = sum(rs) / len(rs)
        for name, r in self.sampler.ratios().items():
            row[f"ratio/{name}"] = r
        row.update({k: v for k, v in m.items()})
        self._dropped_now = 0
        self.history.append(row)
        if self.metrics is not None:
            self.metrics.log(self.step, row)
        ce = self.cfg.run.checkpoint_every
        if ce and self.step % ce == 0:
            self.checkpoint()
        return row

    def _evict_stale(self) -> None:
        """With stale_policy drop, trajectories past the staleness bound leave the pool."""
        sc = self.cfg.sync
        if sc.stale_policy == "drop":
            n = self.pool.call("evict_older_than", self.version - sc.max_staleness)
            self.dropped_stale += n
            self._dropped_now += n

    def _watch_drops(self, trained: int) -> None:
        """Warn once when most of the recent data was dropped as stale (measured, not
        estimated: the share over the last DROP_WARN_WINDOW steps)."""
        self._drop_window = [*self._drop_window, (self._dropped_now, trained)][-DROP_WARN_WINDOW:]
        dropped = sum(d for d, _ in self._drop_window)
        total = dropped + sum(t for _, t in self._drop_window)
        if (not self._drop_warned and len(self._drop_window) == DROP_WARN_WINDOW and total
                and dropped / total > DROP_WARN_FRACTION):
            self._drop_warned = True
            sc = self.cfg.sync
            log.warning("glm5 rl: %.0f%% of the trajectories of the last %d steps were dropped "
                        "as stale (sync.max_staleness %d versions, sync.interval %d steps): "
                        "raise sync.max_staleness or use sync.stale_policy: downweight",
                        100 * dropped / total, DROP_WARN_WINDOW, sc.max_staleness,
                        sc.interval)

    def _wait_batch(self, stop: threading.Event) -> tuple[list[Trajectory], float]:
        t0 = time.perf_counter()
        self._evict_stale()
        while True:
            if self._errors:
                raise self._errors[0]
            if self.pool.call("__len__") >= self.batch_size:
                trajs = self.pool.call("sample", self.batch_size)
                waited = time.perf_counter() - t0
                self.trainer_idle_s += waited
                return trajs, waited
            if stop.is_set():
                raise RuntimeError("glm5 rl: the rollout threads stopped")
            time.sleep(0.002)

    # ------------------------------------------------------------------ modes
    def train(self, steps: int | None = None, progress: Callable[[dict], None] | None = None
              ) -> RunSummary:
        """Train until ``steps`` trainer steps (default cfg.run.steps) have run in total."""
        target = self.cfg.run.steps if steps is None else steps
        self._t0 = time.perf_counter() - (self.history[-1]["time"] if self.history else 0.0)
        t_start = time.perf_counter()
        idle0 = self.trainer_idle_s
        if self.cfg.run.mode == "sync":
            self._train_sync(target, progress)
        else:
            self._train_async(target, progress)
        wall = time.perf_counter() - t_start
        tail = self.history[-max(1, len(self.history) // 10):] if self.history else []
        fr = sum(r["reward"] for r in tail) / len(tail) if tail else 0.0
        return RunSummary(self.step, wall, self.trainer_idle_s - idle0, fr, list(self.history))

    def _train_sync(self, target: int, progress) -> None:
        nw = len(self.workers)
        while self.step < target:
            t0 = time.perf_counter()
            groups = self._take_queued(10**9)
            groups += self._new_groups(max(self.cfg.rollout.groups_per_step
                                           - self._pending_groups(groups), 0))
            for k, g in enumerate(groups):
                self._assign(k % nw, g)
            while True:
                open_ = 0
                for i in range(nw):
                    try:
                        open_ += self._pump(i)
                    except ServiceDied as e:
                        self._worker_failed(i, e)
                queued = self._take_queued(10**9)
                for k, g in enumerate(queued):
                    self._assign(k % nw, g)
                if not open_ and not queued and not self._groups_in_flight():
                    break
            n = self.pool.call("__len__")
            if n == 0:
                continue
            trajs = self.pool.call("sample", min(self.batch_size, n))
            wait = time.perf_counter() - t0
            self.trainer_idle_s += wait
            row = self._train(trajs, wait)
            if progress:
                progress(row)

    def _pending_groups(self, queued: list[PromptGroup]) -> int:
        return len({g.group_id for g in queued})

    def _groups_in_flight(self) -> bool:
        with self._lock:
            return bool(self._where)

    def _train_async(self, target: int, progress) -> None:
        stop = threading.Event()
        threads = [threading.Thread(target=self._rollout_loop, args=(i, stop), daemon=True,
                                    name=f"glm5-rollout-{i}") for i in range(len(self.workers))]
        for t in threads:
            t.start()
        try:
            while self.step < target:
                trajs, wait = self._wait_batch(stop)
                row = self._train(trajs, wait)
                if progress:
                    progress(row)
        finally:
            stop.set()
            for t in threads:
                t.join()

    def _rollout_loop(self, i: int, stop: threading.Event) -> None:
        cap = self.cfg.rollout.in_flight_groups
        size = self.cfg.rollout.group_size
        # Trajectories pooled or still to finish stay under two batches: one for the trainer
        # to take and one being generated. More would only age in the pool (the pool serves by
        # priority, not age) and be dropped as stale.
        lead = 2 * self.batch_size
        try:
            while not stop.is_set():
                with self._lock:
                    mine = sum(1 for w in self._where.values() if w == i)
                    outstanding = sum(g.size - len(self._done[gid])
                                      for gid, g in self._groups.items())
                # re-queued members first (already counted as outstanding), then new groups
                todo = self._take_queued(max(cap - mine, 0))
                room = min(cap - mine - len(todo),
                           (lead - self.pool.call("__len__") - outstanding) // size)
                if room > 0:
                    todo += self._new_groups(room)
                for g in todo:
                    self._assign(i, g)
                try:
                    if self._pump(i) == 0:
                        time.sleep(0.002)
                except ServiceDied as e:
                    if stop.is_set():
                        return
                    self._worker_failed(i, e)
        except BaseException as e:  # noqa: BLE001 - surfaced in the trainer's thread
            self._errors.append(e)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> Path:
        """Write the run's state atomically (tmp file + rename)."""
        with self._lock:
            self._journal.flush()
            os.fsync(self._journal.fileno())
            state = {
                # the run directory may move: checkpoint.pt names the trainer's relative to it
                "trainer": {**self.trainer.call("checkpoint", str(self._trainer_dir().resolve())),
                            "path": str(self._trainer_dir().relative_to(self.out))},
                "pool": self.pool.call("state_dict"),
                "sampler": self.sampler.state_dict(),
                "rng": self._rng.getstate(),
                "next_group": self._next_group,
                "groups": [g.to_dict() for g in self._groups.values()],
                "done": {gid: {m: t.to_dict() for m, t in ms.items()}
                         for gid, ms in self._done.items()},
                "queue": [g.to_dict() for g in self._queue],
                "journal_offset": self._journal.seek(0, os.SEEK_END),
                "step": self.step, "version": self.version, "history": self.history,
                "trainer_idle_s": self.trainer_idle_s, "dropped_stale": self.dropped_stale,
                "tokens": self._tokens,
            }
        path = self.out / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        if crash_points.armed("checkpoint"):
            buf = io.BytesIO()
            torch.save(state, buf)
            tmp.write_bytes(buf.getvalue()[: buf.tell() // 2])
            crash_points.die()
        torch.save(state, tmp)
        os.replace(tmp, path)
        keep = self._trainer_dir()
        for d in (self.out / TRAINER_DIR).glob("step-*"):  # older (or a crash's partial) ones
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)
        return path

    def _trainer_dir(self) -> Path:
        """The trainer's sharded checkpoint of this step (beside checkpoint.pt, which names it;
        the previous one is removed only once checkpoint.pt names the new one)."""
        return self.out / TRAINER_DIR / f"step-{self.step:06d}"

    def _restore(self, st: dict[str, Any]) -> None:
        self.pool.call("load_state_dict", st["pool"])
        self.sampler.load_state_dict(st["sampler"])
        self._rng.setstate(st["rng"])
        self._next_group = st["next_group"]
        self.step, self.version = st["step"], st["version"]
        self.history = st["history"]
        self.trainer_idle_s, self.dropped_stale = st["trainer_idle_s"], st["dropped_stale"]
        self._tokens = st["tokens"]
        self._groups = {g["group_id"]: PromptGroup.from_dict(g) for g in st["groups"]}
        self._done = {gid: {int(m): Trajectory.from_dict(t) for m, t in ms.items()}
                      for gid, ms in st["done"].items()}
        queued = [PromptGroup.from_dict(g) for g in st["queue"]]
        groups, finished = self._read_journal_tail(st["journal_offset"])
        self._journal.truncate(st["journal_offset"])
        self._journal.seek(0, os.SEEK_END)
        kept, discarded = self._replayable(groups, finished)
        if discarded:  # a persistent pool tier may hold them already
            self.pool.call("discard", [t.traj_id for t in discarded])
        for g in groups if self.cfg.run.mode != "sync" else []:
            self._groups[g.group_id] = g
            self._done.setdefault(g.group_id, {})
            self._write({"kind": "group", "group": g.to_dict()})
            self._next_group = max(self._next_group, int(g.group_id[1:]) + 1)
        if self._next_group != st["next_group"]:
            # Groups made after the checkpoint drew from the task RNG past its saved state; a
            # fresh stream keeps the resumed run from drawing the same prompts again.
            self._rng.seed(f"{self.cfg.run.seed}/resumed/{self._next_group}")
        self._replaying = True
        try:
            self._deliver(kept)  # journaled again, so a second crash loses nothing either
        finally:
            self._replaying = False
        # Unfinished members of every incomplete group are re-queued.
        seen = {g.group_id for g in queued}
        for gid, g in self._groups.items():
            if gid in seen:
                continue
            missing = [m for m in range(g.size) if m not in self._done[gid]]
            if missing:
                queued.append(PromptGroup(**{**g.to_dict(), "pending": missing}))
        self._queue = queued
        log.info("glm5 rl: resumed at step %d (version %d): %d journaled trajectories kept, %d "
                 "discarded (sampled by weights newer than the checkpoint's%s), %d groups "
                 "re-queued", self.step, self.version, len(kept), len(discarded),
                 ", or a sync step re-run whole" if self.cfg.run.mode == "sync" else "",
                 len(queued))

    def _read_journal_tail(self, offset: int) -> tuple[list[PromptGroup], list[Trajectory]]:
        """The groups started and the trajectories finished after the checkpoint (a line cut
        by the crash is skipped; train records past the checkpoint are undone with it)."""
        self._journal.seek(offset)
        groups: list[PromptGroup] = []
        finished: list[Trajectory] = []
        for line in self._journal.read().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec["kind"] == "group":
                groups.append(PromptGroup.from_dict(rec["group"]))
            elif rec["kind"] == "traj":
                finished.append(Trajectory.from_dict(rec["traj"]))
        return groups, finished

    def _replayable(self, groups: list[PromptGroup], finished: list[Trajectory]
                    ) -> tuple[list[Trajectory], list[Trajectory]]:
        """(kept, discarded) of the trajectories finished after the checkpoint.

        A token sampled by weights newer than the checkpoint's came from a trainer the resumed
        run never was: its trajectory is discarded and the member re-queued. Sync mode goes
        further and discards everything after the checkpoint: the steps after it run again
        from the checkpoint's state (the same groups, seeds and weights give the same tokens),
        so a resumed sync run is the uninterrupted run, bit for bit.
        """
        if self.cfg.run.mode == "sync":
            return [], finished
        kept, discarded = [], []
        for t in finished:
            newest = max((t.versions[i] for i in t.sampled), default=t.min_version)
            (discarded if newest > self.version else kept).append(t)
        return kept, discarded

    # ------------------------------------------------------------------ checks
    def weights_in_sync(self) -> bool:
        """Every worker's weight checksums equal the trainer's last published weights (call
        after a sync, with the updates applied)."""
        for i, w in enumerate(self.workers):
            with self._lock:
                updates, self._updates[i] = self._updates[i], []
            for u in updates:
                w.call("apply_update", u)
        ref = self.trainer.call("checksums")
        return all(w.call("checksums") == ref for w in self.workers)

    def close(self) -> None:
        self._journal.close()
        for w in self.workers:
            try:
                w.call("close")
            except Exception:  # noqa: BLE001 - in-process workers have nothing to close
                pass
        try:
            self.pool.call("close")
        except ServiceDied:
            pass
        front = getattr(self, "_front", None)
        if front is not None:
            front.stop()
        if self.use_ray:
            for h in [*self.workers, self.pool, self.trainer]:
                try:
                    h.kill()
                except Exception:  # noqa: BLE001 - already gone
                    pass
