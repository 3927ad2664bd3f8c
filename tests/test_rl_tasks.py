"""The digit tasks: prompts, answers and scores by hand."""

from __future__ import annotations

import random

import pytest

from glm5.rl.tasks import DIGIT_TASKS, TASKS, VOCAB, DigitTask, make_task, register_task


def _ids(digits):
    return [VOCAB.digit(d) for d in digits]


@pytest.mark.parametrize("name,digits,answer", [
    ("copy", [3, 1, 2], [3, 1, 2]), ("reverse", [3, 1, 2], [2, 1, 3]),
    ("sort", [3, 1, 2], [1, 2, 3]), ("add1", [9, 0, 4], [0, 1, 5]), ("min", [3, 1, 2], [1]),
])
def test_answers_and_scores_by_hand(name, digits, answer):
    t = make_task(name)
    meta = {"digits": digits, "answer": answer}
    eos = VOCAB.eos
    assert t.stop_token_ids == [eos]  # the engine ends a completion on EOS
    assert t.score(meta, _ids(answer) + [eos]) == {"correctness": 1.0, "exact": 1.0,
                                                    "format": 1.0}
    # no EOS: every position right, but not an exact answer
    assert t.score(meta, _ids(answer)) == {"correctness": 1.0, "exact": 0.0, "format": 0.0}
    # one extra token costs its share: n right of n + 1
    n = len(answer)
    s = t.score(meta, _ids(answer) + [VOCAB.digit(0), eos])
    assert s["correctness"] == pytest.approx(n / (n + 1)) and s["exact"] == 0.0
    # a non-digit in the body breaks the format
    assert t.score(meta, [VOCAB.sep, eos])["format"] == 0.0


def test_partial_credit_is_positionwise():
    t = make_task("reverse")
    meta = {"digits": [1, 2, 3], "answer": [3, 2, 1]}
    assert t.score(meta, _ids([3, 0, 1]) + [VOCAB.eos])["correctness"] == pytest.approx(2 / 3)
    assert t.score(meta, _ids([3]) + [VOCAB.eos])["correctness"] == pytest.approx(1 / 3)
    assert t.score(meta, [])["correctness"] == 0.0


def test_prompts_layout_and_ranges():
    rng = random.Random(0)
    t = DigitTask("sort", length=[2, 4], base=5)
    lens = set()
    for _ in range(200):
        inst = t.sample(rng)
        p = inst.prompt_ids
        assert p[0] == VOCAB.bos and p[1] == VOCAB.marker(DIGIT_TASKS.index("sort"))
        assert p[-1] == VOCAB.sep
        ds = [x - VOCAB.digit0 for x in p[2:-1]]
        assert ds == inst.meta["digits"] and all(0 <= d < 5 for d in ds)
        assert inst.meta["answer"] == sorted(ds)
        lens.add(len(ds))
    assert lens == {2, 3, 4}
    assert max(p for n in DIGIT_TASKS for p in make_task(n).sample(rng).prompt_ids) \
        < VOCAB.size


def test_bad_params_and_registry():
    with pytest.raises(ValueError, match="base expected an int in"):
        make_task("copy", {"base": 11})
    with pytest.raises(ValueError, match="length expected"):
        make_task("copy", {"length": [3, 2]})
    with pytest.raises(ValueError, match="unknown task type 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="bad params"):
        make_task("copy", {"colour": 1})
    with pytest.raises(ValueError, match="already registered"):
        register_task("copy", lambda: None)
    assert set(DIGIT_TASKS) <= set(TASKS)
