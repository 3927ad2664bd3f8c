"""The environment protocol of agentic RL: reset -> observation; step(action) -> observation,
reward, done, info; a registry of environment types; episodes recorded step by step and
checkpointed every `CHECKPOINT_EVERY` steps so a long episode resumes after a crash.

An environment's whole state is `state_dict()` (JSON values), so an episode checkpoint is the
environment's state plus the steps so far. A crashed or timed-out episode is recorded with its
reason, and no earlier step is lost.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

CHECKPOINT_EVERY = 5  # the seed: long tasks checkpoint every 5 steps


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    """An environment type. ``reset`` starts an episode (its task drawn from ``seed``) and
    returns the first observation; ``step`` takes the agent's action (text: an answer, a tool
    call, a command) and returns a `StepResult`. ``state_dict`` / ``load_state_dict``: the
    episode's whole state as JSON values.

    ``demonstration`` is optional (every built-in type has it; check with ``hasattr``): expert
    turns, used for warm starts and golden tests — after ``reset(seed)``, the assistant turns
    (text as a model emits it: GLM-5 tool-call markup or the plain final answer, no role or
    stop tokens) that solve the episode when fed to ``step`` in order, worked out from the
    episode's state.

    ``observation_role`` (optional, default "user"): how a multi-turn rollout renders what
    ``step`` returns in the chat format — "tool" (a tool result after ``<|observation|>``) or
    "user" (a user message)."""

    name: str

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def demonstration(self) -> list[str]:
        """Optional: the expert turns that solve the episode just reset (see above)."""
        ...


ENVS: dict[str, Callable[..., Env]] = {}
# built-in environment types, registered when their module is first imported
_BUILTIN = {"countdown": "glm5.rl.envs.countdown", "search": "glm5.rl.envs.search",
            "codefix": "glm5.rl.envs.workspace", "terminal": "glm5.rl.envs.workspace",
            "data": "glm5.rl.envs.data"}


def register_env(name: str, factory: Callable[..., Env]) -> None:
    """Make ``name`` available to `make_env` (``factory(**params)`` builds one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"glm5 register_env: name expected a non-empty string, got {name!r}")
    if name in ENVS:
        raise ValueError(f"glm5 register_env: environment type {name!r} is already registered")
    ENVS[name] = factory


ENTRY_POINT_GROUP = "glm5.rl_envs"  # a package's environments: name = "module:factory"


def _entry_point(name: str) -> Any:
    from importlib.metadata import entry_points

    return next((ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name), None)


def env_known(name: str) -> bool:
    """Whether ``name`` is an environment type: registered, built in, or declared by an
    installed package under the ``glm5.rl_envs`` entry-point group."""
    return name in ENVS or name in _BUILTIN or _entry_point(name) is not None


def make_env(name: str, **params: Any) -> Env:
    """A new environment of type ``name`` (see `env_known`), built with ``params``."""
    if name not in ENVS and name in _BUILTIN:
        import importlib

        importlib.import_module(_BUILTIN[name])
    if name not in ENVS and (ep := _entry_point(name)) is not None:
        try:
            factory = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plugin names itself
            raise ValueError(f"glm5 make_env: environment type {name!r} ({ENTRY_POINT_GROUP} "
                             f"entry point {ep.value!r}) failed to load: "
                             f"{type(e).__name__}: {e}") from e
        if name not in ENVS:  # loading its module may have registered it already
            register_env(name, factory)
    try:
        factory = ENVS[name]
    except KeyError:
        raise ValueError(f"glm5 make_env: unknown environment type {name!r}; registered: "
                         f"{sorted(set(ENVS) | set(_BUILTIN))}") from None
    try:
        return factory(**params)
    except TypeError as e:
        raise ValueError(f"glm5 make_env({name!r}): bad params {params!r}: {e}") from None


@dataclass
class EpisodeStep:
    action: str
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]
    seconds: float


@dataclass
class Episode:
    """What an episode did: its steps, total reward, and how it ended ("done", "max_steps",
    "error: ...", "timeout")."""

    env: str
    seed: int
    first_observation: str
    steps: list[EpisodeStep] = field(default_factory=list)
    ended: str | None = None

    @property
    def total_reward(self) -> float:
        return sum(s.reward for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        return cls(d["env"], d["seed"], d["first_observation"],
                   [EpisodeStep(**s) for s in d["steps"]], d["ended"])


class EpisodeRunner:
    """Runs an episode of ``env`` step by step, checkpointing every `CHECKPOINT_EVERY` steps
    (and at the end) to ``checkpoint`` (a JSON file, written atomically). ``resume()`` continues
    an episode from its checkpoint: the environment's state and the steps so far."""

    def __init__(self, env: Env, checkpoint: str | Path, max_steps: int = 50,
                 every: int = CHECKPOINT_EVERY) -> None:
        if max_steps < 1 or every < 1:
            raise ValueError(f"glm5 EpisodeRunner: max_steps and every expected >= 1, got "
                             f"{max_steps}, {every}")
        self.env, self.path, self.max_steps, self.every = env, Path(checkpoint), max_steps, every
        self.episode: Episode | None = None

    def reset(self, seed: int) -> str:
        obs = self.env.reset(seed)
        self.episode = Episode(self.env.name, seed, obs)
        self._save()
        return obs

    def resume(self) -> Episode:
        """Load the checkpoint; the environment continues from the last saved step."""
        if not self.path.is_file():
            raise FileNotFoundError(f"glm5 EpisodeRunner.resume: no checkpoint at {self.path}")
        d = json.loads(self.path.read_text())
        self.episode = Episode.from_dict(d["episode"])
        self.env.load_state_dict(d["env"])
        return self.episode

    @property
    def observation(self) -> str:
        ep = self._episode("observation")
        return ep.steps[-1].observation if ep.steps else ep.first_observation

    def step(self, action: str) -> StepResult:
        ep = self._episode("step")
        if ep.ended is not None:
            raise RuntimeError(f"glm5 EpisodeRunner.step: the episode has ended ({ep.ended})")
        t0 = time.perf_counter()
        try:
            r = self.env.step(action)
        except Exception as e:  # noqa: BLE001 - the episode records it and keeps its steps
            ep.ended = f"error: {type(e).__name__}: {e}"
            self._save()
            raise
        ep.steps.append(EpisodeStep(action, r.observation, float(r.reward), bool(r.done),
                                    dict(r.info), time.perf_counter() - t0))
        if r.done:
            ep.ended = "done"
        elif len(ep.steps) >= self.max_steps:
            ep.ended = "max_steps"
        if ep.ended is not None or len(ep.steps) % self.every == 0:
            self._save()
        return r

    def end(self, reason: str) -> Episode:
        """End the episode from outside (a timeout, the agent crashed) and record why."""
        ep = self._episode("end")
        if ep.ended is None:
            ep.ended = reason
        self._save()
        return ep

    def _episode(self, fn: str) -> Episode:
        if self.episode is None:
            raise RuntimeError(f"glm5 EpisodeRunner.{fn}: call reset() or resume() first")
        return self.episode

    def _save(self) -> None:
        ep = self._episode("save")
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps({"episode": ep.to_dict(), "env": self.env.state_dict()}))
        os.replace(tmp, self.path)
