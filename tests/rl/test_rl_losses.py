"""Dr. GRPO policy loss: gradients, normalizers, IS weights, masking, metrics."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.rl.advantages import apply_kl_penalty, group_advantages
from c2jax.rl.losses import default_rl_loss_config, policy_loss, validate_rl_loss_config


def batch(B=6, L=7, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=(B, L)).astype(dtype)
    beh = (logp + rng.normal(0, 0.3, size=(B, L))).astype(dtype)
    lens = rng.integers(2, L + 1, size=B)
    mask = (np.arange(L)[None] < lens[:, None]).astype(dtype)
    adv = rng.normal(size=B).astype(dtype)
    return logp, beh, adv, mask


def cfg_with(**kw):
    c = default_rl_loss_config()
    c.update(kw)
    validate_rl_loss_config(c)
    return c


def grad_logp(logp, beh, adv, mask, cfg, **kw):
    return jax.grad(lambda lp: policy_loss(lp, beh, adv, mask, cfg, **kw)[0])(logp)


def test_default_config_matches_report_and_validates():
    c = default_rl_loss_config()
    validate_rl_loss_config(c)
    assert c.normalizer == "constant" and not c.std_normalize and c.kl_estimator == "k1"
    assert not c.mask_overlong and c.is_cap is None and c.negative_advantage_scale == 1.0
    with pytest.raises(ValueError, match="rl.normalizer"):
        cfg_with(normalizer="bad")
    with pytest.raises(ValueError, match="rl.negative_advantage_scale"):
        cfg_with(negative_advantage_scale=-0.5)


def test_step0_invariants_reinforce_gradient():
    """logp == behaviour: ratio 1, KL 0, and the gradient is plain REINFORCE with the group
    baseline advantage, for every IS cap / clipping setting."""
    G, L = 4, 5
    rng = np.random.default_rng(1)
    rewards_PG = rng.normal(size=(2, G)).astype(np.float32)
    adv_B = np.asarray(group_advantages(rewards_PG)).reshape(-1)
    logp = jnp.asarray(-rng.exponential(size=(2 * G, L)).astype(np.float32))
    mask = jnp.ones((2 * G, L))
    adv_BL = apply_kl_penalty(adv_B, logp, logp, mask, kl_coef=0.5)  # ref == policy -> no change
    np.testing.assert_allclose(adv_BL, np.broadcast_to(adv_B[:, None], (2 * G, L)), atol=0)
    reinforce = -np.broadcast_to(adv_B[:, None], (2 * G, L)) / (2 * G * L)
    for kw in ({}, {"is_cap": 2.0}, {"ppo_clip": True}, {"ppo_clip": True, "is_cap": 1.5}):
        cfg = cfg_with(**kw)
        _loss, m = policy_loss(logp, logp, adv_BL, mask, cfg, ref_logp_BL=logp)
        assert float(m["importance_ratio_mean"]) == 1.0 and float(m["importance_ratio_max"]) == 1.0
        assert float(m["kl_behaviour_k3"]) == 0.0 and float(m["kl_ref_k1"]) == 0.0
        assert float(m["clip_fraction"]) == 0.0 and float(m["logprob_mismatch_p99"]) == 0.0
        np.testing.assert_allclose(grad_logp(logp, logp, adv_BL, mask, cfg), reinforce, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("is_cap", [None, 1.2, 100.0])
def test_gradient_is_minus_adv_w_over_normalizer_float64(is_cap):
    with jax.enable_x64(True):
        logp, beh, adv, mask = batch(dtype=np.float64)
        B, _L = logp.shape
        cfg = cfg_with(is_cap=is_cap, constant_normalizer_len=16)
        g = np.asarray(grad_logp(jnp.asarray(logp), jnp.asarray(beh), jnp.asarray(adv), jnp.asarray(mask), cfg))
        assert g.dtype == np.float64
        w = np.ones_like(logp) if is_cap is None else np.minimum(np.exp(logp - beh), is_cap)
        want = -adv[:, None] * w * mask / (B * 16)
        np.testing.assert_allclose(g, want, rtol=1e-13, atol=1e-16)


def test_ppo_clip_gradient_zero_outside_trust_region():
    logp, beh, adv, mask = batch(seed=3)
    cfg = cfg_with(ppo_clip=True, clip_eps_low=0.1, clip_eps_high=0.1, is_cap=1.05)
    g = np.asarray(grad_logp(logp, beh, adv, mask, cfg))
    rho = np.exp(logp - beh)
    A = np.broadcast_to(adv[:, None], rho.shape)
    clipped = np.clip(rho, 0.9, 1.1)
    active = rho * A <= clipped * A  # min picks the unclipped branch
    want = np.where(active, -A * np.minimum(rho, 1.05) * mask, 0.0) / (logp.size)
    np.testing.assert_allclose(g, want, rtol=2e-5, atol=1e-8)
    _, m = policy_loss(logp, beh, adv, mask, cfg)
    np.testing.assert_allclose(m["clip_fraction"], ((~active) * mask).sum() / mask.sum(), rtol=1e-6)


def test_normalizer_switch():
    logp, beh, adv, mask = batch(seed=4)
    B, L = logp.shape
    lens = mask.sum(1)
    g_const = np.asarray(grad_logp(logp, beh, adv, mask, cfg_with()))
    g_seq = np.asarray(grad_logp(logp, beh, adv, mask, cfg_with(normalizer="seq_len")))
    g_tok = np.asarray(grad_logp(logp, beh, adv, mask, cfg_with(normalizer="tokens")))
    base = -adv[:, None] * mask
    np.testing.assert_allclose(g_const, base / (B * L), rtol=1e-6)
    np.testing.assert_allclose(g_seq, base / (B * lens[:, None]), rtol=1e-6)
    np.testing.assert_allclose(g_tok, base / mask.sum(), rtol=1e-6)
    # Dr. GRPO: a token's weight does not depend on its sequence's length; GRPO: it does.
    per_tok_const = g_const[mask > 0] / -np.broadcast_to(adv[:, None], mask.shape)[mask > 0]
    assert np.allclose(per_tok_const, per_tok_const[0])
    # the constant normalizer from config replaces the padded length
    np.testing.assert_allclose(grad_logp(logp, beh, adv, mask, cfg_with(constant_normalizer_len=100)),
                               base / (B * 100), rtol=1e-6)


def test_masked_tokens_get_zero_gradient_and_overlong_switch():
    logp, beh, adv, mask = batch(seed=5)
    trunc = np.zeros(len(adv), bool)
    trunc[[1, 4]] = True
    g_keep = np.asarray(grad_logp(logp, beh, adv, mask, cfg_with(), truncated_B=trunc))
    assert np.all(g_keep[mask == 0] == 0)
    assert np.all(g_keep[[1, 4]][mask[[1, 4]] > 0] != 0)  # kept by default (report)
    g_mask = np.asarray(grad_logp(logp, beh, adv, mask, cfg_with(mask_overlong=True), truncated_B=trunc))
    assert np.all(g_mask[[1, 4]] == 0)
    np.testing.assert_array_equal(np.delete(g_mask, [1, 4], 0), np.delete(g_keep, [1, 4], 0))
    with pytest.raises(ValueError, match="truncated_B"):
        policy_loss(logp, beh, adv, mask, cfg_with(mask_overlong=True))
    # garbage (-inf, +inf) on masked positions changes neither the loss nor the gradient
    logp2 = np.where(mask > 0, logp, -np.inf).astype(np.float32)
    beh2 = np.where(mask > 0, beh, np.inf).astype(np.float32)
    for cfg in (cfg_with(is_cap=2.0), cfg_with(ppo_clip=True, is_cap=2.0), cfg_with()):
        l1, _ = policy_loss(logp, beh, adv, mask, cfg, ref_logp_BL=beh)
        l2, m2 = policy_loss(logp2, beh2, adv, mask, cfg, ref_logp_BL=beh2)
        np.testing.assert_allclose(l1, l2, rtol=1e-6)
        assert all(np.isfinite(float(v)) for v in m2.values())
        g2 = np.asarray(grad_logp(logp2, beh2, adv, mask, cfg))
        np.testing.assert_allclose(g2, grad_logp(logp, beh, adv, mask, cfg), rtol=1e-6)


def test_metrics_and_jit():
    logp, beh, adv, mask = batch(seed=6)
    cfg = cfg_with(is_cap=1.5)
    f = jax.jit(functools.partial(policy_loss, cfg=cfg))
    _loss, m = f(logp, beh, adv, mask, ref_logp_BL=beh)
    on = mask > 0
    d = np.abs(logp - beh)[on]
    np.testing.assert_allclose(m["logprob_mismatch_mean_abs"], d.mean(), rtol=1e-5)
    want_p99 = np.sort(d)[int(np.ceil(0.99 * d.size)) - 1]
    np.testing.assert_allclose(m["logprob_mismatch_p99"], want_p99, rtol=1e-6)
    ratio = np.exp(logp - beh)[on]
    np.testing.assert_allclose(m["importance_ratio_mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["importance_ratio_max"], ratio.max(), rtol=1e-5)
    np.testing.assert_allclose(m["is_capped_fraction"], (ratio > 1.5).mean(), rtol=1e-6)
    np.testing.assert_allclose(m["kl_ref_k1"], (logp - beh)[on].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["entropy_proxy"], -logp[on].mean(), rtol=1e-6)
    assert all(np.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("normalizer", ["constant", "seq_len", "tokens"])
def test_padded_rows_with_num_sequences_leave_loss_and_grads_unchanged(normalizer):
    """The learner rounds the row count up with empty rows (chained rollouts vary in sequence
    count); with num_sequences the loss and its gradient are those of the unpadded batch."""
    rng = np.random.default_rng(7)
    B, L, pad = 5, 12, 3
    cfg = default_rl_loss_config()
    cfg.normalizer = normalizer
    cfg.constant_normalizer_len = 16
    logp = jnp.asarray(-rng.random((B, L)), jnp.float32)
    beh = logp + jnp.asarray(rng.normal(0, 0.05, (B, L)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=B), jnp.float32)
    mask = jnp.asarray(rng.random((B, L)) < 0.7)

    def padded(x, fill):
        return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])

    f = lambda lp: policy_loss(lp, beh, adv, mask, cfg)[0]  # noqa: E731
    g = lambda lp: policy_loss(lp, padded(beh, 0.0), padded(adv, 0.0), padded(mask, False), cfg,  # noqa: E731
                               num_sequences=B)[0]
    lp_pad = padded(logp, -3.0)
    np.testing.assert_allclose(float(g(lp_pad)), float(f(logp)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(g)(lp_pad))[:B], np.asarray(jax.grad(f)(logp)), rtol=1e-6)
    assert float(jnp.abs(jax.grad(g)(lp_pad)[B:]).max()) == 0.0
