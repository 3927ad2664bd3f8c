"""The RL run's configuration: one dataclass per section, read from YAML or a dict strictly
(an unknown key, a wrong type or an out-of-range value is an error naming the key).

The defaults are GLM-5's where the seed gives one: clip [0.8, 1.25] (clip_low 0.2,
clip_high 0.25), pool decay 20% per 4 h, at least 5 task types per
batch, distillation at temperature 0.7 with weight 0.3 and the teacher refreshed every 1000
steps, the DSA indexer frozen. Two are not, so that a config naming only its tasks and steps
learns: the weights are published after every trainer step (`sync.interval` 1; GLM-5 pushes
every 50 steps across a fleet, where a push is expensive — here it is an in-process delta, and
at 50 the rollouts sample from a policy up to 49 updates behind the trainer), and a
completion's length defaults to the tasks' own answer length (`rollout.max_tokens` None).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5.core.config import GLM5Config, preset
from glm5.rl.reward import text_component_error
from glm5.rl.tasks import is_env_task


class RLConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass
class ModelConfig:
    preset: str = "tiny"  # glm5.core.config preset, used when path is None
    path: str | None = None  # a checkpoint directory (save_pretrained / HF layout)
    overrides: dict[str, Any] = field(default_factory=dict)  # GLM5Config fields
    with_mtp: bool = False
    backend: str | None = None  # the op backend of trainer and rollout engines (None: default)
    dtype: str = "float32"
    init_seed: int = 0
    # the tokenizer of environment tasks (text in, text out): a model directory holding
    # tokenizer.json (the checkpoint's own when None and path is set), or "toy": a small GLM-style
    # byte-level BPE trained for the run (glm5.rl.envs.dialogue.toy_tokenizer; needs
    # vocab_size >= 273)
    tokenizer: str | None = None


def model_config(mc: ModelConfig) -> GLM5Config:
    """The policy's shapes: the checkpoint's config, or the preset with the overrides."""
    if mc.path is not None:
        return GLM5Config.from_pretrained(mc.path)
    return preset(mc.preset).replace(**mc.overrides)


@dataclass
class TaskConfig:
    name: str  # a registered task type (glm5.rl.tasks.TASKS)
    weight: float = 1.0  # the initial ratio (normalised over tasks)
    params: dict[str, Any] = field(default_factory=dict)


DEFAULT_MAX_TOKENS = 16  # rollout.max_tokens when a task does not say how long its answers are


@dataclass
class RolloutConfig:
    num_workers: int = 1
    group_size: int = 8  # completions per prompt (the GRPO group)
    groups_per_step: int = 8  # prompt groups per trainer step
    temperature: float = 1.0
    top_p: float = 1.0
    # per completion (one turn of an environment task); None: the tasks' longest answer where
    # every task declares one (`max_answer_tokens`), else DEFAULT_MAX_TOKENS
    max_tokens: int | None = None
    max_num_seqs: int = 128  # engine batch
    transport: str = "inprocess"  # "inprocess" | "http"
    urls: list[str] = field(default_factory=list)  # engine servers when transport == "http"
    in_flight_groups: int = 16  # groups queued per worker (async); bounds the off-policy lag
    # environment tasks (multi-turn episodes; max_tokens is then the limit of one turn)
    max_turns: int = 8  # turns per episode (an environment may end it sooner)
    max_episode_tokens: int = 512  # sampled + environment tokens after the first prompt
    max_prompt_tokens: int = 1024  # the first prompt (chat template, tools, observation)
    max_observation_tokens: int = 256  # a longer environment answer is cut, and says so
    episode_timeout_s: float = 300.0
    env_threads: int = 4  # environment steps run beside the engine in this many threads
    thinking: bool = False  # the generation prompt opens <think> (else <think></think>)
    # declare the environment's tools in the chat template's system part (GLM-5's layout); off,
    # the prompt is only the observation (which names the tools): far shorter for small models
    declare_tools: bool = True


@dataclass
class DistillConfig:
    enabled: bool = False
    weight: float = 0.3
    temperature: float = 0.7
    refresh_every: int = 1000  # trainer steps between teacher refreshes (0: never)
    teacher_path: str | None = None  # None: the initial policy is the first teacher


@dataclass
class TrainerConfig:
    optimizer: str = "muon"  # "muon" (Muon for matrices, AdamW for the rest) | "adamw"
    lr: float = 1e-3  # AdamW
    muon_lr: float = 2e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global grad norm (0: off)
    lr_schedule: str = "constant"  # "constant" | "cosine" (to min_lr_ratio x lr at run.steps)
    min_lr_ratio: float = 0.1
    micro_batch_size: int = 32  # trajectories per forward/backward (gradient accumulation)
    ppo_epochs: int = 1  # optimizer steps per batch (ratio == 1 on the first)
    clip_low: float = 0.2
    clip_high: float = 0.25
    tis_cap: float = 2.0  # truncated importance sampling cap on exp(old - rollout)
    # "trainer": ratio against the trainer's logprob before the update (1 on the first epoch)
    # with TIS for the rollout mismatch; "rollout": ratio against the engine's logprob (the
    # policy that sampled the token), clipped — off-policy tokens get the trust region
    ratio_base: str = "trainer"
    std_normalize: bool = True
    kl_coef: float = 0.0  # KL to the reference (initial) policy; 0: no reference kept
    freeze_indexer: bool = True
    # data-parallel trainer ranks (FSDP2: parameters, gradients and optimizer state sharded);
    # > 1 runs under `glm5 rl train --nproc N` (torchrun) or as Ray actors with run.ray
    nproc: int = 1
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class SyncConfig:
    interval: int = 1  # trainer steps between weight pushes (module docstring: why not 50)
    max_staleness: int = 2  # versions (weight pushes) a token may lag the trainer
    stale_policy: str = "drop"  # "drop" | "downweight" (weight 0.5 ** excess versions)
    mode: str = "xor"  # delta encoding: "xor" (bit-exact) | "sub" (new - old, float)
    # with trainer.nproc > 1: "shards" (each rank diffs and checksums its rows; rank 0 joins
    # the pieces) | "gathered" (the whole state all-gathered to rank 0, diffed there)
    publish: str = "shards"


@dataclass
class PoolConfig:
    backend: str = "memory"  # "memory" | "sqlite" | "redis"
    memory_capacity: int = 4096  # trajectories in the memory tier (the rest spill to disk)
    path: str | None = None  # SQLite file (None: <out_dir>/pool.sqlite when backend is sqlite)
    redis_url: str = "redis://localhost:6379/0"
    namespace: str = "glm5rl"
    decay: float = 0.2  # priority multiplied by (1 - decay) every decay_period_s
    decay_period_s: float = 4 * 3600.0
    min_task_types: int = 5
    priority_eps: float = 1e-3  # a zero-advantage trajectory keeps a small chance
    sample_mode: str = "proportional"  # "proportional" | "greedy"
    consume: bool = True  # a sampled trajectory leaves the pool


@dataclass
class SamplerConfig:
    dynamic: bool = True
    window: int = 256  # recent results per task type
    floor: float = 0.05  # no task type below this share
    temperature: float = 1.0  # sharpness of the learnability weighting
    update_every: int = 1  # trainer steps between ratio updates


@dataclass
class RewardConfig:
    components: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0})


@dataclass
class WarmStartConfig:
    """Supervised training on expert demonstrations of the environment tasks before RL
    (glm5.rl.warmstart); only on a fresh run, not on resume."""

    demos: int = 0  # demonstrations per environment task (0: no warm start)
    steps: int = 200
    lr: float = 3e-3
    batch_size: int = 16


@dataclass
class RunConfig:
    steps: int = 100
    mode: str = "async"  # "async" | "sync"
    out_dir: str = "runs/rl"
    seed: int = 0
    checkpoint_every: int = 50
    log_every: int = 1
    ray: bool = False
    tensorboard: bool = True  # when the tensorboard package is installed


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: list[TaskConfig] = field(default_factory=lambda: [TaskConfig("reverse")])
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RLConfig":
        return _build(cls, d, "")

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RLConfig":
        import yaml

        p = Path(path)
        if not p.is_file():
            raise RLConfigError(f"glm5 rl config: {p} is not a file")
        d = yaml.safe_load(p.read_text()) or {}
        if not isinstance(d, dict):
            raise RLConfigError(f"glm5 rl config: {p} expected a mapping at the top level, got "
                                f"{type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CHOICES = {
    "rollout.transport": ("inprocess", "http"),
    "trainer.optimizer": ("muon", "adamw"),
    "trainer.lr_schedule": ("constant", "cosine"),
    "trainer.ratio_base": ("trainer", "rollout"),
    "sync.stale_policy": ("drop", "downweight"),
    "sync.mode": ("xor", "sub"),
    "sync.publish": ("shards", "gathered"),
    "pool.backend": ("memory", "sqlite", "redis"),
    "pool.sample_mode": ("proportional", "greedy"),
    "run.mode": ("async", "sync"),
    "model.dtype": ("float32", "float64", "bfloat16"),
}
_OPTIONAL = ("rollout.max_tokens",)  # None: a default resolved when the run starts
_POSITIVE = ("rollout.num_workers", "rollout.group_size", "rollout.groups_per_step",
             "rollout.max_tokens", "rollout.max_num_seqs", "rollout.in_flight_groups",
             "trainer.micro_batch_size", "trainer.ppo_epochs", "trainer.nproc", "sync.interval",
             "pool.memory_capacity", "pool.decay_period_s", "sampler.window",
             "run.steps", "rollout.temperature", "trainer.tis_cap", "pool.min_task_types",
             "rollout.max_turns", "rollout.max_episode_tokens", "rollout.max_prompt_tokens",
             "rollout.episode_timeout_s", "rollout.env_threads", "warm_start.steps",
             "warm_start.lr", "warm_start.batch_size")
_NONNEG = ("trainer.lr", "trainer.muon_lr", "trainer.weight_decay", "trainer.grad_clip",
           "trainer.kl_coef", "trainer.clip_high", "trainer.min_lr_ratio", "sync.max_staleness", "pool.priority_eps",
           "sampler.floor", "run.checkpoint_every", "trainer.distill.weight",
           "trainer.distill.refresh_every", "warm_start.demos")


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _validate(c: RLConfig) -> None:
    for key, allowed in _CHOICES.items():
        v = _get(c, key)
        if v not in allowed:
            raise RLConfigError(f"glm5 rl config: {key} expected one of {list(allowed)}, got "
                                f"{v!r}")
    for key in _POSITIVE:
        if key in _OPTIONAL and _get(c, key) is None:
            continue
        if not _get(c, key) > 0:
            raise RLConfigError(f"glm5 rl config: {key} expected a value > 0, got {_get(c, key)}")
    for key in _NONNEG:
        if not _get(c, key) >= 0:
            raise RLConfigError(f"glm5 rl config: {key} expected a value >= 0, got "
                                f"{_get(c, key)}")
    if not 0.0 <= c.trainer.clip_low < 1.0:
        raise RLConfigError(f"glm5 rl config: trainer.clip_low expected a value in [0, 1), got "
                            f"{c.trainer.clip_low}")
    if not 0.0 <= c.pool.decay < 1.0:
        raise RLConfigError(f"glm5 rl config: pool.decay expected a value in [0, 1), got "
                            f"{c.pool.decay}")
    if not 0.0 < c.rollout.top_p <= 1.0:
        raise RLConfigError(f"glm5 rl config: rollout.top_p expected a value in (0, 1], got "
                            f"{c.rollout.top_p}")
    if c.trainer.distill.temperature <= 0:
        raise RLConfigError(f"glm5 rl config: trainer.distill.temperature expected a value > 0, "
                            f"got {c.trainer.distill.temperature}")
    if not c.tasks:
        raise RLConfigError("glm5 rl config: tasks expected at least one task")
    for i, t in enumerate(c.tasks):
        if not t.weight > 0:
            raise RLConfigError(f"glm5 rl config: tasks[{i}].weight expected a value > 0, got "
                                f"{t.weight}")
    if c.trainer.std_normalize and c.rollout.group_size < 2:
        raise RLConfigError("glm5 rl config: rollout.group_size expected >= 2 with "
                            "trainer.std_normalize (GRPO needs a group)")
    if c.sampler.floor * len(c.tasks) > 1.0:
        raise RLConfigError(f"glm5 rl config: sampler.floor expected at most 1 / {len(c.tasks)} "
                            f"tasks, got {c.sampler.floor}")
    batch = c.rollout.groups_per_step * c.rollout.group_size
    if c.pool.backend == "memory" and c.pool.memory_capacity < 2 * batch:
        raise RLConfigError(f"glm5 rl config: pool.memory_capacity expected at least two "
                            f"batches ({2 * batch} trajectories) with pool.backend: memory, got "
                            f"{c.pool.memory_capacity}")
    if c.rollout.transport == "http" and len(c.rollout.urls) < c.rollout.num_workers:
        raise RLConfigError(f"glm5 rl config: rollout.urls expected one engine server URL per "
                            f"worker (rollout.num_workers = {c.rollout.num_workers}) with "
                            f"rollout.transport: http, got {len(c.rollout.urls)}")
    if c.model.path is not None and c.model.overrides:
        raise RLConfigError("glm5 rl config: model.overrides apply to a preset; a checkpoint "
                            "(model.path) keeps its own config.json")
    known = {f.name for f in dataclasses.fields(GLM5Config)}
    bad = sorted(set(c.model.overrides) - known)
    if bad:
        raise RLConfigError(f"glm5 rl config: unknown key model.overrides.{bad[0]}; overrides "
                            f"take GLM5Config fields (e.g. vocab_size, num_hidden_layers, "
                            f"index_topk)")
    if not c.reward.components:
        raise RLConfigError("glm5 rl config: reward.components expected at least one component")
    if err := text_component_error(c.reward.components, [t.name for t in c.tasks]):
        raise RLConfigError(f"glm5 rl config: {err}")
    if c.rollout.max_observation_tokens < 8:
        raise RLConfigError(f"glm5 rl config: rollout.max_observation_tokens expected a value "
                            f">= 8, got {c.rollout.max_observation_tokens}")
    envs = [t.name for t in c.tasks if is_env_task(t.name)]
    if c.warm_start.demos and not envs:
        raise RLConfigError("glm5 rl config: warm_start.demos expected 0 without environment "
                            "tasks (demonstrations come from environments)")
    if envs:
        if c.model.tokenizer is None and c.model.path is None:
            raise RLConfigError(f"glm5 rl config: model.tokenizer is required with environment "
                                f"tasks ({envs[0]!r} is one): a tokenizer directory or 'toy'")
        if c.rollout.transport == "http":
            raise RLConfigError(f"glm5 rl config: environment tasks ({envs[0]!r}) run on "
                                f"in-process or Ray rollout workers; rollout.transport: http "
                                f"serves single-turn tasks only")
        turn = c.rollout.max_tokens or DEFAULT_MAX_TOKENS
        if turn >= c.rollout.max_episode_tokens:
            raise RLConfigError(f"glm5 rl config: rollout.max_tokens (one turn) expected less "
                                f"than rollout.max_episode_tokens, got {turn} >= "
                                f"{c.rollout.max_episode_tokens}")


# Stale-data warnings (`sync_warnings`, and the loop's own measured one): the numbers quoted
# are docs/rl.md's "Sync interval and staleness" runs (digit sort, 150 / 40 steps).
DROP_WARN_FRACTION = 0.5  # the loop warns when more than this share of a window is dropped
DROP_WARN_WINDOW = 10  # trainer steps


def sync_warnings(c: RLConfig) -> list[str]:
    """What the sync settings cost in data or freshness, said before the run starts (empty for
    the defaults): sync.interval > 1 makes rollouts sample from weights up to interval - 1
    updates behind the trainer; sync.max_staleness 0 in async mode drops every trajectory
    that waited for a push in the pool."""
    out = []
    sc = c.sync
    if sc.interval > 1:
        out.append(f"sync.interval {sc.interval}: rollouts sample from weights up to "
                   f"{sc.interval - 1} trainer updates old (on the digit sort task, reward 0.15 "
                   f"at interval 50 against 0.27 at interval 1 after 150 sync steps); keep 1 "
                   f"unless a weight push is expensive")
    if c.run.mode == "async" and sc.stale_policy == "drop" and sc.max_staleness == 0:
        out.append("sync.max_staleness 0 in async mode with stale_policy drop: a trajectory "
                   "that waits in the pool across a weight push is dropped (2/3 of the "
                   "trajectories on the digit sort task at sync.interval 1); 2 kept 4/5")
    return out


def _build(cls: type, d: Any, where: str) -> Any:
    if isinstance(d, cls):
        return d
    if not isinstance(d, dict):
        raise RLConfigError(f"glm5 rl config: {where or 'the config'} expected a mapping, got "
                            f"{type(d).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise RLConfigError(f"glm5 rl config: unknown key {where}{unknown[0]}; "
                            f"{where.rstrip('.') or 'the top level'} takes {sorted(fields)}")
    kw = {}
    for name, value in d.items():
        kw[name] = _convert(hints[name], value, f"{where}{name}")
    missing = [n for n, f in fields.items() if n not in kw and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise RLConfigError(f"glm5 rl config: {where}{missing[0]} is required")
    return cls(**kw)


def _convert(tp: Any, v: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, v, where + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], v, where)
    if origin is list:
        if not isinstance(v, list):
            raise RLConfigError(f"glm5 rl config: {where} expected a list, got "
                                f"{type(v).__name__}")
        (a,) = typing.get_args(tp)
        return [_convert(a, x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(v, (list, tuple)) or len(v) != len(args):
            raise RLConfigError(f"glm5 rl config: {where} expected {len(args)} values, got {v!r}")
        return tuple(_convert(a, x, where) for a, x in zip(args, v))
    if origin is dict:
        if not isinstance(v, dict):
            raise RLConfigError(f"glm5 rl config: {where} expected a mapping, got "
                                f"{type(v).__name__}")
        _, vt = typing.get_args(tp)
        return {str(k): (x if vt is Any else _convert(vt, x, f"{where}.{k}"))
                for k, x in v.items()}
    if tp is Any:
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise RLConfigError(f"glm5 rl config: {where} expected true or false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise RLConfigError(f"glm5 rl config: {where} expected an integer, got {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RLConfigError(f"glm5 rl config: {where} expected a number, got {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise RLConfigError(f"glm5 rl config: {where} expected a string, got {v!r}")
        return v
    raise RLConfigError(f"glm5 rl config: {where}: unsupported type {tp}")  # pragma: no cover
