"""Group advantages and the detached KL penalty."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.rl.advantages import (
    apply_kl_penalty,
    broadcast_advantages,
    group_advantages,
    group_advantages_by_id,
    kl_penalty,
)
from c2jax.rl.kl import kl_estimate


def test_group_mean_baseline_no_std_by_default():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2], [3.0, 1.0, 2.0, 2.0]])
    adv = np.asarray(group_advantages(r))
    np.testing.assert_allclose(adv, r - r.mean(1, keepdims=True), atol=1e-7)
    np.testing.assert_allclose(adv[1], 0.0)
    std = np.asarray(group_advantages(r, std_normalize=True, std_eps=0.0))[[0, 2]]
    np.testing.assert_allclose(std, (r - r.mean(1, keepdims=True))[[0, 2]] / r.std(1, keepdims=True)[[0, 2]], rtol=1e-6)
    # std normalization changes the scale only: sign pattern and zero groups are kept
    assert np.all(np.asarray(group_advantages(r, std_normalize=True))[1] == 0.0)
    np.testing.assert_array_equal(np.sign(std), np.sign(adv[[0, 2]]))


def test_negative_scale_shrinks_only_the_attempts_below_their_group_mean():
    rng = np.random.default_rng(3)
    r = rng.normal(size=(5, 8))
    base = np.asarray(group_advantages(r))
    for scale in (0.0, 0.3):
        adv = np.asarray(group_advantages(r, negative_scale=scale))
        np.testing.assert_allclose(adv, np.where(base < 0, scale * base, base), rtol=1e-6)
    pos = np.asarray(group_advantages(r, std_normalize=True, negative_scale=0.0))
    assert np.all(pos >= 0) and np.all((pos > 0) == (base > 0))


def test_group_by_id_matches_dense_and_handles_ragged():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(3, 4))
    ids = np.repeat(np.arange(3), 4)
    for s in (False, True):
        np.testing.assert_allclose(group_advantages_by_id(r.reshape(-1), ids, 3, s),
                                   np.asarray(group_advantages(r, s)).reshape(-1), rtol=1e-5, atol=1e-6)
    adv = np.asarray(group_advantages_by_id(np.array([1.0, 3.0, 5.0]), np.array([0, 0, 1]), 2))
    np.testing.assert_allclose(adv, [-1.0, 1.0, 0.0])


def test_kl_estimators_values():
    logp = jnp.array([-1.0, -2.0, -0.5])
    ref = jnp.array([-1.0, -1.0, -2.0])
    log_r = np.asarray(ref - logp)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), -log_r, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), 0.5 * log_r**2, rtol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), np.exp(log_r) - 1 - log_r, rtol=1e-6)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_k1_penalty_is_detached():
    logp = jnp.array([[-1.0, -2.0, -0.3], [-0.7, -0.1, -4.0]])
    ref = logp + jnp.array([[0.5, -0.2, 0.1], [0.0, 0.3, -1.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    adv_B = jnp.array([1.0, -0.5])
    beta = 0.1
    adv = apply_kl_penalty(adv_B, logp, ref, mask, beta, "k1")
    np.testing.assert_allclose(adv, adv_B[:, None] - beta * (logp - ref) * mask, rtol=1e-6)
    for est in ("k1", "k2", "k3"):
        g_logp, g_ref = jax.grad(lambda a, b, est=est: jnp.sum(apply_kl_penalty(adv_B, a, b, mask, beta, est)),
                                 argnums=(0, 1))(logp, ref)
        assert np.all(np.asarray(g_logp) == 0) and np.all(np.asarray(g_ref) == 0)


def test_kl_to_go_is_reverse_cumsum():
    logp = jnp.array([[-1.0, -2.0, -0.3, -1.0]])
    ref = jnp.zeros_like(logp)
    mask = jnp.array([[1, 1, 1, 0]])
    per = np.asarray(kl_penalty(logp, ref, mask, "k1"))
    togo = np.asarray(kl_penalty(logp, ref, mask, "k1", to_go=True))
    np.testing.assert_allclose(per, [[-1.0, -2.0, -0.3, 0.0]])
    np.testing.assert_allclose(togo, [[-3.3, -2.3, -0.3, 0.0]], rtol=1e-6)


def test_broadcast_shape_errors():
    with pytest.raises(ValueError, match="expected"):
        broadcast_advantages(jnp.zeros((2, 3)), (2, 4))
