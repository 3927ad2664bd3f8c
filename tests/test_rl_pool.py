"""The experience pool (glm5.rl.pool): decay, priority order, task-type floor, consumption, the
memory -> SQLite tiers and the Redis tier against a real redis-server started here."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from itertools import permutations
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5.rl.config import PoolConfig
from glm5.rl.pool import (DuplicateTrajectoryError, ExperiencePool, MemoryStore, RedisStore,
                          SQLiteStore)
from glm5.rl.trajectory import Trajectory

NOW = 1.7e9  # a realistic wall clock: keys must stay precise at epoch-sized times
TYPES = [f"t{i}" for i in range(7)]
TOL = 1e-9  # relative: stores order by log-space keys, the checks by the decayed formula


def traj(i, task_type="t0", advantage=0.0, created=NOW) -> Trajectory:
    return Trajectory(traj_id=f"id{i}", group_id=f"g{i}", task_type=task_type,
                      prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], versions=[0],
                      advantage=advantage, created=created, meta={"i": i})


# --------------------------------------------------------------------------- redis-server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private redis-server on a free port (no persistence), shut down after the module."""
    exe = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed: CI installs it (.ci/run), the Redis "
                        "pool tier must be tested there")
        pytest.skip("redis-server is not installed")
    import redis

    workdir = tmp_path_factory.mktemp("redis")
    for _ in range(5):  # another process may grab the free port before the server binds it
        port = _free_port()
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(workdir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10.0
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        else:
            proc.kill()
            proc.wait()
            client.close()
            continue
        client.close()
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return
    pytest.fail("redis-server did not answer PING on any of 5 free ports")


@pytest.fixture
def fast_dir(tmp_path):
    """A directory for many throw-away SQLite files: on /dev/shm when there is one (creating
    a WAL database syncs the disk, ~20-50 ms each on a busy disk), else tmp_path."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(prefix="glm5-pool-", dir="/dev/shm")
        yield Path(d)
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make_pool(request, fast_dir):
    """make_pool(**PoolConfig fields, seed=0) -> a fresh pool of the parametrized backend (a
    new SQLite file / Redis namespace each call unless path / namespace is given)."""
    backend = request.param
    url = request.getfixturevalue("redis_url") if backend == "redis" else None
    pools = []

    def make(seed=0, clock=lambda: NOW, **fields):
        fields.setdefault("path", str(fast_dir / f"{uuid.uuid4().hex}.sqlite"))
        fields.setdefault("namespace", f"test-{uuid.uuid4().hex}")
        if url is not None:
            fields["redis_url"] = url
        p = ExperiencePool(PoolConfig(backend=backend, **fields), clock=clock, seed=seed)
        pools.append(p)
        return p

    make.backend = backend
    yield make
    for p in pools:
        p.close()


# --------------------------------------------------------------------------- strategies

ages = st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0.0, 6.0)  # in decay periods; ties too
advantages = st.sampled_from([0.0, 1.0, -1.0]) | st.floats(-5.0, 5.0)


@st.composite
def pool_cases(draw, binding: bool = False):
    """(trajectories, PoolConfig fields, n, split). binding: cases where the floor and the
    decay decide the greedy batch (several types whose priority levels differ by orders of
    magnitude, a batch smaller than the pool, decay on)."""
    period = draw(st.floats(60.0, 1e5))
    ntypes = draw(st.integers(2 if binding else 1, len(TYPES)))
    n_items = draw(st.integers(4 if binding else 0, 24))
    scale = {t: draw(st.sampled_from([0.01, 1.0, 100.0])) if binding else 1.0 for t in TYPES}
    trajs = []
    for i in range(n_items):
        t = draw(st.sampled_from(TYPES[:ntypes]))
        adv = scale[t] * draw(st.floats(0.1, 1.0) if binding else advantages)
        trajs.append(traj(i, t, adv, NOW - draw(ages) * period))
    cfg = dict(decay=draw(st.sampled_from([0.0, 0.2, 0.9]) | st.floats(0.0, 0.95)),
               decay_period_s=period,
               priority_eps=draw(st.sampled_from([0.0, 1e-3, 0.5])),
               min_task_types=draw(st.integers(1, 6)),
               sample_mode=draw(st.sampled_from(["greedy", "proportional"])),
               consume=draw(st.booleans()),
               memory_capacity=draw(st.integers(1, 8)))
    n = draw(st.integers(0, n_items + 3))
    if binding:
        cfg.update(decay=draw(st.sampled_from([0.5, 0.9]) | st.floats(0.2, 0.95)),
                   priority_eps=0.0, min_task_types=draw(st.integers(2, 6)),
                   sample_mode="greedy")
        n = draw(st.integers(2, n_items - 1))
    return trajs, cfg, n, draw(st.integers(0, n_items))


def ids_of(trajs) -> set[str]:
    return {t.traj_id for t in trajs}


def check_greedy_order(pool: ExperiencePool, held: list[Trajectory], got: list[Trajectory]):
    """Only floor picks may rank below an item left in the pool; a floor pick is the best of
    its type, alone of its type in the batch, and its type is ranked no lower than any type
    the batch left out."""
    p = {t.traj_id: pool.priority(t, NOW) for t in held}
    sampled = ids_of(got)
    left = [t for t in held if t.traj_id not in sampled]
    best = {}
    for t in held:
        best[t.task_type] = max(best.get(t.task_type, 0.0), p[t.traj_id])
    per_type = Counter(t.task_type for t in got)
    missing_types = set(best) - set(per_type)
    max_left = max((p[t.traj_id] for t in left), default=-math.inf)
    for s in got:
        if p[s.traj_id] >= max_left * (1 - TOL):
            continue  # a fill item (or a floor pick that ranks anyway)
        assert p[s.traj_id] >= best[s.task_type] * (1 - TOL), (
            f"{s.traj_id} ranks below a left item and is not the best of {s.task_type}")
        assert per_type[s.task_type] == 1, f"{s.traj_id}: a second item of a floor type"
        for m in missing_types:
            assert best[m] <= p[s.traj_id] * (1 + TOL), (
                f"floor type {s.task_type} was preferred to the better type {m}")


def assert_pool_holds(pool: ExperiencePool, trajs: list[Trajectory]):
    assert len(pool) == len(trajs)
    assert {t.traj_id: t.to_dict() for t in pool} == {t.traj_id: t.to_dict() for t in trajs}
    assert pool.counts_by_type() == dict(Counter(t.task_type for t in trajs))


# --------------------------------------------------------------------------- decay


@given(adv=advantages, decay=st.floats(0.0, 0.95), period=st.floats(1.0, 1e6),
       eps=st.sampled_from([0.0, 1e-3, 0.5]), age1=st.floats(0.0, 10.0),
       age2=st.floats(0.0, 10.0))
def test_priority_decays_by_one_factor_per_period_and_monotone_in_age(adv, decay, period, eps,
                                                                     age1, age2):
    pool = ExperiencePool(PoolConfig(decay=decay, decay_period_s=period, priority_eps=eps),
                          clock=lambda: NOW)
    # created 0: now - created is exactly the age (at epoch-sized times a second's fraction
    # rounds away, which is the clock's precision, not the pool's)
    t = traj(0, advantage=adv, created=0.0)
    fresh = pool.priority(t, 0.0)
    assert fresh == pytest.approx(abs(adv) + eps, rel=1e-12)
    assert pool.priority(t, period) == pytest.approx((1 - decay) * fresh, rel=1e-12)
    assert pool.priority(t, 3 * period) == pytest.approx((1 - decay) ** 3 * fresh, rel=1e-12)
    a, b = sorted((age1, age2))
    assert pool.priority(t, a * period) >= pool.priority(t, b * period)


def test_default_decay_is_20_percent_per_4_hours():
    pool = ExperiencePool(PoolConfig(priority_eps=0.0))
    t = traj(0, advantage=2.0, created=NOW)
    assert pool.priority(t, NOW + 4 * 3600) == pytest.approx(1.6, rel=1e-12)
    assert pool.priority(t, NOW + 2 * 3600) == pytest.approx(2.0 * 0.8 ** 0.5, rel=1e-12)


# --------------------------------------------------------------------------- invariants


@given(case=pool_cases())
def test_sample_invariants(make_pool, case):
    """Every backend: nothing lost on add (across tiers), the batch size, the type floor, the
    greedy order, consume removes exactly the sampled ids, len and counts stay consistent."""
    trajs, cfg, n, split = case
    if make_pool.backend == "memory":  # here nothing is evicted (see the eviction test)
        cfg = {**cfg, "memory_capacity": len(trajs) + 1}
    pool = make_pool(**cfg)
    pool.add(trajs[:split])
    pool.add(trajs[split:])
    assert_pool_holds(pool, trajs)
    if make_pool.backend == "sqlite":
        assert pool.stats["spilled"] == max(0, len(trajs) - cfg["memory_capacity"])

    got = pool.sample(n, now=NOW)
    got_ids = [t.traj_id for t in got]
    assert len(got_ids) == len(set(got_ids)) == min(n, len(trajs))
    by_id = {t.traj_id: t.to_dict() for t in trajs}
    assert all(t.to_dict() == by_id[t.traj_id] for t in got)
    k = len({t.task_type for t in trajs})
    assert len({t.task_type for t in got}) >= min(cfg["min_task_types"], k, n)
    if cfg["sample_mode"] == "greedy":
        check_greedy_order(pool, trajs, got)
    assert set(pool.last_priorities) == set(got_ids)

    left = [t for t in trajs if not cfg["consume"] or t.traj_id not in set(got_ids)]
    assert_pool_holds(pool, left)
    assert pool.stats["sampled"] == len(got)


@given(case=pool_cases(binding=True))
def test_greedy_order_and_type_floor(make_pool, case):
    """Greedy batches where the floor and the decay decide: the floor's size and choice, the
    fill by decayed priority."""
    trajs, cfg, n, split = case
    pool = make_pool(**{**cfg, "memory_capacity": cfg["memory_capacity"]
                        if make_pool.backend == "sqlite" else len(trajs)})
    pool.add(trajs[:split])
    pool.add(trajs[split:])
    got = pool.sample(n, now=NOW)
    assert len(got) == n
    k = len({t.task_type for t in trajs})
    assert len({t.task_type for t in got}) >= min(cfg["min_task_types"], k, n)
    check_greedy_order(pool, trajs, got)


@settings(max_examples=min(20, settings().max_examples))
@given(case=pool_cases(), rounds=st.integers(1, 4))
def test_consume_drains_the_pool_exactly_once(make_pool, case, rounds):
    """Repeated consuming samples return every trajectory exactly once."""
    trajs, cfg, n, _ = case
    pool = make_pool(**{**cfg, "consume": True, "memory_capacity": len(trajs) + 1})
    pool.add(trajs)
    seen: list[str] = []
    while len(pool):
        batch = pool.sample(max(1, n // rounds), now=NOW)
        assert batch
        seen += [t.traj_id for t in batch]
    assert sorted(seen) == sorted(ids_of(trajs))
    assert pool.sample(3) == []
    assert pool.counts_by_type() == {}


def test_decay_changes_the_greedy_order(make_pool):
    """An old high-advantage item loses to a fresh lower one once decay has eaten the gap."""
    pool = make_pool(decay=0.5, decay_period_s=100.0, priority_eps=0.0, sample_mode="greedy",
                     min_task_types=1)
    pool.add([traj(0, advantage=3.0, created=NOW - 200.0),   # 3 * 0.25 = 0.75
              traj(1, advantage=1.0, created=NOW),           # 1
              traj(2, advantage=2.0, created=NOW - 100.0)])  # 2 * 0.5 = 1
    got = [t.traj_id for t in pool.sample(3, now=NOW)]
    assert got[2] == "id0"
    assert pool.last_priorities["id0"] == pytest.approx(0.75)


def test_zero_priority_ranks_below_every_positive_one(make_pool):
    """priority_eps 0: advantage 0 has priority 0, below even the smallest subnormal."""
    pool = make_pool(priority_eps=0.0, sample_mode="greedy", min_task_types=1)
    pool.add([traj(0, advantage=0.0), traj(1, advantage=5e-324), traj(2, advantage=-1e-310)])
    assert [t.traj_id for t in pool.sample(3, now=NOW)] == ["id2", "id1", "id0"]


def test_type_floor_takes_best_item_of_the_best_types(make_pool):
    pool = make_pool(min_task_types=3, sample_mode="greedy", priority_eps=0.0, decay=0.0)
    pool.add([traj(i, "a", 10.0 + i) for i in range(6)]
             + [traj(10, "b", 1.0), traj(11, "b", 2.0), traj(12, "c", 0.5), traj(13, "d", 0.1)])
    got = [t.traj_id for t in pool.sample(4, now=NOW)]
    # floor: the best of a, b, c (d ranks last); the fill: the best remaining item (of a)
    assert got == ["id5", "id11", "id12", "id4"]


# --------------------------------------------------------------------------- proportional


def _frequencies(pool: ExperiencePool, n: int, draws: int) -> Counter:
    c: Counter = Counter()
    for _ in range(draws):
        c.update(t.traj_id for t in pool.sample(n, now=NOW))
    return c


def test_proportional_sampling_follows_priority():
    """Fixed seed, so deterministic: single draws match w_i / sum w within 5 sigma, including
    the decay factor, and pairs match the exact without-replacement inclusion probabilities."""
    weights = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 10.0}
    cfg = PoolConfig(decay=0.5, decay_period_s=100.0, priority_eps=0.0, consume=False,
                     sample_mode="proportional", min_task_types=1)
    pool = ExperiencePool(cfg, clock=lambda: NOW, seed=1)
    # item 4: advantage 40 aged two periods -> priority 10
    pool.add([traj(i, advantage=w, created=NOW) for i, w in weights.items() if i != 4]
             + [traj(4, advantage=40.0, created=NOW - 200.0)])
    total = sum(weights.values())
    draws = 3000
    freq = _frequencies(pool, 1, draws)
    for i, w in weights.items():
        q = w / total
        assert abs(freq[f"id{i}"] - draws * q) <= 5 * math.sqrt(draws * q * (1 - q)), (i, freq)

    incl = Counter()
    for a, b in permutations(weights, 2):  # P(first a, then b)
        pr = weights[a] / total * weights[b] / (total - weights[a])
        incl[a] += pr
        incl[b] += pr
    freq2 = _frequencies(pool, 2, draws)
    for i in weights:
        q = incl[i]
        assert abs(freq2[f"id{i}"] - draws * q) <= 5 * math.sqrt(draws * q * (1 - q)), (i, freq2)


def test_proportional_is_reproducible_for_a_seed():
    def run(seed):
        pool = ExperiencePool(PoolConfig(consume=True), clock=lambda: NOW, seed=seed)
        pool.add([traj(i, TYPES[i % 3], float(i % 5)) for i in range(40)])
        return [[t.traj_id for t in pool.sample(6)] for _ in range(5)]

    assert run(7) == run(7)
    assert run(7) != run(8)


# --------------------------------------------------------------------------- memory / sqlite


def test_memory_backend_evicts_the_lowest_priority():
    pool = ExperiencePool(PoolConfig(memory_capacity=5, decay=0.5, decay_period_s=10.0,
                                     priority_eps=0.0), clock=lambda: NOW)
    trajs = [traj(i, TYPES[i % 2], advantage=float(i + 1), created=NOW - 10.0 * (i % 3))
             for i in range(9)]
    pool.add(trajs[:4])
    pool.add(trajs[4:])
    ranked = sorted(trajs, key=lambda t: -pool.priority(t, NOW))
    assert ids_of(pool) == ids_of(ranked[:5])
    assert pool.stats["evicted"] == 4


@settings(max_examples=min(20, settings().max_examples))
@given(case=pool_cases())
def test_sqlite_tier_keeps_recent_in_memory_and_reloads_after_close(fast_dir, case):
    trajs, cfg, _, split = case
    path = fast_dir / f"{uuid.uuid4().hex}.sqlite"
    pool = ExperiencePool(PoolConfig(backend="sqlite", **cfg), path_default=str(path),
                          clock=lambda: NOW)
    pool.add(trajs[:split])
    pool.add(trajs[split:])
    cap = cfg["memory_capacity"]
    recent = sorted(trajs, key=lambda t: (-t.created, t.traj_id))[:cap]
    assert {t.created for t in pool._memory} == {t.created for t in recent}
    assert len(pool._memory) == min(cap, len(trajs))
    pool.close()
    with pytest.raises(RuntimeError, match="ExperiencePool.sample: the pool is closed"):
        pool.sample(1)

    again = ExperiencePool(PoolConfig(backend="sqlite", **cfg), path_default=str(path),
                           clock=lambda: NOW + 1.0)
    assert_pool_holds(again, trajs)
    assert ids_of(again.sample(len(trajs))) == ids_of(trajs)
    again.close()


def test_sqlite_reopened_with_another_decay_is_rekeyed(tmp_path):
    path = str(tmp_path / "pool.sqlite")
    cfg = dict(backend="sqlite", path=path, memory_capacity=1, sample_mode="greedy",
               min_task_types=1, priority_eps=0.0, decay_period_s=100.0)
    pool = ExperiencePool(PoolConfig(decay=0.0, **cfg), clock=lambda: NOW)
    pool.add([traj(0, advantage=3.0, created=NOW - 300.0), traj(1, advantage=1.0, created=NOW),
              traj(2, advantage=2.0, created=NOW - 10.0)])
    pool.close()
    pool = ExperiencePool(PoolConfig(decay=0.5, **cfg), clock=lambda: NOW)
    assert [t.traj_id for t in pool.sample(3, now=NOW)] == ["id2", "id1", "id0"]
    pool.close()


def test_state_dict_restores_memory_tier_and_rng():
    cfg = PoolConfig(memory_capacity=100)
    a = ExperiencePool(cfg, clock=lambda: NOW, seed=3)
    a.add([traj(i, TYPES[i % 6], float(i % 7) - 3) for i in range(30)])
    a.sample(4)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able, as a checkpoint holds it
    b = ExperiencePool(cfg, clock=lambda: NOW, seed=99)
    b.load_state_dict(state)
    assert_pool_holds(b, list(a))
    assert b.stats == a.stats
    assert [t.traj_id for t in b.sample(6)] == [t.traj_id for t in a.sample(6)]
    with pytest.raises(ValueError, match="ExperiencePool.load_state_dict: state"):
        b.load_state_dict({"memory": []})


def test_sqlite_state_dict_after_a_crash_holds_nothing_twice(tmp_path):
    """A checkpoint's memory tier that has spilled to the file since is not added again."""
    cfg = PoolConfig(backend="sqlite", path=str(tmp_path / "p.sqlite"), memory_capacity=3)
    a = ExperiencePool(cfg, clock=lambda: NOW)
    trajs = [traj(i, TYPES[i % 2], 1.0, created=NOW + i) for i in range(8)]
    a.add(trajs[:5])
    state = a.state_dict()
    a.add(trajs[5:])  # spills the three the checkpoint holds in memory
    # a crash: `a` is never closed, its memory tier (ids 5, 6, 7) is gone
    b = ExperiencePool(cfg, clock=lambda: NOW)
    b.load_state_dict(state)
    assert_pool_holds(b, trajs[:5])
    ids = [t.traj_id for t in b]
    assert sorted(ids) == sorted(t.traj_id for t in trajs[:5]) and len(ids) == len(set(ids))
    b.close()


# --------------------------------------------------------------------------- errors


def test_bad_input_errors(tmp_path):
    pool = ExperiencePool(PoolConfig(), clock=lambda: NOW)
    pool.add([traj(0)])
    with pytest.raises(ValueError, match=r"ExperiencePool.sample: n expected a non-negative"):
        pool.sample(-1)
    with pytest.raises(TypeError, match=r"ExperiencePool.sample: n expected"):
        pool.sample(1.5)
    with pytest.raises(ValueError, match=r"ExperiencePool.sample: now expected a finite"):
        pool.sample(1, now=math.nan)
    with pytest.raises(TypeError, match=r"ExperiencePool.add: trajs\[1\] expected a Trajectory"):
        pool.add([traj(1), {"traj_id": "x"}])
    with pytest.raises(TypeError, match=r"ExperiencePool.add: trajs expected an iterable"):
        pool.add(traj(1))
    with pytest.raises(DuplicateTrajectoryError, match=r"ExperiencePool.add: .*'id0'"):
        pool.add([traj(0)])
    with pytest.raises(DuplicateTrajectoryError, match=r"'id1' appears twice"):
        pool.add([traj(1), traj(1)])
    assert ids_of(pool) == {"id0"}  # a rejected add adds nothing
    with pytest.raises(TypeError, match="ExperiencePool: config expected a PoolConfig"):
        ExperiencePool({"backend": "memory"})
    with pytest.raises(ValueError, match="ExperiencePool: pool.backend 'sqlite' needs a file"):
        ExperiencePool(PoolConfig(backend="sqlite"))

    disk = ExperiencePool(PoolConfig(backend="sqlite", memory_capacity=1),
                          path_default=str(tmp_path / "d.sqlite"))
    disk.add([traj(0), traj(1)])  # id0 spills to the file
    with pytest.raises(DuplicateTrajectoryError, match="'id0' is already in the pool"):
        disk.add([traj(2), traj(0)])
    assert len(disk) == 2
    disk.close()
    (tmp_path / "junk.sqlite").write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match="SQLiteStore: .*junk.sqlite is not a usable"):
        SQLiteStore(tmp_path / "junk.sqlite")


def test_unreachable_redis_names_the_url():
    pytest.importorskip("redis")
    url = f"redis://user:secret@127.0.0.1:{_free_port()}/0"
    with pytest.raises(ConnectionError, match=r"cannot reach the Redis server at "
                                              r"redis://user:\*\*\*@127\.0\.0\.1:\d+/0"):
        ExperiencePool(PoolConfig(backend="redis", redis_url=url))
    with pytest.raises(ValueError, match="RedisStore: redis_url expected"):
        RedisStore("http://127.0.0.1:1", "ns")


# --------------------------------------------------------------------------- redis


def test_redis_pools_share_a_namespace(redis_url):
    cfg = PoolConfig(backend="redis", redis_url=redis_url, namespace=f"n-{uuid.uuid4().hex}")
    a = ExperiencePool(cfg, clock=lambda: NOW)
    b = ExperiencePool(cfg, clock=lambda: NOW)
    a.add([traj(i, TYPES[i % 3], float(i)) for i in range(9)])
    assert b.counts_by_type() == {"t0": 3, "t1": 3, "t2": 3}
    got = b.sample(4)
    assert len(a) == 5 and not (ids_of(a) & ids_of(got))
    held = min(ids_of(a))
    with pytest.raises(DuplicateTrajectoryError, match=f"RedisStore.add: traj_id '{held}'"):
        b.add([traj(100), traj(int(held[2:]))])
    assert len(a) == 5 and "id100" not in ids_of(a)  # all or nothing
    with pytest.raises(ValueError, match=f"namespace '{cfg.namespace}' holds keys computed"):
        ExperiencePool(PoolConfig(backend="redis", redis_url=redis_url,
                                  namespace=cfg.namespace, decay=0.5))
    a.sample(len(a))
    import redis

    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    # drained: no sorted set or type entry is left behind, only the key parameters
    assert set(raw.keys(f"{{{cfg.namespace}}}:*")) == {f"{{{cfg.namespace}}}:meta"}
    raw.close()
    a.close()
    b.close()


@pytest.mark.parametrize("mode", ["greedy", "proportional"])
def test_redis_concurrent_consumers_never_share_or_lose(redis_url, mode):
    """Two pools on one namespace drain it from two threads while a third keeps adding: every
    trajectory comes out exactly once."""
    cfg = PoolConfig(backend="redis", redis_url=redis_url, namespace=f"c-{uuid.uuid4().hex}",
                     sample_mode=mode, min_task_types=2)
    producer = ExperiencePool(cfg, clock=lambda: NOW)
    first = [traj(i, TYPES[i % 4], float(i % 9)) for i in range(240)]
    later = [traj(i, TYPES[i % 4], float(i % 5)) for i in range(240, 400)]
    producer.add(first)
    consumers = [ExperiencePool(cfg, clock=lambda: NOW, seed=s) for s in (1, 2)]
    out: list[list[str]] = [[], []]
    done_adding = threading.Event()
    errors: list[BaseException] = []

    def consume(k):
        try:
            while True:
                batch = consumers[k].sample(5)
                out[k] += [t.traj_id for t in batch]
                if not batch and done_adding.is_set() and not len(consumers[k]):
                    return
        except BaseException as e:  # surfaced below: a thread's failure must fail the test
            errors.append(e)

    def produce():
        try:
            for s in range(0, len(later), 20):
                producer.add(later[s:s + 20])
        except BaseException as e:
            errors.append(e)
        finally:
            done_adding.set()

    threads = [threading.Thread(target=consume, args=(k,)) for k in (0, 1)]
    threads.append(threading.Thread(target=produce))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    every = out[0] + out[1]
    assert len(every) == len(set(every)), "a trajectory was sampled twice"
    assert set(every) == ids_of(first + later)
    assert out[0] and out[1]
    for p in (producer, *consumers):
        p.close()


def test_stores_share_one_interface(tmp_path, redis_url):
    """The three stores answer the Store calls alike (keys given, not computed)."""
    stores = [MemoryStore(), SQLiteStore(tmp_path / "s.sqlite"),
              RedisStore(redis_url, f"s-{uuid.uuid4().hex}")]
    items = [(traj(i, TYPES[i % 2]), float(i)) for i in range(6)]
    for s in stores:
        s.add(items)
        assert len(s) == 6 and s.counts() == {"t0": 3, "t1": 3}
        assert s.top("t0", 2) == [(4.0, "id4"), (2.0, "id2")]
        assert sorted(s.entries()) == sorted((t.traj_id, t.task_type, k) for t, k in items)
        assert s.take([("id4", "t0"), ("id9", "t1")]) is None and len(s) == 6
        assert [t.traj_id for t in s.take([("id4", "t0"), ("id1", "t1")])] == ["id4", "id1"]
        assert s.get([("id4", "t0")]) is None
        assert sorted(t.traj_id for t in s.remove(["id0", "id4", "id5"])) == ["id0", "id5"]
        assert ids_of(s) == {"id2", "id3"} and s.contains(["id2", "id5"]) == {"id2"}
        with pytest.raises(DuplicateTrajectoryError):
            s.add([(traj(2), 0.0)])
        s.close()


def test_evict_older_than_removes_exactly_the_stale(make_pool):
    # sqlite: most items spill to the file (memory: capacity is a hard bound, keep all 6)
    pool = make_pool(memory_capacity=2 if make_pool.backend == "sqlite" else 64)
    ts = []
    for i in range(6):
        t = traj(i, task_type=TYPES[i % 3], advantage=float(i))
        # oldest version that sampled a token: 0, 1, 2, 0, 1, 2
        t.completion_ids, t.logprobs, t.versions = [3, 4], [-0.5, -0.5], [i % 3, 2]
        ts.append(t)
    pool.add(ts)
    assert pool.evict_older_than(1) == 2  # the two with a version-0 token
    assert {t.traj_id for t in pool} == {"id1", "id2", "id4", "id5"}
    assert pool.evict_older_than(1) == 0 and len(pool) == 4
    assert pool.evict_older_than(3) == 4 and len(pool) == 0
    with pytest.raises(TypeError, match="evict_older_than: min_version expected an int"):
        pool.evict_older_than(1.5)
