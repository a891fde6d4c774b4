"""The concave length penalty C(x) of Composer 2 (report section 3) for several q.

    C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))      (q = 1: log(1 + k x) / k)

C(0) = 0 and C'(x) = (1 + k x)^(-q): every curve starts with slope 1, q = 0 is linear (C = x),
and larger q bends sooner: the marginal cost of extra effort falls as the episode grows, so
the penalty pushes hardest on short, easy episodes (where extra turns are pure waste) and
does not crush long episodes that hard tasks need. x is the weighted effort (thinking,
tool-call, tool-output and final-message tokens, tool calls, turns); with the default weights
of `c2jax.rl.losses.default_rl_loss_config()` one unit of x is ~1000 tokens or 5 turns.

Run: JAX_PLATFORMS=cpu python experiments/length_penalty_curves.py [--k K] [--out DIR]
Writes DIR/curves.png and DIR/curves.md (table.md is left for the episode study). (The effect on episodes is a separate RL run.)
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from c2jax.rl.rewards import length_penalty

QS = (0.0, 0.25, 0.5, 0.75, 1.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=float, default=1.0)
    ap.add_argument("--xmax", type=float, default=50.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "results", "length_penalty"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    k = args.k
    xs = np.linspace(0.0, args.xmax, 501)
    curves = {q: np.asarray(length_penalty(xs, k, q)) for q in QS}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for q in QS:
        ax.plot(xs, curves[q], label=f"q={q}")
        ax2.plot(xs, (1 + k * xs) ** (-q), label=f"q={q}")
    ax.set(xlabel="effort x", ylabel="C(x)", title=f"length penalty C(x), k={k}", ylim=(0, args.xmax))
    ax2.set(xlabel="effort x", ylabel="C'(x) = (1 + kx)^(-q)", title="marginal penalty per unit of effort",
            yscale="log")
    for a in (ax, ax2):
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    png = os.path.join(args.out, "curves.png")
    fig.savefig(png, dpi=120)

    table_x = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    lines = [f"# Length penalty C(x) for k = {k}", "",
             "C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); q = 1 is log(1 + k x) / k.", "",
             "| x | " + " | ".join(f"q={q}" for q in QS) + " |", "|---" * (len(QS) + 1) + "|"]
    for x in table_x:
        lines.append(f"| {x:g} | " + " | ".join(f"{float(length_penalty(x, k, q)):.4g}" for q in QS) + " |")
    lines += ["", "Marginal cost C'(x) = (1 + k x)^(-q) at x = 10: "
              + ", ".join(f"q={q}: {(1 + 10 * k) ** (-q):.3g}" for q in QS), ""]
    with open(os.path.join(args.out, "curves.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
