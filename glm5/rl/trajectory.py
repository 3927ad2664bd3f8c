"""One sampled completion as the RL loop keeps it: token in, token out.

The exact token ids the rollout engine sampled, the engine's logprob of each and the weight
version that produced each are kept; nothing is re-tokenized. A trajectory is JSON-serialisable
(`to_dict` / `from_dict`) so the SQLite and Redis pool tiers, Ray and HTTP carry it unchanged.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Trajectory:
    """A completion of one prompt of a GRPO group.

    prompt_ids / completion_ids: token ids as sampled (the completion includes a final stop
    token when the engine stopped on one). logprobs[i]: the rollout engine's log-probability of
    completion_ids[i] (log_softmax(logits / temperature)); versions[i]: the weight version the
    engine held when it sampled completion_ids[i]. reward / advantage are filled when the
    group is complete (advantage by `grpo_advantages` over the group).

    mask: in a multi-turn episode the completion interleaves the policy's turns with what the
    environment inserted (tool results, feedback, the next turn's role tokens); mask[i] is 1
    where the policy sampled completion_ids[i] (trained on) and 0 where the environment wrote
    it (context only; its logprob is 0.0 and its version the previous token's). Empty: every
    token was sampled (a single-turn completion).
    """

    traj_id: str
    group_id: str
    task_type: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    advantage: float = 0.0
    finish_reason: str = "stop"
    temperature: float = 1.0
    created: float = field(default_factory=time.time)  # wall clock (seconds since the epoch)
    meta: dict[str, Any] = field(default_factory=dict)  # the task instance (JSON values)
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; empty: all

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"glm5 rl Trajectory {self.traj_id!r}: completion_ids, logprobs and versions "
                f"expected the same length, got {n}, {len(self.logprobs)}, {len(self.versions)}")
        if self.mask and (len(self.mask) != n or any(m not in (0, 1) for m in self.mask)):
            raise ValueError(
                f"glm5 rl Trajectory {self.traj_id!r}: mask expected {n} values of 0 or 1 (or "
                f"none), got {len(self.mask)} values {sorted(set(self.mask))}")
        if not self.prompt_ids:
            raise ValueError(f"glm5 rl Trajectory {self.traj_id!r}: prompt_ids is empty")
        if not math.isfinite(self.reward) or not math.isfinite(self.advantage):
            raise ValueError(f"glm5 rl Trajectory {self.traj_id!r}: reward and advantage "
                             f"expected finite numbers, got {self.reward}, {self.advantage}")

    @property
    def sampled(self) -> list[int]:
        """Positions in completion_ids of the tokens the policy sampled (those trained on)."""
        return [i for i, m in enumerate(self.mask) if m] if self.mask else \
            list(range(len(self.completion_ids)))

    @property
    def min_version(self) -> int:
        """The oldest weight version that sampled a token (the prompt's version when none)."""
        vs = [self.versions[i] for i in self.sampled]
        return min(vs) if vs else int(self.meta.get("version", 0))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        return cls(**d)
