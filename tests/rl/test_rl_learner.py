"""Step-0 invariants of the learner against the real sampler (f32): recomputed logprobs equal
the behaviour logprobs, importance ratio 1, KL 0; router replay equals the recompute path when
the routes agree, replaces implausible experts past the threshold, and the router still gets
gradients; batch building and balancing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.config import load_config
from c2jax.models import init_params
from c2jax.rl.learner import Learner, _logp, balance_order, build_batch, learner_cfg
from c2jax.rl.rollout import SamplerService, ToyEnv
from c2jax.trajectory import Trajectory


@functools.cache
def setup(temperature=1.0):
    cfg = load_config("configs/rl_tiny.py:toy", [f"--config.rl.temperature={temperature}"])
    params = init_params(cfg, jax.random.key(1))
    return cfg, params


def rollouts(cfg, params, n=6, speculative="none"):
    env = ToyEnv(cfg.rl, cfg.model.vocab_size)
    tasks = env.load_tasks("toy", "train", 3, 0)
    svc = SamplerService(learner_cfg(cfg), params, 0, cfg.rl.sampler_slots, env.max_len(), cfg.rl.sampler_chunk,
                         speculative=speculative)
    try:
        out = [env.episode(tasks[i % 3], svc, f"t/{i}", 0, cfg.rl.temperature)[0] for i in range(n)]
        if speculative == "mtp":
            assert svc.spec_drafted > 0 and svc.sampler.speculative == "mtp"
    finally:
        svc.stop()
    return out


# 1.0 is checked by the orchestrator runs; "mtp": rollouts drafted by the MTP head and verified
# (speculative decoding) hand the learner the same logprobs and expert ids as plain decoding's
@pytest.mark.parametrize("temperature,speculative", [(0.7, "none"), (0.7, "mtp")])
def test_step0_logprobs_ratio_and_kl(temperature, speculative):
    cfg, params = setup(temperature)
    assert cfg.model.num_mtp_layers >= 1
    trajs = rollouts(cfg, params, speculative=speculative)
    learner = Learner(cfg, params)
    adv = np.linspace(-1, 1, len(trajs)).astype(np.float32)
    m = learner.step(trajs, adv)
    assert m["logprob_mismatch_mean"] <= 1e-4 and m["logprob_mismatch_p99"] <= 1e-4, m
    assert m["logprob_mismatch_noreplay_p99"] <= 1e-4, m
    assert abs(m["importance_ratio_mean"] - 1) <= 1e-4 and abs(m["importance_ratio_max"] - 1) <= 1e-4
    assert m["kl_ref_k1"] == 0.0 and m["kl_ref_k3"] == 0.0
    assert abs(m["kl_behaviour_k3"]) <= 1e-7
    assert m["route_agreement"] == 1.0 and m["replayed_fraction"] == 1.0
    assert m["skipped"] == 0 and m["grad_norm"] > 0
    assert learner.version == 1


def _batch_and_cfg(threshold=0.0):
    cfg, params = setup(0.7)
    cfg = learner_cfg(cfg)
    cfg.model.replay_threshold = threshold
    trajs = rollouts(cfg, params, 4)
    b = build_batch(trajs, np.ones(4, np.float32), 16, num_moe_layers=1, top_k=cfg.model.num_experts_per_tok)
    return cfg, params, {k: jnp.asarray(v) for k, v in b.items()}


def test_replay_equals_recompute_when_routes_agree_and_router_gets_gradients():
    cfg, params, b = _batch_and_cfg()
    logp_own, aux = _logp(cfg, params, b, None)
    own = aux["expert_ids"]
    rec = b["forced_ids"]
    on = np.asarray(rec[..., 0] >= 0)
    np.testing.assert_array_equal(np.sort(np.asarray(own), -1)[on], np.sort(np.asarray(rec), -1)[on])
    logp_rep, _ = _logp(cfg, params, b, own)
    np.testing.assert_array_equal(np.asarray(logp_rep), np.asarray(logp_own))

    def loss(p, forced):
        lp, _ = _logp(cfg, p, b, forced)
        return jnp.sum(jnp.where(b["loss_mask"], lp, 0.0))
    g_own = jax.grad(loss)(params, None)
    g_rep = jax.grad(loss)(params, own)
    for a, c in zip(jax.tree.leaves(g_own), jax.tree.leaves(g_rep)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    router_g = g_rep["moe_layers"]["block"]["moe"]["router"]
    assert float(jnp.abs(router_g).sum()) > 0  # forced experts, gate scores still differentiable


def test_replay_threshold_replaces_implausible_experts():
    cfg, params, b = _batch_and_cfg(threshold=0.5)
    logp_own, aux = _logp(cfg, params, b, None)
    # force the two lowest-scoring experts everywhere: all implausible, all replaced by own picks
    E = cfg.model.num_experts
    own = np.asarray(aux["expert_ids"])
    worst = np.zeros_like(own)
    for t in np.ndindex(own.shape[:3]):
        rest = [e for e in range(E) if e not in own[t]]
        worst[t] = rest[:own.shape[-1]]
    cfg_off = learner_cfg(setup(0.7)[0])
    cfg_off.model.replay_threshold = 0.0
    lp_forced_raw, _ = _logp(cfg_off, params, b, jnp.asarray(worst))
    lp_forced_thr, aux_thr = _logp(cfg, params, b, jnp.asarray(worst))
    assert float(aux_thr["replaced_fraction"].mean()) > 0.2
    mask = np.asarray(b["loss_mask"])
    raw_gap = np.abs(np.asarray(lp_forced_raw) - np.asarray(logp_own))[mask].max()
    thr_gap = np.abs(np.asarray(lp_forced_thr) - np.asarray(logp_own))[mask].max()
    assert thr_gap < raw_gap


def test_build_batch_shifts_and_masks():
    t = Trajectory(tokens_T=np.array([5, 6, 7, 8, 9], np.int32), loss_mask_T=np.array([0, 0, 1, 1, 1], bool),
                   logprobs_T=np.array([0, 0, -1, -2, -3], np.float32), versions_T=np.array([-1, -1, 0, 0, 0], np.int32),
                   expert_ids_TNK=np.arange(5 * 1 * 2, dtype=np.int32).reshape(5, 1, 2), finish_reason="length")
    b = build_batch([t], [0.5], 8, num_moe_layers=1, top_k=2)
    assert b["inputs"].shape == (1, 8)
    assert b["inputs"][0, :4].tolist() == [5, 6, 7, 8] and b["targets"][0, :4].tolist() == [6, 7, 8, 9]
    assert b["loss_mask"][0].tolist() == [False, True, True, True] + [False] * 4
    assert b["behaviour_logp"][0, :4].tolist() == [0, -1, -2, -3]
    assert b["forced_ids"][0, 0, :4].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (b["forced_ids"][0, 0, 4:] == -1).all() and b["truncated"][0]
    p = build_batch([t] * 3, [0.5, 1.0, -1.0], 8, [1.0, 2.0, 1.0], row_bucket=2)  # 3 rows -> 4
    assert p["inputs"].shape == (4, 8) and float(p["num_sequences"]) == 3.0
    assert p["advantages"].tolist() == [0.5, 2.0, -1.0, 0.0]
    assert not p["loss_mask"][3].any() and not p["segment_ids"][3].any() and not p["truncated"][3]
    assert build_batch([t] * 2, [1.0, 1.0], 8, row_bucket=2)["inputs"].shape == (2, 8)  # one bucket: as is


def test_balance_order():
    lengths = [100, 90, 10, 5, 50, 45]
    order = balance_order(lengths, 2)
    assert sorted(order) == list(range(6))
    loads = [sum(lengths[i] for i in order[:3]), sum(lengths[i] for i in order[3:])]
    assert abs(loads[0] - loads[1]) <= 20


@pytest.mark.parametrize("micro,normalizer,overlong", [(2, "constant", False), (4, "tokens", True),
                                                       (4, "seq_len", False)])
def test_micro_batched_step_equals_whole_batch(micro, normalizer, overlong):
    """rl.micro_batch_rows splits the step into micro-batches (6 rows -> 3 x 2, or 8 padded rows ->
    2 x 4): the update and the metrics equal the whole-batch step's."""
    cfg, params = setup(0.7)
    trajs = rollouts(cfg, params)
    for i, t in enumerate(trajs):  # toy rollouts all stop at max tokens: one truncated row for mask_overlong
        t.finish_reason = "max_tokens" if i == 1 else "stop"
    adv = np.random.default_rng(0).normal(size=len(trajs)).astype(np.float32)
    out = {}
    for rows in (0, micro):
        c = load_config("configs/rl_tiny.py:toy", ["--config.rl.temperature=0.7", f"--config.rl.micro_batch_rows={rows}",
                                                  f"--config.rl.normalizer={normalizer}", "--config.rl.kl_coef=0.05",
                                                  f"--config.rl.mask_overlong={overlong}",
                                                  "--config.train.adam_eps=1.0"])  # ~SGD: updates follow the gradient
        learner = Learner(c, params)
        learner.step(trajs, adv)  # step 1 moves off the reference: step 2 has KL and ratios != 1
        m = learner.step(trajs, adv[::-1].copy())
        out[rows] = (m, jax.device_get(learner.params))
    (m0, p0), (m1, p1) = out[0], out[micro]
    assert m1["micro_batches"] == (3 if micro == 2 else 2) and m0["micro_batches"] == 1
    for k in ("loss", "grad_norm", "kl_ref_k1", "importance_ratio_mean", "logprob_mismatch_p99", "route_agreement",
              "num_tokens"):
        np.testing.assert_allclose(m1[k], m0[k], rtol=2e-5, atol=1e-7, err_msg=k)
    assert m0["kl_ref_k1"] != 0.0 and m0["grad_norm"] > 0
    # (with Adam's eps 1e-8 a near-zero gradient element gets a ~lr step whose size float noise decides)
    u0 = [np.asarray(a) - np.asarray(p) for a, p in zip(jax.tree.leaves(p0), jax.tree.leaves(params))]
    u1 = [np.asarray(a) - np.asarray(p) for a, p in zip(jax.tree.leaves(p1), jax.tree.leaves(params))]
    scale = max(float(np.abs(u).max()) for u in u0)
    assert scale > 0
    for a, b in zip(u0, u1):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * scale)  # f32 rounding of p + u


@pytest.mark.parametrize("normalizer,micro", [("constant", 2), ("tokens", 2), ("seq_len", 0)])
def test_skipping_zero_advantage_rows_keeps_the_update(normalizer, micro):
    """rl.skip_zero_advantage_rows drops the rows whose advantage is exactly 0 (an all-equal group,
    attempts clipped by negative_advantage_scale 0): the learner runs fewer rows and the update and
    loss equal the whole batch's, because the loss keeps the whole batch's normalizer."""
    cfg, params = setup(0.7)
    trajs = rollouts(cfg, params, n=8)
    adv = np.random.default_rng(3).normal(size=len(trajs)).astype(np.float32)
    adv[[0, 3, 4, 7]] = 0.0
    w = np.random.default_rng(4).uniform(0.5, 1.0, size=len(trajs)).astype(np.float32)
    w[5] = 0.0   # a zero weight drops the row too
    out = {}
    for skip in (False, True):
        c = load_config("configs/rl_tiny.py:toy", ["--config.rl.temperature=0.7", f"--config.rl.micro_batch_rows={micro}",
                                                  f"--config.rl.normalizer={normalizer}", "--config.rl.kl_coef=0.0",
                                                  f"--config.rl.skip_zero_advantage_rows={skip}",
                                                  # the MTP heads' distillation trains on every row it sees
                                                  "--config.train.mtp_loss_weight=0.0",
                                                  "--config.train.adam_eps=1.0"])  # ~SGD: updates follow the gradient
        learner = Learner(c, params)
        m = learner.step(trajs, adv, w)
        out[skip] = (m, jax.device_get(learner.params))
    (m0, p0), (m1, p1) = out[False], out[True]
    assert m0["rows_skipped"] == 0 and m1["rows_skipped"] == 5
    if micro:   # 3 kept rows pad to 2 micro-batches of 2
        assert m1["micro_batches"] == 2 and m0["micro_batches"] == 4
    else:       # one step: the 3 kept rows round up to 4 (quarters of the 8-row batch)
        assert m1["micro_batches"] == m0["micro_batches"] == 1 and m1["num_tokens"] < m0["num_tokens"]
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=2e-5, atol=1e-8)
    np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=2e-5)
    assert m0["grad_norm"] > 0
    u0 = [np.asarray(a) - np.asarray(p) for a, p in zip(jax.tree.leaves(p0), jax.tree.leaves(params))]
    u1 = [np.asarray(a) - np.asarray(p) for a, p in zip(jax.tree.leaves(p1), jax.tree.leaves(params))]
    scale = max(float(np.abs(u).max()) for u in u0)
    for a, b in zip(u0, u1):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * scale)
    from c2jax.config import ConfigError
    with pytest.raises(ConfigError, match="skip_zero_advantage_rows needs rl.kl_coef=0"):
        load_config("configs/rl_tiny.py:toy", ["--config.rl.skip_zero_advantage_rows=True", "--config.rl.kl_coef=0.1"])


def test_micro_batch_rows_is_validated():
    from c2jax.config import ConfigError
    with pytest.raises(ConfigError, match="micro_batch_rows"):
        load_config("configs/rl_tiny.py:toy", ["--config.rl.micro_batch_rows=-1"])


def test_mtp_heads_are_distilled_in_the_rl_step():
    """With MTP heads the step adds their self-distillation to the main head (train.mtp_loss_weight):
    the heads' params move and `mtp_loss` is reported; with weight 0 the heads stay as they were."""
    rng = np.random.default_rng(0)
    trajs = [Trajectory(rng.integers(0, 64, 20).astype(np.int32), np.arange(20) >= 8,
                        np.where(np.arange(20) >= 8, -2.0, 0.0).astype(np.float32), np.zeros(20, np.int32))
             for _ in range(4)]
    moved = {}
    for weight in (0.3, 0.0):
        cfg = load_config("configs/rl_tiny.py:toy", ["--config.model.num_mtp_layers=1", "--config.rl.kl_coef=0",
                                                     f"--config.train.mtp_loss_weight={weight}"])
        params = init_params(cfg, jax.random.key(1))
        learner = Learner(cfg, params)
        m = learner.step(trajs, np.linspace(-1, 1, 4).astype(np.float32))
        heads = [k for k in params if k.startswith("mtp_")]
        assert heads, list(params)
        moved[weight] = max(float(jnp.max(jnp.abs(a - b))) for k in heads
                            for a, b in zip(jax.tree.leaves(learner.params[k]), jax.tree.leaves(params[k])))
        assert ("mtp_loss" in m) == (weight > 0)
        if weight:
            assert m["mtp_loss"] > 0
    assert moved[0.3] > 0 and moved[0.0] == 0, moved


@pytest.mark.parametrize("into_policy", [False, True])
def test_rl_mtp_distillation_reaches_the_policy_only_when_asked(into_policy):
    """rl.mtp_into_policy=False (the default): the MTP term trains the heads alone, so every other
    weight takes exactly the step it takes without the term; True: the trunk moves differently."""
    rng = np.random.default_rng(3)
    trajs = [Trajectory(rng.integers(0, 64, 20).astype(np.int32), np.arange(20) >= 8,
                        rng.normal(-2.0, 0.3, 20).astype(np.float32) * (np.arange(20) >= 8), np.zeros(20, np.int32))
             for _ in range(4)]
    adv = rng.normal(size=4).astype(np.float32)
    after = {}
    for weight in (0.5, 0.0):
        cfg = load_config("configs/rl_tiny.py:toy", ["--config.model.num_mtp_layers=1", "--config.rl.kl_coef=0",
                                                     "--config.train.grad_clip=0",
                                                     f"--config.rl.mtp_into_policy={into_policy}",
                                                     f"--config.train.mtp_loss_weight={weight}"])
        params = init_params(cfg, jax.random.key(2))
        learner = Learner(cfg, params)
        learner.step(trajs, adv)
        after[weight] = {k: v for k, v in learner.params.items() if not k.startswith("mtp_")}
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(after[0.5]), jax.tree.leaves(after[0.0])))
    if into_policy:
        assert diff > 1e-6, diff
    else:
        assert diff == 0.0, diff
