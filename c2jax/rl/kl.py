"""Per-token KL estimators between the policy and a reference policy.

Samples come from the policy pi (the current or behaviour policy); pi_ref is the reference.
With log r = log pi_ref(x) - log pi(x), the estimators of KL(pi || pi_ref) are

  k1 = -log r                 unbiased, variance ~ 2 KL for small drifts, can be negative
  k2 = (log r)^2 / 2          biased (E k2 = KL + O(KL^2)), always >= 0
  k3 = (r - 1) - log r        unbiased, always >= 0, variance grows like e^(2 KL)

Composer 2 uses k1 because k3's variance explodes when the policies drift apart. k1 is only a
correct gradient as a *detached* reward / advantage penalty: E_pi[grad k1(x)] =
E_pi[grad log pi] = 0, so differentiating k1 as a loss term gives a zero-mean gradient.
`experiments/kl_estimators.py` measures both facts on Gaussians.

Letters: B = sequences, L = tokens per sequence (any shape works; the functions are
elementwise).
"""
from __future__ import annotations

import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp, logp_ref, estimator: str = "k1"):
    """Elementwise estimate of KL(pi || pi_ref) from samples of pi.

    Args:
      logp: log pi(x) of the sampled tokens (any shape).
      logp_ref: log pi_ref(x) of the same tokens (same shape).
      estimator: "k1" | "k2" | "k3".
    Returns:
      Array of the same shape. Gradients flow through both inputs; callers that use it as a
      reward penalty must wrap it in `jax.lax.stop_gradient` (see advantages.apply_kl_penalty).
    """
    log_r = logp_ref - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        # expm1 keeps (r - 1) accurate when r is close to 1 (small drift).
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def gaussian_shift_kl(mu):
    """KL(N(mu, 1) || N(0, 1)) = mu^2 / 2."""
    return 0.5 * jnp.square(mu)


def gaussian_shift_estimator_variance(kl, estimator: str):
    """Closed-form variance of each estimator for pi = N(mu, 1), pi_ref = N(0, 1), x ~ pi.

    With K = KL = mu^2 / 2, log r = -K - mu z (z ~ N(0, 1)), so Y := -log r ~ N(K, 2K):
      Var k1 = Var Y = 2K
      Var k2 = Var(Y^2) / 4 = (4 K^2 (2K) + 2 (2K)^2) / 4 = 2 K^2 (1 + K)
      Var k3 = Var(e^{-Y} + Y) = (e^{2K} - 1) + 2K + 2 Cov(e^{-Y}, Y)
             = e^{2K} - 1 + 2K - 2 (2K) = e^{2K} - 1 - 2K        (Stein: Cov(e^{-Y},Y) = -2K E e^{-Y})
    The derivation is written out in experiments/kl_estimators.py.
    """
    kl = jnp.asarray(kl)
    if estimator == "k1":
        return 2.0 * kl
    if estimator == "k2":
        return 2.0 * kl**2 * (1.0 + kl)
    if estimator == "k3":
        return jnp.expm1(2.0 * kl) - 2.0 * kl
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
