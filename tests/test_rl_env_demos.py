"""Golden tests of `demonstration()` (expert turns for warm starts): for every environment type
and several seeds, playing the demonstration through `step()` ends the episode with total
reward 1.0; the turns are well-formed GLM-5 tool calls and a plain final answer; a planted
wrong answer gets 0; a resumed episode still demonstrates."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from glm5.rl.envs.base import _BUILTIN, make_env
from glm5.rl.envs.countdown import evaluate
from glm5.rl.envs.search import SearchEnv
from glm5.rl.envs.workspace import BUGS, TERMINAL_TASKS
from glm5.text.chat import parse_chat_output

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "true",
    reason="bubblewrap (bwrap) is not installed (CI installs it)")


def _play(env, turns: list[str]) -> tuple[float, list]:
    """Feed ``turns`` to ``env.step``; (total reward, results). Every turn but the last must
    leave the episode running and the last must end it."""
    results = [env.step(t) for t in turns]
    assert [r.done for r in results] == [False] * (len(turns) - 1) + [True], results
    return sum(r.reward for r in results), results


def _check_form(turns: list[str]) -> None:
    """Demonstrations are what a model would emit: each turn before the last is exactly one
    tool call (nothing else), the last is a plain answer; all short."""
    assert 1 <= len(turns) <= 3
    for t in turns[:-1]:
        p = parse_chat_output(t, thinking=False)
        assert len(p.tool_calls) == 1 and p.content == "" and p.reasoning is None, t
    last = parse_chat_output(turns[-1], thinking=False)
    assert not last.tool_calls and last.content == turns[-1].strip() != ""
    assert "<|" not in "".join(turns)  # no role or stop tokens


def test_every_builtin_type_demonstrates():
    assert set(_BUILTIN) >= {"countdown", "search", "codefix", "terminal", "data"}
    for name in _BUILTIN:
        env = make_env(name)
        assert callable(getattr(env, "demonstration", None)), name
        with pytest.raises(RuntimeError, match="call reset"):
            env.demonstration()  # nothing to demonstrate before an episode


def test_countdown_demonstrations():
    for params in ({}, {"n_numbers": 6, "max_number": 50}, {"n_numbers": 2}):
        env = make_env("countdown", **params)
        for seed in range(60):
            env.reset(seed)
            turns = env.demonstration()
            _check_form(turns)
            total, _ = _play(env, turns)
            assert total == 1.0, (params, seed, turns, env.target)
    env = make_env("countdown", max_attempts=1)
    env.reset(3)
    expr = env.demonstration()[0]
    assert evaluate(expr)[0] == env.target
    total, _ = _play(env, [f"{expr}+1"])  # planted wrong answer
    assert total == 0.0


def test_countdown_resumed_episode_still_demonstrates():
    env = make_env("countdown")
    env.reset(9)
    env.step("1+")  # a failed attempt, then a checkpoint
    state = json.loads(json.dumps(env.state_dict()))
    fresh = make_env("countdown")
    fresh.load_state_dict(state)
    assert fresh.demonstration() == env.demonstration()
    total, _ = _play(fresh, fresh.demonstration())
    assert total == 1.0
    del state["expression"]  # a checkpoint from before demonstrations existed
    old = make_env("countdown")
    old.load_state_dict(state)
    with pytest.raises(RuntimeError, match="demonstration"):
        old.demonstration()


def test_search_demonstrations_are_grounded_and_short():
    env = make_env("search")
    for seed in range(40):
        env.reset(seed)
        turns = env.demonstration()
        _check_form(turns)
        # the synthetic corpus's snippets show the answer: no `open` needed
        assert len(turns) == 2 and turns[0].startswith("<tool_call>search<"), turns
        total, results = _play(env, turns)
        assert total == 1.0
        # the answer is in what the search returned (the demo does not guess)
        assert env.answer.lower() in results[0].observation.lower()
    env.reset(0)
    total, _ = _play(env, turns[:-1] + ["Atlantis"])  # planted wrong answer
    assert total == 0.0


def test_search_demonstration_opens_the_document_when_snippets_miss():
    filler = " ".join(f"word{i}" for i in range(40))
    corpus = [("Zorblat facts", f"Zorblat is old. {filler} The secret code is Quuxor."),
              ("Other", "Nothing about codes here. " + filler)]
    env = SearchEnv(corpus=corpus, questions=[("What is the zorblat code?", "Quuxor")])
    env.reset(0)
    turns = env.demonstration()
    _check_form(turns)
    assert len(turns) == 3 and "<tool_call>open<" in turns[1], turns
    total, results = _play(env, turns)
    assert total == 1.0 and "Quuxor" not in results[0].observation
    assert "Quuxor" in results[1].observation


def _seed_for(k: int, n: int) -> int:
    """A seed whose episode draws choice ``k`` of ``n`` (codefix and terminal draw first)."""
    return next(s for s in range(1000) if random.Random(s).randrange(n) == k)


@needs_bwrap
@pytest.mark.parametrize("k", range(len(BUGS)))
def test_codefix_demonstrations(k):
    env = make_env("codefix")
    try:
        seed = _seed_for(k, len(BUGS))
        env.reset(seed)
        assert env.module == BUGS[k][0]
        turns = env.demonstration()
        _check_form(turns)
        total, results = _play(env, turns)
        assert total == 1.0 and results[-1].info["tests"]["failed"] == 0
        env.reset(seed)
        total, _ = _play(env, turns[-1:])  # the answer without the fix
        assert total < 1.0
    finally:
        env.close()


@needs_bwrap
def test_terminal_demonstrations():
    env = make_env("terminal")
    seeds = [_seed_for(k, len(TERMINAL_TASKS)) for k in range(len(TERMINAL_TASKS))]
    try:
        for seed in seeds + [s for s in range(6) if s not in seeds]:
            env.reset(seed)
            turns = env.demonstration()
            _check_form(turns)
            total, results = _play(env, turns)
            assert total == 1.0, (seed, turns, results)
            assert json.loads(results[0].observation)[0]["result"]["exit"] == 0
            env.reset(seed)
            total, _ = _play(env, turns[-1:])  # claims done without doing it
            assert total == 0.0
    finally:
        env.close()


@needs_bwrap
def test_data_demonstrations():
    env = make_env("data")
    kinds = set()
    try:
        for seed in range(12):
            env.reset(seed)
            kinds.add(env.kind)
            turns = env.demonstration()
            _check_form(turns)
            total, results = _play(env, turns)
            assert total == 1.0, (seed, turns, results[-1].info)
            # the command's output is the answer: the demo computes it, it does not guess
            assert json.loads(results[0].observation)[0]["result"]["stdout"].strip() == env.gold
            env.reset(seed)
            total, _ = _play(env, turns[:-1] + ["Nowhere 0"])  # planted wrong answer
            assert total == 0.0
        assert len(kinds) == 4, kinds
    finally:
        env.close()
