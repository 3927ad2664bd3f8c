"""The data-analysis env: gold answers checked against an independent computation (csv module,
Decimal arithmetic) on the generated file, the exact check's edge cases (rounding, case,
thousands separators), ill-posed questions never asked, and episodes in the sandbox: the
file, the tools, malformed calls, wrong answers, resume."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import shutil
from collections import Counter
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

from glm5.rl.envs.base import EpisodeRunner, make_env
from glm5.rl.envs.data import (CSV_NAME, KINDS, DataEnv, _round2, answer_matches,
                               make_question, parse_number, to_csv)
from glm5.rl.envs.tools import tool_call

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "true",
    reason="bubblewrap (bwrap) is not installed (CI installs it)")


def _independent_gold(text: str, question: str) -> str:
    """The answer worked out from the CSV text and the question's words alone."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if m := re.fullmatch(r"How many units of product (\w+) were sold in total\?", question):
        return str(sum(int(r["units"]) for r in rows if r["product"] == m.group(1)))
    if question.startswith("Which region has the highest revenue"):
        rev: Counter[str] = Counter()
        for r in rows:
            rev[r["region"]] += int(r["units"]) * Decimal(r["price"])
        (top, v), (_, v2) = rev.most_common(2)
        assert v != v2, "a tie was asked"
        return top
    if m := re.fullmatch(r"How many rows have a price strictly above ([\d.]+)\?", question):
        return str(sum(Decimal(r["price"]) > Decimal(m.group(1)) for r in rows))
    if m := re.fullmatch(r"What is the mean of the (\w+) column, rounded to 2 decimals\?",
                         question):
        mean = sum(Decimal(r[m.group(1)]) for r in rows) / len(rows)
        up = mean.quantize(Decimal("0.01"), ROUND_HALF_UP)
        assert up == mean.quantize(Decimal("0.01"), ROUND_HALF_EVEN), "a halfway mean was asked"
        return str(up)
    raise AssertionError(f"unknown question {question!r}")


def test_gold_answers_match_an_independent_computation():
    kinds: Counter[str] = Counter()
    for seed in range(300):
        rows, kind, question, gold, _, _ = DataEnv.generate(seed)
        kinds[kind] += 1
        text = to_csv(rows)
        assert 5 <= len(text.splitlines()) - 1 <= 30
        assert _independent_gold(text, question) == gold, (seed, question)
    assert set(kinds) == set(KINDS) and min(kinds.values()) >= 30, kinds


def test_answers_need_the_data():
    """Names and values are random: the same question kind has many different answers, and the
    top region is not predictable from its position in the file."""
    golds: dict[str, set[str]] = {k: set() for k in KINDS}
    first_region_wins = top = 0
    for seed in range(400):
        rows, kind, _, gold, _, _ = DataEnv.generate(seed)
        golds[kind].add(gold)
        if kind == "top_region":
            top += 1
            first_region_wins += gold == rows[0][0]
    assert all(len(g) >= 20 for g in golds.values()), {k: len(g) for k, g in golds.items()}
    assert first_region_wins < 0.7 * top
    assert DataEnv.generate(5) == DataEnv.generate(5) != DataEnv.generate(6)


def test_n_rows_param():
    for seed in range(20):
        assert len(DataEnv.generate(seed, (7, 7))[0]) == 7
    for bad in (1, (3, 2), (0, 5), (2, 10_000), "5", (2.0, 5), True, (1, 2, 3)):
        with pytest.raises(ValueError, match="glm5 DataEnv: n_rows expected"):
            DataEnv(n_rows=bad)
    with pytest.raises(ValueError, match="max_turns"):
        DataEnv(max_turns=0)
    assert DataEnv(n_rows=[4, 9]).n_rows == (4, 9)  # a JSON config gives a list


def test_exact_check_edge_cases():
    ok = [("12.5", "12.50"), ("12.50", "12.50"), (" 12.50. ", "12.50"), ("+12.5", "12.50"),
          ("1,234", "1234"), ("1234.0", "1234"), ("7", "7"), ("0.5", "0.50"), (".5", "0.50")]
    bad = [("12.504", "12.50"), ("12.49", "12.50"), ("12,50", "12.50"), ("1,23,4", "1234"),
           ("12.5 units", "12.50"), ("", "7"), ("NaN", "7"), ("Infinity", "7"), ("1e3", "1000"),
           ("seven", "7"), ("7.", "70")]
    for a, g in ok:
        assert answer_matches(a, g, "number"), (a, g)
    for a, g in bad:
        assert not answer_matches(a, g, "number"), (a, g)
    assert parse_number("1,234.5") == Decimal("1234.5") and parse_number("1.2.3") is None
    assert answer_matches("kAzU", "Kazu", "name") and answer_matches(" Kazu.\n", "Kazu", "name")
    for a in ("Kazu region", "Kaz", "", "Kazu!", "Ka zu"):
        assert not answer_matches(a, "Kazu", "name"), a
    with pytest.raises(ValueError, match="answer_matches: kind"):
        answer_matches("1", "1", "float")


def test_rounding_is_exact_and_halfway_means_are_never_asked():
    assert _round2(Fraction(1, 3)) == Fraction(33, 100)
    assert _round2(Fraction(2, 3)) == Fraction(67, 100)
    assert _round2(Fraction(10049, 1000)) == Fraction(1005, 100)  # float round gives 10.05 too
    assert _round2(Fraction(2675, 1000)) is None  # halfway: float round() says 2.67, half-up 2.68
    assert _round2(Fraction(1, 8)) is None
    # units mean 9/8 = 1.125 and price mean 1.005: both halfway, so no mean question at all
    rows = [("A", "P", 2 if i == 0 else 1, 104 if i == 0 else 100) for i in range(8)]
    for s in range(10):
        assert make_question(random.Random(s), rows, "mean") is None
    # two prices a cent apart: the threshold is the lower one, so "strictly above" counts
    # only the higher price's rows (>= would count all three)
    rows = [("A", "P", 1, 100), ("B", "P", 1, 101), ("A", "Q", 3, 100)]
    q, gold, kind, _ = make_question(random.Random(0), rows, "count_above")
    assert (q, gold, kind) == ("How many rows have a price strictly above 1.00?", "1", "number")
    assert _independent_gold(to_csv(rows), q) == gold
    tie = [("A", "P", 2, 100), ("B", "P", 1, 200), ("C", "P", 1, 100)]  # A and B: 2.00 each
    assert make_question(random.Random(0), tie, "top_region") is None
    assert make_question(random.Random(0), tie[:1], "count_above") is None
    with pytest.raises(ValueError, match="make_question: kind"):
        make_question(random.Random(0), tie, "median")


def _one(result) -> dict:
    return json.loads(result.observation)[0]


@needs_bwrap
def test_episode_file_tools_and_answers():
    env = make_env("data", n_rows=(5, 12))
    try:
        for seed in range(6):
            obs = env.reset(seed)
            assert env.question in obs and CSV_NAME in obs
            text = to_csv(env.rows)
            assert _one(env.step(tool_call("read_file", path=CSV_NAME)))["result"] == text
            # python3 is there, as the prompt says: an independent computation inside
            py = ("import csv;r=list(csv.DictReader(open('sales.csv')));"
                  "print(len(r), sum(int(x['units']) for x in r))")
            out = _one(env.step(tool_call("shell", command=f'python3 -c "{py}"')))["result"]
            assert out["exit"] == 0, out
            assert out["stdout"].split() == [str(len(env.rows)),
                                             str(sum(r[2] for r in env.rows))]
            wrong = "Nowhere" if env.answer_type == "name" else str(Decimal(env.gold) + 1)
            r = env.step(wrong)
            assert (r.reward, r.done, r.info["gold"]) == (0.0, True, env.gold)
            env.reset(seed)
            given = (env.gold.upper() if env.answer_type == "name" else
                     env.gold + ("0" if "." in env.gold else ".0"))
            r = env.step(given)  # case and trailing zeros do not matter
            assert (r.reward, r.done) == (1.0, True), (given, env.gold)
    finally:
        env.close()


@needs_bwrap
def test_malformed_and_unknown_tool_calls_are_error_observations():
    env = make_env("data", max_turns=4)
    try:
        env.reset(3)
        r = env.step("<tool_call>shell<arg_key>command</arg_key>ls</tool_call>")
        assert r.observation.startswith("Error: malformed tool call") and not r.done
        r = env.step(tool_call("write_file", path="x.txt", content="hi"))  # not a tool here
        assert "unknown tool" in _one(r)["error"] and not r.done
        r = env.step(tool_call("shell", cmd="ls"))
        assert "bad arguments" in _one(r)["error"] and not r.done
        r = env.step(tool_call("read_file", path="../etc/passwd"))
        assert "relative path" in _one(r)["error"]
        assert r.done and r.reward == 0.0  # the 4th turn was the last
    finally:
        env.close()


@needs_bwrap
def test_episode_resumes_with_the_same_question(tmp_path):
    env = make_env("data")
    run = EpisodeRunner(env, tmp_path / "d.json", every=1)
    try:
        run.reset(seed=11)
        question, gold = env.question, env.gold
        run.step(tool_call("shell", command="echo note > notes.txt"))
    finally:
        env.close()
    env2 = make_env("data")
    try:
        run2 = EpisodeRunner(env2, tmp_path / "d.json", every=1)
        run2.resume()
        assert (env2.question, env2.gold, env2.turns) == (question, gold, 1)
        assert env2.text("notes.txt") == "note\n"
        r = run2.step(gold)
        assert r.reward == 1.0 and r.done
    finally:
        env2.close()
