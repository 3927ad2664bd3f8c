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
"""

from __future__ import annotations

import abc
import heapq
import json
import math
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from glm5.rl.config import PoolConfig
from glm5.rl.trajectory import Trajectory

# log(0) has no value; a zero priority (advantage 0 with priority_eps 0) gets a finite key that
# SQLite and Redis scores can hold, below the log of every positive float (subnormals included).
_LOG_ZERO = math.log(math.ulp(0.0)) - 1.0
_STATE_FORMAT = "glm5.rl.pool/1"
_SQL_CHUNK = 500  # ids per `IN (...)`: well under SQLite's bound variables limit
_MAX_ATTEMPTS = 200  # sample retries when other Redis clients keep taking the chosen items


class DuplicateTrajectoryError(ValueError):
    """A trajectory id is already in the pool (or twice in one `add`)."""


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


# --------------------------------------------------------------------------------------------
# Stores: one tier each. Keys are computed by the pool; a store only orders by them.


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
        dup = self.contains(ids) or _repeated(ids)
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


class SQLiteStore(Store):
    """An SQLite file (WAL): table ``items(id, task_type, key, created, json)`` with an index on
    (task_type, key), and a small ``meta`` table recording the key parameters."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"SQLiteStore: path expected a file, got the directory {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Autocommit; writes take explicit BEGIN IMMEDIATE transactions (`_tx`).
            self._db = sqlite3.connect(str(self.path), isolation_level=None,
                                       check_same_thread=False, timeout=30.0)
            # NORMAL first: switching to WAL then costs no full sync (WAL + NORMAL is durable
            # up to the last checkpoint and never corrupts on a crash).
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA journal_mode=WAL")
            with self._tx():
                self._db.execute("CREATE TABLE IF NOT EXISTS items (id TEXT PRIMARY KEY, "
                                 "task_type TEXT NOT NULL, key REAL NOT NULL, "
                                 "created REAL NOT NULL, json TEXT NOT NULL)")
                self._db.execute("CREATE INDEX IF NOT EXISTS items_type_key "
                                 "ON items (task_type, key)")
                self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, "
                                 "value TEXT NOT NULL)")
        except sqlite3.DatabaseError as e:
            raise ValueError(f"SQLiteStore: {self.path} is not a usable SQLite pool file: "
                             f"{e}") from e

    @contextmanager
    def _tx(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _select_in(self, sql: str, ids: Sequence[str]) -> list[tuple]:
        rows: list[tuple] = []
        for s in range(0, len(ids), _SQL_CHUNK):
            part = ids[s:s + _SQL_CHUNK]
            rows += self._db.execute(sql.format(",".join("?" * len(part))), part).fetchall()
        return rows

    def add(self, entries: Sequence[tuple[Trajectory, float]]) -> None:
        rows = [(t.traj_id, t.task_type, k, t.created, json.dumps(t.to_dict()))
                for t, k in entries]
        try:
            with self._tx():
                self._db.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", rows)
        except sqlite3.IntegrityError as e:
            ids = [r[0] for r in rows]
            dup = self.contains(ids) or _repeated(ids)
            raise DuplicateTrajectoryError(
                f"SQLiteStore.add: traj_id {sorted(dup)[0] if dup else '?'!r} is already in "
                f"{self.path}") from e

    def remove(self, ids: Iterable[str]) -> list[Trajectory]:
        ids = list(ids)
        with self._tx():
            rows = self._select_in("SELECT json FROM items WHERE id IN ({})", ids)
            for s in range(0, len(ids), _SQL_CHUNK):
                part = ids[s:s + _SQL_CHUNK]
                self._db.execute(f"DELETE FROM items WHERE id IN ({','.join('?' * len(part))})",
                                 part)
        return [_decode(r[0]) for r in rows]

    def take(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        ids = [i for i, _ in picks]
        with self._tx():
            found = dict(self._select_in("SELECT id, json FROM items WHERE id IN ({})", ids))
            if len(found) != len(set(ids)):
                return None
            for s in range(0, len(ids), _SQL_CHUNK):
                part = ids[s:s + _SQL_CHUNK]
                self._db.execute(f"DELETE FROM items WHERE id IN ({','.join('?' * len(part))})",
                                 part)
        return [_decode(found[i]) for i in ids]

    def get(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        ids = [i for i, _ in picks]
        found = dict(self._select_in("SELECT id, json FROM items WHERE id IN ({})", ids))
        if len(found) != len(set(ids)):
            return None
        return [_decode(found[i]) for i in ids]

    def top(self, task_type: str, k: int) -> list[tuple[float, str]]:
        return [(key, i) for key, i in self._db.execute(
            "SELECT key, id FROM items WHERE task_type = ? ORDER BY key DESC, id ASC LIMIT ?",
            (task_type, k))]

    def entries(self) -> list[tuple[str, str, float]]:
        return self._db.execute("SELECT id, task_type, key FROM items").fetchall()

    def contains(self, ids: Iterable[str]) -> set[str]:
        return {r[0] for r in self._select_in("SELECT id FROM items WHERE id IN ({})",
                                              list(ids))}

    def counts(self) -> dict[str, int]:
        return dict(self._db.execute("SELECT task_type, COUNT(*) FROM items GROUP BY task_type"))

    def __iter__(self) -> Iterator[Trajectory]:
        # Keyset pages: no cursor stays open across the caller's other calls.
        last = ""
        while True:
            rows = self._db.execute("SELECT id, json FROM items WHERE id > ? ORDER BY id "
                                    "LIMIT 1000", (last,)).fetchall()
            if not rows:
                return
            for _, js in rows:
                yield _decode(js)
            last = rows[-1][0]

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM items").fetchone()[0]

    def meta_get(self, name: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    def meta_set_default(self, name: str, value: str) -> str:
        with self._tx():
            self._db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (name, value))
        return self.meta_get(name)  # type: ignore[return-value]

    def meta_set(self, name: str, value: str) -> None:
        with self._tx():
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    def rekey(self, key: Callable[[Trajectory], float]) -> None:
        with self._tx():
            rows = self._db.execute("SELECT id, json FROM items").fetchall()
            self._db.executemany("UPDATE items SET key = ? WHERE id = ?",
                                 [(key(_decode(js)), i) for i, js in rows])

    def close(self) -> None:
        self._db.close()


# KEYS[1] the id -> json hash, KEYS[2] the set of task types, KEYS[3..] sorted sets per type.
# ARGV: n, then per item: id, index of its sorted set in KEYS, task type, key, json.
# All or nothing: nothing is written when any id is already stored.
_LUA_ADD = """
local n = tonumber(ARGV[1])
for i = 0, n - 1 do
  local id = ARGV[2 + i * 5]
  if redis.call('HEXISTS', KEYS[1], id) == 1 then return id end
end
for i = 0, n - 1 do
  local b = 2 + i * 5
  redis.call('HSET', KEYS[1], ARGV[b], ARGV[b + 4])
  redis.call('ZADD', KEYS[tonumber(ARGV[b + 1])], ARGV[b + 3], ARGV[b])
  redis.call('SADD', KEYS[2], ARGV[b + 2])
end
return false
"""

# KEYS as for _LUA_ADD. ARGV: mode ('all': none removed unless every id is there; 'any'), n,
# per item: id, index of its sorted set in KEYS; then the task type of each KEYS[3..].
# Returns the removed jsons (false when mode 'all' found one missing). One script run is atomic:
# two clients can never both take the same id.
_LUA_TAKE = """
local n = tonumber(ARGV[2])
if ARGV[1] == 'all' then
  for i = 0, n - 1 do
    if not redis.call('ZSCORE', KEYS[tonumber(ARGV[4 + i * 2])], ARGV[3 + i * 2]) then
      return false
    end
  end
end
local out = {}
for i = 0, n - 1 do
  local id = ARGV[3 + i * 2]
  if redis.call('ZREM', KEYS[tonumber(ARGV[4 + i * 2])], id) == 1 then
    out[#out + 1] = redis.call('HGET', KEYS[1], id)
    redis.call('HDEL', KEYS[1], id)
  end
end
local base = 3 + n * 2
for k = 3, #KEYS do
  if redis.call('ZCARD', KEYS[k]) == 0 then redis.call('SREM', KEYS[2], ARGV[base + k - 3]) end
end
return out
"""


def _redact(url: str) -> str:
    """The URL without its password (error messages name the server, not the secret)."""
    try:
        parts = urlsplit(url)
        if parts.password:
            host = parts.hostname or ""
            port = f":{parts.port}" if parts.port else ""
            user = parts.username or ""
            return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
    except ValueError:
        pass
    return url


class RedisStore(Store):
    """Redis: a hash ``{ns}:items`` (id -> json), a sorted set ``{ns}:z:<task type>`` per type
    scored by the static key, a set ``{ns}:types`` and a hash ``{ns}:meta``. The ``{ns}`` hash
    tag keeps every key of a namespace in one Redis Cluster slot, and the Lua scripts declare
    every key they touch. Adds and takes are Lua scripts, hence atomic across clients."""

    def __init__(self, url: str, namespace: str, connect_timeout_s: float = 2.0) -> None:
        try:
            import redis
        except ImportError as e:
            raise ImportError("RedisStore: the `redis` package is needed for pool.backend "
                              "redis (pip install 'glm5[rl]')") from e
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"RedisStore: namespace expected a non-empty string, got "
                             f"{namespace!r}")
        self.url = url
        try:
            self._r = redis.Redis.from_url(url, decode_responses=True,
                                           socket_connect_timeout=connect_timeout_s)
        except ValueError as e:
            raise ValueError(f"RedisStore: redis_url expected a redis://, rediss:// or unix:// "
                             f"URL, got {_redact(url)!r} ({e})") from e
        try:
            self._r.ping()
        except redis.exceptions.RedisError as e:
            self._r.close()
            raise ConnectionError(f"RedisStore: cannot reach the Redis server at "
                                  f"{_redact(url)}: {e}") from e
        p = "{" + namespace + "}"
        self._prefix = p
        self._items = f"{p}:items"
        self._types = f"{p}:types"
        self._meta = f"{p}:meta"
        self._lua_add = self._r.register_script(_LUA_ADD)
        self._lua_take = self._r.register_script(_LUA_TAKE)

    def _z(self, task_type: str) -> str:
        return f"{self._prefix}:z:{task_type}"

    def _keys_for(self, types: Iterable[str]) -> tuple[list[str], list[str], dict[str, int]]:
        order = sorted(set(types))
        index = {t: 3 + i for i, t in enumerate(order)}  # Lua KEYS are 1-based
        return [self._items, self._types] + [self._z(t) for t in order], order, index

    def add(self, entries: Sequence[tuple[Trajectory, float]]) -> None:
        if not entries:
            return
        ids = [t.traj_id for t, _ in entries]
        dup = _repeated(ids)
        if dup:
            raise DuplicateTrajectoryError(f"RedisStore.add: traj_id {sorted(dup)[0]!r} is "
                                           f"twice in one add")
        keys, _, index = self._keys_for(t.task_type for t, _ in entries)
        args: list[Any] = [len(entries)]
        for t, k in entries:
            args += [t.traj_id, index[t.task_type], t.task_type, repr(float(k)),
                     json.dumps(t.to_dict())]
        dup_id = self._lua_add(keys=keys, args=args)
        if dup_id:
            raise DuplicateTrajectoryError(f"RedisStore.add: traj_id {dup_id!r} is already in "
                                           f"the namespace {self._prefix}")

    def _take(self, mode: str, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        if not picks:
            return []
        keys, order, index = self._keys_for(t for _, t in picks)
        args: list[Any] = [mode, len(picks)]
        for i, t in picks:
            args += [i, index[t]]
        out = self._lua_take(keys=keys, args=args + order)
        if out is None:
            return None
        return [_decode(js) for js in out]

    def remove(self, ids: Iterable[str]) -> list[Trajectory]:
        ids = list(ids)
        if not ids:
            return []
        found = [(i, js) for i, js in zip(ids, self._r.hmget(self._items, ids)) if js]
        taken = self._take("any", [(i, _decode(js).task_type) for i, js in found])
        return taken or []

    def take(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        got = self._take("all", picks)
        if got is None:
            return None
        by_id = {t.traj_id: t for t in got}
        return [by_id[i] for i, _ in picks]

    def get(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        if not picks:
            return []
        jsons = self._r.hmget(self._items, [i for i, _ in picks])
        if any(js is None for js in jsons):
            return None
        return [_decode(js) for js in jsons]

    def top(self, task_type: str, k: int) -> list[tuple[float, str]]:
        return [(s, i) for i, s in self._r.zrevrange(self._z(task_type), 0, k - 1,
                                                     withscores=True)]

    def top_all(self, k: int) -> dict[str, list[tuple[float, str]]]:
        types = sorted(self._r.smembers(self._types))
        pipe = self._r.pipeline(transaction=True)
        for t in types:
            pipe.zrevrange(self._z(t), 0, k - 1, withscores=True)
        return {t: [(s, i) for i, s in rows] for t, rows in zip(types, pipe.execute()) if rows}

    def entries(self) -> list[tuple[str, str, float]]:
        types = sorted(self._r.smembers(self._types))
        pipe = self._r.pipeline(transaction=True)
        for t in types:
            pipe.zrange(self._z(t), 0, -1, withscores=True)
        return [(i, t, s) for t, rows in zip(types, pipe.execute()) for i, s in rows]

    def contains(self, ids: Iterable[str]) -> set[str]:
        ids = list(ids)
        if not ids:
            return set()
        return {i for i, js in zip(ids, self._r.hmget(self._items, ids)) if js is not None}

    def counts(self) -> dict[str, int]:
        types = sorted(self._r.smembers(self._types))
        pipe = self._r.pipeline(transaction=True)
        for t in types:
            pipe.zcard(self._z(t))
        return {t: c for t, c in zip(types, pipe.execute()) if c}

    def __iter__(self) -> Iterator[Trajectory]:
        for _, js in self._r.hscan_iter(self._items, count=1000):
            yield _decode(js)

    def __len__(self) -> int:
        return int(self._r.hlen(self._items))

    def meta_get(self, name: str) -> str | None:
        return self._r.hget(self._meta, name)

    def meta_set_default(self, name: str, value: str) -> str:
        self._r.hsetnx(self._meta, name, value)
        return self._r.hget(self._meta, name)

    def meta_set(self, name: str, value: str) -> None:
        self._r.hset(self._meta, name, value)

    def close(self) -> None:
        self._r.close()


def _decode(js: str) -> Trajectory:
    return Trajectory.from_dict(json.loads(js))


def _repeated(ids: Sequence[str]) -> set[str]:
    seen: set[str] = set()
    return {i for i in ids if i in seen or seen.add(i)}  # type: ignore[func-returns-value]


# --------------------------------------------------------------------------------------------


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
        dup = _repeated(ids)
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
