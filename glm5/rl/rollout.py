"""Rollout workers: prompt groups in, finished trajectories out, over the serving engine.

Token in, token out: a trajectory keeps the exact ids the engine sampled, the engine's logprob
of each and the weights version of each (`RequestOutput.token_versions`). A worker is driven by
`step()`; weight updates are applied between steps. The in-process worker wraps an
`LLMEngine`; `glm5.rl.remote.HTTPWorkerService` speaks to `glm5 serve` with the same methods.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from glm5.engine.engine import LLMEngine
from glm5.engine.sampling import SamplingParams
from glm5.rl.trajectory import Trajectory
from glm5.rl.weight_sync import WeightReceiver, apply_to_engine


def member_seed(run_seed: int, group_id: str, member: int) -> int:
    """The sampling seed of one member of a group: the same on every worker and transport."""
    h = hashlib.sha256(f"{run_seed}/{group_id}/{member}".encode()).digest()
    return int.from_bytes(h[:7], "little")


@dataclass
class PromptGroup:
    """A prompt to complete ``size`` times (a GRPO group). ``pending`` lists the member indices
    still to produce (all of them at first; only the missing ones when re-queued)."""

    group_id: str
    task_type: str
    prompt_ids: list[int]
    size: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    pending: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = list(range(self.size))

    def traj_id(self, member: int) -> str:
        return f"{self.group_id}/{member}"

    def params(self, member: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              max_tokens=self.max_tokens, stop_token_ids=list(self.stop_token_ids),
                              logprobs=0, seed=member_seed(self.seed, self.group_id, member))

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PromptGroup":
        return cls(**d)


def trajectory_from_output(group: PromptGroup, member: int, token_ids: list[int],
                           logprobs: list[float], versions: list[int],
                           finish_reason: str) -> Trajectory:
    return Trajectory(
        traj_id=group.traj_id(member), group_id=group.group_id, task_type=group.task_type,
        prompt_ids=list(group.prompt_ids), completion_ids=list(token_ids),
        logprobs=list(logprobs), versions=list(versions), finish_reason=finish_reason,
        temperature=group.temperature, meta=dict(group.meta))


class RolloutError(RuntimeError):
    """A rollout request failed in the engine (the worker reports it; the group is re-queued)."""


class RolloutWorker:
    """Completes prompt groups on an in-process `LLMEngine`.

    `step()` returns the trajectories that finished in that engine step (each one as soon as it
    finishes, not per group) and `failed` collects (group, member, error) of requests the
    engine failed, for the orchestrator to re-queue."""

    def __init__(self, engine: LLMEngine, worker_id: str = "w0", receiver: Any = None,
                 episodes: Any = None) -> None:
        self.engine, self.worker_id = engine, worker_id
        self.receiver = receiver  # a glm5.rl.weight_sync.WeightReceiver over engine.model
        # a glm5.rl.episodes.EpisodePlayer over the same engine: plays environment groups
        self.episodes = episodes
        self._groups: dict[str, PromptGroup] = {}
        self._open: dict[str, tuple[str, int]] = {}  # request id -> (group id, member)
        self.failed: list[tuple[PromptGroup, int, str]] = []
        self.tokens_generated = 0

    @property
    def version(self) -> int:
        return self.engine.weights_version

    def submit(self, group: PromptGroup) -> None:
        busy = [m for m in group.pending if group.traj_id(m) in self._open]
        if busy:
            raise ValueError(f"glm5 rl RolloutWorker.submit: member {busy[0]} of group "
                             f"{group.group_id!r} is already in flight on worker "
                             f"{self.worker_id}")
        if "env" in group.meta:
            if self.episodes is None:
                raise ValueError(f"glm5 rl RolloutWorker.submit: group {group.group_id!r} is an "
                                 f"environment episode ({group.meta['env']!r}) and worker "
                                 f"{self.worker_id} has no episode player (no tokenizer)")
            for m in group.pending:
                try:
                    self.episodes.start(group, m)
                except Exception as e:  # noqa: BLE001 - reported; the orchestrator re-queues
                    self.failed.append((group, m, f"{type(e).__name__}: {e}"))
            return
        # a re-queued member may join the rest of its group still running here
        self._groups.setdefault(group.group_id, group)
        for m in group.pending:
            rid = group.traj_id(m)
            self.engine.add_request(rid, group.prompt_ids, group.params(m))
            self._open[rid] = (group.group_id, m)

    def num_open(self) -> int:
        """Requests (and environment episodes) submitted and not finished."""
        return len(self._open) + (self.episodes.num_open() if self.episodes else 0)

    def in_flight(self) -> list[PromptGroup]:
        """The groups with unfinished members, each with ``pending`` = those members."""
        out: dict[str, list[int]] = {}
        groups = dict(self._groups)
        for gid, m in self._open.values():
            out.setdefault(gid, []).append(m)
        for g, m in self.episodes.open_members() if self.episodes else ():
            groups[g.group_id] = g
            out.setdefault(g.group_id, []).append(m)
        return [PromptGroup(**{**groups[g].to_dict(), "pending": sorted(ms)})
                for g, ms in out.items()]

    def step(self) -> list[Trajectory]:
        done: list[Trajectory] = []
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        if self.episodes is not None:
            for o in outputs:
                if o.finished and self.episodes.owns(o.request_id):
                    self.episodes.on_output(o)
            # nothing for the engine to do: wait a moment for an environment step instead of
            # spinning
            finished = self.episodes.poll(wait=not self.engine.has_unfinished())
            for t in finished:
                self.tokens_generated += sum(t.mask)
            done += finished
            self.failed += self.episodes.failed
            self.episodes.failed = []
        for o in outputs:
            if not o.finished or o.request_id not in self._open:
                continue
            gid, m = self._open.pop(o.request_id)
            group = self._groups[gid]
            if o.finish_reason in ("stop", "length"):
                lps = [lp.logprob for lp in (o.logprobs or [])]
                done.append(trajectory_from_output(group, m, o.token_ids, lps,
                                                   o.token_versions, o.finish_reason))
                self.tokens_generated += len(o.token_ids)
            else:
                self.failed.append((group, m, o.error or o.finish_reason or "failed"))
            if not any(g == gid for g, _ in self._open.values()):
                del self._groups[gid]
        return done

    def apply_update(self, update: Any) -> int:
        """Apply a `WeightUpdate` between steps; returns the engine's new weights version."""
        if self.receiver is None:
            self.receiver = WeightReceiver(self.engine.model, self.engine.weights_version)
        return apply_to_engine(self.engine, self.receiver, update)

    def abort_all(self) -> list[PromptGroup]:
        """Abort every open request; returns the groups' unfinished members (to re-queue)."""
        groups = self.in_flight()
        for rid in list(self._open):
            self.engine.abort(rid)
        if self.episodes is not None:
            self.episodes.abort_all()
        self._open.clear()
        self._groups.clear()
        self.engine.step()  # frees the aborted requests' pages
        return groups
