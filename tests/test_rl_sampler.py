"""DynamicRatioSampler: the learnability formula by hand, flooring by water-filling, the
deficit scheduler's bounds, no starvation, checkpoints, and the error paths."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm5.rl.config import SamplerConfig
from glm5.rl.sampler import DynamicRatioSampler, learnability, water_fill

NAMES = ["a", "b", "c"]


def _sampler(names=NAMES, initial=None, seed=0, **cfg) -> DynamicRatioSampler:
    return DynamicRatioSampler(list(names), initial or [1.0] * len(names), SamplerConfig(**cfg),
                               seed=seed)


def _feed(s: DynamicRatioSampler, task: str, values) -> None:
    for v in values:
        s.record(task, v)


# ------------------------------------------------------------------------------- hand cases


def test_learnability_by_hand():
    assert learnability(0.5) == 1.0
    assert learnability(0.0) == 0.0 and learnability(1.0) == 0.0
    assert learnability(0.25) == pytest.approx(0.75)
    assert learnability(0.25, 2.0) == pytest.approx(0.5625)


def test_water_fill_by_hand():
    # one round: c floored at 0.15, a and b share 0.85 as 0.7 : 0.2
    got = water_fill([0.7, 0.2, 0.1], 0.15)
    assert got == pytest.approx([0.85 * 0.7 / 0.9, 0.85 * 0.2 / 0.9, 0.15])
    # two rounds: flooring c pushes b under the floor too (a one-pass renormalisation leaves
    # b at 0.83 * 0.15 / 0.95 = 0.131 < 0.17)
    got = water_fill([0.8, 0.15, 0.05], 0.17)
    assert got == pytest.approx([0.66, 0.17, 0.17])
    assert water_fill([5.0, 0.0], 0.5) == [0.5, 0.5]
    assert water_fill([3.0, 1.0], 0.0) == [0.75, 0.25]
    # shares whose plain normalisation sums to 1 - 2**-53: the largest absorbs the rounding
    assert math.fsum(water_fill([4.0, 0.5, 0.984375], 0.0)) == 1.0
    assert math.fsum(water_fill([1.0] * 3, 1 / 3)) == 1.0


def test_update_formula_by_hand():
    s = _sampler(floor=0.0)
    _feed(s, "a", [0, 1] * 4)  # p = 0.5, learnability 1
    _feed(s, "b", [1, 0, 0, 0])  # p = 0.25, learnability 0.75
    _feed(s, "c", [1] * 5)  # p = 1, learnability 0
    r = s.update()
    assert [r[t] for t in NAMES] == pytest.approx([1 / 1.75, 0.75 / 1.75, 0.0])
    # with a floor of 0.1: c floored, a and b share 0.9 as 1 : 0.75
    s = _sampler(floor=0.1)
    _feed(s, "a", [0, 1] * 4)
    _feed(s, "b", [1, 0, 0, 0])
    _feed(s, "c", [1] * 5)
    r = s.update()
    assert [r[t] for t in NAMES] == pytest.approx([0.9 / 1.75, 0.9 * 0.75 / 1.75, 0.1])
    # temperature 2 squares the learnability: 1 : 0.5625
    s = _sampler(names=["a", "b"], floor=0.0, temperature=2.0)
    _feed(s, "a", [0, 1])
    _feed(s, "b", [1, 0, 0, 0])
    r = s.update()
    assert [r["a"], r["b"]] == pytest.approx([1 / 1.5625, 0.5625 / 1.5625])


def test_initial_weights_scale_the_learnability():
    s = _sampler(names=["a", "b"], initial={"a": 2.0, "b": 1.0}, floor=0.0)
    _feed(s, "a", [0, 1])
    _feed(s, "b", [1, 0])
    r = s.update()
    assert [r["a"], r["b"]] == pytest.approx([2 / 3, 1 / 3])


def test_types_without_data_keep_their_initial_share():
    s = _sampler(initial=[1.0, 1.0, 2.0], floor=0.0)  # shares 0.25, 0.25, 0.5
    _feed(s, "a", [0, 1])  # learnability 1
    _feed(s, "b", [1] + [0] * 9)  # p = 0.1, learnability 0.36
    r = s.update()
    assert r["c"] == pytest.approx(0.5)
    assert [r["a"], r["b"]] == pytest.approx([0.5 / 1.36, 0.5 * 0.36 / 1.36])


def test_nothing_learnable_falls_back_to_initial_shares():
    s = _sampler(names=["a", "b"], initial=[3.0, 1.0], floor=0.0)
    _feed(s, "a", [0, 0])
    _feed(s, "b", [1, 1])
    r = s.update()
    assert [r["a"], r["b"]] == pytest.approx([0.75, 0.25])


def test_window_keeps_the_last_results():
    s = _sampler(names=["a", "b"], floor=0.0, window=2)
    _feed(s, "a", [0, 1, 1, 1])  # the window holds 1, 1: p = 1
    _feed(s, "b", [0, 1])
    r = s.update()
    assert r == pytest.approx({"a": 0.0, "b": 1.0})
    st_ = s.stats()
    assert st_["a"]["count"] == 2 and st_["a"]["recorded"] == 4
    assert st_["a"]["mean_success"] == 1.0 and st_["b"]["mean_success"] == 0.5


def test_static_ratios_when_not_dynamic():
    s = _sampler(initial=[1.0, 2.0, 5.0], dynamic=False, floor=0.0)
    _feed(s, "a", [0, 1] * 3)
    _feed(s, "c", [1] * 3)
    assert s.update() == pytest.approx({"a": 0.125, "b": 0.25, "c": 0.625})
    assert s.step() is False
    assert s.ratios() == pytest.approx({"a": 0.125, "b": 0.25, "c": 0.625})


def test_step_updates_every_n_steps():
    s = _sampler(names=["a", "b"], floor=0.0, update_every=3)
    _feed(s, "a", [1, 1])
    _feed(s, "b", [0, 1])
    assert [s.step(), s.step()] == [False, False]
    assert s.ratios() == {"a": 0.5, "b": 0.5}
    assert s.step() is True
    assert s.ratios() == pytest.approx({"a": 0.0, "b": 1.0})


def test_stats_before_any_data():
    s = _sampler()
    st_ = s.stats()["a"]
    assert st_["count"] == 0 and math.isnan(st_["mean_success"])
    assert st_["ratio"] == pytest.approx(1 / 3) and st_["chosen"] == 0
    s.choose(6)
    assert sum(v["chosen"] for v in s.stats().values()) == 6


def test_choose_apportions_a_single_call():
    s = _sampler(initial=[5.0, 3.0, 2.0], floor=0.0)
    out = s.choose(10)
    assert [out.count(t) for t in NAMES] == [5, 3, 2]
    assert s.choose(0) == []
    assert _sampler(names=["solo"]).choose(3) == ["solo"] * 3


def test_choose_is_reproducible_and_seeded():
    def seq(seed):
        s = _sampler(seed=seed)
        return [s.choose(k) for k in (1, 2, 3, 4, 5)]

    assert seq(3) == seq(3)
    # equal ratios leave every first pick to the seeded tie-break
    assert len({tuple(map(tuple, seq(seed))) for seed in range(8)}) > 1


def test_floor_raised_on_resume_serves_the_starved_type_first():
    old = _sampler(floor=0.0)
    _feed(old, "a", [0, 1] * 4)
    _feed(old, "b", [0, 1] * 4)
    _feed(old, "c", [1] * 4)  # always right: ratio 0 with no floor
    old.update()
    assert old.ratios()["c"] == 0.0
    first = old.choose(6)
    assert "c" not in first
    new = _sampler(floor=1 / 3)
    new.load_state_dict(json.loads(json.dumps(old.state_dict())))
    assert new.ratios() == pytest.approx({"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    # "c" owes 6/3 - 0 = 2 picks beyond the floor's slack: it goes first until caught up, and
    # from then on keeps count >= floor * N - 1
    nxt = new.choose(12)
    assert nxt[:2] == ["c", "c"]
    seq = first + nxt
    for n in range(8, len(seq) + 1):
        assert seq[:n].count("c") >= n / 3 - 1


# ------------------------------------------------------------------------------ properties

_success = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(0.0, 1.0))


@st.composite
def _setup(draw):
    m = draw(st.integers(1, 5))
    names = [f"t{i}" for i in range(m)]
    initial = draw(st.lists(st.floats(0.05, 10.0), min_size=m, max_size=m))
    floor = draw(st.one_of(st.just(0.0), st.just(1.0 / m), st.floats(0.0, 1.0 / m)))
    cfg = dict(floor=floor, window=draw(st.integers(1, 16)),
               temperature=draw(st.floats(0.25, 4.0)), dynamic=draw(st.booleans()))
    return names, initial, cfg, draw(st.integers(0, 2**31))


def _history(draw, names):
    """A list of ops: ("choose", n) | ("record", task, success) | ("update",)."""
    op = st.one_of(
        st.tuples(st.just("choose"), st.integers(0, 9)),
        st.tuples(st.just("record"), st.sampled_from(names), _success),
        st.tuples(st.just("update")))
    return draw(st.lists(op, max_size=40))


def _run(s, ops, picks=None):
    for op in ops:
        if op[0] == "choose":
            out = s.choose(op[1])
            if picks is not None:
                picks.extend(out)
        elif op[0] == "record":
            s.record(op[1], op[2])
        else:
            s.update()


@given(data=st.data())
def test_ratios_sum_to_one_and_respect_the_floor(data):
    names, initial, cfg, seed = data.draw(_setup())
    s = DynamicRatioSampler(names, initial, SamplerConfig(**cfg), seed=seed)
    for _ in range(3):
        _run(s, _history(data.draw, names))
        r = s.update()
        assert list(r) == names
        assert math.fsum(r.values()) == 1.0  # exactly: the largest share absorbs the rounding
        assert all(v >= cfg["floor"] - 1e-12 for v in r.values()), (r, cfg["floor"])


@given(p_low=st.floats(0.0, 0.05), p_high=st.floats(0.95, 1.0), floor=st.floats(0.0, 0.3),
       temperature=st.floats(0.25, 4.0), n=st.integers(20, 60))
def test_a_type_at_half_success_outweighs_always_wrong_and_always_right(p_low, p_high, floor,
                                                                       temperature, n):
    s = _sampler(floor=floor, temperature=temperature, window=n)
    _feed(s, "a", [0.5] * n)
    _feed(s, "b", [p_low] * n)
    _feed(s, "c", [p_high] * n)
    r = s.update()
    assert r["a"] > r["b"] and r["a"] > r["c"], r


@given(data=st.data())
def test_no_type_starves(data):
    """After N picks in total, each type has at least floor * N - 1 of them, whatever the
    successes and updates in between."""
    names, initial, cfg, seed = data.draw(_setup())
    s = DynamicRatioSampler(names, initial, SamplerConfig(**cfg), seed=seed)
    picks: list[str] = []
    for _ in range(4):
        ops = _history(data.draw, names)
        for op in ops:
            _run(s, [op], picks)
            n = len(picks)
            for t in names:
                assert picks.count(t) >= cfg["floor"] * n - 1 - 1e-9, (t, n, cfg["floor"])


@given(data=st.data())
def test_counts_track_fixed_ratios_within_one(data):
    names, initial, cfg, seed = data.draw(_setup())
    cfg["dynamic"] = False
    s = DynamicRatioSampler(names, initial, SamplerConfig(**cfg), seed=seed)
    r = s.ratios()
    picks: list[str] = []
    for k in data.draw(st.lists(st.integers(0, 12), max_size=25)):
        picks.extend(s.choose(k))
        for t in names:
            assert abs(picks.count(t) - len(picks) * r[t]) < 1.0, (t, len(picks), r)


@given(data=st.data())
def test_state_round_trip_gives_identical_future(data):
    names, initial, cfg, seed = data.draw(_setup())
    a = DynamicRatioSampler(names, initial, SamplerConfig(**cfg), seed=seed)
    _run(a, _history(data.draw, names))
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON
    b = DynamicRatioSampler(names, initial, SamplerConfig(**cfg), seed=seed + 1)
    b.load_state_dict(state)
    assert b.ratios() == a.ratios()
    assert json.dumps(b.stats(), sort_keys=True) == json.dumps(a.stats(), sort_keys=True)
    future = _history(data.draw, names) + [("choose", 7)]
    got_a: list[str] = []
    got_b: list[str] = []
    _run(a, future, got_a)
    _run(b, future, got_b)
    assert got_a == got_b
    assert a.ratios() == b.ratios()


# ------------------------------------------------------------------------------ error paths


def test_errors():
    s = _sampler()
    with pytest.raises(KeyError, match=r"record: unknown task type 'z'.*\['a', 'b', 'c'\]"):
        s.record("z", 1.0)
    for bad in (-0.1, 1.5, math.nan, "1"):
        with pytest.raises(ValueError, match=r"record: success of 'a' expected a number in"):
            s.record("a", bad)
    with pytest.raises(ValueError, match=r"initial weight of 'b' expected a finite number > 0"):
        _sampler(initial=[1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"initial weight of 'a' expected"):
        _sampler(initial=[-1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"initial expected weights for exactly"):
        DynamicRatioSampler(NAMES, {"a": 1.0, "b": 1.0}, SamplerConfig())
    with pytest.raises(ValueError, match=r"initial expected 3 weights"):
        DynamicRatioSampler(NAMES, [1.0, 1.0], SamplerConfig())
    with pytest.raises(ValueError, match=r"config.floor expected at most 1 / 3 task types"):
        _sampler(floor=0.34)
    with pytest.raises(ValueError, match=r"distinct names, got \['a'\]"):
        _sampler(names=["a", "b", "a"])
    with pytest.raises(ValueError, match=r"at least one task type"):
        _sampler(names=[])
    with pytest.raises(ValueError, match=r"config.temperature expected"):
        _sampler(temperature=0.0)
    with pytest.raises(ValueError, match=r"config.update_every expected"):
        _sampler(update_every=0)
    with pytest.raises(ValueError, match=r"choose: n expected an integer >= 0"):
        s.choose(-1)
    other = _sampler(names=["a", "b"])
    with pytest.raises(ValueError, match=r"load_state_dict: state holds task types"):
        s.load_state_dict(other.state_dict())
