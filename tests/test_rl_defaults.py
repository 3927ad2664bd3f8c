"""The RL defaults learn: a config naming only its task and steps learns a digit task; the
completion length comes from the tasks; stale drops are measured per step and warned about."""

from __future__ import annotations

import logging

import pytest

from glm5.rl.config import DEFAULT_MAX_TOKENS, RLConfig
from glm5.rl.loop import RLRun
from glm5.rl.tasks import TASKS, answer_limit, make_task, register_task

LEARN_STEPS = 140
LEARN_TARGET = 0.6  # the bar: mean reward of the last LAST steps
LAST = 20


def _run(tmp_path, d) -> RLRun:
    d = {**d, "run": {"out_dir": str(tmp_path), "tensorboard": False, **d.get("run", {})}}
    return RLRun(RLConfig.from_dict(d), resume=False)


def test_answer_limit_is_the_longest_answer_with_its_stop_token():
    tasks = [make_task("copy", {"length": [1, 3]}), make_task("min", {"length": 4})]
    assert answer_limit(tasks) == 4  # copy: 3 digits + EOS; min: 1 digit + EOS

    class NoLimit:
        name = "free"

    assert answer_limit([*tasks, NoLimit()]) is None
    assert answer_limit([]) is None


def test_max_tokens_defaults_to_the_tasks_answer_length(tmp_path):
    run = _run(tmp_path, {"tasks": [{"name": "reverse", "params": {"length": 2}}],
                          "run": {"steps": 1}})
    try:
        assert run.cfg.rollout.max_tokens == 3
        s = run.train()
        assert s.steps == 1
        assert max(len(t.completion_ids) for t in run.pool.call("sample", 10**6)) <= 3
    finally:
        run.close()
    given = _run(tmp_path / "given", {"tasks": [{"name": "reverse"}],
                                      "rollout": {"max_tokens": 7}, "run": {"steps": 1}})
    try:
        assert given.cfg.rollout.max_tokens == 7
    finally:
        given.close()


class _NoLimit:
    """A task of a user's own that does not say how long its answers are."""

    def __init__(self) -> None:
        self._t = make_task("reverse", {"length": 2})
        self.name, self.stop_token_ids = "no_limit", self._t.stop_token_ids

    def sample(self, rng):
        return self._t.sample(rng)

    def score(self, meta, completion_ids):
        return self._t.score(meta, completion_ids)


def test_max_tokens_falls_back_when_a_task_does_not_say(tmp_path):
    if "no_limit" not in TASKS:
        register_task("no_limit", _NoLimit)
    run = _run(tmp_path, {"tasks": [{"name": "no_limit"}], "run": {"steps": 1}})
    try:
        assert run.cfg.rollout.max_tokens == DEFAULT_MAX_TOKENS
    finally:
        run.close()


def test_most_data_dropped_is_measured_and_warned(tmp_path, caplog):
    # async, max_staleness 0: a trajectory that waited across a push is dropped (2/3 here)
    d = {"tasks": [{"name": "reverse", "params": {"length": 2, "base": 3}}],
         "rollout": {"group_size": 4, "groups_per_step": 4},
         "sync": {"max_staleness": 0}, "run": {"steps": 12}}
    with caplog.at_level(logging.WARNING, logger="glm5"):
        run = _run(tmp_path, d)
        try:
            run.train()
        finally:
            run.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("sync.max_staleness 0 in async mode" in m for m in msgs)  # said up front
    measured = [m for m in msgs if "were dropped as stale" in m]
    assert len(measured) == 1, msgs  # once per run
    dropped = sum(r["dropped_stale"] for r in run.history)
    trained = sum(r["trained"] for r in run.history)
    assert dropped == run.dropped_stale and dropped > trained


def test_a_config_of_task_and_steps_learns(tmp_path):
    """Every other setting at its default (async, weights pushed every step, max_tokens from
    the task): the reward climbs from chance (~0.01) past 0.6 — measured 0.67-0.72 over steps
    120-140 in separate runs (docs/rl.md, "Sync interval and staleness"). The bar is the
    issue's; the copy task because its plateau without EOS (3 of 4 positions, 0.75) lies above
    it, while a 2-digit task's (2/3) sits at it."""
    run = _run(tmp_path, {"tasks": [{"name": "copy", "params": {"length": 3, "base": 3}}],
                          "run": {"steps": LEARN_STEPS}})
    try:
        run.train()
    finally:
        run.close()
    rewards = [r["reward"] for r in run.history]
    first = sum(rewards[:LAST]) / LAST
    last = sum(rewards[-LAST:]) / LAST
    print(f"reward: first {LAST} steps {first:.3f}, last {LAST} {last:.3f}")
    assert first < 0.1, first
    assert last > LEARN_TARGET, (first, last)
