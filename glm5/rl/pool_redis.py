"""The experience pool's Redis tier: everything in one Redis namespace, shared by every pool on
it; adds and takes are Lua scripts, atomic across clients. The `redis` package is imported
only when a `RedisStore` is made."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from glm5.rl.pool_store import DuplicateTrajectoryError, Store, decode_trajectory, repeated_ids
from glm5.rl.trajectory import Trajectory


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
        dup = repeated_ids(ids)
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
        return [decode_trajectory(js) for js in out]

    def remove(self, ids: Iterable[str]) -> list[Trajectory]:
        ids = list(ids)
        if not ids:
            return []
        found = [(i, js) for i, js in zip(ids, self._r.hmget(self._items, ids)) if js]
        taken = self._take("any", [(i, decode_trajectory(js).task_type) for i, js in found])
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
        return [decode_trajectory(js) for js in jsons]

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
            yield decode_trajectory(js)

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
