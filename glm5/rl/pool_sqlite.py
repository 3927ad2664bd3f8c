"""The experience pool's SQLite tier: one file (WAL) holding the trajectories the memory tier
spills, indexed by (task type, key) for sampling."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from glm5.rl.pool_store import DuplicateTrajectoryError, Store, decode_trajectory, repeated_ids
from glm5.rl.trajectory import Trajectory

_SQL_CHUNK = 500  # ids per `IN (...)`: well under SQLite's bound variables limit


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
            dup = self.contains(ids) or repeated_ids(ids)
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
        return [decode_trajectory(r[0]) for r in rows]

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
        return [decode_trajectory(found[i]) for i in ids]

    def get(self, picks: Sequence[tuple[str, str]]) -> list[Trajectory] | None:
        ids = [i for i, _ in picks]
        found = dict(self._select_in("SELECT id, json FROM items WHERE id IN ({})", ids))
        if len(found) != len(set(ids)):
            return None
        return [decode_trajectory(found[i]) for i in ids]

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
                yield decode_trajectory(js)
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
                                 [(key(decode_trajectory(js)), i) for i, js in rows])

    def close(self) -> None:
        self._db.close()
