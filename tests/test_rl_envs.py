"""The env protocol: registry, countdown's exact checking, episodes checkpointed every 5 steps and
resumed, a crashed episode recorded with its reason and no earlier step lost."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from glm5.rl.envs.base import (CHECKPOINT_EVERY, ENVS, EpisodeRunner, StepResult, make_env,
                               register_env)
from glm5.rl.envs.countdown import CountdownEnv, ExpressionError, evaluate


@pytest.mark.parametrize("expr,value,used", [
    ("1 + 2 * 3", Fraction(7), [1, 2, 3]), ("(1 + 2) * 3", Fraction(9), [1, 2, 3]),
    ("7 / 2", Fraction(7, 2), [7, 2]), ("-(4 - 10)", Fraction(6), [4, 10]),
    (" 25 ", Fraction(25), [25]),
])
def test_evaluate_by_hand(expr, value, used):
    assert evaluate(expr) == (value, used)


@pytest.mark.parametrize("expr,msg", [
    ("__import__('os')", "only integers"), ("2 ** 10", "only integers"), ("1 +", "syntax"),
    ("3 / (2 - 2)", "division by zero"), ("1.5 + 1", "only integers"), ("x + 1", "only"),
    ("1" * 300, "longer than"),
])
def test_evaluate_refuses(expr, msg):
    with pytest.raises(ExpressionError, match=msg):
        evaluate(expr)


def test_countdown_episode():
    env = make_env("countdown", n_numbers=3, max_number=9, max_attempts=3)
    obs = env.reset(seed=4)
    assert f"Target: {env.target}" in obs
    a, b, c = env.numbers
    # every target is reachable from the numbers (checked over many seeds)
    for s in range(200):
        env.reset(seed=s)
        assert env.target >= 1
    env.reset(seed=4)
    r = env.step(f"{a} + {a} + {a} + {a}" if env.numbers.count(a) < 4 else "1 +")
    assert r.reward == 0.0 and not r.done and "not available" in r.observation
    r = env.step("((")
    assert r.reward == 0.0 and "Invalid expression" in r.observation and "1 attempt" in r.observation
    r = env.step("0")
    assert r.done and r.reward == 0.0  # out of attempts
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("1")


def _solve(env: CountdownEnv) -> str:
    """A brute-force solver over + - * (the generator's operations) for the tests."""
    import itertools

    nums = env.numbers
    for k in range(2, len(nums) + 1):
        for perm in itertools.permutations(range(len(nums)), k):
            for ops in itertools.product("+-*", repeat=k - 1):
                expr = str(nums[perm[0]])
                for op, i in zip(ops, perm[1:]):
                    expr = f"({expr} {op} {nums[i]})"
                if evaluate(expr)[0] == env.target:
                    return expr
    raise AssertionError("unsolvable")


def test_countdown_solved_gets_reward_one():
    env = CountdownEnv(n_numbers=4, max_number=12)
    for s in range(20):
        env.reset(seed=s)
        r = env.step(_solve(env))
        assert (r.reward, r.done, r.observation) == (1.0, True, "Correct.")


class Counter5:
    """A test env: counts steps, done at ``n``; ``crash_at`` raises."""

    name = "counter"

    def __init__(self, n: int = 12, crash_at: int | None = None) -> None:
        self.n, self.crash_at, self.i = n, crash_at, 0

    def reset(self, seed: int) -> str:
        self.i = seed
        return f"at {self.i}"

    def step(self, action: str) -> StepResult:
        if self.crash_at is not None and self.i == self.crash_at:
            raise OSError("disk on fire")
        self.i += 1
        return StepResult(f"at {self.i}", 1.0, self.i >= self.n, {})

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


def test_checkpoint_every_5_steps_and_resume(tmp_path):
    assert CHECKPOINT_EVERY == 5
    ck = tmp_path / "ep.json"
    run = EpisodeRunner(Counter5(n=12), ck)
    run.reset(seed=0)
    for _ in range(7):
        run.step("go")
    saved = json.loads(ck.read_text())
    assert len(saved["episode"]["steps"]) == 5 and saved["env"] == {"i": 5}
    # a hard crash here loses steps 6-7 only; the resumed episode continues from step 5
    again = EpisodeRunner(Counter5(n=12), ck)
    ep = again.resume()
    assert len(ep.steps) == 5 and again.observation == "at 5"
    while again.episode.ended is None:
        again.step("go")
    assert again.episode.ended == "done" and len(again.episode.steps) == 12
    assert again.episode.total_reward == 12.0
    with pytest.raises(RuntimeError, match="has ended"):
        again.step("go")


def test_crashed_episode_is_recorded_with_its_steps(tmp_path):
    ck = tmp_path / "ep.json"
    run = EpisodeRunner(Counter5(n=20, crash_at=7), ck)
    run.reset(seed=0)
    for _ in range(7):
        run.step("go")
    with pytest.raises(OSError):
        run.step("go")
    saved = json.loads(ck.read_text())
    assert saved["episode"]["ended"] == "error: OSError: disk on fire"
    assert len(saved["episode"]["steps"]) == 7  # steps 6 and 7 too, past the last checkpoint
    run2 = EpisodeRunner(Counter5(n=20), tmp_path / "b.json", max_steps=3)
    run2.reset(seed=0)
    run2.step("a")
    assert run2.end("timeout").ended == "timeout"
    assert json.loads((tmp_path / "b.json").read_text())["episode"]["ended"] == "timeout"
    run3 = EpisodeRunner(Counter5(n=20), tmp_path / "c.json", max_steps=3)
    run3.reset(seed=0)
    for _ in range(3):
        run3.step("a")
    assert run3.episode.ended == "max_steps"


def test_registry_errors():
    assert "countdown" in ENVS
    with pytest.raises(ValueError, match="unknown environment type 'nope'"):
        make_env("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_env("countdown", CountdownEnv)
    with pytest.raises(ValueError, match="bad params"):
        make_env("countdown", colour=1)
    with pytest.raises(ValueError, match="n_numbers expected an int >= 2"):
        make_env("countdown", n_numbers=1)
    with pytest.raises(RuntimeError, match="call reset"):
        EpisodeRunner(Counter5(), "/tmp/x.json").step("a")


def _call(name, **args):
    inner = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{inner}</tool_call>"


def test_search_env_tool_use_in_the_chat_format():
    env = make_env("search", n_countries=6)
    obs = env.reset(seed=3)
    assert obs.startswith("Question: ")
    country = next(w for w in env.question.rstrip("?").split() if w.endswith("land"))
    r = env.step("<think>look it up</think>" + _call("search", query=country, k=2))
    hits = json.loads(r.observation)[0]["result"]
    assert not r.done and r.reward == 0.0 and 1 <= len(hits) <= 2
    assert any(country in h["title"] for h in hits)
    doc = next(h["doc_id"] for h in hits if h["title"] == country)
    r = env.step(_call("open", doc_id=doc))
    body = json.loads(r.observation)[0]["result"]["body"]
    assert env.answer.lower() in body.lower()
    r = env.step(f"  {env.answer.upper()}. ")  # case, punctuation and spaces ignored
    assert (r.reward, r.done, r.info["gold"]) == (1.0, True, env.answer)


def test_search_env_errors_are_observations_not_crashes():
    env = make_env("search", n_countries=4, max_turns=8)
    env.reset(seed=1)
    bad = [
        ("<tool_call>search<arg_key>query</arg_key>oops</tool_call>", "malformed tool call"),
        (_call("fly", to="moon"), "unknown tool"),
        (_call("search", q="x"), "bad arguments"),
        (_call("open", doc_id=999), "doc_id expected an int in"),
        (_call("search", query="!!!"), "query has no words"),
        (_call("search", query='a" OR "b', k=50), "k expected an int in [1, 10]"),
    ]
    for action, msg in bad:
        r = env.step(action)
        assert msg in r.observation and r.reward == 0.0 and not r.done, (action, r)
    r = env.step("wrong answer")
    assert r.done and r.reward == 0.0


def test_search_env_turn_limit_and_resume(tmp_path):
    env = make_env("search", n_countries=4, max_turns=2)
    run = EpisodeRunner(env, tmp_path / "s.json", every=1)
    run.reset(seed=5)
    run.step(_call("search", query="capital"))
    env2 = make_env("search", n_countries=4, max_turns=2)
    run2 = EpisodeRunner(env2, tmp_path / "s.json", every=1)
    run2.resume()
    assert env2.question == env.question and env2.turns == 1
    r = run2.step(_call("search", query="river"))
    assert r.done and run2.episode.ended == "done"  # the second of two turns ends it
