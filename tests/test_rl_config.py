"""The RL config: strict reading (unknown keys, types, ranges named), YAML, the seed's defaults."""

from __future__ import annotations

import pytest

from glm5.rl.config import RLConfig, RLConfigError, sync_warnings


def test_defaults_are_the_seeds():
    c = RLConfig()
    assert (c.trainer.clip_low, c.trainer.clip_high) == (0.2, 0.25)  # ratio in [0.8, 1.25]
    assert c.pool.decay == 0.2 and c.pool.decay_period_s == 4 * 3600
    assert c.pool.min_task_types == 5 and c.trainer.freeze_indexer
    assert (c.trainer.distill.temperature, c.trainer.distill.weight,
            c.trainer.distill.refresh_every) == (0.7, 0.3, 1000)


@pytest.mark.parametrize("d,msg", [
    ({"rollout": {"gruop_size": 1}}, "unknown key rollout.gruop_size; rollout takes"),
    ({"bogus": 1}, "unknown key bogus; the top level takes"),
    ({"model": {"overrides": {"vocab_sizee": 3}}}, "unknown key model.overrides.vocab_sizee"),
    ({"trainer": {"lr": "fast"}}, "trainer.lr expected a number, got 'fast'"),
    ({"rollout": {"group_size": True}}, "rollout.group_size expected an integer"),
    ({"rollout": {"group_size": 1}}, "rollout.group_size expected >= 2"),
    ({"pool": {"backend": "mongo"}}, "pool.backend expected one of"),
    ({"trainer": {"clip_low": 1.0}}, r"trainer.clip_low expected a value in \[0, 1\)"),
    ({"pool": {"decay": 1.0}}, r"pool.decay expected a value in \[0, 1\)"),
    ({"tasks": []}, "tasks expected at least one task"),
    ({"tasks": [{"weight": 1.0}]}, r"tasks\[0\].name is required"),
    ({"tasks": [{"name": "copy", "weight": 0}]}, r"tasks\[0\].weight expected a value > 0"),
    ({"rollout": {"transport": "http"}}, "rollout.urls expected one engine server URL per worker"),
    ({"pool": {"memory_capacity": 10}}, "pool.memory_capacity expected at least two batches"),
    ({"trainer": {"betas": [0.9]}}, "trainer.betas expected 2 values"),
    ({"sync": {"interval": 0}}, "sync.interval expected a value > 0"),
])
def test_errors_name_the_key(d, msg):
    with pytest.raises(RLConfigError, match=msg):
        RLConfig.from_dict(d)


def test_yaml_round_trip(tmp_path):
    yaml = pytest.importorskip("yaml")
    c = RLConfig.from_dict({"tasks": [{"name": "sort", "params": {"length": [2, 4]}}],
                            "trainer": {"betas": [0.8, 0.9], "distill": {"enabled": True}},
                            "model": {"overrides": {"vocab_size": 19}}})
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(c.to_dict()))
    back = RLConfig.from_yaml(p)
    assert back == c and back.trainer.betas == (0.8, 0.9)
    p.write_text("- a list\n")
    with pytest.raises(RLConfigError, match="expected a mapping at the top level"):
        RLConfig.from_yaml(p)
    with pytest.raises(RLConfigError, match="is not a file"):
        RLConfig.from_yaml(tmp_path / "missing.yaml")


def test_defaults_that_are_not_the_seeds_learn():
    """Weights pushed every step (the seed's 50 leaves small-model rollouts up to 49 updates
    behind: docs/rl.md), completion length from the tasks."""
    c = RLConfig()
    assert c.sync.interval == 1 and c.sync.max_staleness == 2
    assert c.rollout.max_tokens is None
    assert sync_warnings(c) == []
    assert sync_warnings(RLConfig.from_dict({"run": {"mode": "sync"}})) == []


def test_sync_settings_that_cost_data_are_said():
    (w,) = sync_warnings(RLConfig.from_dict({"sync": {"interval": 50}}))
    assert "sync.interval 50" in w and "up to 49 trainer updates old" in w
    (w,) = sync_warnings(RLConfig.from_dict({"sync": {"max_staleness": 0}}))
    assert "sync.max_staleness 0 in async mode" in w and "dropped" in w
    # sync mode trains each batch before the next push: nothing waits, nothing is dropped
    assert sync_warnings(RLConfig.from_dict({"sync": {"max_staleness": 0},
                                             "run": {"mode": "sync"}})) == []
    assert sync_warnings(RLConfig.from_dict({"sync": {"max_staleness": 0,
                                                      "stale_policy": "downweight"}})) == []


def test_max_tokens_none_is_accepted_and_a_number_must_be_positive():
    assert RLConfig.from_dict({"rollout": {"max_tokens": None}}).rollout.max_tokens is None
    with pytest.raises(RLConfigError, match="rollout.max_tokens expected a value > 0"):
        RLConfig.from_dict({"rollout": {"max_tokens": 0}})
