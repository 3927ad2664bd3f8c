"""The three services of an RL run — rollout worker, experience pool, trainer — and the handles
the orchestrator calls them through: in process (`LocalHandle`) or as Ray actors
(`RayHandle`). The same objects run either way; only the handle differs.
"""

from __future__ import annotations

import copy
import contextlib
import shutil
import threading
from typing import Any

import torch

from glm5 import ops
from glm5.core.checkpoint import load_model
from glm5.core.model import GLM5ForCausalLM
from glm5.engine.engine import EngineConfig, LLMEngine
from glm5.rl.config import ModelConfig, RLConfig, model_config
from glm5.rl.episodes import EnvTask, EpisodePlayer, env_task_names, episode_limits, load_dialogue
from glm5.rl.rollout import RolloutWorker
from glm5.rl.sharded_sync import make_publisher
from glm5.rl.trainer import GRPOTrainer, dp_slice
from glm5.rl.warmstart import demonstrations, supervised_warm_start
from glm5.rl.weight_sync import WeightReceiver, WeightUpdate, state_checksums

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def build_policy(mc: ModelConfig) -> GLM5ForCausalLM:
    """The initial policy: the checkpoint at ``path`` or a seeded random init of the preset."""
    dtype = _DTYPES[mc.dtype]
    if mc.path is not None:
        model = load_model(mc.path, dtype=dtype)
        return model
    torch.manual_seed(mc.init_seed)
    return GLM5ForCausalLM(model_config(mc), with_mtp=mc.with_mtp).to(dtype)


def engine_config(cfg: RLConfig) -> EngineConfig:
    rc = cfg.rollout
    longest = rc.max_tokens + 256  # prompts of the digit tasks are short
    if env_task_names(cfg):
        longest = max(longest, rc.max_prompt_tokens + rc.max_episode_tokens)
    pages = max(rc.max_num_seqs * rc.in_flight_groups // 8, 64) * (-(-longest // 16))
    return EngineConfig(max_num_seqs=rc.max_num_seqs, page_size=16, num_pages=pages,
                        enable_prefix_cache=True, seed=cfg.run.seed)


class WorkerService:
    """A rollout worker built from a spec (model config + the published weights), so it can
    be built in this process or inside a Ray actor from the same arguments."""

    def __init__(self, cfg_dict: dict[str, Any], full_update: bytes, worker_id: str,
                 threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        cfg = RLConfig.from_dict(cfg_dict)
        mc = cfg.model
        torch.manual_seed(mc.init_seed)
        # the shapes only: the weights come from the update
        model = GLM5ForCausalLM(model_config(mc), with_mtp=mc.with_mtp).to(_DTYPES[mc.dtype])
        engine = LLMEngine(model, engine_config(cfg), backend=mc.backend)
        receiver = WeightReceiver(model, version=0)
        up = WeightUpdate.from_bytes(full_update)
        receiver.apply(up)
        engine.set_weights_version(receiver.version)
        player = None
        if env_task_names(cfg):
            player = EpisodePlayer(engine, load_dialogue(cfg), episode_limits(cfg))
        self.worker = RolloutWorker(engine, worker_id, receiver, episodes=player)

    def close(self) -> None:
        """Stop the worker's episodes (their environments and sandboxes are closed)."""
        if self.worker.episodes is not None:
            self.worker.episodes.close()

    def submit(self, group) -> None:
        self.worker.submit(group)

    def step(self) -> tuple[list, list]:
        """(finished trajectories, failed (group, member, error))."""
        done = self.worker.step()
        failed, self.worker.failed = self.worker.failed, []
        return done, failed

    def num_open(self) -> int:
        return self.worker.num_open()

    def apply_update(self, data: bytes) -> int:
        return self.worker.apply_update(WeightUpdate.from_bytes(data))

    def version(self) -> int:
        return self.worker.version

    def checksums(self) -> dict[str, str]:
        return state_checksums(self.worker.engine.model)

    def tokens_generated(self) -> int:
        return self.worker.tokens_generated


class TrainerService:
    """The policy, its GRPO trainer and the weight publisher. ``mesh`` (a 1-D DeviceMesh of the
    trainer's data-parallel ranks, `glm5.rl.trainer_ranks`): this is one rank's service — the
    policy FSDP2-sharded, each call made on every rank; None: one process."""

    def __init__(self, cfg_dict: dict[str, Any], threads: int | None = None,
                 warm_start: bool = False, mesh: Any = None) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        self.cfg = RLConfig.from_dict(cfg_dict)
        self.mesh = mesh
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        policy = build_policy(self.cfg.model)
        self.warm_report: dict[str, float] = {}
        if warm_start and self.cfg.warm_start.demos > 0 and self.rank == 0:
            self.warm_report = self._warm_start(policy)
        if mesh is not None:  # every rank starts from rank 0's weights (warm-started or loaded)
            _broadcast_module(policy, mesh.get_group())
        teacher = None
        dc = self.cfg.trainer.distill
        if dc.enabled and dc.teacher_path is not None:
            teacher = load_model(dc.teacher_path, dtype=policy.dtype)
        self.trainer = GRPOTrainer(policy, self.cfg.trainer, teacher=teacher,
                                   total_steps=self.cfg.run.steps, mesh=mesh)
        self.publisher = make_publisher(policy, self.cfg.sync.mode,
                                        None if mesh is None else self.cfg.sync.publish,
                                        None if mesh is None else mesh.get_group())

    def _warm_start(self, policy: GLM5ForCausalLM) -> dict[str, float]:
        """Supervised training on the environment tasks' demonstrations (before the trainer,
        its reference and teacher copies and the publisher's version 0 are made)."""
        cfg, ws = self.cfg, self.cfg.warm_start
        dialogue, limits = load_dialogue(cfg), episode_limits(cfg)
        names = env_task_names(cfg)
        tasks = [EnvTask(t.name, t.params, dialogue, limits) for t in cfg.tasks
                 if t.name in names]
        demos = demonstrations(tasks, ws.demos, seed=cfg.run.seed + 1)
        if not demos:
            raise ValueError(f"glm5 rl warm start: none of the environment tasks {names} has "
                             f"demonstrations; set warm_start.demos: 0")
        if cfg.trainer.freeze_indexer:
            policy.freeze_indexer()
        report = supervised_warm_start(policy, demos, ws.steps, ws.lr, ws.batch_size,
                                       seed=cfg.run.seed)
        report["warm_start_demos"] = len(demos)
        return report

    def warm_start_report(self) -> dict[str, float]:
        return dict(self.warm_report)

    def train_step(self, trajs: list, weights: list[float] | None = None) -> dict[str, float]:
        """One step on the whole batch ``trajs`` (with ranks: this rank trains its
        `dp_slice`)."""
        if self.mesh is not None:
            s = dp_slice(len(trajs), self.rank, self.mesh.size())
            trajs, weights = trajs[s], None if weights is None else weights[s]
        b = self.cfg.model.backend
        with ops.use_backend(b) if b else contextlib.nullcontext():
            return self.trainer.train_step(trajs, weights)

    def publish(self) -> tuple[int, bytes | None]:
        up = self.publisher.publish()
        return self.publisher.version, (None if up is None else up.to_bytes())

    def full_update(self) -> bytes | None:
        up = self.publisher.full_update()
        return None if up is None else up.to_bytes()

    def version(self) -> int:
        return self.publisher.version

    def checksums(self) -> dict[str, str] | None:
        """Checksums of the last published weights (what every synced worker holds)."""
        return self.publisher.checksums()

    def checkpoint(self, path: str) -> dict[str, Any]:
        """Write the trainer (policy, optimizers, schedulers, reference, teacher) to the
        directory ``path`` as a torch.distributed.checkpoint (each rank its shards; any rank
        count reads it) and return what the run's checkpoint file holds: that path and the
        publisher's state (rank 0's)."""
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # a crashed run's partial write
        if self.mesh is not None:
            torch.distributed.barrier(group=self.mesh.get_group())
        self.trainer.save_sharded(path)
        return {"format": "dcp", "path": path, "publisher": self.publisher.state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from `checkpoint`'s state, written at any rank count (with ranks, rank 0's
        ``publisher`` entry is the one read)."""
        if state.get("format") != "dcp":
            raise ValueError("glm5 rl: the trainer checkpoint expected format 'dcp' (written by "
                             "TrainerService.checkpoint); this one predates sharded checkpoints")
        self.trainer.load_sharded(state["path"])
        self.publisher.load_state_dict(state["publisher"])


def _broadcast_module(m: torch.nn.Module, group: Any) -> None:
    """Rank 0's parameters and buffers to every rank of ``group``, in place."""
    src = torch.distributed.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            torch.distributed.broadcast(t.data, src=src, group=group)


# ---------------------------------------------------------------------- handles
class LocalHandle:
    """Calls an in-process service, one call at a time (threads share it)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return getattr(self.obj, method)(*args, **kwargs)

    def kill(self) -> None:
        self.obj = _Dead()


class _Dead:
    def __getattr__(self, name: str) -> Any:
        raise ServiceDied(f"glm5 rl: the service was killed (called {name})")


class ServiceDied(RuntimeError):
    """A service (rollout worker, pool, trainer) is gone: its process died or it was killed."""


class ServiceActor:
    """The Ray actor body: holds any service and forwards calls to it."""

    def __init__(self, factory: Any, *args: Any, **kwargs: Any) -> None:
        self.obj = factory(*args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)


class RayHandle:
    """Calls a service living in a Ray actor (a separate process)."""

    def __init__(self, factory: Any, *args: Any, name: str = "", **kwargs: Any) -> None:
        import ray

        self._ray = ray
        actor_cls = ray.remote(num_cpus=0)(ServiceActor)
        self.actor = actor_cls.options(name=name or None).remote(factory, *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from ray.exceptions import RayActorError

        try:
            return self._ray.get(self.actor.call.remote(method, *args, **kwargs))
        except RayActorError as e:
            raise ServiceDied(f"glm5 rl: the Ray actor died during {method}: {e}") from e

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


def copy_config(cfg: RLConfig) -> dict[str, Any]:
    return copy.deepcopy(cfg.to_dict())
