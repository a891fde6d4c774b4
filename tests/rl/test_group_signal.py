"""The RL step's learning-signal diagnostics (c2jax.rl.loop.group_signal_metrics) on hand-made groups."""
import numpy as np
import pytest

from c2jax.rl.loop import group_signal_metrics
from c2jax.rl.store import FinishedGroup


def _group(suite, rewards, passed):
    return FinishedGroup(index=0, task_id="t", suite=suite, start_version=0, trajectories=[],
                         rewards=list(rewards), passed=list(passed))


def test_group_signal_metrics_counts_flat_groups_and_pass_rate_per_suite():
    rng = np.random.default_rng(0)
    mixed = rng.uniform(-1, 1, 4)
    groups = [_group("synthetic:1", [1.0] * 4, [True] * 4),              # all pass, equal rewards
              _group("synthetic:1", [0.9, 1.0, 0.95, 1.0], [True] * 4),  # all pass, rewards still differ
              _group("synthetic:2", [0.0] * 4, [False] * 4),             # all fail
              _group("behaviour", mixed, [True, False, False, True])]
    m = group_signal_metrics(groups)
    assert m["groups_zero_spread"] == pytest.approx(2 / 4)
    assert m["groups_all_pass"] == pytest.approx(2 / 4) and m["groups_all_fail"] == pytest.approx(1 / 4)
    assert m["pass_rate/synthetic:1"] == 1.0 and m["pass_rate/synthetic:2"] == 0.0
    assert m["pass_rate/behaviour"] == pytest.approx(0.5)
    assert group_signal_metrics([]) == {}
