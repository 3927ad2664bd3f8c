"""The experience pool's storage tiers: the `Store` protocol every tier answers (trajectories by
id, ordered per task type by the static key the pool computes), the in-process `MemoryStore`,
and what the tiers share (`DuplicateTrajectoryError`, `decode_trajectory`, `repeated_ids`).
The persistent tiers are `glm5.rl.pool_sqlite.SQLiteStore` and `glm5.rl.pool_redis.RedisStore`.
"""

from __future__ import annotations

import abc
import heapq
import json
from collections.abc import Callable, Iterable, Iterator, Sequence

from glm5.rl.trajectory import Trajectory


class DuplicateTrajectoryError(ValueError):
    """A trajectory id is already in the pool (or twice in one `add`)."""


def decode_trajectory(js: str) -> Trajectory:
    return Trajectory.from_dict(json.loads(js))


def repeated_ids(ids: Sequence[str]) -> set[str]:
    seen: set[str] = set()
    return {i for i in ids if i in seen or seen.add(i)}  # type: ignore[func-returns-value]


class Store(abc.ABC):
    """One tier of the pool: trajectories by id, ordered per task type by a static key.

    `take` and `get` address items as (traj_id, task_type) pairs (the Redis tier needs the type
    to find an item's sorted set) and are all-or-nothing: None when any item is missing.
    """

    @abc.abstractmethod
    def add(self, entries: Sequence[tuple[Trajectory, float]]) -> None:
        """Insert (trajectory, key) pairs, all or none; DuplicateTrajectoryError when an id is
        already stored."""

    @abc.abstractmethod
    def remove(self, ids: Iterable[str]) -> list[Trajectory]:
        """Remove the given ids that are present; return what was removed."""

    @abc.abstractmethod
    def take(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        """Remove and return every (id, task_type) in picks, atomically; None (and nothing
        removed) when any is missing."""

    @abc.abstractmethod
    def get(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        """Return every (id, task_type) in picks without removing; None when any is missing."""

    @abc.abstractmethod
    def top(self, task_type: str, k: int) -> list[tuple[float, str]]:
        """The k highest (key, id) of a task type, highest first."""

    def top_all(self, k: int) -> dict[str, list[tuple[float, str]]]:
        """`top` for every task type present."""
        return {t: self.top(t, k) for t in self.counts()}

    @abc.abstractmethod
    def entries(self) -> list[tuple[str, str, float]]:
        """Every stored (id, task_type, key), without decoding trajectories."""

    @abc.abstractmethod
    def contains(self, ids: Iterable[str]) -> set[str]:
        """The subset of ids that are stored."""

    @abc.abstractmethod
    def counts(self) -> dict[str, int]:
        """Items per task type (types with none are absent)."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Trajectory]: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def close(self) -> None:
        """Release the store's resources (a persistent store keeps its contents)."""

    def meta_get(self, name: str) -> str | None:
        return None

    def meta_set_default(self, name: str, value: str) -> str:
        """Store value under name unless one is there; return the stored value."""
        return value

    def meta_set(self, name: str, value: str) -> None:
        """Overwrite a metadata value (persistent stores)."""

    def rekey(self, key: Callable[[Trajectory], float]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.rekey: this store cannot be re-keyed")


class MemoryStore(Store):
    """In-process dicts; O(n) top-k (the memory tier is bounded by `PoolConfig.memory_capacity`)."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[Trajectory, float]] = {}
        self._by_type: dict[str, dict[str, float]] = {}

    def add(self, entries: Sequence[tuple[Trajectory, float]]) -> None:
        ids = [t.traj_id for t, _ in entries]
        dup = self.contains(ids) or repeated_ids(ids)
        if dup:
            raise DuplicateTrajectoryError(f"MemoryStore.add: traj_id {sorted(dup)[0]!r} is "
                                           f"already in the store")
        for t, k in entries:
            self._items[t.traj_id] = (t, k)
            self._by_type.setdefault(t.task_type, {})[t.traj_id] = k

    def remove(self, ids: Iterable[str]) -> list[Trajectory]:
        out = []
        for i in ids:
            item = self._items.pop(i, None)
            if item is None:
                continue
            t = item[0]
            of_type = self._by_type[t.task_type]
            del of_type[i]
            if not of_type:
                del self._by_type[t.task_type]
            out.append(t)
        return out

    def take(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        if any(i not in self._items for i, _ in picks):
            return None
        return self.remove(i for i, _ in picks)

    def get(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        if any(i not in self._items for i, _ in picks):
            return None
        return [self._items[i][0] for i, _ in picks]

    def entry(self, traj_id: str) -> tuple[Trajectory, float]:
        return self._items[traj_id]

    def top(self, task_type: str, k: int) -> list[tuple[float, str]]:
        of_type = self._by_type.get(task_type, {})
        best = heapq.nsmallest(k, of_type.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(key, i) for i, key in best]

    def lowest(self, k: int) -> list[str]:
        """The ids of the k lowest keys (eviction order: lowest priority first)."""
        return [i for i, _ in heapq.nsmallest(
            k, self._items.items(), key=lambda kv: (kv[1][1], kv[0]))]

    def oldest(self, k: int) -> list[str]:
        """The ids of the k oldest trajectories by `created` (spill order)."""
        return [i for i, _ in heapq.nsmallest(
            k, self._items.items(), key=lambda kv: (kv[1][0].created, kv[0]))]

    def entries(self) -> list[tuple[str, str, float]]:
        return [(i, t.task_type, k) for i, (t, k) in self._items.items()]

    def contains(self, ids: Iterable[str]) -> set[str]:
        return {i for i in ids if i in self._items}

    def counts(self) -> dict[str, int]:
        return {t: len(d) for t, d in self._by_type.items()}

    def __iter__(self) -> Iterator[Trajectory]:
        return iter([t for t, _ in self._items.values()])

    def __len__(self) -> int:
        return len(self._items)

    def rekey(self, key: Callable[[Trajectory], float]) -> None:
        entries = [(t, key(t)) for t, _ in self._items.values()]
        self._items.clear()
        self._by_type.clear()
        self.add(entries)

    def clear(self) -> None:
        self._items.clear()
        self._by_type.clear()
