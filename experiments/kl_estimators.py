"""k1 vs k2 vs k3: variance of KL estimators as two policies drift apart (report section 3).

Setup. The current policy is q = N(mu, 1) (we sample from it, as RL samples from the policy);
the reference is p = N(0, 1). We estimate KL(q || p) from x ~ q with r = p(x) / q(x):
    k1 = -log r,   k2 = (log r)^2 / 2,   k3 = (r - 1) - log r.
mu is chosen so that KL spans 0.01 .. 5.

Closed forms (derivation). log p(x) - log q(x) = -x^2/2 + (x - mu)^2/2 = mu^2/2 - mu x.
Write x = mu + z, z ~ N(0, 1): log r = -mu^2/2 - mu z. KL(q||p) = E[-log r] = mu^2/2 =: K.
So Y := -log r = K + mu z ~ N(K, 2K) (mu^2 = 2K).
  k1 = Y:  E k1 = K (unbiased); Var k1 = mu^2 = 2K.
  k2 = Y^2/2:  E k2 = (K^2 + 2K)/2 = K + K^2/2 (biased up).
       For Y ~ N(m, s^2), Var(Y^2) = 4 m^2 s^2 + 2 s^4, so
       Var k2 = (4 K^2 (2K) + 2 (2K)^2) / 4 = 2 K^2 (1 + K).
  k3 = e^{-Y} - 1 + Y:  E e^{-Y} = e^{-K + (2K)/2} = 1, so E k3 = K (unbiased).
       Var e^{-Y} = E e^{-2Y} - 1 = e^{-2K + 4K} - 1 = e^{2K} - 1.
       Cov(e^{-Y}, Y) = -Var(Y) E e^{-Y} = -2K (Stein's lemma: Cov(g(Y), Y) = s^2 E g'(Y)).
       Var k3 = (e^{2K} - 1) + 2K + 2(-2K) = e^{2K} - 1 - 2K.
So Var k1 grows linearly in K while Var k3 grows like e^{2K}. For small K, Var k3 ~ 2K^2 is
*smaller* than Var k1 = 2K (why k3 is popular); the two cross where e^{2K} - 1 - 2K = 2K,
K* ~ 0.63, and beyond that k3's variance explodes (K = 5: 2.2e4 vs 10).

Gradients (why k1 must be a detached reward). With theta = mu and samples held fixed (RL does
not differentiate through the sampler), grad_mu KL(q||p) = mu. Four ways to use an estimator:
  k1 as a detached reward:   E[k1 * grad log q] = grad E_q[k1] - E[grad k1] = mu - 0 = mu   (correct)
  k1 as a loss term:         E[grad k1] = E[grad log q] = 0                             (no signal)
  k3 as a loss term:         E[(1 - r) grad log q] = -E_p[grad log q] = grad KL(p||q) (forward KL;
                             = mu here only because the Gaussian shift is symmetric)
  k3 as a detached reward:   E[k3 * grad log q] = mu - E[grad k3] = mu - mu = 0         (no signal)
The script measures all four with jax.grad.

Run: JAX_PLATFORMS=cpu python experiments/kl_estimators.py [--samples N] [--seed S] [--out DIR]
Writes DIR/kl_estimators.png and DIR/table.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from c2jax.rl.kl import gaussian_shift_estimator_variance, kl_estimate

ESTIMATORS = ("k1", "k2", "k3")


def crossover_kl() -> float:
    """K where Var k3 = Var k1 (bisection on e^{2K} - 1 - 4K)."""
    lo, hi = 0.1, 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if np.expm1(2 * mid) - 4 * mid < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def estimator_samples(kl: float, n: int, seed: int) -> dict[str, np.ndarray]:
    """Samples of k1/k2/k3 for KL(N(mu,1) || N(0,1)) = kl, x ~ N(mu, 1) (float64)."""
    mu = np.sqrt(2.0 * kl)
    x = mu + np.random.default_rng(seed).standard_normal(n)
    with jax.enable_x64(True):
        logq = jnp.asarray(-0.5 * (x - mu) ** 2)
        logp = jnp.asarray(-0.5 * x**2)  # normalizers cancel
        return {e: np.asarray(kl_estimate(logq, logp, e)) for e in ESTIMATORS}


def gradient_estimates(kl: float, n: int, seed: int) -> dict[str, tuple[float, float]]:
    """Mean and std of per-sample d/dmu estimates for the four uses of k1 / k3 (true: mu)."""
    mu0 = np.sqrt(2.0 * kl)
    x = mu0 + np.random.default_rng(seed + 1).standard_normal(n)
    with jax.enable_x64(True):
        xs = jnp.asarray(x)

        def logq(mu, xi):
            return -0.5 * (xi - mu) ** 2

        def logp(xi):
            return -0.5 * xi**2

        def as_loss(est):
            return lambda mu, xi: kl_estimate(logq(mu, xi), logp(xi), est)

        def as_reward(est):
            return lambda mu, xi: jax.lax.stop_gradient(kl_estimate(logq(mu, xi), logp(xi), est)) * logq(mu, xi)

        uses = {"k1 detached reward": as_reward("k1"), "k1 loss term": as_loss("k1"),
                "k3 loss term": as_loss("k3"), "k3 detached reward": as_reward("k3")}
        out = {}
        for name, f in uses.items():
            g = np.asarray(jax.vmap(jax.grad(f), in_axes=(None, 0))(jnp.asarray(mu0), xs))
            out[name] = (float(g.mean()), float(g.std()))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "kl_estimators"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    kls = np.geomspace(0.01, 5.0, 13)
    rows = []
    for i, kl in enumerate(kls):
        s = estimator_samples(float(kl), args.samples, args.seed + i)
        row = {"kl": float(kl)}
        for e in ESTIMATORS:
            v = s[e]
            row[f"mean_{e}"] = float(v.mean())
            row[f"var_{e}_mc"] = float(v.var())
            row[f"var_{e}_closed"] = float(gaussian_shift_estimator_variance(kl, e))
            # standard error of the sample variance, from the sample 4th central moment
            c = v - v.mean()
            row[f"var_{e}_se"] = float(np.sqrt(max(np.mean(c**4) - np.mean(c**2) ** 2, 0.0) / len(v)))
        rows.append(row)
        print(f"KL={kl:.4g}  " + "  ".join(
            f"{e}: var mc {row[f'var_{e}_mc']:.4g} / closed {row[f'var_{e}_closed']:.4g}" for e in ESTIMATORS),
            flush=True)
    grad_kls = [0.05, 0.5, 2.0]
    grads = {kl: gradient_estimates(kl, args.samples, args.seed + 100) for kl in grad_kls}
    kstar = crossover_kl()

    # ---------------- figure
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    fine = np.geomspace(kls[0], kls[-1], 200)
    colors = {"k1": "C0", "k2": "C2", "k3": "C3"}
    for e in ESTIMATORS:
        ax.plot(fine, [float(gaussian_shift_estimator_variance(k, e)) for k in fine], color=colors[e],
                label=f"{e} closed form")
        ax.plot(kls, [r[f"var_{e}_mc"] for r in rows], "o", color=colors[e], ms=4,
                label=f"{e} Monte Carlo ({args.samples:.0e} samples)")
    ax.axvline(kstar, color="gray", ls=":", lw=1)
    ax.text(kstar * 0.9, 3e2, f"Var k3 = Var k1\nat KL={kstar:.2f}", fontsize=8, color="gray", ha="right")
    ax.set(xscale="log", yscale="log", xlabel="KL(q || p)", ylabel="variance of one-sample estimate",
           title="KL estimators, q = N(mu,1) sampled, p = N(0,1)")
    ax.legend(fontsize=7)
    names = list(grads[grad_kls[0]])
    width = 0.2
    for j, name in enumerate(names):
        ax2.bar(np.arange(len(grad_kls)) + (j - 1.5) * width,
                [grads[k][name][0] / np.sqrt(2 * k) for k in grad_kls], width, label=name)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(0.0, color="k", lw=0.5)
    ax2.set_xlabel("k1 as a loss term and k3 as a detached reward have zero mean gradient")
    ax2.set_xticks(np.arange(len(grad_kls)), [f"KL={k}" for k in grad_kls])
    ax2.set(ylabel="E[gradient estimate] / true d KL / d mu", title="How the estimator is used matters")
    ax2.set_ylim(-0.1, 1.45)
    ax2.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    png = os.path.join(args.out, "kl_estimators.png")
    fig.savefig(png, dpi=120)

    # ---------------- table
    lines = [f"# KL estimator variance (samples per KL = {args.samples}, seed = {args.seed})", "",
             "q = N(mu, 1) sampled, p = N(0, 1); MC = Monte Carlo sample variance (+- its standard error).", "",
             ("| KL | mean k1 | mean k2 | mean k3 | Var k1 closed | Var k1 MC | Var k2 closed | Var k2 MC "
             "| Var k3 closed | Var k3 MC | Var k3 / Var k1 |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['kl']:.4g}"] + [f"{r[f'mean_{e}']:.4g}" for e in ESTIMATORS]
        for e in ESTIMATORS:
            cells += [f"{r[f'var_{e}_closed']:.4g}", f"{r[f'var_{e}_mc']:.4g} +- {r[f'var_{e}_se']:.2g}"]
        cells.append(f"{r['var_k3_closed'] / r['var_k1_closed']:.3g}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Var k3 = Var k1 at KL = {kstar:.3f} (closed form); below it k3 has the lower variance.", "",
              "## Gradient of KL(q||p) w.r.t. mu (true value mu = sqrt(2 KL)), mean +- std of one-sample estimate",
              "", "| KL | true | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for k in grad_kls:
        lines.append(f"| {k} | {np.sqrt(2 * k):.4g} | "
                     + " | ".join(f"{grads[k][n][0]:.4g} +- {grads[k][n][1]:.3g}" for n in names) + " |")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {png} and {os.path.join(args.out, 'table.md')}")
    return rows, grads


if __name__ == "__main__":
    main()
