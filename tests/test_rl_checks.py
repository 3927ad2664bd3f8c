"""The triple check: syntax, differential test on generated inputs, judge hook."""

from __future__ import annotations

import pytest

from glm5.rl.envs.checks import (differential_test, generate_inputs, judge_check,
                                 subprocess_runner, syntax_check, triple_check)

RUN = subprocess_runner(timeout=20)
BUGGY = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi - 1))\n"
FIXED = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"
REFACTORED = "def clamp(x, lo, hi):\n    return lo if x < lo else hi if x > hi else x\n"


def test_syntax_check_names_the_place():
    assert syntax_check(FIXED).ok
    r = syntax_check("def f(:\n    pass\n", "fix.py")
    assert not r.ok and r.message.startswith("fix.py:1:") and r.details["line"] == 1


def test_generate_inputs_edges_first_and_reproducible():
    a = generate_inputs(["int", "str", "list[int]"], 6, seed=1)
    assert a[:3] == [[0, "", []], [1, "a", [0]], [-1, "ab", [2, 1]]]
    assert a == generate_inputs(["int", "str", "list[int]"], 6, seed=1)
    with pytest.raises(ValueError, match="kinds expected from"):
        generate_inputs(["float"], 2)


def test_differential_finds_the_fix_and_accepts_the_refactoring():
    inputs = [[x, 0, 10] for x in (-5, 0, 3, 9, 10, 12)]
    fix = differential_test(BUGGY, FIXED, "clamp", inputs, RUN, expect="different")
    assert fix.ok and fix.details["differ"] == 2  # x = 10 and x = 12
    assert fix.details["first"] == [10, 0, 10]
    same = differential_test(FIXED, REFACTORED, "clamp", inputs, RUN, expect="same")
    assert same.ok and same.details["differ"] == 0
    broken = differential_test(FIXED, BUGGY, "clamp", inputs, RUN, expect="same")
    assert not broken.ok and "2 of 6 inputs differ" in broken.message


def test_differential_reports_exceptions_crashes_and_missing_functions():
    raises = "def clamp(x, lo, hi):\n    return [][0]\n"
    r = differential_test(FIXED, raises, "clamp", [[1, 0, 2]], RUN, expect="same")
    assert not r.ok and "IndexError" in r.details["after"]["raises"]
    r = differential_test(FIXED, "def other(): pass\n", "clamp", [[1, 0, 2]], RUN)
    assert not r.ok and "no function 'clamp'" in r.message
    r = differential_test(FIXED, "import os\nos._exit(3)\n", "clamp", [[1, 0, 2]], RUN)
    assert not r.ok and r.message.startswith("after: exit 3")


def test_judge_hook_and_triple_check():
    assert judge_check(lambda t, a: 0.9, "t", "a").ok
    assert not judge_check(lambda t, a: 0.1, "t", "a").ok
    r = judge_check(lambda t, a: 1 / 0, "t", "a")
    assert not r.ok and "ZeroDivisionError" in r.message
    assert not judge_check(lambda t, a: 7, "t", "a").ok
    seen = []
    res = triple_check(FIXED, before=BUGGY, func="clamp", inputs=[[12, 0, 10]], run=RUN,
                       judge=lambda t, a: seen.append((t, a)) or 1.0, task="fix clamp")
    assert [c.name for c in res] == ["syntax", "differential", "judge"]
    assert all(c.ok for c in res) and seen == [("fix clamp", FIXED)]
    res = triple_check("def clamp(:", before=BUGGY, func="clamp", inputs=[[1, 0, 2]], run=RUN)
    assert [c.name for c in res] == ["syntax"] and not res[0].ok
