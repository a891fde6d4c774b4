"""Closed-form variances of k1/k2/k3 (Gaussian shift) against Monte Carlo, and the gradient
facts behind "k1 only as a detached penalty" (experiments/kl_estimators.py)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from c2jax.rl.kl import gaussian_shift_estimator_variance
from experiments.kl_estimators import (
    crossover_kl,
    estimator_samples,
    gradient_estimates,
)

N = 400_000


@pytest.mark.parametrize("kl", [0.02, 0.2, 0.6])
def test_closed_form_variance_matches_monte_carlo(kl):
    s = estimator_samples(kl, N, seed=7)
    for est, v in s.items():
        c = v - v.mean()
        var_hat = c.var()
        se = np.sqrt((np.mean(c**4) - var_hat**2) / N)  # standard error of the sample variance
        want = float(gaussian_shift_estimator_variance(kl, est))
        assert abs(var_hat - want) < 5 * se + 1e-12, (est, var_hat, want, se)
    # k1, k3 unbiased; k2 biased by K^2/2
    for est, mean in (("k1", kl), ("k3", kl), ("k2", kl + kl**2 / 2)):
        se = s[est].std() / np.sqrt(N)
        assert abs(s[est].mean() - mean) < 5 * se, est


def test_k3_variance_overtakes_k1():
    kstar = crossover_kl()
    assert 0.6 < kstar < 0.66
    for kl, k3_smaller in ((0.1, True), (0.5, True), (1.0, False), (5.0, False)):
        v1, v3 = (float(gaussian_shift_estimator_variance(kl, e)) for e in ("k1", "k3"))
        assert (v3 < v1) == k3_smaller
    assert float(gaussian_shift_estimator_variance(5.0, "k3")) > 2000 * float(gaussian_shift_estimator_variance(5.0, "k1"))


def test_k1_is_correct_only_as_detached_reward():
    kl = 0.5  # true gradient d KL / d mu = mu = 1
    g = gradient_estimates(kl, 200_000, seed=0)
    n = 200_000
    for name, want in (("k1 detached reward", 1.0), ("k1 loss term", 0.0), ("k3 loss term", 1.0),
                       ("k3 detached reward", 0.0)):
        mean, std = g[name]
        assert abs(mean - want) < 5 * std / np.sqrt(n), (name, mean)
