"""The experience pool: completed trajectories wait here between the rollout workers and the
trainer, and leave by priority sampling.

Priority of a trajectory at time ``now`` (seconds since the epoch, like ``Trajectory.created``)::

    (|advantage| + priority_eps) * (1 - decay) ** ((now - created) / decay_period_s)

The time factor is the same for every trajectory at a given ``now`` up to ``created``, so the
ORDER of priorities never changes with time. Stores therefore keep a static key, the log of the
priority without the ``now`` term::

    key = log(|advantage| + priority_eps) + (created - origin) * rate,
    rate = -log(1 - decay) / decay_period_s

(``origin`` is a per-store constant, recorded with the store, that keeps keys small and
precise). The SQLite tier indexes it, the Redis tier scores its sorted sets by it; the decayed
value is computed only for reporting (`ExperiencePool.priority`, ``last_priorities``) and
proportional weights are ``exp(key - max key)`` (the same ratios, no underflow).

Tiers (``PoolConfig.backend``): ``memory`` (bounded; the lowest-priority items are evicted),
``sqlite`` (a memory tier of the most recent ``memory_capacity`` items over an SQLite file that
takes the overflow, oldest first; sampling draws from both), ``redis`` (everything in Redis,
shared by every pool on the same namespace; taking items is atomic across clients).
The tiers are stores (`glm5.rl.pool_store`: the protocol and the memory tier;
`glm5.rl.pool_sqlite`, `glm5.rl.pool_redis`); this module is the pool over them: the keys,
sampling, eviction at capacity and the spill from memory to SQLite.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from glm5.rl.config import PoolConfig
from glm5.rl.pool_redis import RedisStore
from glm5.rl.pool_sqlite import SQLiteStore
from glm5.rl.pool_store import DuplicateTrajectoryError, MemoryStore, Store, repeated_ids
from glm5.rl.trajectory import Trajectory

__all__ = ["DuplicateTrajectoryError", "ExperiencePool", "MemoryStore", "PriorityKey",
           "RedisStore", "SQLiteStore", "Store"]

# log(0) has no value; a zero priority (advantage 0 with priority_eps 0) gets a finite key that
# SQLite and Redis scores can hold, below the log of every positive float (subnormals included).
_LOG_ZERO = math.log(math.ulp(0.0)) - 1.0
_STATE_FORMAT = "glm5.rl.pool/1"
_MAX_ATTEMPTS = 200  # sample retries when other Redis clients keep taking the chosen items


@dataclass(frozen=True)
class PriorityKey:
    """The priority function and its time-invariant storage key (see the module docstring)."""

    decay: float
    decay_period_s: float
    priority_eps: float
    origin: float

    @property
    def rate(self) -> float:
        return -math.log1p(-self.decay) / self.decay_period_s

    def key(self, traj: Trajectory) -> float:
        base = abs(traj.advantage) + self.priority_eps
        return (math.log(base) if base > 0 else _LOG_ZERO) + (traj.created - self.origin) * self.rate

    def priority(self, traj: Trajectory, now: float) -> float:
        age_periods = (now - traj.created) / self.decay_period_s
        return (abs(traj.advantage) + self.priority_eps) * (1.0 - self.decay) ** age_periods

    def params(self) -> dict[str, float]:
        """What the keys depend on, besides origin (a store keyed with other params is re-keyed
        or refused)."""
        return {"decay": self.decay, "decay_period_s": self.decay_period_s,
                "priority_eps": self.priority_eps}

    def to_json(self) -> str:
        return json.dumps({**self.params(), "origin": self.origin}, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "PriorityKey":
        d = json.loads(s)
        return cls(float(d["decay"]), float(d["decay_period_s"]), float(d["priority_eps"]),
                   float(d["origin"]))


@dataclass(frozen=True)
class _Cand:
    score: float  # the key (greedy) or the key plus Gumbel noise (proportional)
    traj_id: str
    task_type: str
    tier: int


def _select(cands: Sequence[_Cand], n: int, min_task_types: int) -> list[_Cand]:
    """The type floor, then the fill: highest score first, ties to the smaller id."""
    order = sorted(cands, key=lambda c: (-c.score, c.traj_id))
    best: dict[str, _Cand] = {}
    for c in order:  # insertion order = the types ranked by their best score
        best.setdefault(c.task_type, c)
    m = min(min_task_types, len(best), n)
    floor = list(best.values())[:m]
    picked = {c.traj_id for c in floor}
    return floor + [c for c in order if c.traj_id not in picked][:n - m]


class ExperiencePool:
    """Trajectories by priority: |advantage| with time decay, a task-type floor per batch.

    ``add(trajs)`` rejects a traj_id already in the pool (any tier) or repeated in the call with
    DuplicateTrajectoryError: an id is one completion and must not be trained on twice; a
    caller that retries an add after an error can skip what `contains` reports.
    ``sample(n)`` returns min(n, len(pool)) trajectories: first the floor — when the pool holds
    k task types, one trajectory of each of the min(min_task_types, k, n) types ranked best —
    then the rest by ``sample_mode``: ``greedy`` highest priority first; ``proportional``
    without replacement with probability proportional to priority (the Gumbel-top-k draw from
    a ``random.Random(seed)``: reproducible for the same seed and calls). In proportional mode
    "best" means best under the same Gumbel perturbation, so the floor's types are drawn in
    proportion to their total priority and its item within a type in proportion to priority.
    Ties go to the smaller traj_id (memory and SQLite tiers). With ``consume`` sampled items
    leave the pool (atomically across clients of a Redis namespace).

    Thread-safe (one lock); several pools on one Redis namespace share one buffer.
    ``stats``: added, sampled, evicted (memory backend at capacity), spilled (memory -> SQLite),
    conflicts (Redis samples retried because another client took a chosen item).
    ``last_priorities``: traj_id -> decayed priority at ``now`` of the last sample.
    """

    def __init__(self, config: PoolConfig, path_default: str | None = None,
                 clock: Callable[[], float] = time.time, seed: int = 0) -> None:
        if not isinstance(config, PoolConfig):
            raise TypeError(f"ExperiencePool: config expected a PoolConfig, got "
                            f"{type(config).__name__}")
        if config.backend not in ("memory", "sqlite", "redis"):
            raise ValueError(f"ExperiencePool: config.backend expected 'memory', 'sqlite' or "
                             f"'redis', got {config.backend!r}")
        if config.sample_mode not in ("proportional", "greedy"):
            raise ValueError(f"ExperiencePool: config.sample_mode expected 'proportional' or "
                             f"'greedy', got {config.sample_mode!r}")
        self.config = config
        self._clock = clock
        self._rng = random.Random(seed)
        self._jitter = random.Random()  # retry back-off only: never perturbs the seeded draws
        self._lock = threading.RLock()
        self._closed = False
        self.stats: dict[str, int] = {"added": 0, "sampled": 0, "evicted": 0, "spilled": 0,
                                      "conflicts": 0}
        self.last_priorities: dict[str, float] = {}
        self._memory: MemoryStore | None = None
        self._disk: Store | None = None
        if config.backend == "memory":
            self._memory = MemoryStore()
        elif config.backend == "sqlite":
            path = config.path or path_default
            if not path:
                raise ValueError("ExperiencePool: pool.backend 'sqlite' needs a file: set "
                                 "pool.path (or pass path_default)")
            self._memory = MemoryStore()
            self._disk = SQLiteStore(path)
        else:
            self._disk = RedisStore(config.redis_url, config.namespace)
        self._tiers: list[Store] = [s for s in (self._memory, self._disk) if s is not None]
        self._keyer = self._init_keyer()

    def _init_keyer(self) -> PriorityKey:
        c = self.config
        mine = PriorityKey(c.decay, c.decay_period_s, c.priority_eps, float(self._clock()))
        if self._disk is None:
            return mine
        stored = PriorityKey.from_json(self._disk.meta_set_default("key_params", mine.to_json()))
        if stored.params() == mine.params():
            return stored
        if isinstance(self._disk, RedisStore):
            self._disk.close()
            raise ValueError(f"ExperiencePool: the Redis namespace {self.config.namespace!r} "
                             f"holds keys computed with {stored.params()}, this pool's config "
                             f"has {mine.params()} (every client of a namespace must agree)")
        # A reopened SQLite file under a new decay / eps: re-key it once.
        keyer = PriorityKey(c.decay, c.decay_period_s, c.priority_eps, stored.origin)
        self._disk.rekey(keyer.key)
        self._disk.meta_set("key_params", keyer.to_json())
        return keyer

    # ---- public API --------------------------------------------------------------------------

    def priority(self, traj: Trajectory, now: float | None = None) -> float:
        """The decayed priority of traj at now (default: the pool's clock)."""
        if not isinstance(traj, Trajectory):
            raise TypeError(f"ExperiencePool.priority: traj expected a Trajectory, got "
                            f"{type(traj).__name__}")
        return self._keyer.priority(traj, self._now("priority", now))

    def add(self, trajs: Iterable[Trajectory]) -> None:
        """Insert trajectories (all or none); see the class docstring for duplicates."""
        if isinstance(trajs, Trajectory) or not isinstance(trajs, Iterable):
            raise TypeError(f"ExperiencePool.add: trajs expected an iterable of Trajectory, got "
                            f"{type(trajs).__name__}")
        items = list(trajs)
        for i, t in enumerate(items):
            if not isinstance(t, Trajectory):
                raise TypeError(f"ExperiencePool.add: trajs[{i}] expected a Trajectory, got "
                                f"{type(t).__name__}")
            if not isinstance(t.created, (int, float)) or not math.isfinite(t.created):
                raise ValueError(f"ExperiencePool.add: trajs[{i}] ({t.traj_id!r}).created "
                                 f"expected a finite time in seconds, got {t.created!r}")
        ids = [t.traj_id for t in items]
        dup = repeated_ids(ids)
        if dup:
            raise DuplicateTrajectoryError(f"ExperiencePool.add: traj_id {sorted(dup)[0]!r} "
                                           f"appears twice in trajs")
        if not items:
            return
        with self._lock:
            self._check_open("add")
            if len(self._tiers) > 1:
                present = set().union(*(s.contains(ids) for s in self._tiers))
                if present:
                    raise DuplicateTrajectoryError(f"ExperiencePool.add: traj_id "
                                                   f"{sorted(present)[0]!r} is already in the "
                                                   f"pool")
            try:
                self._tiers[0].add([(t, self._keyer.key(t)) for t in items])
            except DuplicateTrajectoryError as e:
                raise DuplicateTrajectoryError(f"ExperiencePool.add: {e}") from e
            self.stats["added"] += len(items)
            self._enforce_capacity()

    def sample(self, n: int, now: float | None = None) -> list[Trajectory]:
        """Up to n trajectories (fewer only when the pool holds fewer), floor first then by
        priority; see the class docstring. now: for ``last_priorities`` (default: the clock)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"ExperiencePool.sample: n expected a non-negative integer, got "
                            f"{n!r}")
        if n < 0:
            raise ValueError(f"ExperiencePool.sample: n expected a non-negative integer, got {n}")
        now = self._now("sample", now)
        with self._lock:
            self._check_open("sample")
            got: list[Trajectory] | None = []
            for _ in range(_MAX_ATTEMPTS):
                picks = _select(self._candidates(n), n, self.config.min_task_types) if n else []
                got = self._fetch(picks)
                if got is not None:
                    break
                self.stats["conflicts"] += 1
                time.sleep(self._jitter.uniform(0.0, 0.002))
            else:
                raise RuntimeError(f"ExperiencePool.sample: other clients took the chosen "
                                   f"trajectories {_MAX_ATTEMPTS} times in a row")
            self.stats["sampled"] += len(got)
            self.last_priorities = {t.traj_id: self._keyer.priority(t, now) for t in got}
            return got

    def contains(self, ids: Iterable[str]) -> set[str]:
        """Which of ids are in the pool."""
        ids = list(ids)
        with self._lock:
            self._check_open("contains")
            return set().union(*(s.contains(ids) for s in self._tiers))

    def discard(self, traj_ids: Iterable[str]) -> int:
        """Remove the given trajectories from every tier where present (a resumed run drops
        what was pooled after its checkpoint by weights it never made); returns how many."""
        ids = list(traj_ids)
        if not all(isinstance(i, str) for i in ids):
            raise TypeError("ExperiencePool.discard: traj_ids expected strings")
        with self._lock:
            self._check_open("discard")
            return sum(len(tier.remove(ids)) for tier in self._tiers)

    def evict_older_than(self, min_version: int) -> int:
        """Remove every trajectory with a token sampled by a weights version below
        ``min_version`` (`Trajectory.min_version`): the trainer would drop it as stale, and
        while it waits — a low priority keeps it waiting — it holds the place of fresh data.
        Returns how many were removed. Reads every trajectory: for pools of a few batches."""
        if isinstance(min_version, bool) or not isinstance(min_version, int):
            raise TypeError(f"ExperiencePool.evict_older_than: min_version expected an int, got "
                            f"{min_version!r}")
        with self._lock:
            self._check_open("evict_older_than")
            gone = 0
            for s in self._tiers:
                old = [t.traj_id for t in s if t.min_version < min_version]
                gone += len(s.remove(old)) if old else 0
            self.stats["evicted"] += gone
            return gone

    def counts_by_type(self) -> dict[str, int]:
        with self._lock:
            self._check_open("counts_by_type")
            out: dict[str, int] = {}
            for s in self._tiers:
                for t, c in s.counts().items():
                    out[t] = out.get(t, 0) + c
            return out

    def __len__(self) -> int:
        with self._lock:
            self._check_open("__len__")
            return sum(len(s) for s in self._tiers)

    def __iter__(self) -> Iterator[Trajectory]:
        """Every trajectory (memory tier first); a snapshot per tier."""
        with self._lock:
            self._check_open("__iter__")
            tiers = [list(s) for s in self._tiers]
        for tier in tiers:
            yield from tier

    def close(self) -> None:
        """Close the pool. The sqlite backend first moves its memory tier to the file, so a
        new pool on the same path holds everything; the memory backend's contents are gone
        (keep a `state_dict`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            if self._memory is not None and self._disk is not None and len(self._memory):
                self._spill(len(self._memory))
            for s in self._tiers:
                s.close()
            self._closed = True

    def __enter__(self) -> "ExperiencePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The memory tier's trajectories (as dicts), the RNG state and stats: JSON-able. The
        SQLite and Redis tiers persist on their own and are not included."""
        with self._lock:
            self._check_open("state_dict")
            version, internal, gauss = self._rng.getstate()
            return {"format": _STATE_FORMAT,
                    "memory": [t.to_dict() for t in self._memory] if self._memory else [],
                    "rng": [version, list(internal), gauss],
                    "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the memory tier with the saved one and restore the RNG and stats. Saved
        trajectories already in the SQLite / Redis tier (spilled after the save) are skipped,
        so nothing is held twice."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"ExperiencePool.load_state_dict: state expected a dict from "
                             f"ExperiencePool.state_dict (format {_STATE_FORMAT!r}), got "
                             f"{state.get('format') if isinstance(state, dict) else state!r}")
        try:
            trajs = [Trajectory.from_dict(d) for d in state["memory"]]
            version, internal, gauss = state["rng"]
            rng_state = (version, tuple(internal), gauss)
            stats = {k: int(state["stats"][k]) for k in self.stats}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ExperiencePool.load_state_dict: state is malformed: {e}") from e
        with self._lock:
            self._check_open("load_state_dict")
            if self._memory is not None:
                self._memory.clear()
            if self._disk is not None:
                held = self._disk.contains(t.traj_id for t in trajs)
                trajs = [t for t in trajs if t.traj_id not in held]
            self._rng.setstate(rng_state)
            self.stats = stats
            if trajs:
                self._tiers[0].add([(t, self._keyer.key(t)) for t in trajs])
                self._enforce_capacity()

    # ---- internals ---------------------------------------------------------------------------

    def _now(self, fn: str, now: float | None) -> float:
        if now is None:
            return float(self._clock())
        if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
            raise ValueError(f"ExperiencePool.{fn}: now expected a finite time in seconds, got "
                             f"{now!r}")
        return float(now)

    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise RuntimeError(f"ExperiencePool.{fn}: the pool is closed")

    def _enforce_capacity(self) -> None:
        if self._memory is None:
            return
        excess = len(self._memory) - self.config.memory_capacity
        if excess <= 0:
            return
        if self._disk is None:
            self._memory.remove(self._memory.lowest(excess))
            self.stats["evicted"] += excess
        else:
            self._spill(excess)

    def _spill(self, k: int) -> None:
        assert self._memory is not None and self._disk is not None
        ids = self._memory.oldest(k)
        # Written to disk before leaving memory: a failing disk loses nothing.
        self._disk.add([self._memory.entry(i) for i in ids])
        self._memory.remove(ids)
        self.stats["spilled"] += len(ids)

    def _candidates(self, n: int) -> list[_Cand]:
        if self.config.sample_mode == "greedy":
            # The floor takes one item per type, the fill n at most: the top n per type suffice.
            return [_Cand(key, i, t, ti) for ti, s in enumerate(self._tiers)
                    for t, top in s.top_all(n).items() for key, i in top]
        entries = sorted(((i, t, key, ti) for ti, s in enumerate(self._tiers)
                          for i, t, key in s.entries()))
        # Gumbel-top-k: key - log(Exp(1)) ranks like sampling without replacement in
        # proportion to exp(key), i.e. to the decayed priority. Sorted by id first, so the
        # noise each item gets depends only on the seed and the call sequence.
        return [_Cand(key - math.log(max(self._rng.expovariate(1.0), sys.float_info.min)),
                      i, t, ti) for i, t, key, ti in entries]

    def _fetch(self, picks: list[_Cand]) -> list[Trajectory] | None:
        by_tier: dict[int, list[tuple[str, str]]] = {}
        for c in picks:
            by_tier.setdefault(c.tier, []).append((c.traj_id, c.task_type))
        got: dict[str, Trajectory] = {}
        taken: list[tuple[int, list[Trajectory]]] = []
        for ti, tp in by_tier.items():
            store = self._tiers[ti]
            part = store.take(tp) if self.config.consume else store.get(tp)
            if part is None:
                # Another client took one: put back what this attempt took from other tiers.
                for tj, ts in taken:
                    self._tiers[tj].add([(t, self._keyer.key(t)) for t in ts])
                return None
            if self.config.consume:
                taken.append((ti, part))
            got.update((t.traj_id, t) for t in part)
        return [got[c.traj_id] for c in picks]
