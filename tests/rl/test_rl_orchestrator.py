"""Cheap pieces of the orchestrator: rl config validation, the group store round trip and
admissions ledger, the prompt source (each prompt once, curriculum upsampling, resume
mapping), the staleness admission bound and stale-group handling, reward stats mapping."""
import numpy as np
import pytest

from c2jax.config import ConfigError, load_config
from c2jax.rl.config import rl_defaults, validate_rl
from c2jax.rl.loop import _stale_weights
from c2jax.rl.orchestrator import Orchestrator, PromptSource
from c2jax.rl.rollout import ToyEnv, reward_stats
from c2jax.rl.rewards import compute_reward
from c2jax.rl.store import FinishedGroup, GroupStore
from c2jax.trajectory import Trajectory


def test_validation_names_the_field():
    r = rl_defaults()
    validate_rl(r)
    for key, bad in (("backend", "mpi"), ("staleness", -1), ("group_size", 0), ("stale_policy", "x"),
                     ("normalizer", "bogus"), ("sync_dtype", "int8"), ("task_seed", -2)):
        r2 = rl_defaults()
        r2[key] = bad
        with pytest.raises(ConfigError, match=f"rl.{key}"):
            validate_rl(r2)
    r3 = rl_defaults()
    with r3.unlocked():
        r3.nonsense = 1
    with pytest.raises(ConfigError, match="rl.nonsense"):
        validate_rl(r3)
    cfg = load_config("configs/rl_tiny.py")
    validate_rl(cfg.rl, cfg.model)


def _traj(n=6, reward=1.0, turns=1):
    return Trajectory(tokens_T=np.arange(n, dtype=np.int32), loss_mask_T=np.r_[np.zeros(2, bool), np.ones(n - 2, bool)],
                      logprobs_T=-np.ones(n, np.float32), versions_T=np.r_[[-1, -1], np.zeros(n - 2, np.int32)],
                      expert_ids_TNK=np.zeros((n, 1, 2), np.int32), reward=reward,
                      reward_terms={"verifier": reward, "total": reward}, task_id="t", group_id="3",
                      finish_reason="final", stats={"turns": turns, "tool_calls_by_name": {"run": 2}})


def test_group_store_roundtrip_and_ledger(tmp_path):
    st = GroupStore(str(tmp_path))
    g = FinishedGroup(3, "t", "toy", 5, [_traj(), _traj(8, 0.0)], [1.0, 0.0], [True, False], attempt=1, end_version=6)
    st.put(g)
    assert st.indices() == [3] and st.get(4) is None
    h = st.get(3)
    assert h.start_version == 5 and h.rewards == [1.0, 0.0] and h.passed == [True, False] and h.attempt == 1
    np.testing.assert_array_equal(h.trajectories[1].tokens_T, g.trajectories[1].tokens_T)
    np.testing.assert_array_equal(h.trajectories[0].expert_ids_TNK, g.trajectories[0].expert_ids_TNK)
    assert h.trajectories[0].stats["tool_calls_by_name"] == {"run": 2}
    st.record_admission(0, "toy", 0)
    st.record_admission(1, "toy", 1)
    with open(st.ledger_path, "a") as f:
        f.write('{"index": 2, "sui')  # torn write at the crash
    assert st.admissions() == {0: ("toy", 0), 1: ("toy", 1)}


def test_prompt_source_each_prompt_once_curriculum_and_resume(tmp_path):
    r = rl_defaults()
    r.suites = ("easy", "hard")
    r.curriculum_strength = 4.0
    env = ToyEnv(r, 64)
    st = GroupStore(str(tmp_path))
    src = PromptSource(env, r, 0, 200, st)
    early = [src.assigned.get(i) or (src.task_for(i), src.assigned[i])[1] for i in range(40)]
    assert len({(s, p) for s, p in early}) == 40  # no prompt twice
    for _ in range(20):
        src.observe("easy", 1.0)
        src.observe("hard", 5.0)
    src.progress = 1.0
    w = src.weights()
    assert w[1] > 2 * w[0]  # harder suite upsampled late in training
    late = [src.assigned[i][0] for i in range(40, 140) if src.task_for(i) is not None]
    assert late.count("hard") > 65
    # a resumed source maps admitted indices to the same tasks and continues the cursors
    src2 = PromptSource(env, r, 0, 200, st)
    assert all(src2.task_for(i).task_id == src.task_for(i).task_id for i in (0, 17, 139))
    assert src2.cursor == src.cursor


def test_admission_bound_and_stale_handling(tmp_path):
    r = rl_defaults()
    r.prompts_per_step, r.staleness, r.env_workers = 2, 1, 1
    st = GroupStore(str(tmp_path))
    env = ToyEnv(r, 64)
    src = PromptSource(env, r, 0, 100, st)
    o = Orchestrator(r, env, None, st, src, version=0, consumed=set(), seed=0, total_groups=10)
    assert o._admit_limit() == 4
    o.set_version(3)
    assert o._admit_limit() == 10
    r.staleness = 0
    o.set_version(1)
    assert o._admit_limit() == 4
    gs = [FinishedGroup(i, "t", "toy", v, [], [], []) for i, v in enumerate([5, 4, 2])]
    r.staleness = 1
    r.stale_policy = "drop"
    keep, w, stale = _stale_weights(gs, 5, r)
    assert [g.index for g in keep] == [0, 1] and stale == [0, 1, 3]
    r.stale_policy = "reweight"
    keep, w, _ = _stale_weights(gs, 5, r)
    assert len(keep) == 3 and w == [1.0, 1.0, r.stale_decay ** 2]


def test_reward_stats_cover_every_reward_key():
    stats = {"turns": 2, "tool_calls": 3, "malformed_calls": 1, "thinking_tokens": 10, "tool_call_tokens": 20,
             "tool_output_tokens": 30, "final_message_tokens": 5, "tool_calls_by_name": {"run": 3}}
    orig = {"a.py": "x = 1\n"}
    final = {"a.py": "x = 1\n# let me think about why the bug was here, actually it is the sign\ny = 2\n"}
    s = reward_stats(stats, orig, final)
    assert s["terminal_only"] == 1 and s["comment_reasoning_lines"] >= 1 and s["unfinished_todos"] == 0
    total, terms = compute_reward(1.0, s, rl_defaults())
    assert terms["behaviour/malformed_calls"] < 0 and terms["behaviour/terminal_only"] < 0
    assert terms["length_penalty"] < 0 and total < 1.0


def test_toy_latency_is_per_episode_heavy_tailed_and_reproducible():
    from c2jax.rl.rollout import toy_latency
    r = rl_defaults()
    r.toy_latency_s = 0.2
    assert toy_latency(r, "a/0") == 0.2  # sigma 0: fixed
    r.toy_latency_sigma = 1.0
    draws = np.array([toy_latency(r, f"task-{i}/{j}") for i in range(400) for j in range(4)])
    assert toy_latency(r, "task-3/1") == draws[3 * 4 + 1]  # same key, same latency (sync and async runs)
    assert abs(draws.mean() - 0.2) < 0.03  # mean toy_latency_s
    assert np.percentile(draws, 99) > 4 * np.median(draws)  # long tail: stragglers
    r.toy_latency_sigma = -1.0
    with pytest.raises(ConfigError, match="toy_latency"):
        validate_rl(r)
