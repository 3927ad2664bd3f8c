"""A rank that dies or hangs never hangs the others: in a 4-process world (gloo), rank 3 exits
(os._exit) or sleeps before an all_reduce, and ranks 0-2 fail within the collective timeout +
a few seconds with a `glm5.parallel.CollectiveError` naming the collective, their rank, the group's
ranks, the timeout and rank 3. The harness bounds every run and reaps every child."""

from __future__ import annotations

import os
import time

import torch

import glm5.parallel as gd
from glm5.testing.dist import DistPool, RankError, run_multiprocess

TIMEOUT_S = 3.0  # the collectives' timeout in these worlds
GRACE_S = 8.0  # what "a few seconds" past it may take (the fault report waits SLACK_S = 1 s)


def _all_reduce_after(ctx, mode: str) -> dict:
    if ctx.rank == 3:
        if mode == "kill":
            os._exit(3)
        time.sleep(TIMEOUT_S + GRACE_S + 1.0)  # past the others' timeout + report, then leaves
        return {"slept": True}
    t0 = time.monotonic()
    try:
        gd.all_reduce(torch.ones(4), ctx.world)
    except gd.CollectiveError as e:
        return {"type": type(e).__name__, "msg": str(e), "missing": e.missing, "dead": e.dead,
                "attrs": (e.collective, e.rank, e.group_ranks, e.timeout_s),
                "elapsed": time.monotonic() - t0}
    return {"type": None, "elapsed": time.monotonic() - t0}


def _check(out: dict, rank: int) -> None:
    assert out["type"] is not None, f"rank {rank}: the all_reduce completed without rank 3"
    assert out["elapsed"] <= TIMEOUT_S + GRACE_S, out
    assert out["attrs"] == ("all_reduce", rank, (0, 1, 2, 3), TIMEOUT_S)
    msg = out["msg"]
    assert msg.startswith(f"glm5.parallel.all_reduce "), msg
    assert f"on rank {rank} (group world of ranks [0, 1, 2, 3]" in msg, msg
    assert f"timeout {TIMEOUT_S:g} s" in msg, msg
    assert out["missing"] == [3], msg


def test_a_killed_rank_fails_the_others_with_an_error_naming_it():
    t0 = time.monotonic()
    res = run_multiprocess(_all_reduce_after, 4, 40.0, "kill", comm_timeout_s=TIMEOUT_S,
                           after_failure_s=TIMEOUT_S + GRACE_S + 5.0)
    wall = time.monotonic() - t0
    assert isinstance(res[3], RankError) and res[3].kind == "exited" and res[3].exitcode == 3
    for r in range(3):
        assert not isinstance(res[r], RankError), res[r]
        _check(res[r], r)
        assert res[r]["type"] in ("PeerLost", "CollectiveTimeout"), res[r]
        assert res[r]["dead"] == [3], res[r]
        assert "rank 3 exited" in res[r]["msg"], res[r]["msg"]
    assert wall < 30.0


def test_a_hung_rank_fails_the_others_at_the_timeout_with_an_error_naming_it():
    res = run_multiprocess(_all_reduce_after, 4, 40.0, "hang", comm_timeout_s=TIMEOUT_S,
                           after_failure_s=None)
    assert res[3] == {"slept": True}
    timed_out = 0
    for r in range(3):
        assert not isinstance(res[r], RankError), res[r]
        _check(res[r], r)  # names the collective, the rank, the group, rank 3 missing
        assert res[r]["dead"] == [], res[r]
        # the first ranks to time out abort their side of gloo's ring; a rank still waiting
        # then sees its connection break (PeerLost) — still naming rank 3 as missing
        assert res[r]["type"] in ("CollectiveTimeout", "PeerLost"), res[r]
        if res[r]["type"] == "CollectiveTimeout":
            timed_out += 1
            assert res[r]["elapsed"] >= TIMEOUT_S - 0.5, res[r]
            assert f"did not complete within the timeout of {TIMEOUT_S:g} s" in res[r]["msg"]
            assert "rank 3 did not reach or fail this collective" in res[r]["msg"], res[r]
    assert timed_out >= 1, res


def _raise_on_rank1(ctx) -> str:
    if ctx.rank == 1:
        raise ValueError("planted failure on rank 1")
    return "ok"


def _never_returns(ctx) -> None:
    time.sleep(600)


def test_harness_returns_exceptions_per_rank_and_bounds_a_stuck_run():
    res = run_multiprocess(_raise_on_rank1, 2, 30.0, comm_timeout_s=5.0)
    assert res[0] == "ok"
    assert isinstance(res[1], RankError) and res[1].kind == "raised"
    assert isinstance(res[1].exception, ValueError)
    assert "planted failure on rank 1" in res[1].message and "_raise_on_rank1" in res[1].traceback
    pool = DistPool(2)
    t0 = time.monotonic()
    res = pool.run(_never_returns, timeout_s=2.0)
    assert time.monotonic() - t0 < 3.0
    assert [r.kind for r in res] == ["timeout", "timeout"]
    assert pool.broken and "a task failed" in pool.broken
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 8.0  # terminate, then kill, then join
    assert all(p.exitcode is not None for p in pool._procs)
