"""The multi-component reward: built-in components by hand, the default 0.6 / 0.3 / 0.1
weighting, a plugged-in component, and the error paths."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm5.rl import reward as R
from glm5.rl.config import RewardConfig
from glm5.rl.reward import (COMPONENTS, DEFAULT_WEIGHTS, CompositeReward, RewardContext,
                            count_steps, register_component, repeated_ngram_fraction)
from glm5.rl.trajectory import Trajectory


def _ctx(text=None, correctness=1.0, **meta) -> RewardContext:
    return RewardContext(task_type="math", prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                         text=text, task_score={"correctness": correctness}, meta=meta)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Components registered by a test vanish after it."""
    monkeypatch.setattr(R, "COMPONENTS", dict(COMPONENTS))
    return R.COMPONENTS


TWO_STEPS = "1. add the units\n2. carry the one\nAnswer: 42"


def test_default_weights_are_glm5s():
    assert DEFAULT_WEIGHTS == {"correctness": 0.6, "reasoning_steps": 0.3, "clarity": 0.1}
    assert CompositeReward().weights == DEFAULT_WEIGHTS


def test_default_total_by_hand():
    # correctness 1, 2 of 3 steps, clarity 1: 0.6 + 0.3 * 2/3 + 0.1 = 0.9
    total, parts = CompositeReward()(_ctx(TWO_STEPS, answer_marker="Answer:"))
    assert parts == pytest.approx({"correctness": 1.0, "reasoning_steps": 2 / 3, "clarity": 1.0})
    assert total == pytest.approx(0.9)
    # wrong answer, 3+ steps, marker missing (clarity 0.5): 0 + 0.3 + 0.05
    text = "Step 1: a\nStep 2: b\n- c\n- d\nso 41"
    total, parts = CompositeReward()(_ctx(text, correctness=0.0, answer_marker="Answer:"))
    assert parts == {"correctness": 0.0, "reasoning_steps": 1.0, "clarity": 0.5}
    assert total == pytest.approx(0.35)
    # no text: only correctness counts
    total, parts = CompositeReward()(_ctx(None, correctness=1.0))
    assert parts == {"correctness": 1.0, "reasoning_steps": 0.0, "clarity": 0.0}
    assert total == pytest.approx(0.6)


def test_weights_are_normalised_by_their_sum():
    ctx = _ctx(TWO_STEPS, correctness=0.5)
    # scaling every weight changes nothing
    a, _ = CompositeReward({"correctness": 6, "reasoning_steps": 3, "clarity": 1})(ctx)
    b, _ = CompositeReward(DEFAULT_WEIGHTS)(ctx)
    assert a == pytest.approx(b) == pytest.approx(0.6 * 0.5 + 0.3 * 2 / 3 + 0.1)
    # weights 2 and 1 on correctness 0.5 and steps 2/3: (1 + 2/3) / 3
    total, _ = CompositeReward({"correctness": 2.0, "reasoning_steps": 1.0})(ctx)
    assert total == pytest.approx((2 * 0.5 + 2 / 3) / 3)
    # a zero weight is allowed and reported, but adds nothing
    total, parts = CompositeReward({"correctness": 1.0, "clarity": 0.0})(ctx)
    assert total == 0.5 and parts["clarity"] == 1.0


@given(values=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
       weights=st.lists(st.floats(0.0, 100.0), min_size=2, max_size=2).filter(
           lambda w: sum(w) > 1e-6))
def test_total_is_the_weighted_mean(values, weights):
    ctx = RewardContext("t", [1], [2], task_score={"correctness": values[0],
                                                   "format": values[1]})
    total, parts = CompositeReward({"correctness": weights[0], "format": weights[1]})(ctx)
    assert parts == {"correctness": values[0], "format": values[1]}
    want = (weights[0] * values[0] + weights[1] * values[1]) / (weights[0] + weights[1])
    assert total == pytest.approx(want, abs=1e-12)
    assert 0.0 <= total <= 1.0


def test_count_steps_markers():
    text = ("1. one\n  2) two\nStep 3: three\nstep 4 : four\n- five\n-not a step\n"
            "3.5 is a number\nno step\n10. ten")
    assert count_steps(text) == 6
    assert count_steps("") == 0


def test_reasoning_steps_target_from_meta():
    assert R.reasoning_steps(_ctx(TWO_STEPS)) == pytest.approx(2 / 3)
    assert R.reasoning_steps(_ctx(TWO_STEPS, target_steps=2)) == 1.0
    assert R.reasoning_steps(_ctx(TWO_STEPS, target_steps=4)) == 0.5
    assert R.reasoning_steps(_ctx("- a\n- b\n- c\n- d\n- e")) == 1.0  # capped at 1
    assert R.reasoning_steps(_ctx(None)) == 0.0


def test_clarity_penalties():
    ok = "The answer is 7."
    assert R.clarity(_ctx(ok)) == 1.0
    assert R.clarity(_ctx(ok, answer_marker="####")) == 0.5
    assert R.clarity(_ctx(ok + " #### 7", answer_marker="####")) == 1.0
    assert R.clarity(_ctx(ok, max_chars=10)) == pytest.approx(0.8)
    loop = "so we add one " * 6  # 24 words, 21 four-grams, 4 distinct: 17/21 repeated
    assert repeated_ngram_fraction(loop, 4) == pytest.approx(17 / 21)
    assert R.clarity(_ctx(loop)) == pytest.approx(0.7)
    assert R.clarity(_ctx(loop, max_repeat=0.9)) == 1.0
    # all three penalties: 0.5 + 0.3 + 0.2 = 1
    assert R.clarity(_ctx(loop, answer_marker="####", max_chars=20)) == 0.0
    assert R.clarity(_ctx(None)) == 0.0
    assert repeated_ngram_fraction("too short", 4) == 0.0


def test_format_component_reads_the_task_score():
    ctx = RewardContext("t", [1], [2], task_score={"correctness": 1.0, "format": 0.25})
    assert CompositeReward({"format": 1.0})(ctx) == (0.25, {"format": 0.25})


def test_custom_component_plugs_in(scratch_registry):
    @register_component("short")
    def short(ctx: RewardContext) -> float:
        return 1.0 if len(ctx.completion_ids) <= 2 else 0.0

    assert "short" in scratch_registry
    r = CompositeReward({"correctness": 3.0, "short": 1.0})
    total, parts = r(_ctx(None, correctness=1.0))  # 3 completion ids: short = 0
    assert parts == {"correctness": 1.0, "short": 0.0} and total == pytest.approx(0.75)
    with pytest.raises(ValueError, match=r"component 'short' is already registered"):
        register_component("short")(lambda ctx: 0.0)
    register_component("short", replace=True)(lambda ctx: 1.0)
    assert r(_ctx(None))[0] == pytest.approx(0.75)  # built before the replacement
    assert CompositeReward({"correctness": 3.0, "short": 1.0})(_ctx(None))[0] == 1.0


def test_from_config_and_trajectory():
    r = CompositeReward.from_config(RewardConfig(components={"correctness": 1.0}))
    traj = Trajectory(traj_id="x", group_id="g", task_type="reverse", prompt_ids=[5, 6],
                      completion_ids=[6, 5], logprobs=[-0.1, -0.2], versions=[0, 0],
                      meta={"target_steps": 2})
    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0}, text="1. x\n2. y")
    assert (ctx.task_type, ctx.completion_ids, ctx.meta) == ("reverse", [6, 5],
                                                             {"target_steps": 2})
    assert r(ctx) == (1.0, {"correctness": 1.0})
    assert R.reasoning_steps(ctx) == 1.0


# ------------------------------------------------------------------------------ error paths


def test_construction_errors():
    with pytest.raises(ValueError, match=r"unknown reward component 'speed'; registered "
                                         r"components are \['clarity', 'correctness'"):
        CompositeReward({"correctness": 1.0, "speed": 1.0})
    with pytest.raises(ValueError, match=r"weight of 'clarity' expected a finite number >= 0"):
        CompositeReward({"correctness": 1.0, "clarity": -0.1})
    with pytest.raises(ValueError, match=r"weight of 'correctness' expected"):
        CompositeReward({"correctness": math.inf})
    with pytest.raises(ValueError, match=r"weights expected a positive sum"):
        CompositeReward({"correctness": 0.0, "clarity": 0.0})
    with pytest.raises(ValueError, match=r"at least one component"):
        CompositeReward({})
    with pytest.raises(ValueError, match=r"name expected a non-empty string"):
        register_component("")


@pytest.mark.parametrize("bad", [1.5, -0.01, math.nan, math.inf, "1", None])
def test_a_component_out_of_range_is_named(scratch_registry, bad):
    register_component("broken")(lambda ctx: bad)
    r = CompositeReward({"correctness": 1.0, "broken": 1.0})
    with pytest.raises(ValueError, match=r"component 'broken' returned .* for task 'math'; "
                                         r"expected a finite number in \[0, 1\]"):
        r(_ctx(None))


def test_task_score_and_meta_errors():
    ctx = RewardContext("t", [1], [2], task_score={})
    with pytest.raises(KeyError, match=r"component 'correctness': task 't' gave no "
                                       r"'correctness' score"):
        CompositeReward({"correctness": 1.0})(ctx)
    with pytest.raises(KeyError, match=r"gave no 'format' score"):
        CompositeReward({"format": 1.0})(_ctx("x"))
    with pytest.raises(ValueError, match=r"meta\['target_steps'\] of task 'math' expected an "
                                         r"integer >= 1"):
        R.reasoning_steps(_ctx("x", target_steps=0))
    with pytest.raises(ValueError, match=r"meta\['answer_marker'\]"):
        R.clarity(_ctx("x", answer_marker=""))
    with pytest.raises(ValueError, match=r"meta\['max_repeat'\]"):
        R.clarity(_ctx("x", max_repeat=2))
