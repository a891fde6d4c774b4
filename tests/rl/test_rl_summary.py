"""Self-summarization on the RL side: the summary config fields, chained groups -> learner
sequences (every model token of every segment carries the chain's advantage, the group mean
counts chains once, versions and expert ids survive the group store and the batch), and a tiny
end-to-end run_rl with summary_method="self" on the long_horizon suite."""
import os

import numpy as np
import pytest

from c2jax.agent.sandbox import unavailable_reason
from c2jax.config import ConfigError, load_config
from c2jax.rl import chains as ch
from c2jax.rl.config import rl_defaults, validate_rl
from c2jax.rl.learner import build_batch
from c2jax.rl.store import FinishedGroup, GroupStore
from c2jax.trajectory import Trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_SANDBOX = unavailable_reason()
N, K = 2, 2


# ------------------------------------------------------------------- config
def _rl(**kw):
    r = rl_defaults()
    r.suites = ("long_horizon",)
    for k, v in kw.items():
        r[k] = v
    return r


def test_summary_fields_default_off_and_validate():
    r = rl_defaults()
    assert r.summary_method == "none" and r.context_window == 0
    validate_rl(r)
    validate_rl(_rl(summary_method="self", summary_trigger_tokens=256, context_window=512))


@pytest.mark.parametrize("kw, match", [
    ({"summary_method": "auto"}, "rl.summary_method must be one of"),
    ({"summary_method": "self", "summary_trigger_tokens": 0}, "rl.summary_trigger_tokens must be >= 1"),
    ({"summary_method": "self", "max_summaries": 0}, "rl.max_summaries must be >= 1"),
    ({"summary_method": "prompt", "max_summary_tokens": 0}, "rl.max_summary_tokens must be >= 1"),
    ({"summary_method": "self", "summary_trigger_tokens": 512, "context_window": 512},
     "rl.summary_trigger_tokens=512 must be < the context window"),
    ({"summary_method": "self", "summary_trigger_tokens": 768}, "must be < the context window \\(768"),
    ({"context_window": -1}, "rl.context_window must be >= 0"),
    ({"context_window": 1024}, "rl.context_window=1024 exceeds rl.max_total_tokens=768"),
    ({"summary_method": "self", "env_workers": 8, "sampler_slots": 4}, "rl.sampler_slots=4 must be >= rl.env_workers"),
    ({"summary_method": "truncate", "env": "toy"}, "needs rl.env='harness'"),
])
def test_summary_fields_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        validate_rl(_rl(**kw))


def test_context_window_checked_against_the_model():
    cfg = load_config(os.path.join(ROOT, "configs/rl_tiny.py"), [
        "--config.rl.max_total_tokens=4096", "--config.rl.context_window=1024", "--config.rl.summary_method=self"])
    validate_rl(cfg.rl, cfg.model)   # the window, not the chain budget, must fit the model
    cfg.rl.context_window = 4096
    with pytest.raises(ConfigError, match="rl.context_window=4096 exceeds model.max_position_embeddings"):
        validate_rl(cfg.rl, cfg.model)


# ------------------------------------------------------------------- chains -> learner batch
def _segment(rng, n_env, n_model, version, tag, finish):
    """env tokens then model tokens; model tokens carry a version and expert ids that encode tag."""
    T = n_env + n_model
    ex = np.full((T, N, K), -1, np.int32)
    ex[n_env:] = tag
    ex[n_env:, 0, 0] = np.arange(n_model)
    return Trajectory(tokens_T=rng.integers(3, 300, T).astype(np.int32),
                      loss_mask_T=np.r_[np.zeros(n_env, bool), np.ones(n_model, bool)],
                      logprobs_T=np.r_[np.zeros(n_env), np.full(n_model, -0.5)].astype(np.float32),
                      versions_T=np.r_[np.full(n_env, -1), np.full(n_model, version)].astype(np.int32),
                      expert_ids_TNK=ex, task_id="t", finish_reason=finish, stats={"turns": 3})


def _chain(rng, n_segments, reward, key, tag0):
    segs = [_segment(rng, 5 + k, 4 + 2 * k, version=10 + k, tag=tag0 + k,
                     finish="summarized" if k < n_segments - 1 else "final") for k in range(n_segments)]
    segs[-1].reward = reward
    segs[-1].reward_terms = {"verifier": reward}
    return ch.chain_sequences(segs, chain_id=key)


def _group(rng, index, lengths, rewards, tag0=1):
    chains = [_chain(rng, n, r, f"{index}/{j}", tag0 + 10 * j) for j, (n, r) in enumerate(zip(lengths, rewards))]
    return FinishedGroup(index=index, task_id="t", suite="long_horizon", start_version=0,
                         trajectories=[t for c in chains for t in c], rewards=list(rewards), passed=[False] * 3)


def test_chained_groups_every_segment_gets_the_chain_advantage(tmp_path):
    rng = np.random.default_rng(0)
    g0 = _group(rng, 0, lengths=[3, 1, 2], rewards=[1.0, 0.0, 0.5])
    g1 = _group(rng, 1, lengths=[1, 1, 4], rewards=[0.0, 0.0, 1.0], tag0=100)
    store = GroupStore(str(tmp_path))        # the learner reads groups back from the store
    for g in (g0, g1):
        store.put(g)
    groups = [store.get(0), store.get(1)]
    seqs, adv_B, w_B, chains = ch.groups_to_sequences(groups, weights=[1.0, 0.5])
    assert [len(c) for c in chains] == [3, 1, 2, 1, 1, 4] and len(seqs) == 12
    # group mean over chains: g0 mean 0.5 (not the segment-weighted 4/6), g1 mean 1/3
    chain_adv = [0.5, -0.5, 0.0, -1 / 3, -1 / 3, 2 / 3]
    np.testing.assert_allclose(adv_B, np.repeat(chain_adv, [3, 1, 2, 1, 1, 4]), atol=1e-6)
    np.testing.assert_allclose(ch.chain_advantages([1, 0, .5, 0, 0, 1], [0, 0, 0, 1, 1, 1]), chain_adv, atol=1e-6)
    np.testing.assert_array_equal(w_B, np.repeat([1.0, 0.5], [6, 6]))
    # the learner batch: every model token of every segment carries its chain's (weighted) advantage
    b = build_batch(seqs, adv_B, 16, w_B, num_moe_layers=N, top_k=K)
    for i, s in enumerate(seqs):
        n = len(s.tokens_T) - 1
        assert b["advantages"][i] == np.float32(adv_B[i] * w_B[i])
        np.testing.assert_array_equal(b["loss_mask"][i, :n], s.loss_mask_T[1:])
        assert b["loss_mask"][i].sum() == s.num_model_tokens  # model tokens never come first
        # versions and expert ids survive the store round trip and reach the batch
        orig = (g0.trajectories + g1.trajectories)[i]
        np.testing.assert_array_equal(s.versions_T, orig.versions_T)
        np.testing.assert_array_equal(s.expert_ids_TNK, orig.expert_ids_TNK)
        np.testing.assert_array_equal(b["forced_ids"][:, i, :n], np.transpose(orig.expert_ids_TNK[:n], (1, 0, 2)))
    owner = [j for j, c in enumerate(chains) for _ in c]
    assert [s.stats["chain_length"] for s in seqs] == [len(chains[j]) for j in owner]
    # the packed path (chains.pack_sequences) gives the same per-token advantages
    p = ch.pack_sequences(seqs, adv_B, 64)
    for i, s in enumerate(seqs):
        at = p["seq_index"] == i
        on = at & (p["loss_weights"] > 0)
        assert on.sum() == s.num_model_tokens - int(s.loss_mask_T[0])
        np.testing.assert_allclose(p["advantages"][on], adv_B[i])
        assert set(p["versions"][on].tolist()) == {int(s.versions_T[-1])}


def test_unchained_groups_are_the_plain_group_advantage():
    """Without chains the helper is the old per-trajectory computation, bit for bit."""
    from c2jax.rl.advantages import group_advantages
    rng = np.random.default_rng(1)
    groups = []
    for i in range(3):
        trajs = [_segment(rng, 4, 3, 0, 1, "final") for _ in range(4)]
        rw = rng.random(4).astype(np.float32).tolist()
        groups.append(FinishedGroup(i, "t", "s", 0, trajs, rw, [False] * 4))
    seqs, adv, w, chains = ch.groups_to_sequences(groups, [1.0, 0.25, 1.0], std_normalize=True)
    ref = np.asarray(group_advantages(np.asarray([g.rewards for g in groups], np.float32), True, 1e-6)).reshape(-1)
    assert adv.dtype == ref.dtype and adv.tobytes() == ref.tobytes()
    np.testing.assert_array_equal(w, np.repeat(np.asarray([1.0, 0.25, 1.0], np.float32), 4))
    assert [id(s) for s in seqs] == [id(t) for g in groups for t in g.trajectories]
    assert all(len(c) == 1 for c in chains)


def test_split_chains_rejects_broken_groups():
    rng = np.random.default_rng(2)
    c = _chain(rng, 3, 1.0, "k", 1)
    with pytest.raises(ValueError, match="the last chain has 2 of 3 segments"):
        ch.split_chains(c[:2])
    with pytest.raises(ValueError, match="is segment 1 of 3, expected segment 0"):
        ch.split_chains(c[1:])
    with pytest.raises(ValueError, match="1 chains but 2 rewards"):
        ch.split_chains(c, 2)


def test_context_full_counts_as_truncated():
    rng = np.random.default_rng(3)
    b = build_batch([_segment(rng, 3, 3, 0, 1, "context_full"), _segment(rng, 3, 3, 0, 1, "summarized")], [1, 1])
    assert b["truncated"].tolist() == [True, False]


# ------------------------------------------------------------------- end to end
@pytest.mark.skipif(bool(NO_SANDBOX), reason=NO_SANDBOX or "")
def test_run_rl_with_self_summary_on_long_horizon(tmp_path):
    """A random tiny model with a tight trigger (below the system + task prefix): every episode
    is a chain of several segments, and two learner steps train on all of them."""
    from c2jax.train.metrics import read_metrics
    from c2jax.rl.loop import run_rl
    cfg = load_config(os.path.join(ROOT, "configs/rl_tiny.py"), [
        "--config.model.vocab_size=320", "--config.model.hidden_size=32", "--config.model.num_layers=2",
        "--config.model.intermediate_size=64", "--config.model.moe_intermediate_size=32", "--config.model.head_dim=8",
        "--config.rl.suites=('long_horizon',)", "--config.rl.suite_weights=()", "--config.rl.steps=2", "--config.rl.group_size=2",
        "--config.rl.prompts_per_step=1", "--config.rl.max_new_tokens=16", "--config.rl.max_turns=2",
        "--config.rl.max_total_tokens=3072", "--config.rl.context_window=1024",
        "--config.rl.summary_method=self", "--config.rl.summary_trigger_tokens=128",
        "--config.rl.max_summaries=2", "--config.rl.max_summary_tokens=8",
        "--config.rl.env_workers=2", "--config.rl.sampler_slots=2",
        "--config.rl.system_prompt=Use the tools.", "--config.rl.constant_normalizer_len=256",
        "--config.rl.eval_every=-1", "--config.rl.staleness=0", "--config.rl.length_bucket=128"])
    run = str(tmp_path / "run")
    s = run_rl(cfg, run)  # byte codec (no tokenizer.json)
    assert s["final_step"] == 2
    rows = [m for m in read_metrics(run) if "reward" in m]
    assert len(rows) == 2
    for m in rows:
        # the prefix alone passes the trigger: a summary before the first turn (a random model's
        # first message has no tool call, so it is also the last)
        assert m["summaries_mean"] >= 1 and m["sequences_per_chain"] == m["summaries_mean"] + 1
    # step 1 (one version, no swap yet): the sampler's logprobs of every segment, summaries
    # included, match the learner's; later steps may reuse prefix caches written by older weights
    # (the sampler keeps caches across in-flight updates), so they are not exact
    assert rows[0]["logprob_mismatch_p99"] <= 1e-4 and rows[0]["logprob_mismatch_noreplay_p99"] <= 1e-4
    store = GroupStore(os.path.join(run, "groups"))
    for i in store.indices():
        g = store.get(i)
        chains = ch.split_chains(g.trajectories, len(g.rewards))
        for c, r in zip(chains, g.rewards):
            assert len(c) == c[-1].stats["summaries"] + 1 >= 2
            assert [t.finish_reason for t in c[:-1]] == ["summarized"] * (len(c) - 1)
            assert all(t.reward == r and len(t.tokens_T) <= 1024 for t in c)
            assert all(t.expert_ids_TNK is not None and t.versions_T[t.loss_mask_T].min() >= 0 for t in c)
            assert all(t.loss_mask_T[-1] for t in c[:-1])   # a summarized segment ends with the summary
