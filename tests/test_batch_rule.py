"""One rule derives plan.grad_accum from a batch (`fivefold.specs.batch`): every place that asks
(the search's target, `plan estimate`, the explorer, the data loader, `[train]`) gets its answer."""

from __future__ import annotations

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.search.outcomes import BatchTarget
from fivefold.specs.batch import grad_accum_for, grad_accum_problem, nearest_grad_accum
from fivefold.train.data import grad_accum_steps


def test_the_rule_by_hand():
    assert nearest_grad_accum(1000, 2, 8) == 62  # 1000 / 16 = 62.5 rounds to even
    assert grad_accum_for(1024, 2, 8) == 64
    assert grad_accum_for(1000, 2, 8) is None  # 992 or 1008 sequences: not exact
    assert grad_accum_for(1000, 2, 8, tolerance=0.01) == 62  # 992 is 0.8 % off
    assert grad_accum_for(3, 2, 8, tolerance=0.5) is None  # one micro-batch = 16, 433 % off
    message = grad_accum_problem(1000, 2, 8, "the global batch")
    assert "1000 sequences" in message and "such as 992 or 1008" in message


def test_every_caller_gives_the_rules_answer():
    assert BatchTarget(1000, 4096, 0.01).accumulation(2, 8) == 62
    assert BatchTarget(1000, 4096, 0.0).accumulation(2, 8) is None
    assert grad_accum_steps(1024, 2, 8) == 64
    with pytest.raises(ConfigError, match="such as 992 or 1008"):
        grad_accum_steps(1000, 2, 8)


def test_a_partial_layout_is_completed_by_the_planners_defaults():
    from fivefold.planner.search.layout_defaults import complete_layout
    from fivefold.specs.cluster import cluster_preset
    from fivefold.specs.presets import model_preset

    model, cluster = model_preset("llama3-8b"), cluster_preset("dgx-h100", 16)
    values = complete_layout({"tp": 2}, model, cluster)
    # 16 GPUs / tp 2 = dp 8, ZeRO-1 over all 8, SP with TP; 4M tokens / 8192 = 512 sequences
    assert values == {"tp": 2, "zero": 1, "dp_shard": 8, "dp_replicate": 1, "sp": True,
                      "grad_accum": 64}  # fmt: skip
    pinned = complete_layout({"pp": 2, "schedule": "zbv"}, model, cluster, dp=8, dp_shard=2)
    assert (pinned["dp_shard"], pinned["dp_replicate"], pinned["vpp"]) == (2, 4, 2)
    with pytest.raises(ConfigError, match="such as 992 or 1008"):
        complete_layout({}, model, cluster, batch=(None, 1001))
