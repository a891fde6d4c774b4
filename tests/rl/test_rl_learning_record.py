"""experiments/rl_learning.py sorts every training attempt of a run by how it ended."""
import importlib.util
import os

import numpy as np

from c2jax.rl.store import FinishedGroup, GroupStore
from c2jax.trajectory import Trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("rl_learning", os.path.join(ROOT, "experiments/rl_learning.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _traj(rng, edits, lines_changed, tool_errors):
    n = int(rng.integers(5, 9))
    return Trajectory(tokens_T=rng.integers(0, 50, n).astype(np.int32), loss_mask_T=np.ones(n, bool),
                      logprobs_T=-rng.random(n).astype(np.float32), versions_T=np.zeros(n, np.int32),
                      expert_ids_TNK=np.zeros((n, 1, 2), np.int32), reward=0.0, reward_terms={"total": 0.0},
                      task_id="t", group_id="g", finish_reason="final",
                      stats={"tool_calls_by_name": {"edit_file": edits, "read_file": 1},
                             "lines_changed": lines_changed, "tool_errors": tool_errors})


def test_attempt_outcomes_per_policy_version(tmp_path):
    rng = np.random.default_rng(7)
    store = GroupStore(str(tmp_path / "groups"))
    # version 0: a pass after a retried edit, a miss with nothing changed, a wrong change, a plain stop
    store.put(FinishedGroup(0, "a", "synthetic:1", 0,
                            [_traj(rng, 2, 1, 1), _traj(rng, 1, 0, 1), _traj(rng, 1, 1, 0), _traj(rng, 0, 0, 0)],
                            [1.0, 0.0, 0.0, 0.0], [True, False, False, False]))
    # version 2: two retries that failed, one plain pass
    store.put(FinishedGroup(1, "b", "synthetic:1", 2, [_traj(rng, 3, 0, 2), _traj(rng, 2, 1, 1), _traj(rng, 1, 1, 0)],
                            [0.0, 0.0, 1.0], [False, False, True]))
    with open(tmp_path / "groups" / "g00000002.json", "w") as f:
        f.write("{torn")  # a damaged group file is counted, not fatal
    out = _script().attempt_outcomes(str(tmp_path))
    assert out["version"] == [0, 2]
    assert out["passed"] == [1, 1] and out["failed_tool_error_nothing_changed"] == [1, 1]
    assert out["failed_changed_files"] == [1, 1] and out["failed_other"] == [1, 0]
    assert out["repeated_edits"] == [1, 2] and out["repeated_edits_passed"] == [1, 0]
    assert out["total"]["passed"] == 2 and sum(out["total"][k] for k in (
        "passed", "failed_tool_error_nothing_changed", "failed_changed_files", "failed_other")) == 7
    assert out["unreadable_group_files"] == 1


def test_held_out_curve_pairs_every_eval_with_the_first():
    rng = np.random.default_rng(11)
    passes = [rng.integers(0, 5, 32) / 4 for _ in range(3)]
    evals = [{"step": s, "eval/task_pass": list(p), "eval/pass_at_1": float(p.mean()),
              "eval/pass_at_1_se": float(p.std(ddof=1) / np.sqrt(len(p)))} for s, p in zip((0, 25, 50), passes)]
    curve = _script().held_out_curve(evals)
    assert [c["step"] for c in curve] == [0, 25, 50]
    assert curve[0]["change"] == 0.0
    for c, p in zip(curve[1:], passes[1:]):
        d = p - passes[0]
        assert np.isclose(c["change"], d.mean()) and np.isclose(c["paired_se"], d.std(ddof=1) / np.sqrt(len(d)))
        assert np.isclose(c["pass_at_1"], p.mean())


def test_wall_split_times_the_first_eval_apart_from_rl():
    rng = np.random.default_rng(3)
    t0 = 1.7e9 + rng.random() * 1e6
    before, step_s, mid, last = 200.0 + rng.random(), 40.0 + rng.random(), 180.0, 170.0
    rows = [{"step": 0, "time": t0}, {"step": 0, "time": t0 + before, "eval/pass_at_1": 0.3}]
    t = t0 + before
    for step in range(1, 5):
        t += step_s
        rows.append({"step": step, "time": t, "reward": 0.1})
        if step == 2:
            t += mid
            rows.append({"step": step, "time": t, "eval/pass_at_1": 0.35})
    t += last
    rows.append({"step": 4, "time": t, "eval/pass_at_1": 0.4})
    wall_split = _script().wall_split
    split = wall_split(rows)
    np.testing.assert_allclose(split["eval_before_s"], before, rtol=1e-9)
    np.testing.assert_allclose(split["rl_wall_s"], 4 * step_s + mid + last, rtol=1e-9)
    assert wall_split(rows[:3]) == {"eval_before_s": None, "rl_wall_s": None}
