"""Environments as RL tasks: multi-turn episodes rolled out on the serving engine.

`EnvTask` makes an environment type of `glm5.rl.envs` a task of the RL loop: its prompt is the
episode's first observation in the chat format (`glm5.rl.envs.dialogue`), and its score is the
episode's reward. A rollout worker plays each member of an environment group as an episode
(`EpisodePlayer`): the engine samples a turn, the environment acts on it (in a thread pool, so
tool calls and sandboxed commands never stall the engine's other requests), its answer is
appended as context tokens (mask 0) and the next turn is sampled after it — one trajectory per
episode, token in, token out. An episode ends when the environment says done, after
``max_turns`` turns, when its tokens reach ``max_episode_tokens``, after
``episode_timeout_s``, or when the environment raises (recorded with the reason; the turns
before are kept). Each episode is checkpointed every 5 steps by `EpisodeRunner`.

An environment task has text: the trajectory's ``meta["episode"]`` keeps the environment's
answer to each turn as the policy was shown it (``observations``, cut to
``max_observation_tokens``, and their ``observation_role``), and `EnvTask.transcript` rebuilds
the conversation from them and the sampled turns for the reward (`glm5.rl.reward`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from glm5.engine.engine import RequestRejected
from glm5.rl.config import model_config
from glm5.rl.envs.base import EpisodeRunner, make_env
from glm5.rl.envs.dialogue import Dialogue, toy_tokenizer
from glm5.rl.tasks import TaskInstance, is_env_task
from glm5.rl.trajectory import Trajectory
from glm5.text.tokenizer import Tokenizer

SUCCESS = 1.0 - 1e-9  # an episode whose total reward reaches 1 succeeded ("exact")


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run (see the module docstring)."""

    max_turns: int = 8
    max_episode_tokens: int = 512
    max_prompt_tokens: int = 1024
    episode_timeout_s: float = 300.0
    env_threads: int = 4
    declare_tools: bool = True  # the tools in the first prompt's system part


class EnvTask:
    """An environment type as a task: ``sample`` draws an episode seed and renders the first
    observation (the environment is reset once to see it, then closed); ``score`` reads the
    episode's result the rollout worker put in the trajectory's meta: "correctness" (the
    total reward, clipped to [0, 1]), "exact" (1 when it reached 1) and "format" (the share of
    turns the environment accepted without an error); ``transcript`` gives the episode's turns
    as text (`glm5.rl.tasks.Task`)."""

    def __init__(self, name: str, params: dict[str, Any] | None, dialogue: Any,
                 limits: EpisodeLimits = EpisodeLimits()) -> None:
        self.name, self.params = name, dict(params or {})
        self.dialogue, self.limits = dialogue, limits
        env = make_env(name, **self.params)  # bad params fail here, naming the env
        close_env(env)
        self.stop_token_ids = list(dialogue.stop_token_ids)

    def sample(self, rng: random.Random) -> TaskInstance:
        seed = rng.randrange(2**31)
        env = make_env(self.name, **self.params)
        try:
            obs = env.reset(seed)
            prompt = self.dialogue.prompt_ids(obs, declared_tools(env, self.limits))
        finally:
            close_env(env)
        if len(prompt) > self.limits.max_prompt_tokens:
            raise ValueError(f"glm5 rl env task {self.name!r}: the first prompt has "
                             f"{len(prompt)} tokens, over rollout.max_prompt_tokens = "
                             f"{self.limits.max_prompt_tokens}")
        return TaskInstance(self.name, prompt, {"env": self.name, "env_seed": seed,
                                                "env_params": self.params})

    def score(self, meta: dict[str, Any], completion_ids: Sequence[int]) -> dict[str, float]:
        ep = meta.get("episode")
        if ep is None:
            raise ValueError(f"glm5 rl env task {self.name!r}: the trajectory has no episode "
                             f"result (meta['episode']); was it rolled out by a worker without "
                             f"environments?")
        total = sum(ep["rewards"])
        turns = max(ep["turns"], 1)
        return {"correctness": min(max(total, 0.0), 1.0), "exact": float(total >= SUCCESS),
                "format": 1.0 - ep["errors"] / turns}

    def transcript(self, meta: dict[str, Any], completion_ids: Sequence[int],
                   mask: Sequence[int]) -> list[dict[str, Any]]:
        """The episode's turns after the first prompt: each sampled turn (a run of mask 1) as
        an "assistant" turn (`Dialogue.turn_text`), each followed by the environment's answer
        to it (meta["episode"]["observations"], role "tool" or "user"); the answer to the last
        turn is included though the policy never saw it. The environment's tokens between
        turns (its answer rendered in the chat template) are not decoded: the answers are
        taken as the environment gave them, cut as the policy saw them."""
        ep = meta.get("episode")
        if ep is None:
            raise ValueError(f"glm5 rl EnvTask.transcript ({self.name!r}): meta expected an "
                             f"episode result (meta['episode']), got keys {sorted(meta)}")
        if mask and len(mask) != len(completion_ids):
            raise ValueError(f"glm5 rl EnvTask.transcript ({self.name!r}): mask expected "
                             f"{len(completion_ids)} values (or none), got {len(mask)}")
        runs: list[list[int]] = []
        prev = 0
        for tok, m in zip(completion_ids, mask or [1] * len(completion_ids)):
            if m:
                if not prev:
                    runs.append([])
                runs[-1].append(tok)
            prev = m
        obs = ep.get("observations", [])  # absent in trajectories from before it was kept
        role = ep.get("observation_role", "user")
        turns: list[dict[str, Any]] = []
        for i in range(max(len(runs), len(obs))):
            if i < len(runs):
                turns.append({"role": "assistant", "text": self.dialogue.turn_text(runs[i])})
            if i < len(obs):
                turns.append({"role": role, "text": obs[i]})
        return turns


def declared_tools(env: Any, limits: EpisodeLimits) -> list[dict[str, Any]] | None:
    """The tool specs the first prompt declares: the environment's ``tool_specs()``, None
    without them or with ``limits.declare_tools`` off."""
    specs = getattr(env, "tool_specs", None)
    return specs() if callable(specs) and limits.declare_tools else None


def _observation_role(env: Any) -> str:
    return getattr(env, "observation_role", "user")


def close_env(env: Any) -> None:
    """Close an environment that has a ``close()``."""
    close = getattr(env, "close", None)
    if callable(close):
        close()


@dataclass
class _Episode:
    """One member of an environment group being played."""

    group: Any  # PromptGroup
    member: int
    env: Any
    runner: Any  # EpisodeRunner
    started: float
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn: int = 0
    turn_len: int = 0  # sampled ids of the current turn
    errors: int = 0
    tool_calls: int = 0
    observations: list[str] = field(default_factory=list)  # as the policy is shown them
    future: cf.Future | None = None

    @property
    def traj_id(self) -> str:
        return self.group.traj_id(self.member)


class EpisodePlayer:
    """Plays environment-group members on an engine for a `RolloutWorker` (which owns the
    engine and routes the outputs of the requests it does not own here)."""

    def __init__(self, engine: Any, dialogue: Any, limits: EpisodeLimits = EpisodeLimits(),
                 checkpoint_dir: str | Path | None = None) -> None:
        self.engine, self.dialogue, self.limits = engine, dialogue, limits
        self._tmp = None
        if checkpoint_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="glm5-episodes-")
            checkpoint_dir = self._tmp.name
        self.dir = Path(checkpoint_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._pool = cf.ThreadPoolExecutor(max_workers=limits.env_threads,
                                           thread_name_prefix="glm5-env")
        self.episodes: dict[str, _Episode] = {}  # traj id -> episode
        self._requests: dict[str, str] = {}  # engine request id -> traj id
        self.failed: list[tuple[Any, int, str]] = []  # (group, member, error): re-queue
        self.env_seconds = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self, group: Any, member: int) -> None:
        meta = group.meta
        env = make_env(meta["env"], **meta.get("env_params", {}))
        runner = EpisodeRunner(env, self.dir / (group.traj_id(member).replace("/", "_") +
                                                ".json"),
                               max_steps=self.limits.max_turns)
        try:
            obs = runner.reset(int(meta["env_seed"]))
            prompt = self.dialogue.prompt_ids(obs, declared_tools(env, self.limits))
        except Exception:
            close_env(env)
            raise
        if prompt != list(group.prompt_ids):
            close_env(env)
            raise ValueError(f"glm5 rl: environment {meta['env']!r} gave a different first "
                             f"observation for seed {meta['env_seed']} on this worker than when "
                             f"the prompt was made; an environment must be deterministic in "
                             f"its seed")
        ep = _Episode(group, member, env, runner, time.monotonic())
        self.episodes[ep.traj_id] = ep
        self._next_turn(ep)

    def owns(self, request_id: str) -> bool:
        return request_id in self._requests

    def num_open(self) -> int:
        return len(self.episodes)

    def open_members(self) -> list[tuple[Any, int]]:
        return [(ep.group, ep.member) for ep in self.episodes.values()]

    def on_output(self, o: Any) -> list[Any]:
        """A finished engine output of a turn: hand the turn to the environment."""
        tid = self._requests.pop(o.request_id)
        ep = self.episodes[tid]
        if o.finish_reason not in ("stop", "length"):
            self._drop(ep)
            self.failed.append((ep.group, ep.member, o.error or o.finish_reason or "failed"))
            return []
        ep.ids += o.token_ids
        ep.mask += [1] * len(o.token_ids)
        ep.logprobs += [lp.logprob for lp in (o.logprobs or [])]
        ep.versions += list(o.token_versions)
        ep.turn += 1
        ep.turn_len = len(o.token_ids)
        action, _ = self.dialogue.action(o.token_ids)
        ep.future = self._pool.submit(self._env_step, ep, action)
        return []

    def _env_step(self, ep: _Episode, action: str) -> Any:
        t = time.perf_counter()
        try:
            return ep.runner.step(action)
        finally:
            self.env_seconds += time.perf_counter() - t

    def poll(self, wait: bool) -> list[Any]:
        """Finished episodes as trajectories; environment steps that completed start the next
        turn. ``wait``: block briefly for an environment step when nothing else can run."""
        pending = [ep.future for ep in self.episodes.values() if ep.future is not None]
        if wait and pending:
            cf.wait(pending, timeout=0.05, return_when=cf.FIRST_COMPLETED)
        out = []
        for ep in list(self.episodes.values()):
            f = ep.future
            if f is None or not f.done():
                continue
            ep.future = None
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001 - the runner recorded it; the episode ends
                out.append(self._finish(ep, f"error: {type(e).__name__}: {e}"))
                continue
            if "error" in r.info:
                ep.errors += 1
            ep.tool_calls += len(r.info.get("tool_calls", ()))
            ep.observations.append(self.dialogue.cut(r.observation))
            reason = self._ended(ep, r)
            if reason is None:
                obs = self.dialogue.observation_ids(
                    r.observation, _observation_role(ep.env), ep.ids[-1] if ep.ids else None)
                if len(ep.ids) + len(obs) >= self.limits.max_episode_tokens:
                    reason = "length"
                else:
                    self._append_context(ep, obs)
                    reason = self._next_turn(ep)
            if reason is not None:
                out.append(self._finish(ep, reason))
        return out

    def _ended(self, ep: _Episode, r: Any) -> str | None:
        if r.done:
            return "done"
        if ep.runner.episode.ended is not None:  # the runner's own step limit
            return ep.runner.episode.ended
        if time.monotonic() - ep.started > self.limits.episode_timeout_s:
            return "timeout"
        return None

    def _append_context(self, ep: _Episode, ids: list[int]) -> None:
        v = ep.versions[-1] if ep.versions else 0
        ep.ids += ids
        ep.mask += [0] * len(ids)
        ep.logprobs += [0.0] * len(ids)
        ep.versions += [v] * len(ids)

    def _next_turn(self, ep: _Episode) -> str | None:
        """Queue the episode's next turn; the reason it cannot run, if any."""
        left = self.limits.max_episode_tokens - len(ep.ids)
        if left < 1:
            return "length"
        params = ep.group.params(ep.member)
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, left),
                                     seed=params.seed + ep.turn)
        rid = f"{ep.traj_id}#{ep.turn}"
        try:
            self.engine.add_request(rid, list(ep.group.prompt_ids) + ep.ids, params)
        except RequestRejected as e:
            return f"length: {e}"
        self._requests[rid] = ep.traj_id
        return None

    def _finish(self, ep: _Episode, reason: str) -> Any:
        episode = ep.runner.end(reason)
        self._drop(ep)
        rewards = [s.reward for s in episode.steps]
        meta = {**ep.group.meta, "episode": {
            "rewards": rewards, "ended": episode.ended, "turns": ep.turn, "errors": ep.errors,
            "tool_calls": ep.tool_calls,
            "env_seconds": round(sum(s.seconds for s in episode.steps), 6),
            "observations": ep.observations,
            "observation_role": _observation_role(ep.env)}}
        g = ep.group
        return Trajectory(traj_id=ep.traj_id, group_id=g.group_id, task_type=g.task_type,
                          prompt_ids=list(g.prompt_ids), completion_ids=ep.ids,
                          logprobs=ep.logprobs, versions=ep.versions,
                          finish_reason="stop" if reason == "done" else reason.split(":")[0],
                          temperature=g.temperature, meta=meta, mask=ep.mask)

    def _drop(self, ep: _Episode) -> None:
        self.episodes.pop(ep.traj_id, None)
        for rid in [r for r, t in self._requests.items() if t == ep.traj_id]:
            del self._requests[rid]
            self.engine.abort(rid)
        close_env(ep.env)
        try:
            ep.runner.path.unlink()
        except OSError:
            pass

    def abort_all(self) -> list[tuple[Any, int]]:
        """Stop every episode (their members are returned to re-queue)."""
        members = self.open_members()
        for ep in list(self.episodes.values()):
            if ep.future is not None:
                ep.future.cancel()
                try:
                    ep.future.result(timeout=60)
                except BaseException:  # noqa: BLE001 - cancelled or failed: dropped anyway
                    pass
            self._drop(ep)
        return members

    def close(self) -> None:
        self.abort_all()
        self._pool.shutdown(wait=True)
        if self._tmp is not None:
            self._tmp.cleanup()


# ---------------------------------------------------------------------- from the config
def env_task_names(cfg: Any) -> list[str]:
    """The environment tasks of an RLConfig."""
    return [t.name for t in cfg.tasks if is_env_task(t.name)]


def episode_limits(cfg: Any) -> EpisodeLimits:
    rc = cfg.rollout
    return EpisodeLimits(max_turns=rc.max_turns, max_episode_tokens=rc.max_episode_tokens,
                         max_prompt_tokens=rc.max_prompt_tokens,
                         episode_timeout_s=rc.episode_timeout_s, env_threads=rc.env_threads,
                         declare_tools=rc.declare_tools)


def resolve_tokenizer(cfg: Any, out_dir: str | Path) -> None:
    """Make ``cfg.model.tokenizer`` a directory every service can load: "toy" is trained once
    into ``out_dir/tokenizer`` (kept across resumes) for the run's environment tasks."""
    mc = cfg.model
    if mc.tokenizer != "toy":
        return
    path = (Path(out_dir) / "tokenizer").resolve()  # absolute: Ray actors have their own cwd
    if not (path / "tokenizer.json").is_file():
        toy_tokenizer(path, model_config(mc).vocab_size, env_task_names(cfg))
    mc.tokenizer = str(path)


def load_dialogue(cfg: Any) -> Any:
    """The `Dialogue` of a config's environment tasks (its tokenizer must fit the model)."""
    mc = cfg.model
    where = mc.tokenizer or mc.path
    if where is None or where == "toy":
        raise ValueError("glm5 rl: model.tokenizer expected a tokenizer directory here (call "
                         "resolve_tokenizer first for 'toy')")
    tok = Tokenizer.from_dir(where)
    V = model_config(mc).vocab_size
    if tok.vocab_size > V:
        raise ValueError(f"glm5 rl: the tokenizer at {where} has {tok.vocab_size} tokens; the "
                         f"model's vocab_size is {V} (model.overrides.vocab_size must be at "
                         f"least the tokenizer's)")
    return Dialogue(tok, thinking=cfg.rollout.thinking,
                    max_observation_tokens=cfg.rollout.max_observation_tokens)
