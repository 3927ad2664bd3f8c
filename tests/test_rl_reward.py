"""The multi-component reward: built-in components by hand, the default 0.6 / 0.3 / 0.1
weighting, a plugged-in component, the text rules (steps with content, no credit for short
junk), the text the RL loop feeds the reward, the config check of text components, and the
error paths."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm5.rl import reward as R
from glm5.rl import tasks as T
from glm5.rl.config import RewardConfig
from glm5.rl.reward import (COMPONENTS, DEFAULT_WEIGHTS, CompositeReward, RewardContext,
                            count_steps, register_component, repeated_ngram_fraction,
                            step_contents, text_component_error)
from glm5.rl.trajectory import Trajectory


def _ctx(text=None, correctness=1.0, **meta) -> RewardContext:
    return RewardContext(task_type="math", prompt_ids=[1, 2], completion_ids=[3, 4, 5],
                         text=text, task_score={"correctness": correctness}, meta=meta)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Components registered by a test vanish after it."""
    monkeypatch.setattr(R, "COMPONENTS", dict(COMPONENTS))
    monkeypatch.setattr(R, "TEXT_COMPONENTS", set(R.TEXT_COMPONENTS))
    return R.COMPONENTS


@pytest.fixture
def scratch_tasks(monkeypatch):
    """Task types registered by a test vanish after it."""
    monkeypatch.setattr(T, "TASKS", dict(T.TASKS))
    monkeypatch.setattr(T, "TEXT_TASKS", set(T.TEXT_TASKS))
    return T.TASKS


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
    text = "Step 1: add the tens\nStep 2: add the ones\n- carry the one\n- check it\nso 41"
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
    text = ("1. list the digits\n  2) sort them up\nStep 3: drop the tens\nstep 4 : add 3+4\n"
            "- carry the one\n* check the sum\n-not a step here\n3.5 is a number\n"
            "no step at all\n10. then write it")
    assert step_contents(text) == ["list the digits", "sort them up", "drop the tens",
                                   "add 3+4", "carry the one", "check the sum", "then write it"]
    assert count_steps(text) == 7
    assert count_steps("") == 0


@pytest.mark.parametrize("text, steps", [
    # gaming: markers without content, one-word steps, the same step again and again
    ("- \n- \n- ", 0),
    ("-\n-\n-", 0),
    ("- a\n- a\n- a", 0),
    ("- a\n- b\n- c", 0),          # one word each
    ("1. a b\n2. c d\n3. e f", 0),  # two words but 3 visible characters each (< 5)
    ("1. !!!!!\n2. ?????\n3. ...", 0),
    ("Step 1: ok\nStep 2: ok\nStep 3: ok", 0),
    ("- add the ones\n- Add  the ones.\n- ADD THE ONES!", 1),  # one step, normalised
    # genuine steps: at least 2 words and 5 visible characters after the marker
    ("1. 3+4=7", 1),                  # words 3, 4, 7; 5 visible characters
    ("1. 3+4=7\n2. 7*2=14\n3. 14-5=9", 3),
    ("1. add the units\n2. carry the one\nAnswer: 42", 2),
    ("Step 1: read the file\nStep 2: fix the bug\nStep 3: run the tests", 3),
])
def test_steps_need_content_and_count_once(text, steps):
    assert count_steps(text) == steps
    assert R.reasoning_steps(_ctx(text)) == pytest.approx(min(1.0, steps / 3))


def test_reasoning_steps_target_from_meta():
    assert R.reasoning_steps(_ctx(TWO_STEPS)) == pytest.approx(2 / 3)
    assert R.reasoning_steps(_ctx(TWO_STEPS, target_steps=2)) == 1.0
    assert R.reasoning_steps(_ctx(TWO_STEPS, target_steps=4)) == 0.5
    five = "- list them\n- sort them\n- drop the tens\n- add the rest\n- write it down"
    assert R.reasoning_steps(_ctx(five)) == 1.0  # capped at 1
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


@pytest.mark.parametrize("text", ["", "   ", "ok", "!!!", "- \n- \n- ", "- a\n- a\n- a",
                                  "42", "a b c d", "ok ok ok ok ok ok", "yes no maybe",
                                  "#### 7"])
def test_clarity_gives_short_junk_nothing(text):
    # fewer than 4 distinct words or fewer than 12 visible characters: 0, whatever the meta
    assert R.clarity(_ctx(text)) == 0.0
    assert R.clarity(_ctx(text, answer_marker="####")) == 0.0


def test_clarity_by_hand_at_the_content_threshold():
    # "The answer is 7." : 4 distinct words, 13 visible characters: full marks
    assert R.has_clear_content("The answer is 7.")
    assert R.clarity(_ctx("The answer is 7.")) == 1.0
    # "the THE answer answer is" : 3 distinct words (case-folded): none
    assert not R.has_clear_content("the THE answer answer is")
    # "so x is 7" : 4 distinct words, 6 visible characters: none
    assert not R.has_clear_content("so x is 7")
    # genuine multi-step text with the marker: full marks on all three components
    text = "1. add the units\n2. carry the one\n3. add the tens\n#### 42"
    total, parts = CompositeReward()(_ctx(text, answer_marker="####"))
    assert parts == {"correctness": 1.0, "reasoning_steps": 1.0, "clarity": 1.0}
    assert total == 1.0


def test_illegible_text_has_no_content():
    # U+FFFD (undecodable bytes) or a control character: no clarity, no step
    assert R.clarity(_ctx("The answer is 7.")) == 1.0
    assert R.clarity(_ctx("The answer is 7.\ufffd")) == 0.0
    assert R.clarity(_ctx("The answer\x10 is 7.")) == 0.0
    assert R.clarity(_ctx("The answer\tis\r\n7.")) == 1.0  # tab, CR, newline are fine
    assert count_steps("1. add the units\n2. carry\ufffd the one\n3. add the\x00 tens") == 1
    # what an untrained byte-level policy writes (from examples/rl/agentic_ci.yaml's journal)
    assert R.clarity(_ctx("valers\ufffdtool\ufffd\x10 taL=\ufffd pro|>")) == 0.0


def test_gaming_text_no_longer_lifts_the_staged_reward():
    # a wrong answer dressed as steps: only what it is worth (nothing)
    for junk in ("- \n- \n- ", "- a\n- a\n- a", "ok", "!!!"):
        total, parts = CompositeReward()(_ctx(junk, correctness=0.0))
        assert parts == {"correctness": 0.0, "reasoning_steps": 0.0, "clarity": 0.0}, junk
        assert total == 0.0


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
    text = "1. swap the digits\n2. check the order"
    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0}, text=text)
    assert (ctx.task_type, ctx.completion_ids, ctx.meta) == ("reverse", [6, 5],
                                                             {"target_steps": 2})
    assert ctx.turns == [{"role": "assistant", "text": text}]
    assert r(ctx) == (1.0, {"correctness": 1.0})
    assert R.reasoning_steps(ctx) == 1.0
    # without text: no turns
    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0})
    assert ctx.text is None and ctx.turns == []


# ------------------------------------------------------------------------------ text in the loop


class DigitTextTask(T.DigitTask):
    """A digit task whose completions read as text: each digit, then "?" for anything else,
    separated by spaces (the stop token dropped)."""

    def transcript(self, meta, completion_ids, mask):
        return [{"role": "assistant", "text": digits_text(completion_ids)}]


def digits_text(ids) -> str:
    v = T.VOCAB
    return " ".join(str(t - v.digit0) if v.digit0 <= t < v.digit0 + 10 else "?"
                    for t in ids if t != v.eos)


def test_context_from_a_task_with_text_carries_its_turns():
    traj = Trajectory(traj_id="g/0", group_id="g", task_type="sort", prompt_ids=[1, 18, 5, 3],
                      completion_ids=[5, 7, 2], logprobs=[0.0] * 3, versions=[0] * 3)
    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0}, task=DigitTextTask("sort"))
    assert ctx.text == "1 3" and ctx.turns == [{"role": "assistant", "text": "1 3"}]
    # a task without text: none
    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0}, task=T.DigitTask("sort"))
    assert ctx.text is None and ctx.turns == []

    class Episode:  # several turns: text is the assistant turns joined, tool results apart
        def transcript(self, meta, ids, mask):
            return [{"role": "assistant", "text": "1. call the tool now"},
                    {"role": "tool", "text": "- \n- \n- (a tool's bullets)"},
                    {"role": "assistant", "text": "2. read the result"}]

    ctx = RewardContext.from_trajectory(traj, {"correctness": 1.0}, task=Episode())
    assert ctx.text == "1. call the tool now\n2. read the result" and len(ctx.turns) == 3
    assert R.reasoning_steps(ctx) == pytest.approx(2 / 3)

    class Bad:
        def __init__(self, turns):
            self.turns = turns

        def transcript(self, meta, ids, mask):
            return self.turns

    with pytest.raises(ValueError, match=r"task 'sort''s transcript: turn 0 expected a dict "
                                         r"with role in \['assistant', 'tool', 'user'\]"):
        RewardContext.from_trajectory(traj, {}, task=Bad([{"role": "robot", "text": "x"}]))
    with pytest.raises(ValueError, match=r"turn 1 expected"):
        RewardContext.from_trajectory(traj, {}, task=Bad([{"role": "user", "text": "x"},
                                                          {"role": "assistant", "text": 3}]))
    with pytest.raises(TypeError, match=r"transcript expected a list of turns, got str"):
        RewardContext.from_trajectory(traj, {}, task=Bad("text"))
    with pytest.raises(ValueError, match=r"from_trajectory: text expected None when task "
                                         r"'sort' has a transcript"):
        RewardContext.from_trajectory(traj, {}, text="x", task=DigitTextTask("sort"))


LOOP_MODEL = {"preset": "tiny", "overrides": {"vocab_size": 19, "num_hidden_layers": 1,
                                              "indexer_types": ["full"], "index_topk": 16,
                                              "mlp_layer_types": ["dense"],
                                              "num_nextn_predict_layers": 0}}


def _loop_cfg(tmp_path, task, components):
    from glm5.rl.config import RLConfig

    return RLConfig.from_dict({
        "model": LOOP_MODEL, "tasks": [{"name": task, "params": {"length": 2, "base": 5}}],
        "rollout": {"group_size": 2, "groups_per_step": 3, "max_tokens": 3, "num_workers": 1},
        "trainer": {"micro_batch_size": 6}, "sync": {"interval": 1},
        "pool": {"min_task_types": 1}, "reward": {"components": components},
        "run": {"steps": 1, "mode": "sync", "checkpoint_every": 0, "out_dir": str(tmp_path)}})


@pytest.mark.usefixtures("one_torch_thread")
def test_the_loop_feeds_the_reward_the_decoded_completion(tmp_path, scratch_registry,
                                                          scratch_tasks):
    from glm5.rl.loop import RLRun

    T.register_task("sort_text", lambda **p: DigitTextTask("sort", **p), has_text=True)
    seen = []

    @register_component("record_text", needs_text=True)
    def record_text(ctx: RewardContext) -> float:
        seen.append((list(ctx.completion_ids), ctx.text, ctx.turns))
        return 0.5

    cfg = _loop_cfg(tmp_path, "sort_text", {"correctness": 0.6, "reasoning_steps": 0.3,
                                            "clarity": 0.1, "record_text": 0.1})
    run = RLRun(cfg, resume=False, use_ray=False)
    try:
        run.train(1)
    finally:
        run.close()
    assert len(seen) >= 6  # every completion of the step's 3 groups of 2
    for ids, text, turns in seen:
        assert text is not None and text == digits_text(ids), (ids, text)
        assert turns == [{"role": "assistant", "text": text}]


def test_a_text_component_on_a_task_without_text_is_a_config_error(tmp_path, scratch_registry,
                                                                  scratch_tasks):
    from glm5.rl.config import RLConfigError

    for comp in ("reasoning_steps", "clarity"):
        with pytest.raises(RLConfigError, match=rf"glm5 rl config: reward.components.{comp} "
                                                rf"expected weight 0 with task 'reverse', "
                                                rf"which has no text .*got 0.3"):
            _loop_cfg(tmp_path, "reverse", {"correctness": 0.7, comp: 0.3})
    # a registered component that needs text, likewise; one that does not, not
    register_component("mine", needs_text=True)(lambda ctx: 0.0)
    register_component("ids_only")(lambda ctx: 0.0)
    with pytest.raises(RLConfigError, match=r"reward.components.mine .*task 'reverse'"):
        _loop_cfg(tmp_path, "reverse", {"correctness": 1.0, "mine": 0.5})
    _loop_cfg(tmp_path, "reverse", {"correctness": 1.0, "ids_only": 0.5})
    # weight 0 is allowed (it scores nothing either way)
    _loop_cfg(tmp_path, "reverse", {"correctness": 1.0, "clarity": 0.0})
    # replace=True re-declares it
    register_component("mine", replace=True)(lambda ctx: 0.0)
    _loop_cfg(tmp_path, "reverse", {"correctness": 1.0, "mine": 0.5})
    # a task registered with text, and the environment tasks, have text
    T.register_task("sort_text", lambda **p: DigitTextTask("sort", **p), has_text=True)
    _loop_cfg(tmp_path, "sort_text", {"correctness": 0.6, "reasoning_steps": 0.3, "clarity": 0.1})
    assert T.task_has_text("sort_text") and T.task_has_text("countdown")
    assert T.task_has_text("reverse") is False and T.task_has_text("nope") is None
    assert text_component_error({"correctness": 0.6, "clarity": 0.4},
                                ["countdown", "search"]) is None
    err = text_component_error({"correctness": 0.6, "clarity": 0.4}, ["countdown", "min"])
    assert "reward.components.clarity" in err and "task 'min'" in err
    # the agentic examples weight the staged reward on environment tasks
    from glm5.rl.config import RLConfig

    for name in ("agentic", "agentic_ci"):
        cfg = RLConfig.from_yaml(Path(__file__).parents[1] / f"examples/rl/{name}.yaml")
        assert cfg.reward.components == DEFAULT_WEIGHTS, name


def test_a_task_says_whether_it_has_text(scratch_tasks):
    T.register_task("sort_text", lambda **p: DigitTextTask("sort", **p), has_text=True)
    assert isinstance(T.make_task("sort_text", {"length": 2}), DigitTextTask)
    T.register_task("liar", lambda **p: T.DigitTask("sort", **p), has_text=True)
    with pytest.raises(ValueError, match=r"make_task\('liar'\): a task registered with "
                                         r"has_text=True expected a transcript\(meta, "
                                         r"completion_ids, mask\) method, got DigitTask "
                                         r"without one"):
        T.make_task("liar")
    T.register_task("quiet", lambda **p: DigitTextTask("sort", **p))
    with pytest.raises(ValueError, match=r"has_text=False expected no transcript"):
        T.make_task("quiet")
    with pytest.raises(TypeError, match=r"register_task\('x'\): has_text expected True or "
                                        r"False, got 1"):
        T.register_task("x", DigitTextTask, has_text=1)


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
